"""The skip rules' bookkeeping across steps, on plain numbers: skips in a row, skips in a window, escalation.

No tensor here, and no torch: ``gradguard replay`` and ``gradguard suggest`` (``gradguard.tuning``) keep the same
histories as the guard with the same code, in a process that never imports torch. The guard's participant
(``gradguard.enforce.actions.nonfinite.SkipLimits``) is ``SkipBook`` taking part in the step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gradguard.policy.schema import Action, Rule, SkipStepOnNonfinite, SkipStepOnSpike

__all__ = ["SkipBook", "SkipHistory", "has_active", "joined_kind"]


class _Limits(Protocol):
    max_consecutive_skips: int | None
    max_skips: int | None
    window_steps: int | None


@dataclass
class SkipHistory:
    """Skips in a row and at which recent steps: a skip rule's, or the ``loss`` section's."""

    consecutive: int = 0
    recent: deque[int] = field(default_factory=deque)

    def note(self, step: int) -> None:
        self.consecutive += 1
        self.recent.append(step)

    def exceeded(self, limits: _Limits, step: int, skips: str) -> str | None:
        """Why the skips noted so far exceed ``limits`` at ``step`` (``skips`` names them: ``skipped steps``), or
        None. Forgets the skips that fell out of the window."""
        reason = None
        if limits.max_consecutive_skips is not None and self.consecutive > limits.max_consecutive_skips:
            reason = f"{self.consecutive} consecutive {skips} (max_consecutive_skips: {limits.max_consecutive_skips})"
        if limits.max_skips is not None and limits.window_steps is not None:
            while self.recent and self.recent[0] <= step - limits.window_steps:
                self.recent.popleft()
            if len(self.recent) > limits.max_skips:
                reason = f"{len(self.recent)} {skips} within the last {limits.window_steps} steps "
                reason += f"(max_skips: {limits.max_skips})"
        return reason


class SkipBook:
    """Each skip rule's history of skipped steps, and when it escalates to a halt."""

    def __init__(self) -> None:
        self.history: dict[int, SkipHistory] = {}
        """Rule index -> its skips: how many in a row, and at which recent steps."""
        self.scaler_skips = 0
        """GradScaler skips in a row (``halt_on_nonfinite``'s ``max_scaler_skips``)."""
        self.applied_at: int | None = None
        """The last training step one of whose boundaries was applied (``step_applied(step)``): it ends a rule's run of
        skips only once that step is over without a skip of the rule. A step of two optimizers may apply one's update
        and skip the other's, and the step is then a skipped one in the run."""

    def _settle(self, history: SkipHistory, step: int) -> int:
        """``history``'s skips in a row before a skip at ``step``: none where a step after its last skip, and before
        ``step``, was applied."""
        applied = self.applied_at
        if applied is not None and applied != step and (not history.recent or applied > history.recent[-1]):
            return 0
        return history.consecutive

    def record(
        self, rule_index: int, rule: Rule, step: int, cause: type[SkipStepOnNonfinite | SkipStepOnSpike]
    ) -> str | None:
        """Note a skip by ``rule`` at ``step``; return why it must halt instead, or ``None``.

        The rule's history counts all its skips; the limits are those of its actions of type ``cause``.
        """
        history = self.history.setdefault(rule_index, SkipHistory())
        history.consecutive = self._settle(history, step)
        history.note(step)
        return _exceeded(history, rule, step, cause)

    def would_exceed(
        self, rule_index: int, rule: Rule, step: int, cause: type[SkipStepOnNonfinite | SkipStepOnSpike]
    ) -> bool:
        """Whether ``record`` of this skip would say halt, without noting it (a pipeline's stages must know before
        they exchange their verdicts)."""
        held = self.history.get(rule_index)
        trial = SkipHistory(self._settle(held, step), deque(held.recent)) if held is not None else SkipHistory()
        trial.note(step)
        return _exceeded(trial, rule, step, cause) is not None

    def step_applied(self, step: int | None = None) -> None:
        """A step went through: no rule's skips are consecutive any more. With ``step``, a boundary of that training
        step did (another of the same step may still skip: ``applied_at``)."""
        self.scaler_skips = 0
        if step is not None:
            self.applied_at = step
            return
        for history in self.history.values():
            history.consecutive = 0

    def state_dict(self, rules: Sequence[Rule]) -> dict[str, Any]:
        after = -1 if self.applied_at is None else self.applied_at + 1  # the skips in a row a next step would meet
        return {
            rules[index].name: {"consecutive": self._settle(history, after), "recent": list(history.recent)}
            for index, history in sorted(self.history.items())
        }

    def load_state_dict(self, saved: dict[str, Any], rules: Sequence[Rule]) -> list[str]:
        """Take over saved histories, by rule name; returns the names this policy lacks."""
        by_name = {rule.name: index for index, rule in enumerate(rules)}
        self.history, self.applied_at = {}, None
        unknown = []
        for name, entry in saved.items():
            if name not in by_name:
                unknown.append(name)
                continue
            recent = deque(int(step) for step in entry["recent"])
            self.history[by_name[name]] = SkipHistory(int(entry["consecutive"]), recent)
        return unknown


def _exceeded(
    history: SkipHistory, rule: Rule, step: int, cause: type[SkipStepOnNonfinite | SkipStepOnSpike]
) -> str | None:
    """Why ``history``, with this step's skip noted, exceeds the limits of ``rule``'s active actions of type
    ``cause`` (the first that says so), or None."""
    for action in rule.actions:
        if isinstance(action, cause) and action.active_at(step):
            reason = history.exceeded(action, step, "skipped steps")
            if reason is not None:
                return reason
    return None


def joined_kind(kinds: Iterable[str]) -> str:
    """``"nan"``, ``"inf"`` or ``"nan+inf"``, always in that order."""
    present = set(kinds)
    return "+".join(kind for kind in ("nan", "inf") if kind in present)


def has_active(actions: Sequence[Action], kind: type, step: int) -> bool:
    return any(isinstance(action, kind) and action.active_at(step) for action in actions)
