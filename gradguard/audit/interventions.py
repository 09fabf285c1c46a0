"""Interventions (clips): counted by (rule, action) and by parameter, with the largest values seen.

A group clip counts once for each of its parameters; its events are pooled by (rule, parameter list)
first and attributed to the parameters one by one when the summary is made.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from gradguard.audit.fields import Malformed, names_field, number_or_none
from gradguard.audit.filters import EventFilter
from gradguard.audit.reader import Record
from gradguard.audit.run_state import RunState
from gradguard.audit.summary import ParamRow, ParamTally, RuleActionRow

__all__ = ["InterventionCollector"]

KEPT_GROUPS: Final = 1000
"""Distinct (rule, parameter list) group clips pooled before attributing them to parameters one by one."""


class _RuleAction:
    __slots__ = ("best", "best_step", "count", "events", "first", "last")

    def __init__(self) -> None:
        self.count = 0
        self.events = 0
        self.first: int | None = None
        self.last: int | None = None
        self.best: float | None = None
        self.best_step: int | None = None


class _Param(ParamTally):
    __slots__ = ("element", "element_step", "norm", "norm_step")

    def __init__(self) -> None:
        super().__init__()
        self.norm: float | None = None
        self.norm_step: int | None = None
        self.element: float | None = None
        self.element_step: int | None = None


NORM_ACTIONS = frozenset({"clip_norm", "zclip", "autoclip", "agc"})
"""Actions whose ``before`` is a gradient norm (clip_value's is the largest element)."""


class InterventionCollector:
    """Takes ``intervention`` events; :meth:`rows` gives the by-(rule, action) and by-parameter tables."""

    def __init__(self, event_filter: EventFilter) -> None:
        self._shown = event_filter.shown
        self._narrow = event_filter.narrow
        self._param_filter = event_filter.params
        self._rule_action: dict[tuple[str, str], _RuleAction] = {}
        self._params: dict[str, _Param] = {}
        self._groups: dict[tuple[str, tuple[str, ...]], list[Any]] = {}
        """Group-clip events pooled by (rule, parameters): [events, first step, last step]."""
        self.series: dict[str, int] = {}
        """Clip events per plottable series (a parameter, or ``"<rule> (group)"``)."""

    def intervention(self, event: dict[str, Any], run: RunState, record: Record) -> None:
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
            before = number_or_none(before)
        if type(param) is str:
            n = 1
            run.last_intervention = (step, rule, action, param, before)
        elif param is None:
            names = names_field(event, "params")
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
        self.series[series] = self.series.get(series, 0) + 1

    def _tensor_event(self, rule: str, action: str, name: str, step: int | None, before: float | None) -> None:
        entry = self._params.get(name)
        if entry is None:
            entry = self._params[name] = _Param()
        entry.add(step, rule)
        if before is None:
            return
        if action in NORM_ACTIONS:
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

    def rows(self) -> tuple[list[RuleActionRow], list[ParamRow]]:
        """The by-(rule, action) rows, most changes first, and the by-parameter rows, most-affected first.

        Attributes the pooled group clips to their parameters first.
        """
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
