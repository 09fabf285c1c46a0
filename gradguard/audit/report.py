"""Aggregating audit-log events into an :class:`AuditSummary`, in memory bounded by the model, not the log.

What is kept grows with the number of runs, rules and parameter names, never with the number of
steps: counts, first/last steps, largest values, the first few steps of each kind of incident and
the first few halts, with totals for the rest.

Reproduced counters. ``guard.counters.snapshot()`` is ``{rule: {action: count}}``. The log carries
that snapshot whole in every ``counters`` event (every ``summary_every`` steps), in ``detach`` and in
``halt``; it also carries one event per clip, non-finite detection, halt and skip, but nothing per
step for ``scale``, ``zero`` and ``drop``. So a run's counters are its last snapshot, plus what the
events after that snapshot add; and at every snapshot, the counts the events give are checked
against it (a difference means lost or foreign lines, and is a finding).

Filters (steps, rules, parameter patterns) narrow the breakdowns; the run table, the reproduced
counters and the cross-check always cover the whole log.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Final

from gradguard.audit.reader import BadLine, ReadStats, Record

__all__ = [
    "AuditSummary",
    "EventFilter",
    "Filters",
    "Malformed",
    "Summarizer",
]

SHOWN_STEPS: Final = 20
"""How many distinct steps of each kind of incident are listed."""
KEPT_HALTS: Final = 50
KEPT_MISMATCHES: Final = 50
KEPT_EVENT_NAMES: Final = 100
KEPT_GROUPS: Final = 1000
"""Distinct (rule, parameter list) group clips pooled before attributing them to parameters one by one."""
HALT_PARAMS_SHOWN: Final = 10

RECOMPUTABLE_ACTIONS: Final = frozenset(
    {"clip_norm", "clip_value", "nan", "inf", "halt_on_nonfinite", "skip_step_on_nonfinite"}
)
"""Actions whose counts the per-event lines reproduce (``scale``, ``zero`` and ``drop`` are not logged per step)."""
SCALER_KEY: Final = ("grad_scaler", "skip")
"""The counter of steps GradScaler skipped; one ``scaler_skip`` event each."""

_CORE_EVENTS: Final = frozenset(
    {
        "attach",
        "detach",
        "counters",
        "intervention",
        "nonfinite",
        "nonfinite_unhalted",
        "nonfinite_group_norm",
        "halt",
        "skip",
        "scaler_skip",
    }
)

Counts = dict[str, dict[str, int]]


class Malformed(Exception):
    """A gradguard event whose fields are not what its kind requires; its line is reported and skipped."""


# --- filters ---------------------------------------------------------------------------------------


def _pattern(pattern: str) -> Callable[[str], bool]:
    """The policy pattern language: a glob on dotted names (``*`` crosses dots), or ``re:<regex>`` (full match)."""
    if pattern.startswith("re:"):
        regex = re.compile(pattern[3:])
        return lambda name: regex.fullmatch(name) is not None
    glob = re.compile(fnmatch.translate(pattern))
    return lambda name: glob.match(name) is not None


@dataclass(frozen=True)
class Filters:
    """Which incidents the breakdowns cover; empty means all."""

    since: int | None = None
    """First step shown (inclusive)."""
    until: int | None = None
    """Last step shown (inclusive)."""
    rules: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    """Parameter-name patterns, as in a policy: globs, or ``re:<regex>``."""

    def __post_init__(self) -> None:
        for pattern in self.params:
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern[3:])
                except re.error as exc:
                    raise ValueError(f"invalid regular expression in --param {pattern!r}: {exc}") from None

    @property
    def active(self) -> bool:
        return self.since is not None or self.until is not None or bool(self.rules) or bool(self.params)

    def describe(self) -> str:
        parts = []
        if self.since is not None or self.until is not None:
            low = "" if self.since is None else str(self.since)
            high = "" if self.until is None else str(self.until)
            parts.append(f"steps {low}..{high}")
        if self.rules:
            parts.append("rule " + " or ".join(self.rules))
        if self.params:
            parts.append("param " + " or ".join(self.params))
        return ", ".join(parts) if parts else "none"

    def as_json(self) -> dict[str, Any]:
        return {"since": self.since, "until": self.until, "rules": list(self.rules), "params": list(self.params)}


class _ParamFilter:
    def __init__(self, patterns: tuple[str, ...]) -> None:
        self._tests = [_pattern(pattern) for pattern in patterns]
        self._cache: dict[str, bool] = {}

    def __call__(self, name: str) -> bool:
        hit = self._cache.get(name)
        if hit is None:
            if len(self._cache) > 100_000:
                self._cache.clear()
            hit = any(test(name) for test in self._tests)
            self._cache[name] = hit
        return hit


class EventFilter:
    """:class:`Filters` applied to one event: its step and rule (:meth:`shown`), its parameters (:meth:`narrow`)."""

    def __init__(self, filters: Filters) -> None:
        self.filters = filters
        self.since = filters.since
        self.until = filters.until
        self.rules = frozenset(filters.rules)
        self.params = _ParamFilter(filters.params) if filters.params else None

    def shown(self, step: int | None, rule: str | None) -> bool:
        """Whether an event at ``step`` (``None``: no step) under ``rule`` passes the step and rule filters."""
        if step is not None:
            if self.since is not None and step < self.since:
                return False
            if self.until is not None and step > self.until:
                return False
        return not self.rules or rule in self.rules

    def narrow(self, names: list[str]) -> list[str]:
        """The names that pass the parameter filter (all of them when there is none)."""
        keep = self.params
        return names if keep is None else [name for name in names if keep(name)]


# --- the summary -----------------------------------------------------------------------------------


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
    """The first :data:`SHOWN_STEPS` distinct steps."""
    first_step: int | None = None
    last_step: int | None = None


@dataclass
class HaltRow:
    run: str
    rank: int
    step: int | None
    rule: str
    kind: str
    reason: str | None
    params: list[str]
    """The first :data:`HALT_PARAMS_SHOWN` non-finite parameters, in model order."""
    n_params: int
    where: str
    ts: str | None
    preceded_by: str | None
    """The run's last intervention before the halt."""


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
class AuditSummary:
    """Everything ``gradguard audit`` reports; :meth:`as_json` is its ``--format json``."""

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
    """The reproduced ``guard.counters.snapshot()``, summed over runs (whole log, never filtered)."""
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

    @property
    def exit_code(self) -> int:
        """0 when the log shows nothing to look at, 1 when :attr:`findings` is not empty."""
        return 1 if self.findings else 0

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("series_counts")
        data["filters"] = self.filters.as_json()
        data["bad_lines"] = [asdict(bad) for bad in self.bad_lines]
        data["exit_code"] = self.exit_code
        return {"schema": 1, **data}


# --- accumulators ----------------------------------------------------------------------------------


class _Steps:
    """A :class:`StepList` being filled: events, distinct steps (in arrival order), the first few steps."""

    __slots__ = ("_last", "distinct", "events", "first", "last", "shown")

    def __init__(self) -> None:
        self.events = 0
        self.distinct = 0
        self.shown: list[int] = []
        self.first: int | None = None
        self.last: int | None = None
        self._last: int | None = None

    def add(self, step: int | None) -> None:
        self.events += 1
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


class _RuleAction:
    __slots__ = ("best", "best_step", "count", "events", "first", "last")

    def __init__(self) -> None:
        self.count = 0
        self.events = 0
        self.first: int | None = None
        self.last: int | None = None
        self.best: float | None = None
        self.best_step: int | None = None


class _Param:
    __slots__ = ("count", "element", "element_step", "first", "last", "norm", "norm_step", "rules")

    def __init__(self) -> None:
        self.count = 0
        self.first: int | None = None
        self.last: int | None = None
        self.norm: float | None = None
        self.norm_step: int | None = None
        self.element: float | None = None
        self.element_step: int | None = None
        self.rules: dict[str, None] = {}


class _Nonfinite:
    __slots__ = ("count", "first", "kinds", "last", "rules")

    def __init__(self) -> None:
        self.count = 0
        self.first: int | None = None
        self.last: int | None = None
        self.kinds: dict[str, None] = {}
        self.rules: dict[str, None] = {}


class _Run:
    """Whole-log bookkeeping for one run id; never filtered."""

    def __init__(self, run: str, rank: int) -> None:
        self.run = run
        self.rank = rank
        self.files: dict[int, None] = {}
        self.model: str | None = None
        self.policy: str | None = None
        self.params: int | None = None
        self.rule_order: list[str] | None = None
        self.rules_matched: dict[str, int] = {}
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.steps: int | None = None
        self.first_ts: str | None = None
        self.last_ts: str | None = None
        self.events = 0
        self.detach_reason: str | None = None
        self.halted_at: list[int | None] = []
        self.recomputed: dict[tuple[str, str], int] = {}
        self.snapshot: Counts | None = None
        self.snapshot_event = ""
        self.snapshot_step: int | None = None
        self.snapshots = 0
        self.at_snapshot: dict[tuple[str, str], int] = {}
        self.unverifiable: set[str] = set()
        self.mismatched: set[tuple[str, str]] = set()
        self.watch_step: int | None = None
        self.halting_rules: dict[str, None] = {}
        self.skipping_rules: dict[str, None] = {}
        self.last_intervention: tuple[int | None, str, str, str | int, float | None] | None = None
        """(step, rule, action, parameter or group size, value before) of the last intervention."""

    def count(self, rule: str, action: str, n: int = 1) -> None:
        key = (rule, action)
        self.recomputed[key] = self.recomputed.get(key, 0) + n


def _recomputable(key: tuple[str, str]) -> bool:
    return key[1] in RECOMPUTABLE_ACTIONS or key == SCALER_KEY


def _number(value: Any) -> float | None:
    if type(value) is float or type(value) is int:
        return float(value)
    if value in ("NaN", "Infinity", "-Infinity"):
        return float(value)
    return None


def _text(event: Mapping[str, Any], key: str) -> str:
    value = event.get(key)
    if type(value) is not str:
        name = event.get("event")
        raise Malformed(f"gradguard {name!r} event without a {key!r} string (got {value!r})")
    return value


def _names(event: Mapping[str, Any], key: str) -> list[str]:
    value = event.get(key)
    if not isinstance(value, list) or not all(type(item) is str for item in value):
        raise Malformed(f"gradguard {event.get('event')!r} event whose {key!r} is not a list of parameter names")
    return value


def _counts(event: Mapping[str, Any]) -> Counts:
    value = event.get("counters")
    if isinstance(value, dict) and all(
        isinstance(by_action, dict) and all(type(n) is int for n in by_action.values()) for by_action in value.values()
    ):
        return value
    raise Malformed(f"gradguard {event.get('event')!r} event whose 'counters' is not {{rule: {{action: count}}}}")


def _describe(last: tuple[int | None, str, str, str | int, float | None] | None) -> str | None:
    if last is None:
        return None
    step, rule, action, what, before = last
    value = "?" if before is None else f"{before:.4g}"
    if isinstance(what, int):
        return f"{action} of {what} parameters as a group (rule {rule!r}) at step {step}, group norm before {value}"
    return f"{action} of {what} (rule {rule!r}) at step {step}, before {value}"


# --- the summarizer --------------------------------------------------------------------------------


class Summarizer:
    """Feed it :class:`Record` s (:meth:`add`); :meth:`summary` at any time gives an :class:`AuditSummary`."""

    def __init__(self, paths: Iterable[str], stats: ReadStats, filters: Filters | None = None) -> None:
        self.paths = list(paths)
        self.stats = stats
        self.filters = filters or Filters()
        event_filter = EventFilter(self.filters)
        self._shown = event_filter.shown
        self._narrow = event_filter.narrow
        self._rules = event_filter.rules
        self._param_filter = event_filter.params
        self._runs: dict[str, _Run] = {}
        self._rule_action: dict[tuple[str, str], _RuleAction] = {}
        self._params: dict[str, _Param] = {}
        self._groups: dict[tuple[str, tuple[str, ...]], list[Any]] = {}
        """Group-clip events pooled by (rule, parameters): [events, first step, last step]."""
        self._series: dict[str, int] = {}
        self._nonfinite = _Steps()
        self._nonfinite_kind: dict[str, int] = {}
        self._nonfinite_rule: dict[str, int] = {}
        self._nonfinite_param: dict[str, _Nonfinite] = {}
        self._unhalted = _Steps()
        self._unhalted_params: dict[str, None] = {}
        self._group_norm = _Steps()
        self._halts: list[HaltRow] = []
        self._halts_total = 0
        self._skips = _Steps()
        self._skips_rule: dict[str, int] = {}
        self._skipped_params: dict[str, int] = {}
        self._scaler = _Steps()
        self._other: dict[str, _Steps] = {}
        self._mismatches: list[Mismatch] = []
        self._mismatches_total = 0
        self._handlers: dict[str, Callable[[dict[str, Any], _Run, Record], None]] = {
            "attach": self._attach,
            "detach": self._detach,
            "counters": self._counters,
            "intervention": self._intervention,
            "nonfinite": self._nonfinite_event,
            "nonfinite_unhalted": self._unhalted_event,
            "nonfinite_group_norm": self._group_norm_event,
            "halt": self._halt,
            "skip": self._skip,
            "scaler_skip": self._scaler_skip,
        }

    # --- feeding ------------------------------------------------------------------------------------

    def add(self, record: Record) -> None:
        """Take one event; a malformed one is reported as a bad line (with its number) and skipped."""
        event = record.event
        try:
            run = self._run_of(event, record)
            handler = self._handlers.get(event["event"])
            if handler is None:
                self._other_event(event)
            else:
                handler(event, run, record)
        except Malformed as exc:
            path = self.paths[record.file]
            self.stats.events[path] = self.stats.events.get(path, 1) - 1
            self.stats.bad_line(path, record.line, str(exc))

    def add_all(self, records: Iterable[Record]) -> None:
        for record in records:
            self.add(record)

    def _run_of(self, event: dict[str, Any], record: Record) -> _Run:
        run_id: str = event["run"]
        run = self._runs.get(run_id)
        if run is None:
            rank = event.get("rank")
            run = self._runs[run_id] = _Run(run_id, rank if type(rank) is int else 0)
        if record.file not in run.files:
            run.files[record.file] = None
        run.events += 1
        ts = event.get("ts")
        if type(ts) is str:
            if run.first_ts is None:
                run.first_ts = ts
            run.last_ts = ts
        step = event.get("step")
        if step is not None:
            if run.first_step is None or step < run.first_step:
                run.first_step = step
            if run.last_step is None or step > run.last_step:
                run.last_step = step
        return run

    # --- events -------------------------------------------------------------------------------------

    def _attach(self, event: dict[str, Any], run: _Run, record: Record) -> None:
        model, policy, params, rules = event.get("model"), event.get("policy"), event.get("params"), event.get("rules")
        run.model = model if type(model) is str else None
        run.policy = policy if type(policy) is str else None
        run.params = params if type(params) is int else None
        if isinstance(rules, dict):
            run.rule_order = [str(name) for name in rules]
            run.rules_matched = {str(name): n for name, n in rules.items() if type(n) is int}

    def _detach(self, event: dict[str, Any], run: _Run, record: Record) -> None:
        reason = event.get("reason")
        run.detach_reason = reason if type(reason) is str else "unknown reason"
        self._snapshot(event, run, record)

    def _counters(self, event: dict[str, Any], run: _Run, record: Record) -> None:
        self._snapshot(event, run, record)

    def _snapshot(self, event: dict[str, Any], run: _Run, record: Record) -> None:
        counts = _counts(event)
        steps = event.get("steps")
        if type(steps) is int:
            run.steps = steps if run.steps is None else max(run.steps, steps)
        step = event.get("step")
        for rule, by_action in counts.items():
            for action, logged in by_action.items():
                key = (rule, action)
                if _recomputable(key) and action not in run.unverifiable:
                    self._check(run, key, logged, step, record)
        for key, counted in run.recomputed.items():
            if (
                counted
                and _recomputable(key)
                and key[1] not in run.unverifiable
                and key[1] not in counts.get(key[0], {})
            ):
                self._check(run, key, 0, step, record)
        run.snapshot = counts
        run.snapshots += 1
        run.snapshot_event = event["event"]
        run.snapshot_step = step if step is not None else run.last_step
        run.at_snapshot = dict(run.recomputed)

    def _check(self, run: _Run, key: tuple[str, str], logged: int, step: int | None, record: Record) -> None:
        counted = run.recomputed.get(key, 0)
        if counted == logged or key in run.mismatched:
            return
        run.mismatched.add(key)
        self._mismatches_total += 1
        if len(self._mismatches) < KEPT_MISMATCHES:
            where = f"{self.paths[record.file]}:{record.line}"
            self._mismatches.append(Mismatch(run.run, step, key[0], key[1], logged, counted, where))

    def _intervention(self, event: dict[str, Any], run: _Run, record: Record) -> None:
        rule = event.get("rule")
        action = event.get("action")
        if type(rule) is not str or type(action) is not str:
            raise Malformed(
                f"gradguard 'intervention' event without a 'rule' and an 'action' string (got {rule!r}, {action!r})"
            )
        param = event.get("param")
        step: int | None = event.get("step")
        before = event.get("before")
        if type(before) is not float:
            before = _number(before)
        if type(param) is str:
            n = 1
            run.last_intervention = (step, rule, action, param, before)
        elif param is None:
            names = _names(event, "params")
            given = event.get("n_params")
            n = given if type(given) is int else len(names)
            run.last_intervention = (step, rule, action, n, before)
        else:
            raise Malformed(f"gradguard 'intervention' event whose 'param' is {param!r}, not a name or null")
        key = (rule, action)
        recomputed = run.recomputed
        recomputed[key] = recomputed.get(key, 0) + n
        if not self._shown(step, rule):
            return
        if param is None:
            if self._param_filter is not None:
                names = self._narrow(names)
                if not names:
                    return
                n = len(names)
            self._group_event(rule, names, step)
            series = f"{rule} (group)"
        else:
            if self._param_filter is not None and not self._param_filter(param):
                return
            self._tensor_event(rule, action, param, step, before)
            series = param
        row = self._rule_action.get(key)
        if row is None:
            row = self._rule_action[key] = _RuleAction()
        row.count += n
        row.events += 1
        if step is not None:
            if row.first is None:
                row.first = step
            row.last = step
        if before is not None and (row.best is None or before > row.best):
            row.best, row.best_step = before, step
        self._series[series] = self._series.get(series, 0) + 1

    def _tensor_event(self, rule: str, action: str, name: str, step: int | None, before: float | None) -> None:
        entry = self._params.get(name)
        if entry is None:
            entry = self._params[name] = _Param()
        entry.count += 1
        if step is not None:
            if entry.first is None:
                entry.first = step
            entry.last = step
        if rule not in entry.rules:
            entry.rules[rule] = None
        if before is None:
            return
        if action == "clip_norm":
            if entry.norm is None or before > entry.norm:
                entry.norm, entry.norm_step = before, step
        elif action == "clip_value" and (entry.element is None or before > entry.element):
            entry.element, entry.element_step = before, step

    def _group_event(self, rule: str, names: list[str], step: int | None) -> None:
        """A group clip counts once for each of its parameters; events of one (rule, parameters) are pooled first."""
        key = (rule, tuple(names))
        pooled = self._groups.get(key)
        if pooled is None:
            if len(self._groups) >= KEPT_GROUPS:
                self._spread(rule, names, 1, step, step)
                return
            pooled = self._groups[key] = [0, step, step]
        pooled[0] += 1
        if step is not None:
            if pooled[1] is None:
                pooled[1] = step
            pooled[2] = step

    def _spread(self, rule: str, names: Iterable[str], count: int, first: int | None, last: int | None) -> None:
        params = self._params
        for name in names:
            entry = params.get(name)
            if entry is None:
                entry = params[name] = _Param()
            entry.count += count
            if first is not None and (entry.first is None or first < entry.first):
                entry.first = first
            if last is not None and (entry.last is None or last > entry.last):
                entry.last = last
            if rule not in entry.rules:
                entry.rules[rule] = None

    def _watch(self, run: _Run, step: int | None) -> None:
        if step != run.watch_step:
            run.watch_step = step
            run.halting_rules = {}
            run.skipping_rules = {}

    def _nonfinite_event(self, event: dict[str, Any], run: _Run, record: Record) -> None:
        rule = _text(event, "rule")
        kind = _text(event, "kind")
        param = _text(event, "param")
        step: int | None = event.get("step")
        run.count(rule, kind)
        self._watch(run, step)
        if event.get("halts") is True:
            run.halting_rules[rule] = None
        if event.get("skips") is True:
            run.skipping_rules[rule] = None
        if not self._shown(step, rule) or not self._narrow([param]):
            return
        self._nonfinite.add(step)
        self._nonfinite_kind[kind] = self._nonfinite_kind.get(kind, 0) + 1
        self._nonfinite_rule[rule] = self._nonfinite_rule.get(rule, 0) + 1
        entry = self._nonfinite_param.get(param)
        if entry is None:
            entry = self._nonfinite_param[param] = _Nonfinite()
        entry.count += 1
        if step is not None:
            if entry.first is None:
                entry.first = step
            entry.last = step
        entry.kinds[kind] = None
        entry.rules[rule] = None

    def _unhalted_event(self, event: dict[str, Any], run: _Run, record: Record) -> None:
        names = _names(event, "params")
        step: int | None = event.get("step")
        if self._rules or not self._shown(step, None):
            return
        names = self._narrow(names)
        if not names:
            return
        self._unhalted.add(step)
        for name in names:
            self._unhalted_params[name] = None

    def _group_norm_event(self, event: dict[str, Any], run: _Run, record: Record) -> None:
        rule = _text(event, "rule")
        step: int | None = event.get("step")
        if self._param_filter is None and self._shown(step, rule):
            self._group_norm.add(step)

    def _halt(self, event: dict[str, Any], run: _Run, record: Record) -> None:
        rule = _text(event, "rule")
        params = _names(event, "params")
        step: int | None = event.get("step")
        reason = event.get("reason")
        reason = reason if type(reason) is str else None
        if reason is None:
            halting = run.halting_rules if run.watch_step == step and run.halting_rules else {rule: None}
            for name in halting:
                run.count(name, "halt_on_nonfinite")
        else:
            # A skip rule over its limits: it counts the halt, and the skip rules before it (policy order)
            # count this step's skip.
            run.count(rule, "halt_on_nonfinite")
            order = run.rule_order
            if order is None or rule not in order:
                run.unverifiable.add("skip_step_on_nonfinite")
            else:
                for name in run.skipping_rules if run.watch_step == step else {}:
                    if name in order and order.index(name) < order.index(rule):
                        run.count(name, "skip_step_on_nonfinite")
        run.halted_at.append(step)
        self._snapshot(event, run, record)
        if not self._shown(step, rule) or not self._narrow(params):
            return
        self._halts_total += 1
        if len(self._halts) < KEPT_HALTS:
            kind = event.get("kind")
            ts = event.get("ts")
            self._halts.append(
                HaltRow(
                    run=run.run,
                    rank=run.rank,
                    step=step,
                    rule=rule,
                    kind=kind if type(kind) is str else "?",
                    reason=reason,
                    params=params[:HALT_PARAMS_SHOWN],
                    n_params=len(params),
                    where=f"{self.paths[record.file]}:{record.line}",
                    ts=ts if type(ts) is str else None,
                    preceded_by=_describe(run.last_intervention),
                )
            )

    def _skip(self, event: dict[str, Any], run: _Run, record: Record) -> None:
        rule = _text(event, "rule")
        params = _names(event, "params")
        step: int | None = event.get("step")
        skipping = run.skipping_rules if run.watch_step == step and run.skipping_rules else {rule: None}
        for name in skipping:
            run.count(name, "skip_step_on_nonfinite")
        if not self._shown(step, rule):
            return
        names = self._narrow(params)
        if not names:
            return
        self._skips.add(step)
        self._skips_rule[rule] = self._skips_rule.get(rule, 0) + 1
        for name in names:
            self._skipped_params[name] = self._skipped_params.get(name, 0) + 1

    def _scaler_skip(self, event: dict[str, Any], run: _Run, record: Record) -> None:
        rule = event.get("rule")
        run.count(rule if type(rule) is str else SCALER_KEY[0], SCALER_KEY[1])
        step: int | None = event.get("step")
        if self._param_filter is None and self._shown(step, None) and not self._rules:
            self._scaler.add(step)

    def _other_event(self, event: dict[str, Any]) -> None:
        name: str = event["event"]
        step = event.get("step")
        rule = event.get("rule")
        if not self._shown(step, rule if type(rule) is str else None):
            return
        param = event.get("param")
        if self._param_filter is not None and not (type(param) is str and self._param_filter(param)):
            return
        steps = self._other.get(name)
        if steps is None:
            if len(self._other) >= KEPT_EVENT_NAMES:
                name = "(other names)"
                steps = self._other.get(name)
            if steps is None:
                steps = self._other[name] = _Steps()
        steps.add(step)

    # --- the result -------------------------------------------------------------------------------

    def summary(self) -> AuditSummary:
        """The summary of everything added so far."""
        runs = [self._run_info(run) for run in self._runs.values()]
        runs.sort(key=lambda info: (info.start or "", info.rank, info.run))
        totals: Counts = {}
        for info in runs:
            for rule, by_action in info.counters.items():
                into = totals.setdefault(rule, {})
                for action, n in by_action.items():
                    into[action] = into.get(action, 0) + n
        starts = [info.start for info in runs if info.start]
        ends = [info.end for info in runs if info.end]
        start, end = (min(starts) if starts else None), (max(ends) if ends else None)
        firsts = [info.first_step for info in runs if info.first_step is not None]
        lasts = [info.last_step for info in runs if info.last_step is not None]

        by_rule_action = [
            RuleActionRow(rule, action, acc.count, acc.events, acc.first, acc.last, acc.best, acc.best_step)
            for (rule, action), acc in self._rule_action.items()
        ]
        by_rule_action.sort(key=lambda row: (-row.count, row.rule, row.action))
        for (rule, names), (count, first, last) in self._groups.items():
            self._spread(rule, names, count, first, last)
        self._groups.clear()
        by_param = [
            ParamRow(
                name,
                acc.count,
                list(acc.rules),
                acc.first,
                acc.last,
                acc.norm,
                acc.norm_step,
                acc.element,
                acc.element_step,
            )
            for name, acc in self._params.items()
        ]
        by_param.sort(key=lambda row: (-row.count, -(row.largest_norm or 0.0), row.param))
        nonfinite_rows = [
            NonfiniteRow(name, acc.count, list(acc.kinds), list(acc.rules), acc.first, acc.last)
            for name, acc in self._nonfinite_param.items()
        ]
        nonfinite_rows.sort(key=lambda row: (row.first_step if row.first_step is not None else -1, -row.count))

        files = [
            FileInfo(
                path,
                self.stats.lines.get(path, 0),
                self.stats.events.get(path, 0),
                self.stats.bad_per_file.get(path, 0),
            )
            for path in self.paths
        ]
        summary = AuditSummary(
            files=files,
            runs=runs,
            ranks=sorted({info.rank for info in runs}),
            first_step=min(firsts) if firsts else None,
            last_step=max(lasts) if lasts else None,
            start=start,
            end=end,
            seconds=_seconds(start, end),
            lines=sum(info.lines for info in files),
            events=sum(info.events for info in files),
            filters=self.filters,
            totals=totals,
            totals_complete=all(info.counters_complete for info in runs),
            intervention_count=sum(row.count for row in by_rule_action),
            intervention_events=sum(row.events for row in by_rule_action),
            by_rule_action=by_rule_action,
            by_param=by_param,
            nonfinite=self._nonfinite.done(),
            nonfinite_by_kind=dict(sorted(self._nonfinite_kind.items())),
            nonfinite_by_rule=dict(sorted(self._nonfinite_rule.items(), key=lambda item: -item[1])),
            nonfinite_by_param=nonfinite_rows,
            unhalted=self._unhalted.done(),
            unhalted_params=list(self._unhalted_params),
            group_norm_nonfinite=self._group_norm.done(),
            halts=list(self._halts),
            halts_total=self._halts_total,
            skips=self._skips.done(),
            skips_by_rule=dict(self._skips_rule),
            skipped_params=dict(sorted(self._skipped_params.items(), key=lambda item: -item[1])),
            scaler_skips=self._scaler.done(),
            other_events={name: steps.done() for name, steps in sorted(self._other.items())},
            bad_lines=list(self.stats.bad_lines),
            bad_lines_total=self.stats.bad_total,
            mismatches=list(self._mismatches),
            mismatches_total=self._mismatches_total,
            notes=self._notes(runs),
            findings=[],
            series_counts=dict(self._series),
        )
        summary.findings = _findings(summary)
        return summary

    def _run_info(self, run: _Run) -> RunInfo:
        counters: Counts = {}
        if run.snapshot is not None:
            counters = {rule: dict(by_action) for rule, by_action in run.snapshot.items()}
            after = {
                key: n - run.at_snapshot.get(key, 0)
                for key, n in run.recomputed.items()
                if _recomputable(key) and n != run.at_snapshot.get(key, 0)
            }
            at = "after" if run.snapshot_event == "detach" else "at"
            source = f"{run.snapshot_event} event {at} step {run.snapshot_step}"
            if after:
                source += f" + {sum(after.values())} counted from the events after it"
            late = run.last_step is not None and (run.snapshot_step is None or run.last_step > run.snapshot_step)
            complete = run.snapshot_event == "detach" or not late
        else:
            after = {key: n for key, n in run.recomputed.items() if _recomputable(key) and n}
            source = "events alone (no counters event in the log yet)"
            complete = False
        for (rule, action), n in after.items():
            into = counters.setdefault(rule, {})
            into[action] = into.get(action, 0) + n
            if into[action] == 0:
                del into[action]
                if not into:
                    del counters[rule]
        if run.detach_reason is not None:
            ended = f"detached ({run.detach_reason})"
            if run.halted_at:
                ended = f"halted at step {run.halted_at[-1]}; " + ended
        elif run.halted_at:
            ended = f"halted at step {run.halted_at[-1]}; no detach event"
        else:
            ended = "no detach event: still running, or the process died"
        steps = run.steps
        if steps is None and run.last_step is not None:
            steps = run.last_step + 1
        return RunInfo(
            run=run.run,
            rank=run.rank,
            files=[self.paths[index] for index in run.files],
            model=run.model,
            policy=run.policy,
            params=run.params,
            first_step=run.first_step,
            last_step=run.last_step,
            steps=steps,
            start=run.first_ts,
            end=run.last_ts,
            seconds=_seconds(run.first_ts, run.last_ts),
            events=run.events,
            ended=ended,
            counters=counters,
            counters_source=source,
            counters_complete=complete,
            snapshots=run.snapshots,
            rules_matching_nothing=[name for name, n in run.rules_matched.items() if n == 0],
        )

    def _notes(self, runs: list[RunInfo]) -> list[str]:
        notes = []
        if self._rules:
            seen: set[str] = set()
            for run in self._runs.values():
                seen.update(run.rules_matched)
                seen.update(rule for rule, _ in run.recomputed)
                if run.snapshot:
                    seen.update(run.snapshot)
            missing = [rule for rule in self.filters.rules if rule not in seen]
            if missing:
                known = ", ".join(sorted(seen)) or "none"
                notes.append(f"--rule {', '.join(missing)}: no such rule in the log (rules seen: {known})")
        for info in runs:
            if not info.counters_complete and info.counters:
                notes.append(
                    f"run {info.run}: scale/zero/drop counts after {info.counters_source.split(' + ')[0]} are "
                    "not in the log (the guard writes them every summary_every steps and at detach)"
                )
        return notes


def _seconds(start: str | None, end: str | None) -> float | None:
    if not start or not end:
        return None
    try:
        return (_parse_ts(end) - _parse_ts(start)).total_seconds()
    except ValueError:
        return None


def _parse_ts(text: str) -> datetime:
    return datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _findings(summary: AuditSummary) -> list[str]:
    found = []
    if summary.halts_total:
        found.append(_plural(summary.halts_total, "halt"))
    if summary.unhalted.events:
        found.append(
            f"{_plural(summary.unhalted.distinct_steps, 'step')} applied non-finite gradients "
            "(no halt or skip rule covered them)"
        )
    if summary.nonfinite.events:
        found.append(_plural(summary.nonfinite.events, "non-finite gradient"))
    if summary.group_norm_nonfinite.events:
        found.append(_plural(summary.group_norm_nonfinite.events, "group clip") + " skipped on a non-finite norm")
    if summary.skips.events:
        found.append(_plural(summary.skips.events, "skipped step"))
    if summary.bad_lines_total:
        found.append(_plural(summary.bad_lines_total, "unreadable line"))
    if summary.mismatches_total:
        n = summary.mismatches_total
        found.append(f"{n:,} counter mismatch{'' if n == 1 else 'es'} between the events and the counters events")
    return found
