"""Thread-safe intervention counters, keyed by rule and action."""

from __future__ import annotations

import threading
from collections.abc import Iterable

__all__ = [
    "BUILT_IN_RULES",
    "LOSS_RULE",
    "RANKS_RULE",
    "RECOVERY_RULE",
    "RERUN_RULE",
    "SCALER_RULE",
    "STAGES_RULE",
    "Counters",
]

LOSS_RULE = "loss"
"""Counter key of the policy's ``loss`` section (its spikes, non-finite losses and halts)."""
RERUN_RULE = "rerun"
"""Counter key of the ``rerun`` section (its verdicts and halts)."""
SCALER_RULE = "grad_scaler"
"""Counter key of the steps a GradScaler skipped (inf/NaN found in a normal loss-scale search)."""
RECOVERY_RULE = "recovery"
"""Counter key of the steps of a rewind's window (``recovery`` section)."""
RANKS_RULE = "ranks"
"""Counter key of the policy's ``ranks`` section (its outliers, divergences, skips and halts)."""
STAGES_RULE = "pipeline"
"""Counter key of a verdict another pipeline stage made (a stage's skip or halt for another's fault)."""
BUILT_IN_RULES = frozenset({LOSS_RULE, RERUN_RULE, SCALER_RULE, RECOVERY_RULE, RANKS_RULE, STAGES_RULE})
"""The keys the guard counts under besides its rules' names: no rule may take one (``policy.schema``'s
``RESERVED_RULE_NAMES``, which cannot import this room, says the same; a test holds them equal)."""


class Counters:
    """``{rule_name: {action_name: count}}``, safe to update and read from any thread.

    A count is the number of (parameter, step) pairs an action changed: a tensor-scope clip of three
    parameters in one step counts 3, and so does a group clip of a three-parameter rule. Non-finite
    detections are counted under the pseudo-actions ``nan`` and ``inf``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, dict[str, int]] = {}

    def add(self, rule: str, action: str, count: int = 1) -> None:
        """Add ``count`` to ``rule``/``action``."""
        if count <= 0:
            return
        with self._lock:
            by_action = self._counts.setdefault(rule, {})
            by_action[action] = by_action.get(action, 0) + count

    def add_many(self, items: Iterable[tuple[str, str, int]]) -> None:
        """Add several ``(rule, action, count)`` at once, under one lock acquisition."""
        with self._lock:
            for rule, action, count in items:
                if count > 0:
                    by_action = self._counts.setdefault(rule, {})
                    by_action[action] = by_action.get(action, 0) + count

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A plain-dict deep copy, consistent at one instant."""
        with self._lock:
            return {rule: dict(by_action) for rule, by_action in self._counts.items()}

    def total(self, action: str | None = None) -> int:
        """The sum over all rules, of one action or of all."""
        with self._lock:
            return sum(
                count
                for by_action in self._counts.values()
                for name, count in by_action.items()
                if action is None or name == action
            )
