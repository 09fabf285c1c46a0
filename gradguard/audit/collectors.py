"""Where the collectors of ``gradguard audit`` are registered: one line each, in the order they take an event.

A collector (``gradguard.audit.collector``) is built from the same ``Context`` as every other (``factory(context)``)
and never from another. Adding a section to the report is one module with its collector and one ``register`` line
here (or ``with registered(name, factory):`` in a test, as ``tests/support/exercise_collector.py`` shows). The order
matters only where a collector refuses a line: the ranks collector comes before the counts, so that a ``ranks`` that
names no rank makes the line unreadable before anything counts it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from gradguard.audit.collector import Collector, Context
from gradguard.audit.counters import CounterCheck
from gradguard.audit.halts_and_skips import HaltSkipCollector
from gradguard.audit.health import HealthCollector
from gradguard.audit.interventions import InterventionCollector
from gradguard.audit.loss_report import LossCollector
from gradguard.audit.nonfinite import NonfiniteCollector
from gradguard.audit.other_events import OtherEventCollector
from gradguard.audit.ranks_report import RankCollector
from gradguard.audit.rerun_report import RerunCollector
from gradguard.audit.runs import RunTable

__all__ = ["Factory", "build", "register", "registered", "registered_names"]

Factory = Callable[[Context], Collector]

_REGISTRY: dict[str, Factory] = {}


def register(name: str, factory: Factory) -> None:
    """Register a collector under ``name``: built for every audit from now on, after those registered before."""
    if name in _REGISTRY:
        raise ValueError(f"a collector named {name!r} is registered already")
    _REGISTRY[name] = factory


@contextmanager
def registered(name: str, factory: Factory) -> Iterator[None]:
    """``register`` for the duration of a ``with`` block (a test's own collector)."""
    register(name, factory)
    try:
        yield
    finally:
        del _REGISTRY[name]


def registered_names() -> list[str]:
    return list(_REGISTRY)


def build(context: Context) -> list[Collector]:
    """One of each registered collector, in registration order."""
    return [factory(context) for factory in _REGISTRY.values()]


register("runs", RunTable)
register("ranks", RankCollector)
register("interventions", InterventionCollector)
register("nonfinite", NonfiniteCollector)
register("halts_and_skips", HaltSkipCollector)
register("health", HealthCollector)
register("loss", LossCollector)
register("reruns", RerunCollector)
register("counters", CounterCheck)
register("other_events", OtherEventCollector)
