"""The data model of ``gradguard audit``: an ``AuditSummary`` and its rows, and the findings it yields.

Plain data: the summarizer (``gradguard.audit.summarizer``) fills it, the renderers
(``gradguard.audit.render``, ``gradguard.audit.plot``) read it; ``AuditSummary.as_json`` is
``--format json``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from gradguard.audit.filters import Filters
from gradguard.audit.reader import BadLine

__all__ = [
    "FINDING_ADDED",
    "FINDING_GROUP_NORMS",
    "FINDING_HALTS",
    "FINDING_LOSS",
    "FINDING_MISMATCHES",
    "FINDING_NONFINITE",
    "FINDING_REWINDS",
    "FINDING_SKIPS",
    "FINDING_UNHALTED",
    "FINDING_UNREADABLE",
    "AddedSection",
    "AuditSummary",
    "Counts",
    "FileInfo",
    "FlagRow",
    "HaltRow",
    "HealthRow",
    "JobInfo",
    "LossRow",
    "Mismatch",
    "NonfiniteRow",
    "ParamRow",
    "ParamTally",
    "RankRow",
    "RerunRow",
    "RewindRow",
    "RuleActionRow",
    "RunInfo",
    "StepList",
    "StepTally",
    "joined_stretches",
    "unlearned_stretch",
]

SHOWN_STEPS: Final = 20
"""How many distinct steps of each kind of incident are listed."""
HALT_PARAMS_SHOWN: Final = 10

Counts = dict[str, dict[str, int]]
"""``guard.counters.snapshot()``: ``{rule: {action: count}}``."""


@dataclass
class FileInfo:
    path: str
    lines: int
    events: int
    bad_lines: int


@dataclass
class RunInfo:
    """One guard's life in the log (a ``run`` id)."""

    run: str
    rank: int
    files: list[str]
    model: str | None
    policy: str | None
    params: int | None
    first_step: int | None
    last_step: int | None
    steps: int | None
    """Steps the guard treated, from its last ``counters``/``detach`` event (else last step + 1)."""
    start: str | None
    end: str | None
    seconds: float | None
    events: int
    ended: str
    counters: Counts
    counters_source: str
    counters_complete: bool
    """False where ``scale``/``zero``/``drop`` counts after the last snapshot cannot be known."""
    snapshots: int
    """How many ``counters``/``halt``/``detach`` snapshots the log has of this run (each one cross-checked)."""
    rules_matching_nothing: list[str]
    rewinds: int = 0
    """How many times recovery rewound the run to a snapshot (the run went on each time)."""
    unlearned_steps: list[list[int]] = field(default_factory=list)
    """The stretches ``[first, last]`` of steps whose batches the run never learned from (rewinds' undone,
    faulty and skipped steps, overlapping stretches joined)."""
    snapshot_memory: str | None = None
    """Where recovery's snapshots lived and the bytes they held (the attach event's ``recovery``), or ``None``."""
    job: int = 1
    """The job it belongs to (``JobInfo.job``): the runs of the other ranks it trained with."""


@dataclass
class JobInfo:
    """The runs of one job, one per rank: an event every rank wrote is counted once per step."""

    job: int
    runs: list[str]
    ranks: list[int]
    counters: Counts
    """Its counters per step across its ranks: an event every rank counted, once (each run's are its rank's own)."""


@dataclass
class RankRow:
    """What the log says about one rank: the faults made there (before the reduction), its outliers, replica
    divergences and failures, and the re-runs whose computations differed or not there."""

    rank: int
    hosts: list[str]
    halts: int = 0
    rewinds: int = 0
    skips: int = 0
    outliers: int = 0
    divergences: int = 0
    failures: int = 0
    transient: int = 0
    reproducible: int = 0
    steps: StepList = field(default_factory=lambda: StepList())
    """The steps at which an event named the rank."""
    errors: list[str] = field(default_factory=list)
    """The first exceptions of its ``rank_failure`` events."""


@dataclass
class RuleActionRow:
    rule: str
    action: str
    count: int
    """(parameter, step) pairs changed: a group clip counts each of its parameters."""
    events: int
    first_step: int | None
    last_step: int | None
    largest_before: float | None
    """The largest norm (clip_norm) or element (clip_value) before the guard."""
    largest_before_step: int | None


@dataclass
class ParamRow:
    param: str
    count: int
    rules: list[str]
    first_step: int | None
    last_step: int | None
    largest_norm: float | None
    """The largest gradient norm a tensor-scope clip_norm saw on this parameter."""
    largest_norm_step: int | None
    largest_element: float | None
    """The largest absolute gradient element a clip_value saw on this parameter."""
    largest_element_step: int | None


@dataclass
class NonfiniteRow:
    param: str
    count: int
    kinds: list[str]
    rules: list[str]
    first_step: int | None
    last_step: int | None


@dataclass
class StepList:
    events: int = 0
    distinct_steps: int = 0
    steps: list[int] = field(default_factory=list)
    """The first ``SHOWN_STEPS`` distinct steps."""
    first_step: int | None = None
    last_step: int | None = None


class ParamTally:
    """One parameter's events of a kind: how many, the first and last step, and under which rules."""

    __slots__ = ("count", "first", "last", "rules")

    def __init__(self) -> None:
        self.count = 0
        self.first: int | None = None
        self.last: int | None = None
        self.rules: dict[str, None] = {}

    def add(self, step: int | None, rule: str) -> None:
        self.count += 1
        if step is not None:
            if self.first is None:
                self.first = step
            self.last = step
        self.rules[rule] = None


class StepTally:
    """A ``StepList`` being filled: events, distinct steps (in arrival order), the first few steps."""

    __slots__ = ("_last", "distinct", "events", "first", "last", "shown")

    def __init__(self) -> None:
        self.events = 0
        self.distinct = 0
        self.shown: list[int] = []
        self.first: int | None = None
        self.last: int | None = None
        self._last: int | None = None

    @property
    def last_added(self) -> int | None:
        """The step of the event added last."""
        return self._last

    def add(self, step: int | None, events: int = 1) -> None:
        """``events`` more events, of ``step``."""
        self.events += events
        if step is None or step == self._last:
            return
        self._last = step
        self.distinct += 1
        if len(self.shown) < SHOWN_STEPS and step not in self.shown:
            self.shown.append(step)
        if self.first is None or step < self.first:
            self.first = step
        if self.last is None or step > self.last:
            self.last = step

    def done(self) -> StepList:
        return StepList(self.events, self.distinct, sorted(self.shown), self.first, self.last)


@dataclass
class HaltRow:
    run: str
    rank: int
    step: int | None
    rule: str
    kind: str
    reason: str | None
    params: list[str]
    """The first ``HALT_PARAMS_SHOWN`` non-finite parameters, in model order."""
    n_params: int
    where: str
    ts: str | None
    preceded_by: str | None
    """The run's last intervention before the halt."""
    origin: dict[str, Any] | None = None
    """Where the NaN/Inf started, as the guard traced it (``GradGuard(provenance=...)``)."""
    restored_to: int | None = None
    """The step of the recovery snapshot restored before the halt (``max_rewinds`` reached), or ``None``."""
    ranks: list[int] = field(default_factory=list)
    """Every rank that wrote the halt (the ranks of a job halt together: one row for all)."""
    runs: list[str] = field(default_factory=list)


@dataclass
class RewindRow:
    """A rewind: recovery turned a halt at ``step`` into a rewind to the snapshot of ``to_step``; the run went on.

    One row per rewind; the ranks of a distributed run rewind together, so their events make one row.
    """

    step: int | None
    """The fault: the step whose verdict was a halt (its update was not taken)."""
    to_step: int | None
    """The snapshot's step: parameters, optimizer state and the guard's statistics are as they were then."""
    skip_until: int | None
    """The first step applied again: the batches of steps ``to_step`` .. ``skip_until - 1`` were never learned from."""
    rule: str
    kind: str
    reason: str | None
    params: list[str]
    """The first ``HALT_PARAMS_SHOWN`` non-finite parameters, as the halt would have named them."""
    n_params: int
    rewinds: int | None
    """How many rewinds the run had made, this one included."""
    lr_scale: float | None
    """The product of every rewind's ``lr_factor`` so far: the LRs now run at this fraction."""
    runs: list[str]
    ranks: list[int]
    where: str
    ts: str | None
    origin: dict[str, Any] | None = None


@dataclass
class SkipOrigin:
    """Where a skipped step's NaN/Inf started, on one rank of one run."""

    run: str
    rank: int
    step: int | None
    origin: dict[str, Any]


@dataclass
class Mismatch:
    run: str
    step: int | None
    rule: str
    action: str
    counters: int
    events: int
    where: str


@dataclass
class HealthRow:
    """One monitored figure over the run: ``name`` is a parameter, a module, or (group) the rule."""

    rule: str
    scope: str
    name: str
    stat: str
    samples: int
    first_step: int | None
    last_step: int | None
    first: float
    last: float
    min: float | None
    median: float | None
    max: float | None
    nonfinite: int
    median_exact: bool


@dataclass
class FlagRow:
    """A name that vanished or exploded: each episode ``[from_step, recovered_at]`` (``None``: not yet)."""

    rule: str
    name: str
    kind: str
    times: int
    episodes: list[list[int | None]]
    threshold: float | None
    worst: float | None
    """The smallest (vanishing) or largest (exploding) norm the warnings carried."""


@dataclass
class LossRow:
    """The ``loss`` section's verdicts of one kind and action (``loss_spike``, ``loss_nonfinite`` events)."""

    kind: str
    """``spike`` or ``nonfinite``."""
    action: str
    """``skip``, ``halt`` (a rewind under recovery) or ``ignore``."""
    steps: StepList
    largest_ratio: float | None = None
    """The largest ``loss / reference`` of the spikes, and its step, loss, reference and factor."""
    largest_step: int | None = None
    largest_loss: float | None = None
    largest_reference: float | None = None
    factor: float | None = None
    values: dict[str, int] = field(default_factory=dict)
    """Of a ``nonfinite`` row: how many were ``nan``, ``inf`` and ``-inf``."""


@dataclass
class RerunRow:
    """The ``rerun`` section's re-runs of one verdict (``rerun`` events)."""

    verdict: str
    """``transient`` or ``reproducible``."""
    steps: StepList
    asked: dict[str, int] = field(default_factory=dict)
    """What made the steps suspect (``nonfinite``, ``spike``, ``loss``), and how often."""


FINDING_HALTS, FINDING_REWINDS, FINDING_UNHALTED, FINDING_NONFINITE, FINDING_GROUP_NORMS = 0, 1, 2, 3, 4
FINDING_SKIPS, FINDING_UNREADABLE, FINDING_MISMATCHES, FINDING_LOSS, FINDING_ADDED = 5, 6, 7, 8, 9
"""The places of the findings in the report's Findings line, whichever collector found them."""


@dataclass
class AddedSection:
    """The section of a collector the summary has no field for: its JSON (under ``name``), its title and lines."""

    name: str
    data: Any
    title: str
    lines: list[str]


@dataclass
class AuditSummary:
    """Everything ``gradguard audit`` reports; ``as_json`` is its ``--format json``."""

    files: list[FileInfo]
    runs: list[RunInfo]
    ranks: list[int]
    first_step: int | None
    last_step: int | None
    start: str | None
    end: str | None
    seconds: float | None
    lines: int
    events: int
    filters: Filters
    totals: Counts
    """The reproduced ``guard.counters.snapshot()``, summed over jobs (whole log, never filtered): a job's ranks
    count the same events, so a job counts each once per step, not once per rank."""
    totals_complete: bool
    intervention_count: int
    intervention_events: int
    by_rule_action: list[RuleActionRow]
    by_param: list[ParamRow]
    """Every parameter with an intervention, most-affected first."""
    nonfinite: StepList
    nonfinite_by_kind: dict[str, int]
    nonfinite_by_rule: dict[str, int]
    nonfinite_by_param: list[NonfiniteRow]
    unhalted: StepList
    unhalted_params: list[str]
    group_norm_nonfinite: StepList
    halts: list[HaltRow]
    halts_total: int
    skips: StepList
    skips_by_rule: dict[str, int]
    skipped_params: dict[str, int]
    skip_origins: list[SkipOrigin]
    """The first skips that carry an origin (``KEPT_HALTS``)."""
    scaler_skips: StepList
    other_events: dict[str, StepList]
    bad_lines: list[BadLine]
    bad_lines_total: int
    mismatches: list[Mismatch]
    mismatches_total: int
    notes: list[str]
    findings: list[str]
    series_counts: dict[str, int] = field(repr=False, default_factory=dict)
    """Clip events per plottable series (a parameter, or ``"<rule> (group)"``), for ``--plot``."""
    health: list[HealthRow] = field(default_factory=list)
    """Every monitored figure (rule, scope, name, stat): first, last, min, median, max."""
    health_flags: list[FlagRow] = field(default_factory=list)
    """The names that vanished or exploded, and when."""
    spiked_params: dict[str, int] = field(default_factory=dict)
    """Parameters whose gradient norm spiked in a step ``skip_step_on_spike`` skipped, and how often."""
    largest_spike: tuple[float, int | None] | None = None
    """The largest z-score of a skipped spike, and its step."""
    rewinds: list[RewindRow] = field(default_factory=list)
    """The first ``KEPT_HALTS`` rewinds (one row for all ranks)."""
    rewinds_total: int = 0
    unlearned_steps: list[list[int]] = field(default_factory=list)
    """The stretches ``[first, last]`` of steps the shown rewinds left unlearned, joined across runs."""
    rewind_skips: list[list[int]] = field(default_factory=list)
    """The stretches ``[first, last]`` of steps the shown rewinds took no update at: each fault and its window
    (``step`` .. ``skip_until - 1``), joined across runs. The guard counts the window as ``recovery``/``skip``."""
    loss: list[LossRow] = field(default_factory=list)
    """The ``loss`` section's spikes and non-finite losses, one row per kind and action."""
    loss_unseen: list[str] = field(default_factory=list)
    """What the ``loss`` section could not judge (``loss_unseen`` events: each run says it once)."""
    loss_watched: bool = False
    """Some run's policy had a ``loss`` section (its attach event says so), whether or not it fired."""
    reruns: list[RerunRow] = field(default_factory=list)
    """The ``rerun`` section's re-runs, one row per verdict."""
    rerun_ranks: dict[int, StepList] = field(default_factory=dict)
    """Rank -> the steps at which its computation of a re-run step differed (transient faults)."""
    rerun_notes: list[str] = field(default_factory=list)
    """Suspect steps that could not be computed again (``rerun_unavailable``), in words."""
    jobs: list[JobInfo] = field(default_factory=list)
    """The runs grouped by job (one run per rank); ``totals`` sums the jobs' counters, not the runs'."""
    by_rank: list[RankRow] = field(default_factory=list)
    """Faults by the rank where they were made, outliers, divergences, failures and re-runs, by rank."""
    added: list[AddedSection] = field(default_factory=list)
    """The sections of collectors this summary has no field for (``Collector.section``), in registration order."""

    @property
    def exit_code(self) -> int:
        """0 when the log shows nothing to look at, 1 when ``findings`` is not empty."""
        return 1 if self.findings else 0

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("series_counts")
        data["filters"] = self.filters.as_json()
        data["bad_lines"] = [asdict(bad) for bad in self.bad_lines]
        data["exit_code"] = self.exit_code
        data.pop("added")
        data.update((added.name, added.data) for added in self.added)
        return {"schema": 1, **data}


def unlearned_stretch(step: int | None, to_step: int | None, skip_until: int | None) -> tuple[int, int] | None:
    """A rewind's steps never learned from, ``[to_step, skip_until)`` (to the fault where ``skip_until`` is missing)."""
    if to_step is None:
        return None
    if skip_until is not None:
        return (to_step, skip_until)
    return (to_step, (step if step is not None else to_step) + 1)


def joined_stretches(stretches: Iterable[tuple[int, int]]) -> list[list[int]]:
    """Half-open ``[start, stop)`` stretches of steps as sorted, joined ``[first, last]`` ones."""
    joined: list[list[int]] = []
    for start, stop in sorted(stretches):
        if stop <= start:
            continue
        if joined and start <= joined[-1][1] + 1:
            joined[-1][1] = max(joined[-1][1], stop - 1)
        else:
            joined.append([start, stop - 1])
    return joined


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")
