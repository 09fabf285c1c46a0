"""The "Other events" section: events of a name no collector reads (a callback's, a later guard's), counted by name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from gradguard.audit.collector import UNCLAIMED, Collector, Context, Handler
from gradguard.audit.dispatch import name_of
from gradguard.audit.reader import AnyEvent, Record
from gradguard.audit.run_state import RunState
from gradguard.audit.summary import StepTally

__all__ = ["KEPT_EVENT_NAMES", "OtherEventCollector"]

KEPT_EVENT_NAMES: Final = 100


class OtherEventCollector(Collector):
    """Events no other collector reads: counted by name, the first ``KEPT_EVENT_NAMES`` names apart and the rest
    together (a replica is not counted again)."""

    def __init__(self, context: Context) -> None:
        event_filter = context.event_filter
        self._shown = event_filter.shown
        self._param_filter = event_filter.params
        self.by_name: dict[str, StepTally] = {}

    def reads(self) -> Mapping[type[Any], Handler]:
        return {UNCLAIMED: self.add}

    def add(self, event: AnyEvent, run: RunState, record: Record) -> None:
        name = name_of(event)
        step = getattr(event, "step", None)
        rule = getattr(event, "rule", None)
        if not self._shown(step, rule if type(rule) is str else None):
            return
        param = getattr(event, "param", None)
        if self._param_filter is not None and not (type(param) is str and self._param_filter(param)):
            return
        steps = self.by_name.get(name)
        if steps is None:
            if len(self.by_name) >= KEPT_EVENT_NAMES:
                name = "(other names)"
                steps = self.by_name.get(name)
            if steps is None:
                steps = self.by_name[name] = StepTally()
        steps.add(step)

    def contribute(self, fields: dict[str, Any]) -> None:
        fields["other_events"] = {name: steps.done() for name, steps in sorted(self.by_name.items())}
