"""What attaching a guard sets up and detaching undoes: argument checks, the attach event, the handles.

Kept apart from :class:`gradguard.GradGuard` so that the class reads as what a guard does at each
step; this module holds what happens once, at its start and at its end.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim import Optimizer

from gradguard.enforce.engine import Enforcer
from gradguard.errors import GuardStateError, GuardWarning
from gradguard.events.log import EVENT_SCHEMA_VERSION, EventLog
from gradguard.policy.document import Policy
from gradguard.policy.matching import Binding

__all__ = [
    "Attachment",
    "Removable",
    "check_arguments",
    "distributed_rank",
    "emit_attach",
    "load_guard_state",
    "optimizers_given",
    "warn_unexpected_optimizer",
]


class Removable(Protocol):
    def remove(self) -> None: ...


class Attachment:
    """Everything that must be undone when a guard goes away; deliberately holds no reference to it."""

    def __init__(self, enforcer: Enforcer, events: EventLog) -> None:
        self.enforcer = enforcer
        self.events = events
        self.handles: list[Removable] = []
        self.open = True

    def close(self, reason: str) -> None:
        if not self.open:
            return
        self.open = False
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.enforcer.emit_summary()
        self.events.emit(
            "info",
            "detach",
            reason=reason,
            steps=self.enforcer.step,
            counters=self.enforcer.counters.snapshot(),
        )
        self.events.close()

    def collected(self) -> None:
        """The guard was garbage-collected while still attached: unhook, and say so."""
        if not self.open:
            return
        self.close("garbage-collected")
        warnings.warn(
            "a GradGuard was garbage-collected while still attached, so its hooks were removed and the "
            "model is no longer guarded. Keep a reference to the guard (guard = GradGuard(...)) or use "
            "it as a context manager (with GradGuard(...) as guard:).",
            GuardWarning,
            stacklevel=2,
        )


def optimizers_given(optimizer: Optimizer | Iterable[Optimizer] | None) -> list[Optimizer] | None:
    """The optimizers given, checked before anything is attached (so a bad one leaves nothing behind)."""
    if optimizer is None:
        return None
    optimizers = [optimizer] if isinstance(optimizer, Optimizer) else list(optimizer)
    for opt in optimizers:
        if not isinstance(opt, Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer (or a list of them), got {type(opt).__name__}")
    if not optimizers:
        raise ValueError("optimizer=[] would never trigger the guard; pass None to guard every torch optimizer")
    return optimizers


def check_arguments(
    model: nn.Module, start_step: int, summary_every: int, attach_timeout: float, reload_interval: float = 2.0
) -> None:
    if not reload_interval > 0:
        raise ValueError(f"reload_interval must be > 0 (seconds between looks at the file), got {reload_interval}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"GradGuard needs a torch.nn.Module, got {type(model).__name__}")
    if start_step < 0:
        raise ValueError(f"start_step must be >= 0 (the step a resumed run starts at), got {start_step}")
    if attach_timeout <= 0:
        raise ValueError(f"attach_timeout must be > 0 (seconds to wait for the other ranks), got {attach_timeout}")
    if summary_every < 0:
        raise ValueError(f"summary_every must be >= 0 (0 turns periodic summaries off), got {summary_every}")


def emit_attach(
    events: EventLog,
    policy: Policy,
    model: nn.Module,
    binding: Binding,
    optimizers: list[Optimizer] | None,
    start_step: int,
) -> None:
    boundary = "any torch.optim optimizer"
    if optimizers is not None:
        boundary = ", ".join(type(opt).__name__ for opt in optimizers)
    events.emit(
        "info",
        "attach",
        schema=EVENT_SCHEMA_VERSION,
        policy=policy.source,
        model=type(model).__name__,
        boundary=boundary,
        start_step=start_step,
        params=len(binding.params),
        rules={bound.name: len(bound.params) for bound in binding.rules},
        pid=os.getpid(),
    )


def distributed_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    return 0


def load_guard_state(enforcer: Enforcer, events: EventLog, state: Any) -> None:
    """``guard.load_state_dict``: check the saved state, take it over, warn about dropped rules."""
    if not isinstance(state, dict) or state.get("format") != 1 or "step" not in state:
        raise GuardStateError(
            f"not a gradguard state_dict (expected a dict with format 1 and a step): got {state!r:.200}"
        )
    unknown = enforcer.load_state_dict(state)
    if unknown:
        warnings.warn(
            f"the saved guard state has skip histories or statistics for rules this policy does not have: {unknown}; "
            "they were dropped",
            GuardWarning,
            stacklevel=3,
        )
    events.emit("info", "state_loaded", step=enforcer.step)


def warn_unexpected_optimizer(events: EventLog, optimizer: Optimizer, step: int) -> None:
    """An optimizer not given as ``optimizer=`` stepped new gradients of the model: say so, once."""
    name = type(optimizer).__name__
    events.emit("warning", "unexpected_optimizer", step=step, optimizer=name)
    warnings.warn(
        f"a {name} that was not given as optimizer= stepped new gradients of the guarded model; "
        "gradguard treated them, so nothing went unguarded. Pass it in optimizer= to silence this.",
        GuardWarning,
        stacklevel=5,
    )
