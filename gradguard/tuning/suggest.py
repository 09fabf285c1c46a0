"""``gradguard suggest``: a policy whose thresholds come from a recorded run's gradient norms.

Two streaming passes over the logs. The first (``NormSummary``) folds each recorded norm into its
family's ``LogHistogram`` (bounded: memory does not grow with the log's length), and each member's into
its own. Families (``gradguard.tuning.families``) with alike medians are merged. Each member's norms
are measured against that member's own median (so a weight and its bias, whose medians differ, do not
widen the family's spread), and each family gets a ``clip_norm`` per tensor whose ``max_norm`` is ``M``
(the median of its largest member, so no member's ordinary norms are clipped for being that member's)
times the largest of

- ``e^(z x spread)``: ``z`` (default 6) robust spreads, where the spread is ``1.4826 x MAD`` of
  ``ln(norm / member's median)`` (the standard deviation of a normal with that MAD) and never below
  ``MIN_SPREAD``: anomalies move neither the medians nor the MAD;
- ``2`` (``MIN_FACTOR``): a family with a tiny spread is not clipped for ordinary noise;
- the ``1 - budget / (families x members)`` quantile of the family's ordinary ratios (below
  ``e^(2 z x spread)`` and below ``SPIKE_FACTOR``; larger ones are anomalies and do not count): at most
  that fraction of ordinary norms lies above it, so, summed over every norm of a step, at most
  ``budget`` (1%) of the ordinary steps of the recorded run are acted on;

and never above ``SPIKE_FACTOR`` (10) times ``M`` but where ``2`` sets it: a norm ten times its median
is a spike however wide the spread, so a step whose family's norms are 20x their medians is always
acted on.

Every parameter gets a non-finite rule: ``skip_step_on_nonfinite``, or ``halt_on_nonfinite`` where the run's
policy halted (``keep``, ``--policy``) or had a ``recovery`` section (a halt is what it turns into a rewind); and a
``monitor`` keeps recording norms for the next run. Every section the run's policy had (``recovery``, ``loss``,
``rerun``: from ``keep``, or from the log's ``attach`` event) is kept, a proposed ``loss`` section taking the place of
the run's, and the header says what changed (``gradguard.tuning.run_policy``). A per-tensor clip of the run's policy
below a tensor's median norm (a hold-down the user wrote) is kept as it was, that tensor apart from the families.

With ``loss=True`` (``--loss``), where the log holds the step's loss (the ``stats`` events carry it), a ``loss``
section with a ``spike.factor`` learned the same way from ``ln(loss / reference)``, the reference a running
median of the recorded losses as the guard's is (``gradguard.tuning.loss_factor``). The second pass replays the
suggested policy on the same logs (``gradguard.tuning.replay``), so each rule's comment (and the loss section's) says on
which recorded steps it would have acted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from gradguard.policy.document import Policy
from gradguard.policy.loading import load_policy_text
from gradguard.policy.patterns import pattern_matcher
from gradguard.tuning.families import Family, family_key, family_pattern, merge_alike
from gradguard.tuning.histogram import BIN_WIDTH, LogHistogram, round_up, yaml_float
from gradguard.tuning.loss_factor import LossFactor, LossRatios, loss_factor, loss_lines
from gradguard.tuning.norm_summary import NormSummary
from gradguard.tuning.records import Recording, no_norms_message, recorded_steps
from gradguard.tuning.replay import ReplayResult, replay_files
from gradguard.tuning.run_policy import Apart, HardClip, Kept, apart_lines, hard_clips

__all__ = [
    "MIN_FACTOR",
    "MIN_SAMPLES",
    "MIN_SPREAD",
    "NoNorms",
    "NormSummary",
    "Suggestion",
    "Threshold",
    "suggest_files",
]

MIN_SPREAD: Final = 0.05
"""The smallest robust spread of ``ln(norm)`` used (5%): a constant norm still gets a sane threshold."""
MIN_FACTOR: Final = 2.0
"""A threshold is at least this many times the family's median norm."""
MIN_SAMPLES: Final = 20
"""A family with fewer finite, positive norms gets no clip (too little evidence); it keeps the non-finite rule."""
ANOMALY_FACTOR: Final = 2.0
"""Norms more than ``ANOMALY_FACTOR x z`` spreads above the median are anomalies: left out of the quantile."""
SPIKE_FACTOR: Final = 10.0
"""A norm this many times its tensor's median is a spike, whatever the spread: never ordinary, and no threshold
lies above it (the spread and quantile bounds are capped there), so a 20x spike is always acted on."""
NONFINITE_RULE: Final = "nonfinite"
MONITOR_RULE: Final = "record-norms"
MAX_CONSECUTIVE_SKIPS: Final = 3
_SHOWN_STEPS: Final = 12


class NoNorms(Exception):
    """The logs hold no per-tensor norm to learn from; the message names the ``monitor`` to add."""


@dataclass
class Threshold:
    """One family's ``clip_norm`` and the figures behind it (``ln`` of norms)."""

    family: Family
    rule: str
    patterns: list[str]
    median: float
    spread: float
    level: float
    """The quantile level of the ordinary norms used."""
    quantile: float
    max_norm: float
    bound_by: str
    """Which of the three bounds set ``max_norm``: ``spread``, ``factor`` or ``quantile``."""
    steps: list[int] = field(default_factory=list)
    """The recorded steps the replay would have clipped."""
    exclude: list[str] = field(default_factory=list)
    """Tensors its patterns match that are kept apart (a clip of the run's, ``gradguard.tuning.run_policy``)."""


@dataclass
class Suggestion:
    """The suggested policy (``text``, YAML with comments) and what it was learned from."""

    text: str
    thresholds: list[Threshold]
    sparse: list[Family]
    """Families with too few finite, positive norms for a threshold."""
    replay: ReplayResult
    recording: Recording
    params: int
    budget: float
    z: float
    loss: LossFactor | None = None
    """The proposed ``loss.spike.factor`` and its figures, or ``None`` (too few recorded losses)."""
    kept: Kept | None = None
    """What was kept of the run's policy, and what was replaced."""
    hard: list[HardClip] = field(default_factory=list)
    """The run's clips below their tensors' median norms, kept as written and apart from the families."""

    @property
    def policy(self) -> Policy:
        return load_policy_text(Policy, self.text, "yaml", "<suggested>")

    def changes(self) -> list[str]:
        """What the suggestion kept of the run's policy and changed, in a few words each (``suggest -o``'s line)."""
        said = [self.kept.said()] if self.kept is not None and self.kept.said() else []
        return said + [
            f"kept the run's clip of {', '.join(clip.params)} at {clip.max_norm:g} (rule {clip.rule!r})"
            for clip in self.hard
        ]


def suggest_files(
    paths: Sequence[Path],
    *,
    budget: float = 0.01,
    z: float = 6.0,
    merge_within: float = 1.5,
    loss: bool = False,
    keep: Policy | None = None,
) -> Suggestion:
    """Learn a policy from the norms recorded in ``paths`` (and a ``loss`` section from the losses, with ``loss``);
    ``NoNorms`` if there are none. ``keep``: the run's own policy, whose non-finite verdict (halt or skip) and
    ``recovery``, ``rerun`` and ``loss`` sections the suggestion keeps."""
    recording = Recording()
    summary = NormSummary()
    ratios = LossRatios()
    for recorded in recorded_steps(paths, recording):
        summary.add(recorded.norm)
        if loss and recorded.loss is not None:
            ratios.add(recorded.step, recorded.loss, SPIKE_FACTOR)
    summary.flush()
    if not summary.names:
        raise NoNorms(no_norms_message(paths, recording, loss=loss))
    kept = Kept.of(keep, recording, proposed_loss=loss)
    # A proposed loss section keeps the run's verdict on a NaN/Inf loss (a halt stays a halt).
    shown: dict[str, Any] = {
        "z": z,
        "spike_factor": SPIKE_FACTOR,
        "least": MIN_SAMPLES,
        "nonfinite": kept.nonfinite_loss,
    }
    medians = {
        name: math.exp(h.median()) for family in summary.families.values() for name, h in family.by_member.items()
    }
    hard = hard_clips(keep, recording, medians)
    apart = [Apart(clip, [summary.take_apart(name) for name in clip.params]) for clip in hard]
    usable = [family for family in summary.families.values() if family.samples >= MIN_SAMPLES]
    sparse = [family for family in summary.families.values() if family.samples < MIN_SAMPLES]
    merged = merge_alike(usable, merge_within, lambda family: family.histogram.median())
    names = list(summary.names)
    thresholds = [_threshold(family, names, len(merged), budget, z) for family in merged]
    thresholds.sort(key=lambda t: -t.median)
    _unique_rule_names(thresholds, apart)
    for held in apart:  # what its own norms would have given it, had the clip not been kept
        held.own = [
            _threshold(one, names, 1, budget, z).max_norm for one in held.families if one.samples >= MIN_SAMPLES
        ]
        held.patterns = [family_pattern(name, {name}, names) for name in held.clip.params]
    for threshold in thresholds:  # a family's pattern may still reach a tensor kept apart (``blocks.*.weight``)
        matches = [pattern_matcher(pattern) for pattern in threshold.patterns]
        threshold.exclude = [name for held in apart for name in held.patterns if any(m(name) for m in matches)]
    found = None
    if ratios.ratios.total >= MIN_SAMPLES:
        bounds = {"min_spread": MIN_SPREAD, "min_factor": MIN_FACTOR, "spike_factor": SPIKE_FACTOR}
        found = loss_factor(ratios, budget=budget, z=z, **bounds)
    draft = _render(paths, thresholds, sparse, recording, len(names), budget, z, None, kept, apart)
    if loss:
        draft += "\n".join(loss_lines(found, ratios, None, **shown)) + "\n"
    draft += kept.text()
    replay = replay_files(load_policy_text(Policy, draft, "yaml", "<suggested>"), paths)
    by_rule = {entry.rule: entry.steps for entry in replay.actions}
    for threshold in thresholds:
        threshold.steps = by_rule.get(threshold.rule, [])
    for held in apart:
        held.steps = by_rule.get(held.name, [])
    text = _render(paths, thresholds, sparse, recording, len(names), budget, z, replay, kept, apart)
    if found is not None:
        verdicts = {entry.action: entry.steps for entry in replay.actions if entry.rule == "loss"}
        found.spikes, found.nonfinite = verdicts.get("spike", []), verdicts.get("nonfinite", [])
        flagged = _steps(sorted(found.spikes + found.nonfinite), recording.loss_steps).replace("acts on", "skips", 1)
        text += "\n".join(loss_lines(found, ratios, flagged, **shown)) + "\n"
    elif loss:
        text += "\n".join(loss_lines(None, ratios, None, **shown)) + "\n"
    text += kept.text()
    load_policy_text(Policy, text, "yaml", "<suggested>")  # what is printed loads: a failure here is a bug
    return Suggestion(text, thresholds, sparse, replay, recording, len(names), budget, z, found, kept, hard)


def _threshold(family: Family, names: list[str], families: int, budget: float, z: float) -> Threshold:
    # Each member's norms against its own median, pooled: members whose medians differ (a weight and its
    # bias) do not widen the spread, and a family of one tensor is read as one of many.
    own = {name: h.median() for name, h in family.by_member.items() if h.total}
    relative = LogHistogram().merged(
        h.shifted(round(own[name] / BIN_WIDTH)) for name, h in family.by_member.items() if h.total
    )
    median = max(own.values())  # the threshold must not clip the ordinary norms of the largest member
    centre = relative.median()
    spread = max(1.4826 * relative.mad(centre), MIN_SPREAD)
    ceiling = math.log(SPIKE_FACTOR)
    level = 1.0 - budget / (families * len(family.members))
    ordinary = min(ANOMALY_FACTOR * z * spread, ceiling)
    quantile = median + relative.quantile(level, upper=True, at_most=ordinary)
    spread_bound = median + min(z * spread, ceiling)
    bounds = {"spread": spread_bound, "factor": median + math.log(MIN_FACTOR), "quantile": quantile}
    bound_by = max(bounds, key=lambda key: bounds[key])
    max_norm = round_up(math.exp(bounds[bound_by]))
    members = family.members
    patterns = [family_pattern(key, {m for m in members if family_key(m) == key}, names) for key in family.keys]
    return Threshold(family, _rule_name(family.keys), patterns, median, spread, level, quantile, max_norm, bound_by)


_NAMED_KEYS: Final = 3
"""A merged family's rule names this many of its families; more are counted (a rule name is a counter key)."""


def _rule_name(keys: Sequence[str]) -> str:
    """``blocks.*.0.weight``, ``embed.weight & blocks.*.2.bias``, ``a & b & c & 2 more``: the families a rule covers,
    in words (``embed.weight+1`` left the reader to guess what the ``+1`` was)."""
    named = list(keys[:_NAMED_KEYS])
    if len(keys) > _NAMED_KEYS:
        named.append(f"{len(keys) - _NAMED_KEYS} more")
    return " & ".join(named)


def _unique_rule_names(thresholds: list[Threshold], apart: list[Apart]) -> None:
    taken = {NONFINITE_RULE, MONITOR_RULE}
    for held in apart:
        name, count = held.clip.rule, 1
        while name in taken:
            count += 1
            name = f"{held.clip.rule}#{count}"
        held.name = name
        taken.add(name)
    for threshold in thresholds:
        name, count = threshold.rule, 1
        while name in taken:
            count += 1
            name = f"{threshold.rule}#{count}"
        threshold.rule = name
        taken.add(name)


def _g(ln_value: float) -> str:
    return f"{math.exp(ln_value):.3g}"


def _steps(steps: list[int], of: int) -> str:
    if not steps:
        return f"acts on none of the {of:,} recorded steps"
    shown = ", ".join(str(step) for step in steps[:_SHOWN_STEPS])
    more = f", ... ({len(steps) - _SHOWN_STEPS} more)" if len(steps) > _SHOWN_STEPS else ""
    percent = 100.0 * len(steps) / of if of else 0.0
    return f"acts on {len(steps):,} of {of:,} recorded steps ({percent:.2g}%): {shown}{more}"


def _natural(name: str) -> list[tuple[int, int | str]]:
    """A sort key that puts ``blocks.2`` before ``blocks.10``."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in name.split(".")]


def _percent(level: float) -> str:
    """A quantile level as a percentage with the digits that tell it from 100% (99.9983%)."""
    tail = 100.0 * (1.0 - level)
    decimals = max(1, math.ceil(-math.log10(tail)) + 1) if tail > 0 else 1
    return f"{100.0 * level:.{decimals}f}%"


def _members(family: Family) -> str:
    members = sorted(family.members, key=_natural)
    shown = ", ".join(members[:3]) + (f", ... ({len(members) - 3} more)" if len(members) > 3 else "")
    return f"{len(members)} tensor{'s' if len(members) != 1 else ''}: {shown}"


def _render(
    paths: Sequence[Path],
    thresholds: list[Threshold],
    sparse: list[Family],
    recording: Recording,
    params: int,
    budget: float,
    z: float,
    replay: ReplayResult | None,
    kept: Kept,
    apart: list[Apart],
) -> str:
    steps = recording.steps
    acted: list[int] = []
    lines = [
        f"# Suggested by `gradguard suggest` from {', '.join(path.name for path in paths)}:",
        f"# {steps:,} recorded steps ({recording.first_step}-{recording.last_step}), {params} parameters, "
        f"{len(thresholds)} families with a clip.",
        f"# Each max_norm is median x the largest of: e^({z:g} x spread), {MIN_FACTOR:g}, and the quantile of the",
        f"# family's ordinary norms that keeps the clips on at most {100 * budget:g}% of ordinary steps; median: its",
        "# largest tensor's. Each tensor's norms count against its own median (spread: 1.4826 x MAD of",
        f"# ln(norm / median); ordinary: below e^({ANOMALY_FACTOR * z:g} x spread) and {SPIKE_FACTOR:g} x the median,"
        f" no bound above {SPIKE_FACTOR:g}).",
        *kept.changes(held.clip for held in apart),
        "version: 1",
        "rules:",
    ]
    nonfinite_steps: list[int] = []
    if replay is not None:
        # Under recovery the rule's halts are listed as rewinds: both are where it acted.
        nonfinite_steps = sorted({step for e in replay.actions if e.rule == NONFINITE_RULE for step in e.steps})
    if kept.halts:
        lines.append(f"  # Every parameter: a NaN or Inf gradient halts the run, {kept.why_halt}.")
    else:
        lines += [
            "  # Every parameter: a NaN or Inf gradient skips the step (no parameter or optimizer state moves);",
            f"  # more than {MAX_CONSECUTIVE_SKIPS} skipped steps in a row halt the run.",
        ]
    if replay is not None:
        lines.append(f"  # On the recorded run it {_steps(nonfinite_steps, steps)}.")
    lines += [f"  - name: {NONFINITE_RULE}", '    match: "*"', "    actions:"]
    if kept.halts:
        lines.append("      - action: halt_on_nonfinite")
    else:
        lines += ["      - action: skip_step_on_nonfinite", f"        max_consecutive_skips: {MAX_CONSECUTIVE_SKIPS}"]
    for held in apart:
        acted += held.steps
        lines += apart_lines(
            held, f"On the recorded run it {_steps(held.steps, steps)}." if replay is not None else None
        )
    for threshold in thresholds:
        family = threshold.family
        acted += threshold.steps
        left_out = (
            f"; {family.zeros:,} zero and {family.nonfinite:,} non-finite left out"
            if (family.zeros or family.nonfinite)
            else ""
        )
        lines += [
            f"  # {' + '.join(family.keys)}: {_members(family)}",
            f"  # {family.samples:,} norms{left_out}; median {_g(threshold.median)}, spread {threshold.spread:.3g} "
            f"(x{math.exp(threshold.spread):.3g}), {_percent(threshold.level)} quantile {_g(threshold.quantile)}",
            f"  # max_norm: {_bound_text(threshold, z)}",
        ]
        if replay is not None:
            lines.append(f"  # On the recorded run it {_steps(threshold.steps, steps)}.")
        lines += [
            f"  - name: {json.dumps(threshold.rule)}",
            f"    match: [{', '.join(json.dumps(pattern) for pattern in threshold.patterns)}]",
            *([f"    exclude: {json.dumps(threshold.exclude)}"] if threshold.exclude else []),
            "    actions:",
            "      - action: clip_norm",
            f"        max_norm: {yaml_float(threshold.max_norm)}",
        ]
    for family in sparse:
        lines.append(
            f"  # {' + '.join(family.keys)} ({_members(family)}): only {family.samples} finite, positive norms "
            f"(fewer than {MIN_SAMPLES}): no clip, the non-finite rule covers it."
        )
    lines += [
        "  # Keeps recording each gradient's norm, so the next run can be replayed and suggested from.",
        f"  - name: {MONITOR_RULE}",
        '    match: "*"',
        "    actions:",
        "      - action: monitor",
        "        stats: [norm]",
    ]
    if replay is not None:
        union = len(set(acted))
        share = 100.0 * union / steps if steps else 0.0
        lines.append(f"# In all, the clips act on {union:,} of the {steps:,} recorded steps ({share:.2g}%).")
    return "\n".join(lines) + "\n"


def _bound_text(threshold: Threshold, z: float) -> str:
    value = f"{threshold.max_norm:.3g}"
    ratio = math.exp(math.log(threshold.max_norm) - threshold.median)
    if threshold.bound_by == "spread":
        why = f"median x e^({z:g} x {threshold.spread:.3g})"
    elif threshold.bound_by == "factor":
        why = f"{MIN_FACTOR:g} x median (the spread is small)"
    else:
        why = f"the {_percent(threshold.level)} quantile of ordinary norms"
    return f"{value} = {why}, {ratio:.3g} x the median"
