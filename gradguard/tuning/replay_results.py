"""The answers of ``gradguard replay`` (``gradguard.tuning.replay``), as data: which steps each action of the policy
acted on (``ActionSteps``), what the log cannot decide (``Undecidable``), where the run would have halted (``Halt``),
where the ``recovery`` section turned a halt into a rewind (``Rewind``), and the whole (``ReplayResult``) with its
JSON form. Nothing here replays: the replayer and its recovery fill these in, and the report renders them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gradguard.tuning.records import Recording

__all__ = ["ActionSteps", "Halt", "ReplayResult", "Rewind", "Undecidable"]


@dataclass
class ActionSteps:
    """One action of the policy and the steps on which it changed a gradient, or skipped or halted the step."""

    rule: str
    action: str
    position: int
    """The action's place in its rule (0-based)."""
    steps: list[int] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "action": self.action, "steps": list(self.steps)}


@dataclass(frozen=True)
class Undecidable:
    """An action the log cannot decide, and why."""

    rule: str
    action: str
    reason: str

    def as_json(self) -> dict[str, str]:
        return {"rule": self.rule, "action": self.action, "reason": self.reason}


@dataclass(frozen=True)
class Halt:
    """Where the replayed run would have halted (the replay ends there, as the run would)."""

    step: int
    rule: str
    action: str
    reason: str


@dataclass
class Rewind:
    """Where the policy's ``recovery`` section turned a halt into a rewind, as the guard's would have."""

    halt: Halt
    """The halt the rewind stands for."""
    to_step: int
    """The snapshot's step: its state comes back."""
    skip_until: int
    """The first step applied again; the steps from ``halt.step + 1`` up to it are skipped."""
    rewinds: int
    """Rewinds so far, this one included."""
    recorded_in_window: int = 0
    """Steps inside the window that the log holds norms of: the recorded run applied them, so it did not rewind
    here, and the norms after are of a run that went on without this rewind."""

    def as_json(self) -> dict[str, Any]:
        return {
            "step": self.halt.step,
            "rule": self.halt.rule,
            "action": self.halt.action,
            "reason": self.halt.reason,
            "to_step": self.to_step,
            "skip_until": self.skip_until,
            "rewinds": self.rewinds,
            "recorded_in_window": self.recorded_in_window,
        }


@dataclass
class ReplayResult:
    """What a policy would have done on a recorded run."""

    policy: str
    actions: list[ActionSteps]
    undecidable: list[Undecidable]
    halt: Halt | None
    recording: Recording
    params: list[str]
    """The parameter names the log recorded norms of, in the order first seen."""
    steps_replayed: int
    rewinds: list[Rewind] = field(default_factory=list)
    """The halts the policy's ``recovery`` section turned into rewinds, in order."""
    not_replayed: list[str] = field(default_factory=list)
    """What of the policy the replay leaves out, in words (the ``rerun`` section, the LR after a rewind)."""
    window_steps: int = 0
    """Recorded steps inside a rewind's window: skipped, not replayed."""

    @property
    def exit_code(self) -> int:
        """1 if an action would have halted, else 0."""
        return 1 if self.halt is not None else 0

    def as_json(self) -> dict[str, Any]:
        halt = None
        if self.halt is not None:
            halt = {"step": self.halt.step, "rule": self.halt.rule, "action": self.halt.action}
            halt["reason"] = self.halt.reason
        return {
            "policy": self.policy,
            "steps": self.steps_replayed,
            "first_step": self.recording.first_step,
            "last_step": self.recording.last_step,
            "params": len(self.params),
            "actions": [entry.as_json() for entry in self.actions],
            "undecidable": [entry.as_json() for entry in self.undecidable],
            "window_steps": self.window_steps,
            "rewinds": [rewind.as_json() for rewind in self.rewinds],
            "halt": halt,
            "not_replayed": list(self.not_replayed),
            "unreadable_lines": self.recording.read.bad_total,
        }
