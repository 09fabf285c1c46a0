"""What a halt comes to under recovery: the halt's report (``HaltReport``, which the ``rewind`` event repeats), the
decision (``Decision``: rewind, or halt after restoring), and the rewind asked of the step (``RewindRequested``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gradguard.enforce.recovery.snapshots import Snapshot

__all__ = ["Decision", "HaltReport", "RewindRequested", "ranks_field"]


def ranks_field(ranks: Mapping[int, Any]) -> dict[str, Any]:
    """A {rank: value} mapping as an event writes it: JSON keys are strings, ranks in order."""
    return {str(rank): value for rank, value in sorted(ranks.items())}


@dataclass(frozen=True)
class HaltReport:
    """What a halt would have said: the rewind event repeats it."""

    step: int
    rule: str
    params: list[str]
    kinds: dict[str, str]
    kind: str
    reason: str | None
    origin: Mapping[str, Any] | None
    ranks: Mapping[int, str] = field(default_factory=dict)
    """The ranks where it was made (before the reduction, or after it on some replicas): {global rank: host}
    (``StepOutcome.ranks``)."""

    def fields(self) -> dict[str, Any]:
        """The fields the ``halt`` and ``rewind`` events share, in the log's order."""
        return {
            "step": self.step,
            "rule": self.rule,
            "params": self.params,
            "kinds": self.kinds,
            "kind": self.kind,
            "reason": self.reason,
            "origin": self.origin,
            "ranks": ranks_field(self.ranks),
        }


class RewindRequested(Exception):
    """Raised by the verdicts instead of [`GradientHalt`][gradguard.GradientHalt] when recovery rewinds (the
    engine's)."""

    def __init__(self, halt: HaltReport, snapshot: Snapshot) -> None:
        super().__init__(f"rewind at step {halt.step} to step {snapshot.step}")
        self.halt = halt
        self.snapshot = snapshot


@dataclass(frozen=True)
class Decision:
    """What a halt at a step comes to under recovery."""

    rewind: bool
    snapshot: Snapshot | None
    """The snapshot to rewind to, or to restore before halting (``max_rewinds`` reached)."""
    why: str | None
    """Why the halt goes through (no snapshot old enough, ``max_rewinds`` reached)."""
