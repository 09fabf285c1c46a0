"""The interventions sections: clips counted by (rule, action) and by parameter, with the largest values seen.

A group clip counts once for each of its parameters; its events are pooled by (rule, parameter list)
first and attributed to the parameters one by one when the summary is made.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from gradguard.audit.collector import Collector, Context, Handler
from gradguard.audit.fields import Malformed, number_or_none
from gradguard.audit.reader import Record
from gradguard.audit.run_state import RunState
from gradguard.audit.summary import ParamRow, ParamTally, RuleActionRow
from gradguard.events.definitions import AdaptiveClip, Intervention, as_float

__all__ = ["InterventionCollector"]

KEPT_GROUPS: Final = 1000
"""Distinct (rule, parameter list) group clips pooled before attributing them to parameters one by one."""


class _RuleAction:
    __slots__ = ("best", "best_step", "count", "events", "first", "first_seq", "last", "last_seq")

    def __init__(self) -> None:
        self.count = 0
        self.events = 0
        self.first: int | None = None
        self.first_seq = -1
        self.last: int | None = None
        self.last_seq = -1
        self.best: float | None = None
        self.best_step: int | None = None


class _Param(ParamTally):
    __slots__ = ("element", "element_step", "first_seq", "last_seq", "norm", "norm_step")

    def __init__(self) -> None:
        super().__init__()
        self.first_seq = -1
        self.last_seq = -1
        self.norm: float | None = None
        self.norm_step: int | None = None
        self.element: float | None = None
        self.element_step: int | None = None


NORM_ACTIONS = frozenset({"clip_norm", "zclip", "autoclip", "agc"})
"""Actions whose ``before`` is a gradient norm (clip_value's is the largest element)."""

Entry = list[Any]
"""The clips of one (rule, action, parameter) since the tables were last settled:
``[count, first step, first seq, last step, last seq, largest before, its step]``."""
Entries = dict[tuple[str, str], dict[str, Entry]]
"""``Entry`` s by (rule, action), then parameter: a run of clips under one rule and action (how the guard writes
them) looks the pair up once."""


class InterventionCollector(Collector):
    """Takes ``intervention`` and ``adaptive_clip`` events; ``rows`` gives the by-(rule, action) and by-parameter
    tables.

    A clip of one tensor (by far the most common line) only updates its (rule, action, parameter)
    ``Entry`` in ``entries``
    (a streak of them at once: ``clips``); the tables are settled from the entries when they are read. ``seq``
    numbers the clips in reading order, so that the first and last of a row are the ones read first and last.
    """

    def __init__(self, context: Context) -> None:
        event_filter = context.event_filter
        self._shown = event_filter.shown
        self._narrow = event_filter.narrow
        self._param_filter = event_filter.params
        self.filtered = event_filter.filters.active
        """Whether a filter is on (clips then take the general path)."""
        self._rule_action: dict[tuple[str, str], _RuleAction] = {}
        self._params: dict[str, _Param] = {}
        self._groups: dict[tuple[str, tuple[str, ...]], list[Any]] = {}
        """Group-clip events pooled by (rule, parameters): [events, first step, last step]."""
        self.series: dict[str, int] = {}
        """Clip events per plottable series (a parameter, or ``"<rule> (group)"``)."""
        self.entries: Entries = {}
        self.seq = 0

    def reads(self) -> Mapping[type[Any], Handler]:
        return {Intervention: self.intervention, AdaptiveClip: self.adaptive_clip}

    def clips(self, run: RunState, records: Sequence[Record]) -> None:
        """A streak of one-tensor clips of one rule and action (no filter on): each updates its ``Entry``; replicas
        are counted once."""
        if run.replica or not records:
            return
        first: Intervention = records[0].event  # type: ignore[assignment]  # a streak holds clips only
        key = (first.rule, first.action)
        by_param = self.entries.get(key)
        if by_param is None:
            by_param = self.entries[key] = {}
        get = by_param.get
        seq = self.seq
        # The loop a clip of most lines goes through: each step and name read once, where it is used (a tenth fewer
        # instructions than reading them all first). ``before`` is a Number, never None: a float once ``as_float``.
        for record in records:
            event: Intervention = record.event  # type: ignore[assignment]
            seq += 1
            before = event.before
            if type(before) is not float:
                before = as_float(before)
            entry = get(event.param)  # type: ignore[arg-type]  # a streak's clips are of one tensor each
            if entry is None:
                step = event.step
                by_param[event.param] = [1, step, seq, step, seq, before, step]  # type: ignore[index]
                continue
            entry[0] += 1
            entry[3] = step = event.step
            entry[4] = seq
            best = entry[5]
            if best is None or before > best:
                entry[5] = before
                entry[6] = step
        self.seq = seq

    def contribute(self, fields: dict[str, Any]) -> None:
        by_rule_action, by_param = self.rows()
        fields["by_rule_action"] = by_rule_action
        fields["by_param"] = by_param
        fields["intervention_count"] = sum(row.count for row in by_rule_action)
        fields["intervention_events"] = sum(row.events for row in by_rule_action)
        fields["series_counts"] = dict(self.series)

    def intervention(self, event: Intervention, run: RunState, record: Record) -> None:
        param = event.param
        if param is None:
            names = event.params
            if names is None:
                raise Malformed("gradguard 'intervention' event of a group clip ('param': null) without its 'params'")
            self.add(run, event.step, event.rule, event.action, None, names, event.n_params, event.before)
            return
        self.tensor_clip(run, event.step, event.rule, event.action, param, event.before)

    def adaptive_clip(self, event: AdaptiveClip, run: RunState, record: Record) -> None:
        """An adaptive clip is an intervention per parameter (``scope: tensor`` events list them in one line)."""
        before = event.before
        if not isinstance(before, list):
            self.add(run, event.step, event.rule, event.action, event.param, event.params, event.n_params, before)
            return
        params = event.params
        if len(before) != len(params):
            raise Malformed(
                f"gradguard 'adaptive_clip' event whose lists do not have one entry per parameter "
                f"({len(params)} params, {len(before)} 'before' values)"
            )
        step, rule, action = event.step, event.rule, event.action
        if self.filtered:
            for name, one in zip(params, before, strict=True):
                self.tensor_clip(run, step, rule, action, name, one)
            return
        if not params:
            return
        # tensor_clip inlined: a line of a hundred tensors' clips is a hundred clips (a tenth of a log's clips).
        key = (rule, action)
        if run.replica:  # another rank of the job wrote these clips at this step: counted in the tables once
            return
        entries = self.entries.get(key)
        if entries is None:
            entries = self.entries[key] = {}
        seq = self.seq
        get = entries.get
        for name, one in zip(params, before, strict=True):
            value = one if type(one) is float else as_float(one)  # a Number, never None (see ``clips``)
            seq += 1
            entry = get(name)
            if entry is None:
                entries[name] = [1, step, seq, step, seq, value, step]
                continue
            entry[0] += 1
            entry[3] = step
            entry[4] = seq
            best = entry[5]
            if best is None or value > best:
                entry[5] = value
                entry[6] = step
        self.seq = seq

    def tensor_clip(self, run: RunState, step: int, rule: str, action: str, param: str, raw: float | str) -> None:
        """One clip of one tensor (the summarizer inlines this for ``intervention`` lines when no filter is on)."""
        before = raw if type(raw) is float else number_or_none(raw)
        key = (rule, action)
        if run.replica:
            return
        if self.filtered and (
            not self._shown(step, rule) or (self._param_filter is not None and not self._param_filter(param))
        ):
            return
        self.seq += 1
        entries = self.entries.get(key)
        if entries is None:
            entries = self.entries[key] = {}
        entry = entries.get(param)
        if entry is None:
            entries[param] = [1, step, self.seq, step, self.seq, before, step]
            return
        entry[0] += 1
        entry[3] = step
        entry[4] = self.seq
        if before is not None and (entry[5] is None or before > entry[5]):
            entry[5] = before
            entry[6] = step

    def add(
        self,
        run: RunState,
        step: int,
        rule: str,
        action: str,
        param: str | None,
        names: list[str],
        n_params: int | None,
        raw_before: float | str,
    ) -> None:
        """One clip of the group ``names`` (``param`` None), or of ``param`` (an adaptive clip at group scope)."""
        if param is not None:
            self.tensor_clip(run, step, rule, action, param, raw_before)
            return
        before = raw_before if type(raw_before) is float else number_or_none(raw_before)
        n = n_params if n_params is not None else len(names)
        key = (rule, action)
        if run.replica or not self._shown(step, rule):
            return
        if self._param_filter is not None:
            names = self._narrow(names)
            if not names:
                return
            n = len(names)
        self._group_event(rule, names, step)
        series = f"{rule} (group)"
        self.seq += 1
        row = self._rule_action.get(key)
        if row is None:
            row = self._rule_action[key] = _RuleAction()
        row.count += n
        row.events += 1
        if row.first is None:
            row.first, row.first_seq = step, self.seq
        row.last, row.last_seq = step, self.seq
        if before is not None and (row.best is None or before > row.best):
            row.best, row.best_step = before, step
        self.series[series] = self.series.get(series, 0) + 1

    def settle(self) -> None:
        """Fold the entries into the tables (in the order their clips were read), and empty them."""
        # In the order of each entry's first clip (its first seq), as one dict of every entry would hold them.
        settled = [
            (entry[2], rule, action, name, entry)
            for (rule, action), by_param in self.entries.items()
            for name, entry in by_param.items()
        ]
        settled.sort(key=lambda item: item[0])
        for _, rule, action, name, entry in settled:
            self._settle(rule, action, name, entry)
        self.entries.clear()

    def _settle(self, rule: str, action: str, name: str, entry: Entry) -> None:
        count, first, first_seq, last, last_seq, best, best_step = entry
        row = self._rule_action.get((rule, action))
        if row is None:
            row = self._rule_action[(rule, action)] = _RuleAction()
        row.count += count
        row.events += count
        if row.first is None or first_seq < row.first_seq:
            row.first, row.first_seq = first, first_seq
        if last_seq > row.last_seq:
            row.last, row.last_seq = last, last_seq
        if best is not None and (row.best is None or best > row.best):
            row.best, row.best_step = best, best_step
        param = self._params.get(name)
        if param is None:
            param = self._params[name] = _Param()
        param.count += count
        if param.first is None or first_seq < param.first_seq:
            param.first, param.first_seq = first, first_seq
        if last_seq > param.last_seq:
            param.last, param.last_seq = last, last_seq
        param.rules[rule] = None
        if best is not None:
            if action in NORM_ACTIONS:
                if param.norm is None or best > param.norm:
                    param.norm, param.norm_step = best, best_step
            elif action == "clip_value" and (param.element is None or best > param.element):
                param.element, param.element_step = best, best_step
        self.series[name] = self.series.get(name, 0) + count

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
                entry.last, entry.last_seq = last, self.seq
            if rule not in entry.rules:
                entry.rules[rule] = None

    def rows(self) -> tuple[list[RuleActionRow], list[ParamRow]]:
        """The by-(rule, action) rows, most changes first, and the by-parameter rows, most-affected first.

        Attributes the pooled group clips to their parameters first.
        """
        self.settle()
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
        return by_rule_action, by_param
