"""What ``gradguard suggest`` keeps of the run's own policy, and the words that say what it changed.

The run's policy is known from ``--policy`` (``keep``) or, without it, from the log: the ``attach`` event carries
its ``recovery``, ``loss`` and ``rerun`` sections and its rules' names, and the ``intervention`` events show each
per-tensor ``clip_norm`` that acted. A suggestion keeps every section the run had (a ``--loss`` proposal takes the
place of the run's ``loss`` section, and says so): a user who trains on it must not lose a watch without a word.

A ``clip_norm`` the user wrote below a tensor's ordinary norms (its ``max_norm`` under the tensor's median recorded
norm: it clipped most steps) is a hold-down written on purpose, not a spike guard; merged into a family, it would be
loosened to the family's threshold (an embedding held at 0.1 let through at 4.8). Such a tensor is kept apart from
the families, with the run's clip as it was (``HardClip``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, get_args

from pydantic import BaseModel, ValidationError

from gradguard.policy.document import Policy
from gradguard.policy.patterns import rule_matches
from gradguard.policy.schema import ClipNorm, HaltOnNonfinite, PolicyFields
from gradguard.tuning.families import Family
from gradguard.tuning.histogram import yaml_float
from gradguard.tuning.records import Recording

__all__ = ["Apart", "HardClip", "Kept", "apart_lines", "hard_clips"]

_WHY_RECOVERY: Final = "which the recovery section (below, the run's) turns into a rewind"


@dataclass
class HardClip:
    """A per-tensor ``clip_norm`` of the run's policy below its tensors' median norms, kept as it was."""

    rule: str
    """The run's rule that wrote it (the kept rule's name, unless another rule of the suggestion has it)."""
    max_norm: float
    params: list[str] = field(default_factory=list)
    medians: dict[str, float] = field(default_factory=dict)
    """Each tensor's median recorded norm (not its log)."""
    source: str = ""
    """Where the clip was read: the run's policy file, or the log's intervention events."""


def hard_clips(keep: Policy | None, recording: Recording, medians: Mapping[str, float]) -> list[HardClip]:
    """The run's clips that held a tensor below its median recorded norm (``medians``: name -> median, not its log),
    grouped by rule and ``max_norm``, in the order of the tensors' names."""
    tightest: dict[str, tuple[str, float]] = {}
    if keep is not None:
        source = f"the run's policy ({keep.source})"
        for rule in keep.rules:
            for action in rule.actions:
                if not isinstance(action, ClipNorm) or action.scope != "tensor" or action.norm_type != 2.0:
                    continue
                for name in medians:
                    if rule_matches(rule, (name,)) and (name not in tightest or action.max_norm < tightest[name][1]):
                        tightest[name] = (rule.name, action.max_norm)
    else:
        source = "the log's intervention events"
        tightest = {name: (clip.rule, clip.max_norm) for name, clip in recording.clips.items() if name in medians}
    groups: dict[tuple[str, float], HardClip] = {}
    for name, (rule_name, max_norm) in tightest.items():
        if not max_norm < medians[name]:
            continue
        group = groups.setdefault((rule_name, max_norm), HardClip(rule_name, max_norm, source=source))
        group.params.append(name)
        group.medians[name] = medians[name]
    return list(groups.values())


@dataclass
class Apart:
    """A clip of the run's kept apart from the families: the rule, its tensors' own families, where it acted."""

    clip: HardClip
    families: list[Family]
    name: str = ""
    """The rule's name in the suggestion: the run's, unless another rule has it."""
    own: list[float] = field(default_factory=list)
    """What each tensor's own norms would suggest (those with enough of them)."""
    patterns: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)


def apart_lines(held: Apart, replayed: str | None) -> list[str]:
    """A kept clip of the run's, its comment saying why it is apart (and where it acted, after the replay)."""
    clip = held.clip
    medians = ", ".join(f"{name} {clip.medians[name]:.3g}" for name in clip.params)
    own = f"; its own norms would suggest {', '.join(f'{value:.3g}' for value in held.own)}" if held.own else ""
    lines = [
        f"  # Kept from {clip.source}: rule {clip.rule!r} clips {', '.join(clip.params)} to {clip.max_norm:g}, below",
        f"  # the median recorded norm ({medians}): a hold-down, not a spike guard, so it stays apart",
        f"  # from the families (merged, the family's looser clip would have replaced it){own}.",
    ]
    if replayed is not None:
        lines.append(f"  # {replayed}")
    return [
        *lines,
        f"  - name: {json.dumps(held.name)}",
        f"    match: [{', '.join(json.dumps(pattern) for pattern in held.patterns)}]",
        "    actions:",
        "      - action: clip_norm",
        f"        max_norm: {yaml_float(clip.max_norm)}",
    ]


@dataclass(frozen=True)
class Kept:
    """What the suggestion keeps of the run's policy: the non-finite verdict and the top-level sections."""

    halts: bool
    why_halt: str
    sections: dict[str, dict[str, Any]]
    """The run's sections the suggestion keeps, by name, in the order a policy declares them (defaults left out)."""
    source: str
    """Where the sections were read: the run's policy file, or the log's attach event."""
    replaced_loss: dict[str, Any] | None = None
    """The run's loss section where ``--loss`` proposes one in its place."""
    rules: tuple[str, ...] = ()
    """The run's rules, by name (the suggestion's rules take their place)."""
    unreadable: tuple[str, ...] = ()
    """Sections of the log's attach event this version cannot read (an older or newer gradguard wrote them)."""

    @property
    def nonfinite_loss(self) -> str:
        """A proposed loss section's verdict on a NaN/Inf loss: the run's (a halt stays a halt), else ``skip``."""
        section = self.sections.get("loss", self.replaced_loss)
        return str(section.get("nonfinite", "halt")) if section is not None else "skip"

    @classmethod
    def of(cls, keep: Policy | None, recording: Recording, *, proposed_loss: bool) -> Kept:
        unreadable: list[str] = []
        if keep is not None:
            sections = {name: _dumped(section) for name in _SECTIONS if (section := getattr(keep, name)) is not None}
            halts = any(isinstance(a, HaltOnNonfinite) for rule in keep.rules for a in rule.actions)
            why = "as the run's policy did" if halts else ""
            source, rules = f"the run's policy ({keep.source})", tuple(r.name for r in keep.rules)
        else:
            sections = {}
            for name in _SECTIONS:
                if name in recording.sections:
                    section = _section(name, recording.sections[name])
                    if section is None:
                        unreadable.append(name)
                    else:
                        sections[name] = section
            halts, why, source, rules = False, "", "the log's attach event", recording.rules
        if not halts and "recovery" in sections:
            halts, why = True, _WHY_RECOVERY
        replaced = sections.pop("loss", None) if proposed_loss else None
        return cls(halts, why, sections, source, replaced, rules, tuple(unreadable))

    def text(self) -> str:
        """The kept sections, in YAML's flow style (JSON), each with a comment saying where it comes from."""
        lines: list[str] = []
        for name, section in self.sections.items():
            lines.append(f"# The {name} section, kept from {self.source}{_WHY_KEPT.get(name, '')}.")
            lines.append(f"{name}: {json.dumps(section)}")
        return "".join(f"{line}\n" for line in lines)

    def changes(self, hard: Iterable[HardClip]) -> list[str]:
        """What the suggestion changes of the run's policy, one comment line each (the file's header); none where the
        run's policy had nothing beside its rules (whose replacement is what a suggestion is)."""
        hard = list(hard)
        if not (hard or self.sections or self.replaced_loss or self.unreadable):
            return []
        lines = [f"# What this changes of the run's policy (as {self.source} gives it):"]
        if self.rules:
            lines.append(f"#   its rules ({', '.join(self.rules)}) are replaced by the rules below;")
        for clip in hard:
            lines.append(
                f"#   its rule {clip.rule!r} clipped {', '.join(clip.params)} to {clip.max_norm:g}, below the recorded "
                "median norm: kept as written, apart from the families;"
            )
        if self.replaced_loss is not None:
            lines.append(
                f"#   its loss section {json.dumps(self.replaced_loss)} is replaced by the one --loss proposes;"
            )
        for name in self.unreadable:
            lines.append(
                f"#   its {name} section could not be read (another gradguard version wrote the log): left out;"
            )
        if self.sections:
            lines.append(f"#   kept as it was: its {self._kept_names()} (at the end);")
        lines[-1] = lines[-1][:-1] + "."
        return lines

    def said(self) -> str:
        """The sections kept and replaced, for the line ``suggest -o`` prints."""
        words = [f"kept the run's {self._kept_names()}"] if self.sections else []
        if self.replaced_loss is not None:
            words.append("replaced the run's loss section by the proposed one")
        words += [f"left out its unreadable {name} section" for name in self.unreadable]
        return "; ".join(words)

    def _kept_names(self) -> str:
        return f"{' and '.join(self.sections)} section{'s' if len(self.sections) > 1 else ''}"


_SECTIONS: Final = tuple(name for name in PolicyFields.model_fields if name not in ("version", "rules"))
"""A policy's top-level sections besides its rules (``loss``, ``recovery``, ``rerun``, ...): each is kept."""

_WHY_KEPT: Final = {
    "loss": " (--loss proposes one instead)",
    "recovery": ": a halt rewinds to a snapshot",
}


def _dumped(section: BaseModel) -> dict[str, Any]:
    return section.model_dump(mode="json", exclude_defaults=True)


def _section(name: str, data: dict[str, Any]) -> dict[str, Any] | None:
    """A section of the attach event as a policy writes it (the policy's keys only, defaults left out), or ``None``
    where it does not validate (a log written by another version)."""
    kind = next(arg for arg in get_args(PolicyFields.model_fields[name].annotation) if arg is not type(None))
    assert issubclass(kind, BaseModel)
    keys = {key: value for key, value in data.items() if key in kind.model_fields}
    try:
        return _dumped(kind.model_validate_json(json.dumps(keys)))
    except ValidationError:
        return None
