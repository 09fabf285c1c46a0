"""The replay of a policy's ``recovery`` section (``gradguard.tuning.replay``), as the guard's ``Recovery`` decides
(``enforce/recovery``). ``RecoveryReplay`` owns the bookkeeping: the snapshots of the replay's own state
(``HeldState``: the adaptive statistics, the skip histories, the loss section's reference) taken at the multiples of
``snapshot_every`` outside a skip window, the newest ``keep`` held; the halts it turns into rewinds (``Rewind``) and
the skip windows after them; and what of a rewind the log cannot give, in words. The replayer it serves hands its
state over and takes it back through ``Rewindable``, a Protocol, so this module never imports the replayer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from gradguard.enforce.work.skips import SkipBook
from gradguard.events.counters import RECOVERY_RULE
from gradguard.policy.schema import Recovery
from gradguard.tuning.acting import Stats
from gradguard.tuning.replay_results import ActionSteps, Halt, Rewind

__all__ = ["HeldState", "RecoveryReplay", "Rewindable", "Snapshot"]


@dataclass(frozen=True)
class HeldState:
    """The replay's own state: what the guard's snapshot holds of the guard."""

    stats: dict[tuple[int, int], Stats]
    skip_limits: SkipBook
    loss: dict[str, Any]
    """The loss section's ``LossWatch.state_dict()``."""


@dataclass(frozen=True)
class Snapshot:
    """``state`` as it stood at the first boundary of ``step``."""

    step: int
    state: HeldState


class Rewindable(Protocol):
    """What the recovery replay needs of the replayer it serves."""

    def snapshot_state(self) -> HeldState:
        """The replayer's state now, every step it has taken decided, as copies later steps leave alone."""
        ...

    def restore_state(self, state: HeldState) -> None:
        """Bring ``state`` back (``state`` itself stays as it is: another rewind may restore it again)."""
        ...


class RecoveryReplay:
    """The snapshots, rewinds and skip windows of a policy's ``recovery`` section, over the steps of one replay."""

    def __init__(self, config: Recovery, replay: Rewindable) -> None:
        self.config = config
        self._replay = replay
        self.rewinds: list[Rewind] = []
        self.skip_until: int | None = None
        """The first step applied again after the last rewind (the steps before it are skipped)."""
        self.window_steps: list[int] = []
        """The recorded steps that fell inside a rewind's window (not replayed: the guard skips them)."""
        self._snapshots: list[Snapshot] = []
        self._boundary: int | None = None
        """The last step whose first boundary the replay went past (snapshots are due at multiples after it)."""

    def begin_step(self, step: int) -> bool:
        """The first boundary of ``step``, as the guard's ``begin_step``: False inside a rewind's window (the step is
        skipped), else take the snapshots due since the last boundary."""
        config = self.config
        if self.skip_until is not None and step < self.skip_until:
            self.window_steps.append(step)
            if self.rewinds:
                self.rewinds[-1].recorded_in_window += 1
            return False
        start = step if self._boundary is None else self._boundary + 1
        if self.skip_until is not None:
            start = max(start, self.skip_until)  # no snapshot is taken inside a window
        self._boundary = step
        every = config.snapshot_every
        first = -(-start // every) * every
        if first > step:
            return True
        # Between two recorded steps nothing the replay holds moves: each snapshot due there holds the same state.
        due = list(range(first, step + 1, every))[-config.keep :]
        state = self._replay.snapshot_state()
        self._snapshots.extend(Snapshot(at, state) for at in due)
        del self._snapshots[: -config.keep]
        return True

    def ending_halt(self, halt: Halt) -> Halt | None:
        """The halt that ends the run where the guard's would let ``halt`` through (no snapshot old enough,
        ``max_rewinds`` reached), its reason saying so; else None, having rewound as the guard's would."""
        config = self.config
        old_enough = [snapshot for snapshot in self._snapshots if halt.step - snapshot.step >= config.min_age]
        why = None
        if not old_enough:
            held = [snapshot.step for snapshot in self._snapshots]
            why = f"recovery: no snapshot at least {config.min_age} steps older than step {halt.step} (held: {held})"
        elif len(self.rewinds) >= config.max_rewinds:
            target = old_enough[-1].step
            why = f"recovery: max_rewinds ({config.max_rewinds}) reached; restored to step {target}'s snapshot"
        if why is not None:
            return Halt(halt.step, halt.rule, halt.action, f"{halt.reason}; {why}" if halt.reason else why)
        target_snapshot = old_enough[-1]
        self._replay.restore_state(target_snapshot.state)
        self._snapshots = [snapshot for snapshot in self._snapshots if snapshot.step <= target_snapshot.step]
        self.skip_until = halt.step + config.skip_steps + 1
        self.rewinds.append(Rewind(halt, target_snapshot.step, self.skip_until, len(self.rewinds) + 1))
        return None

    def list_actions(self, actions: list[ActionSteps], last_step: int | None) -> None:
        """Add to ``actions`` each rewind, as action ``rewind`` just after its halting rule's entries, and the steps
        of every window up to ``last_step`` (the log's last, or the halt's) as ``recovery``/``skip``."""
        for rewind in self.rewinds:
            rule = next((entry for entry in actions if entry.rule == rewind.halt.rule), None)
            entry = next((e for e in actions if e.rule == rewind.halt.rule and e.action == "rewind"), None)
            if entry is None:
                entry = ActionSteps(rewind.halt.rule, "rewind", rule.position + 1 if rule else 0)
                actions.insert(actions.index(rule) + 1 if rule is not None else len(actions), entry)
            entry.steps.append(rewind.halt.step)
        actions.append(ActionSteps(RECOVERY_RULE, "skip", 0, self._skipped(last_step)))

    def _skipped(self, last_step: int | None) -> list[int]:
        """The steps of every rewind's window, as the guard counts them, up to ``last_step``."""
        if last_step is None:
            return []
        return [
            step
            for rewind in self.rewinds
            for step in range(rewind.halt.step + 1, min(rewind.skip_until, last_step + 1))
        ]

    def not_replayed(self) -> list[str]:
        """What of the rewinds the log cannot replay, in words (the report and the JSON say it)."""
        left: list[str] = []
        if self.rewinds:
            left.append(
                "recovery: the weights and the LR after a rewind (lr_factor) are not in the log; the norms replayed "
                "after a rewind are those the recorded run had"
            )
        diverged = [rewind.halt.step for rewind in self.rewinds if rewind.recorded_in_window]
        if diverged:
            steps = ", ".join(map(str, diverged))
            left.append(
                f"the recorded run did not rewind at step {steps} (the log holds norms inside the window): the norms "
                "after it are of a run that went on without the rewind"
            )
        return left
