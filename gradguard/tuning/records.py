"""The gradient norms a run recorded, step by step: the ``stats`` events of its ``monitor`` rules.

A ``monitor`` with ``stats: [norm]`` and ``scope: tensor`` writes, on every step it samples, one
``stats`` event holding the 2-norm of each parameter's gradient as it arrived (before any action of
any rule). ``recorded_steps`` streams those events out of one or more audit logs (merged in step order
by ``gradguard.audit.reader``) and hands them back one step at a time: memory holds one step's
figures, whatever the log's length. ``max_abs`` and ``grad_to_weight`` figures at tensor scope are
kept too (``gradguard replay`` uses them for ``clip_value`` and ``agc``); group and module scopes, and
the other figures, are counted and left out. The step's loss, which every ``stats`` event of a step carries
where the guard saw it (any scope), is kept as the step's ``loss`` (``suggest`` and ``replay`` of the policy's
``loss`` section).

Besides the norms, the run's policy as far as the log shows it: the sections its ``attach`` event carries
(``recovery``, ``loss``, ``rerun``: ``suggest`` keeps them), its rules' names, and each tensor's per-tensor
``clip_norm`` as its ``intervention`` events show it (the rule, the ``max_norm``, the steps it acted on), so a clip
the user wrote tighter than the tensor's ordinary norms is known without the policy file.

Each line is read once into its typed event (``gradguard.events.definitions``);
no torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from gradguard.audit.reader import ReadStats, read_merged
from gradguard.events.definitions import Attach, Intervention, Number, Stats, as_float

__all__ = ["MONITOR_HINT", "RecordedClip", "RecordedStep", "Recording", "no_norms_message", "recorded_steps"]

MONITOR_HINT: Final = (
    "{name: record-norms, match: '*', actions: [{action: monitor, stats: [norm], scope: tensor, every: 1}]}"
)
"""The rule that records what ``suggest`` and ``replay`` read, in the policy's own YAML."""

_KEPT: Final = ("norm", "max_abs", "grad_to_weight")


@dataclass
class RecordedStep:
    """One step's recorded figures, per parameter name (``NaN``/``inf`` kept as floats)."""

    step: int
    norm: dict[str, float] = field(default_factory=dict)
    max_abs: dict[str, float] = field(default_factory=dict)
    grad_to_weight: dict[str, float] = field(default_factory=dict)
    loss: float | None = None
    """The step's loss (the guard's, as its ``stats`` events carry it), or ``None`` where none was recorded."""


@dataclass
class RecordedClip:
    """A per-tensor ``clip_norm`` of the run's policy on one tensor, as its ``intervention`` events show it."""

    rule: str
    max_norm: float
    steps: int = 0
    """The steps on which it acted (clipped the tensor)."""


@dataclass
class Recording:
    """What reading the logs found besides the norms: counts for the report, and the unreadable lines."""

    read: ReadStats = field(default_factory=ReadStats)
    stats_events: int = 0
    """``stats`` events seen, whatever their scope."""
    tensor_events: int = 0
    """``stats`` events at tensor scope with a ``norm`` figure: the ones used."""
    other_scopes: dict[str, int] = field(default_factory=dict)
    """Scope -> ``stats`` events left out (group and module figures are not per parameter)."""
    malformed: int = 0
    """``stats`` events whose figures could not be read (reported, and skipped)."""
    steps: int = 0
    """Steps with at least one recorded norm."""
    first_step: int | None = None
    last_step: int | None = None
    guarded_params: int | None = None
    """The ``params`` of the log's last ``attach`` event: how many tensors the guard watched."""
    step_back: tuple[int, int] | None = None
    """The first place the steps went back, ``(from, to)``: the log holds several runs (read as one)."""
    loss_steps: int = 0
    """Recorded steps with a loss."""
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The top-level sections of the run's policy (``recovery``, ``loss``, ``rerun``, any the ``attach`` event
    carries) as the log's last ``attach`` event gives them (with what the guard adds, the recovery section's bytes
    and placement): ``suggest`` keeps them (``gradguard.tuning.run_policy``)."""
    rules: tuple[str, ...] = ()
    """The names of the run's rules, from the log's last ``attach`` event."""
    clips: dict[str, RecordedClip] = field(default_factory=dict)
    """Parameter name -> the tightest per-tensor 2-norm ``clip_norm`` that acted on it (``intervention`` events)."""


def no_norms_message(paths: Sequence[Path], recording: Recording, *, loss: bool = False) -> str:
    """One line: the logs hold no per-tensor norm, why, and the ``monitor`` rule to add (``loss``: for
    ``suggest --loss``, which reads the step's loss from the same events)."""
    logs = ", ".join(str(path) for path in paths)
    if recording.stats_events == 0:
        if loss:
            return (
                f"no losses and no gradient norms in {logs} (no 'stats' events): the guard writes the step's loss "
                "beside the norms a monitor records, and suggest --loss needs both (the norms for the clips, the "
                f"losses for the loss section); add this rule to the run's policy and run it again: {MONITOR_HINT}"
            )
        found = "no 'stats' events"
    else:
        scopes = ", ".join(f"{scope} ({count})" for scope, count in sorted(recording.other_scopes.items()))
        found = f"'stats' events only at other scopes or without a norm figure: {scopes or 'none usable'}"
    return f"no gradient norms per tensor in {logs} ({found}); add this rule to the run's policy: {MONITOR_HINT}"


def recorded_steps(paths: Sequence[Path], recording: Recording) -> Iterator[RecordedStep]:
    """The recorded figures of every step, in step order (several files merged; a name's first value wins)."""
    current: RecordedStep | None = None
    loss_at: tuple[int, float] | None = None
    """The last loss a ``stats`` event carried, and its step (an event at another scope may come first)."""
    for record in read_merged(paths, recording.read):
        event = record.event
        if isinstance(event, Attach):
            recording.guarded_params = event.params
            recording.sections, recording.rules = _sections(event), tuple(event.rules)
            continue
        if isinstance(event, Intervention):
            _note_clip(event, recording.clips)
            continue
        if not isinstance(event, Stats):
            continue
        recording.stats_events += 1
        step, figures, scope = event.step, event.figures, event.scope
        if event.loss is not None and (loss_at is None or loss_at[0] != step):
            loss_at = (step, as_float(event.loss))
        if scope != "tensor" or "norm" not in figures:
            key = scope if scope != "tensor" else "tensor, without norm"
            recording.other_scopes[key] = recording.other_scopes.get(key, 0) + 1
            continue
        if current is not None and step != current.step:
            if step < current.step and recording.step_back is None:
                recording.step_back = (current.step, step)
            yield current
            current = None
        if current is None:
            current = RecordedStep(step)
            recording.steps += 1
            recording.first_step = step if recording.first_step is None else min(recording.first_step, step)
            recording.last_step = step if recording.last_step is None else max(recording.last_step, step)
        if current.loss is None and loss_at is not None and loss_at[0] == step:
            current.loss = loss_at[1]
            recording.loss_steps += 1
        if _take(figures, current):
            recording.tensor_events += 1
        else:
            recording.malformed += 1
    if current is not None:
        yield current


def _sections(event: Attach) -> dict[str, dict[str, Any]]:
    """The attach event's policy sections as it carries them. Every top-level field of a policy but its rules is
    looked for, so a section the event comes to carry is kept with no change here."""
    from gradguard.policy.schema import PolicyFields

    names = [name for name in PolicyFields.model_fields if name not in ("version", "rules")]
    return {name: section for name in names if isinstance(section := getattr(event, name, None), dict)}


def _note_clip(event: Intervention, clips: dict[str, RecordedClip]) -> None:
    """Count a per-tensor 2-norm ``clip_norm``'s intervention on its tensor; the tightest ``max_norm`` is kept."""
    if event.action != "clip_norm" or event.scope != "tensor" or event.param is None or event.max_norm is None:
        return
    if event.norm_type is not None and as_float(event.norm_type) != 2.0:
        return
    max_norm = as_float(event.max_norm)
    clip = clips.get(event.param)
    if clip is None or max_norm < clip.max_norm:
        clip = clips[event.param] = RecordedClip(event.rule, max_norm, clip.steps if clip is not None else 0)
    if clip.rule == event.rule:
        clip.steps += 1


def _take(figures: dict[str, dict[str, Number] | Number], into: RecordedStep) -> bool:
    """Copy a tensor-scope event's figures into ``into``; False if they are not name -> number maps."""
    for stat in _KEPT:
        values = figures.get(stat)
        if values is None:
            continue
        if not isinstance(values, dict):
            return False
        target: dict[str, float] = getattr(into, stat)
        if not target:
            target.update(values)  # type: ignore[arg-type]  # the non-finite strings are made floats below
            # Most steps hold no non-finite string: one pass in C over the types finds that, not a Python loop.
            if str in set(map(type, values.values())):
                for name in [name for name, value in values.items() if type(value) is str]:
                    target[name] = as_float(values[name])
            continue
        for name, value in values.items():
            if name not in target:
                target[name] = value if type(value) is float else as_float(value)
    return True
