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
``monitor`` keeps recording norms for the next run. The run's ``recovery`` section is kept (from ``keep``, or from
the log's ``attach`` event), and ``keep``'s ``rerun`` and ``loss`` sections too (a proposed ``loss`` section takes
the place of the latter).

With ``loss=True`` (``--loss``), where the log holds the step's loss (the ``stats`` events carry it), a ``loss``
section with a ``spike.factor`` learned the same way from ``ln(loss / reference)``, the reference a running
median of the recorded losses as the guard's is (``gradguard.tuning.loss_factor``). The second pass replays the
suggested policy on the same logs (``gradguard.tuning.replay``), so each rule's comment (and the loss section's) says on
which recorded steps it would have acted.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import torch

from gradguard.policy.document import Policy
from gradguard.policy.loading import load_policy_text
from gradguard.policy.schema import HaltOnNonfinite
from gradguard.tuning.blocks import stacked
from gradguard.tuning.families import Family, family_key, family_pattern, merge_alike
from gradguard.tuning.histogram import BIN_WIDTH, LogHistogram, round_up, yaml_float
from gradguard.tuning.loss_factor import LossFactor, LossRatios, loss_factor, loss_lines
from gradguard.tuning.records import Recording, no_norms_message, recorded_steps
from gradguard.tuning.replay import ReplayResult, replay_files

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
class NormSummary:
    """The first pass: every family's histogram of ``ln(norm)``, built one recorded step at a time."""

    families: dict[str, Family] = field(default_factory=dict)
    names: dict[str, Family] = field(default_factory=dict)
    """Parameter name -> its family, in the order first seen."""

    _block_names: list[str] = field(default_factory=list)
    _values: array[float] = field(default_factory=lambda: array("d"))
    """The gathered steps' norms, row after row (``_block_names`` in each)."""

    def add(self, norms: dict[str, float]) -> None:
        """One recorded step's norms; they are counted a block of steps at a time (``flush``)."""
        names = list(norms)
        if names != self._block_names:
            self.flush()
            self._block_names = names
            for name in names:
                if name not in self.names:
                    key = family_key(name)
                    family = self.families.get(key)
                    if family is None:
                        family = self.families[key] = Family([key])
                    family.members.add(name)
                    self.names[name] = family
        self._values.extend(norms.values())
        if len(self._values) >= _HISTOGRAM_STEPS * len(names):
            self.flush()

    def flush(self) -> None:
        """Count the gathered steps' norms, every member's column at once (binned as ``LogHistogram.add`` bins).

        ``ln`` is torch's float64 logarithm, which can be an ulp away from ``math.log``: enough to move a norm on a
        bin's edge into the next bin, so the few within a millionth of a bin of an edge are binned again with
        ``math.log``, and the histograms are those ``LogHistogram.add`` makes. One ``unique`` over
        ``(column, bin)`` pairs counts the whole block.
        """
        if not self._values:
            return
        values = stacked(self._values, len(self._block_names))
        self._values = array("d")
        positive = (values > 0.0) & (values < math.inf)
        zeros = (values == 0.0).sum(dim=0).tolist()
        counted = positive.sum(dim=0).tolist()
        steps = values.shape[0]
        for name, zero, count in zip(self._block_names, zeros, counted, strict=True):
            family = self.names[name]
            family.zeros += zero
            family.nonfinite += steps - count - zero
        if not any(counted):
            return
        kept = values[positive]
        scaled = torch.log(kept) / BIN_WIDTH
        edge = torch.nonzero((scaled - scaled.round()).abs() < 1e-6).flatten()
        if len(edge):
            exact = [math.log(value) / BIN_WIDTH for value in kept[edge].tolist()]
            scaled[edge] = torch.tensor(exact, dtype=torch.float64)
        keys = torch.floor(scaled).to(torch.int64)
        columns = positive.nonzero()[:, 1]
        low = int(keys.min())
        span = int(keys.max()) - low + 1
        pairs, counts = torch.unique(columns * span + (keys - low), return_counts=True)
        by_column: dict[int, dict[int, int]] = {}
        for pair, count in zip(pairs.tolist(), counts.tolist(), strict=True):
            column, key = divmod(pair, span)
            by_column.setdefault(column, {})[key + low] = count
        for column, binned in by_column.items():
            name = self._block_names[column]
            family = self.names[name]
            own = family.by_member.get(name)
            if own is None:
                own = family.by_member[name] = LogHistogram()
            own.add_counts(binned, counted[column])
            family.histogram.add_counts(binned, counted[column])


_HISTOGRAM_STEPS: Final = 512
"""Recorded steps gathered before their norms are counted: 512 x 300 tensors is 1.2 MB of float64, and the
binning's temporaries stay small enough that the peak is flat in the log's length (2,048 steps grew it)."""


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

    @property
    def policy(self) -> Policy:
        return load_policy_text(Policy, self.text, "yaml", "<suggested>")


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
    kept = _Kept.of(keep, recording, proposed_loss=loss)
    # A proposed loss section keeps the run's verdict on a NaN/Inf loss (a halt stays a halt).
    nonfinite = keep.loss.nonfinite if keep is not None and keep.loss is not None else "skip"
    shown: dict[str, Any] = {"z": z, "spike_factor": SPIKE_FACTOR, "least": MIN_SAMPLES, "nonfinite": nonfinite}
    usable = [family for family in summary.families.values() if family.samples >= MIN_SAMPLES]
    sparse = [family for family in summary.families.values() if family.samples < MIN_SAMPLES]
    merged = merge_alike(usable, merge_within, lambda family: family.histogram.median())
    names = list(summary.names)
    thresholds = [_threshold(family, names, len(merged), budget, z) for family in merged]
    thresholds.sort(key=lambda t: -t.median)
    _unique_rule_names(thresholds)
    found = None
    if ratios.ratios.total >= MIN_SAMPLES:
        bounds = {"min_spread": MIN_SPREAD, "min_factor": MIN_FACTOR, "spike_factor": SPIKE_FACTOR}
        found = loss_factor(ratios, budget=budget, z=z, **bounds)
    draft = _render(paths, thresholds, sparse, recording, len(names), budget, z, None, kept)
    if loss:
        draft += "\n".join(loss_lines(found, ratios, None, **shown)) + "\n"
    draft += kept.sections()
    replay = replay_files(load_policy_text(Policy, draft, "yaml", "<suggested>"), paths)
    by_rule = {entry.rule: entry.steps for entry in replay.actions}
    for threshold in thresholds:
        threshold.steps = by_rule.get(threshold.rule, [])
    text = _render(paths, thresholds, sparse, recording, len(names), budget, z, replay, kept)
    if found is not None:
        verdicts = {entry.action: entry.steps for entry in replay.actions if entry.rule == "loss"}
        found.spikes, found.nonfinite = verdicts.get("spike", []), verdicts.get("nonfinite", [])
        flagged = _steps(sorted(found.spikes + found.nonfinite), recording.loss_steps).replace("acts on", "skips", 1)
        text += "\n".join(loss_lines(found, ratios, flagged, **shown)) + "\n"
    elif loss:
        text += "\n".join(loss_lines(None, ratios, None, **shown)) + "\n"
    text += kept.sections()
    load_policy_text(Policy, text, "yaml", "<suggested>")  # what is printed loads: a failure here is a bug
    return Suggestion(text, thresholds, sparse, replay, recording, len(names), budget, z, found)


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


def _unique_rule_names(thresholds: list[Threshold]) -> None:
    taken = {NONFINITE_RULE, MONITOR_RULE}
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
    kept: _Kept,
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


_WHY_RECOVERY: Final = "which the recovery section (below, the run's) turns into a rewind"


@dataclass(frozen=True)
class _Kept:
    """What the suggestion keeps of the run's policy: the non-finite verdict and the top-level sections."""

    halts: bool
    why_halt: str
    recovery: dict[str, Any] | None
    recovery_from: str
    rerun: dict[str, Any] | None
    loss: dict[str, Any] | None

    @classmethod
    def of(cls, keep: Policy | None, recording: Recording, *, proposed_loss: bool) -> _Kept:
        if keep is not None:
            recovery = keep.recovery.model_dump(mode="json", exclude_defaults=True) if keep.recovery else None
            rerun = keep.rerun.model_dump(mode="json", exclude_defaults=True) if keep.rerun else None
            loss = keep.loss.model_dump(mode="json", exclude_defaults=True) if keep.loss and not proposed_loss else None
            halts = any(isinstance(a, HaltOnNonfinite) for rule in keep.rules for a in rule.actions)
            why = "as the run's policy did" if halts else ""
            if not halts and recovery is not None:
                halts, why = True, _WHY_RECOVERY
            return cls(halts, why, recovery, f"the run's policy ({keep.source})", rerun, loss)
        recovery = recording.recovery
        return cls(recovery is not None, _WHY_RECOVERY, recovery, "the log's attach event", None, None)

    def sections(self) -> str:
        """The kept sections, in YAML's flow style (JSON), each with a comment saying where it comes from."""
        lines: list[str] = []
        if self.loss is not None:
            lines.append("# The loss section of the run's policy, kept as it was (--loss proposes one instead).")
            lines.append(f"loss: {json.dumps(self.loss)}")
        if self.recovery is not None:
            lines.append(f"# The recovery section, kept from {self.recovery_from}: a halt rewinds to a snapshot.")
            lines.append(f"recovery: {json.dumps(self.recovery)}")
        if self.rerun is not None:
            lines.append("# The rerun section of the run's policy, kept as it was.")
            lines.append(f"rerun: {json.dumps(self.rerun)}")
        return "".join(f"{line}\n" for line in lines)


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
