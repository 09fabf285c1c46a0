"""Gradient health, after the step's one sync: the monitors' figures become events, warnings and metrics.

Each sampled monitor writes one ``stats`` event per step (its figures per name); a 2-norm below
``vanishing_below`` or above ``exploding_above`` is warned about (``vanishing`` / ``exploding``) and
counted once per name, and not again until the norm comes back inside the thresholds (``recovered``).
The last figures of every monitor are kept for ``Health.metrics``, a flat dict for loggers: those of steps whose
update was applied, or that halted the run (``commit``); the NaN figures of a step that was skipped or rewound are
logged in its ``stats`` event but not shown as the current ones for the steps after it, where the run goes on.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

from gradguard.enforce.work.step_work import Observation
from gradguard.events.counters import Counters
from gradguard.events.log import EventLog

__all__ = ["Health", "metric_key"]


def metric_key(rule: str, stat: str, name: str | None = None) -> str:
    """``gradguard/<rule>/<stat>[/<name>]``: the key of one figure in ``Health.metrics``."""
    return f"gradguard/{rule}/{stat}" if name is None else f"gradguard/{rule}/{stat}/{name}"


class Health:
    """The monitors' state across steps: the last figures, and which names are flagged."""

    def __init__(self, counters: Counters, events: EventLog) -> None:
        self.counters = counters
        self.events = events
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._pending: tuple[int, dict[str, float]] | None = None
        """The figures of a step reported but not yet applied (its step), for ``commit``."""
        self._flagged: dict[tuple[str, str, str], str] = {}
        """(rule, scope, name) -> ``vanishing`` or ``exploding`` while it stays out of its thresholds."""

    def report(self, observed: Sequence[Observation], step: int, loss: float | None = None) -> None:
        """Log the step's figures (and its ``loss``, where seen), warn about names that crossed a threshold, keep
        them for metrics."""
        if not observed:
            return
        latest: dict[str, float] = {}
        for seen in observed:
            group = seen.scope == "group"
            figures: dict[str, Any] = {
                stat: values[0] if group else dict(zip(seen.names, values, strict=True))
                for stat, values in seen.figures.items()
            }
            extra = {} if loss is None else {"loss": loss}
            self.events.emit("info", "stats", step=step, rule=seen.rule, scope=seen.scope, figures=figures, **extra)
            for stat, values in seen.figures.items():
                if group:
                    latest[metric_key(seen.rule, stat)] = values[0]
                else:
                    latest.update({metric_key(seen.rule, stat, n): v for n, v in zip(seen.names, values, strict=True)})
            if seen.norms is not None:
                self._check(seen, step)
        self._pending = (step, latest)

    def commit(self, step: int) -> None:
        """``step``'s update was applied (or it halted the run): its figures, if any, become the current ones."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == step:
            with self._lock:
                self._last.update(pending[1])

    def _check(self, seen: Observation, step: int) -> None:
        low, high = seen.action.vanishing_below, seen.action.exploding_above
        assert seen.norms is not None
        for name, norm in zip(seen.names, seen.norms, strict=True):
            key = (seen.rule, seen.scope, name)
            if math.isnan(norm):
                continue  # a NaN is neither small nor large: the non-finite watch reports it
            state = None
            threshold = None
            if low is not None and norm < low:
                state, threshold = "vanishing", low
            elif high is not None and norm > high:
                state, threshold = "exploding", high
            was = self._flagged.get(key)
            if state is None:
                if was is not None:
                    del self._flagged[key]
                    self.events.emit("info", "recovered", step=step, rule=seen.rule, name=name, norm=norm, was=was)
                continue
            if was == state:
                continue  # already warned; not again until it recovers
            self._flagged[key] = state
            self.counters.add(seen.rule, state)
            self.events.emit(
                "warning", state, step=step, rule=seen.rule, scope=seen.scope, name=name, norm=norm, threshold=threshold
            )

    def keep_rules(self, names: set[str]) -> None:
        """A new policy is in force: forget the flags and figures of every rule not in ``names``."""
        with self._lock:
            prefixes = tuple(f"gradguard/{name}/" for name in names)
            self._last = {key: value for key, value in self._last.items() if key.startswith(prefixes)}
        self._flagged = {key: state for key, state in self._flagged.items() if key[0] in names}

    def state_dict(self) -> list[list[str]]:
        """The names out of their thresholds now, ``[rule, scope, name, state]``: a resumed run warns again only
        after they recover, as the uninterrupted run would."""
        return [[rule, scope, name, state] for (rule, scope, name), state in sorted(self._flagged.items())]

    def load_state_dict(self, saved: Sequence[Sequence[str]], rule_names: set[str]) -> None:
        self._flagged = {
            (str(rule), str(scope), str(name)): str(state)
            for rule, scope, name, state in saved
            if rule in rule_names and state in ("vanishing", "exploding")
        }

    def flagged(self) -> dict[tuple[str, str], str]:
        """``(rule, name) -> "vanishing" | "exploding"`` for the names out of their thresholds now."""
        return {(rule, name): state for (rule, _, name), state in self._flagged.items()}

    def metrics(self, counters: dict[str, dict[str, int]], steps: int, loss: float | None = None) -> dict[str, float]:
        """The last sampled figures and the counters, flat: ``gradguard/<rule>/<stat>[/<name>]``,
        ``gradguard/<rule>/<action>``, ``gradguard/steps`` and the last step's ``gradguard/loss`` (where seen)."""
        with self._lock:
            out: dict[str, float] = dict(self._last)
        for rule, by_action in counters.items():
            for action, count in by_action.items():
                out[f"gradguard/{rule}/{action}"] = float(count)
        out["gradguard/steps"] = float(steps)
        if loss is not None:
            out["gradguard/loss"] = loss
        return out
