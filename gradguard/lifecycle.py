"""What attaching a guard sets up and detaching undoes: argument checks, the attach event, the handles, and
the process's register of guards (one per model, claimed at attach from any thread).

Kept apart from [`gradguard.GradGuard`][gradguard.GradGuard] so that the class reads as what a guard does at each
step; this module holds what happens once, at its start and at its end.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim import Optimizer

from gradguard.enforce.distributed.deepspeed import deepspeed_engine
from gradguard.enforce.hooks.deepspeed_boundary import DeepSpeedBoundary, needs_update_hook, refuse_under_deepspeed
from gradguard.enforce.plans.plan_book import PlanBook
from gradguard.enforce.recovery.recovery import Recovery
from gradguard.enforce.recovery.schedulers import holdable
from gradguard.enforce.step.engine import Enforcer
from gradguard.enforce.step.reload import Reloader
from gradguard.enforce.work.step_work import StepContext
from gradguard.errors import GuardStateError, GuardWarning
from gradguard.events.log import EVENT_SCHEMA_VERSION, EventLog
from gradguard.policy.document import Policy
from gradguard.policy.matching import Binding

__all__ = [
    "Attachment",
    "LiveGuard",
    "Removable",
    "check_arguments",
    "claim_model",
    "distributed_rank",
    "emit_attach",
    "forget",
    "live_guards",
    "load_guard_state",
    "optimizers_given",
    "warn_unexpected_optimizer",
]


class Removable(Protocol):
    def remove(self) -> None: ...


class LiveGuard(Protocol):
    """What the process's register of guards reads of a guard (``GradGuard``, a room above, is one)."""

    _lock: threading.RLock
    _attachment: Attachment
    _finalizer: weakref.finalize[Any, Any]
    _model_ref: weakref.ReferenceType[nn.Module]
    _plans: PlanBook
    _reloader: Reloader

    @property
    def attached(self) -> bool: ...

    def remove(self) -> None: ...

    def _record(self, proceed: bool) -> bool: ...

    def _at_boundary(self) -> bool: ...


class Attachment:
    """Everything that must be undone when a guard goes away; deliberately holds no reference to it."""

    def __init__(self, enforcer: Enforcer, events: EventLog, model: weakref.ReferenceType[nn.Module]) -> None:
        self.enforcer = enforcer
        self.events = events
        self.model = model
        self.handles: list[Removable] = []
        self.open = True
        self.inside_deepspeed = False
        """The guard's step runs inside a DeepSpeed engine's update (ZeRO 1/2): no other boundary is the guard's."""

    def close(self, reason: str) -> None:
        if not self.open:
            return
        self.open = False
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        try:
            self.enforcer.verdicts.interventions(*self.enforcer.carry.flush())  # the last step's, waiting for a read
            self.enforcer.emit_summary()
            self.events.emit(
                "info",
                "detach",
                reason=reason,
                steps=self.enforcer.step,
                counters=self.enforcer.counters.snapshot(),
            )
            self.events.close()
        finally:
            self.enforcer.release()  # whatever the log did: a fused optimizer's flag, the snapshots

    @staticmethod
    def abandon(attachment: Attachment | None) -> None:
        """An attach that failed part way (recovery.memory: device not fitting is found late): remove its hooks."""
        for handle in attachment.handles if attachment is not None else ():
            handle.remove()

    def collected(self) -> None:
        """The guard was garbage-collected while still attached: unhook, and say so if the model trains on.

        A guard and its model that go together (the function that built both returns at the end of the
        run, the interpreter exits) are a clean end, not a mistake: the warning waits for the model's next
        backward, which only a model that goes on training without its guard makes.
        """
        if not self.open:
            return
        self.close("garbage-collected")
        model = self.model()
        if model is not None:
            _warn_at_next_backward(model)


def _warn_at_next_backward(model: nn.Module) -> None:
    """One warning, the first time backward reaches a parameter of ``model``; then the hooks go."""
    handles: list[Any] = []

    def warn(_: torch.Tensor) -> None:
        if not handles:
            return  # another parameter's hook of the same backward warned already
        for handle in handles:
            handle.remove()
        handles.clear()
        warnings.warn(
            f"the GradGuard of this {type(model).__name__} was garbage-collected while still attached, so its "
            "hooks were removed and the model now trains unguarded. Keep a reference to the guard "
            "(guard = GradGuard(...)) for as long as the model trains, or use it as a context manager "
            "(with GradGuard(...) as guard:).",
            GuardWarning,
            stacklevel=2,
        )

    for param in model.parameters():
        if param.requires_grad:
            handles.append(param.register_post_accumulate_grad_hook(warn))  # type: ignore[no-untyped-call]


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
    recovery: Recovery,
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
        **_recovery_fields(policy, recovery),
        **{name: section.model_dump(mode="json") for name, section in _watches(policy).items()},
    )


def _watches(policy: Policy) -> dict[str, Any]:
    """The attach event's ``loss`` and ``rerun``: the sections as written, where the policy has them."""
    return {name: section for name, section in (("loss", policy.loss), ("rerun", policy.rerun)) if section is not None}


def _recovery_fields(policy: Policy, recovery: Recovery) -> dict[str, Any]:
    """The attach event's ``recovery``: the section, the bytes its snapshots will hold, and where."""
    if policy.recovery is None:
        return {}
    fields: dict[str, Any] = policy.recovery.model_dump()
    # Optimizer state made at the first step (Adam's moments) is not known yet: metrics() has the held bytes.
    fields["snapshot_bytes"] = recovery.estimated_bytes()
    fields["schedulers"] = len(recovery.live.schedulers)
    if recovery.placement is not None:  # where the snapshots live: device or host, the bytes needed and free, why
        fields.update(recovery.placement.fields())
    return {"recovery": fields}


def schedulers_given(given: Any) -> list[Any]:
    """``GradGuard(lr_scheduler=...)``: one scheduler, several, or None."""
    if given is None:
        return []
    schedulers = list(given) if isinstance(given, list | tuple) else [given]
    for scheduler in schedulers:
        if not holdable(scheduler):
            raise TypeError(
                "lr_scheduler must be an LR scheduler (with state_dict and load_state_dict), "
                f"got {type(scheduler).__name__}"
            )
    return schedulers


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


# --- the process's guards: one per model, claimed at attach, let go at remove and at interpreter exit ---

_LIVE_GUARDS: weakref.WeakSet[LiveGuard] = weakref.WeakSet()
"""Every guard attached or attaching; read and changed only under ``_LIVE_LOCK``."""
_LIVE_LOCK = threading.Lock()
"""Attaching checks that no other guard holds the model and claims it in one step (two threads attaching
to one model: one of them is refused)."""
_EXIT_LOCK_TIMEOUT_S = 5.0
"""How long interpreter exit waits for a guard's step in flight on another thread before closing it anyway."""


def live_guards() -> list[LiveGuard]:
    """Every guard attached or attaching, now."""
    with _LIVE_LOCK:
        return list(_LIVE_GUARDS)


def claim_model(guard: LiveGuard, model: nn.Module, replace: bool) -> None:
    """Refuse (or, with ``replace``, remove) another live guard on the same model or tensors, and claim them.

    Checked and claimed under one lock: of two threads attaching to one model at once, one is refused.
    """
    with _LIVE_LOCK:
        others = [other for other in _LIVE_GUARDS if other is not guard and _holds(other, model, guard)]
        if others and not replace:
            raise GuardStateError(
                f"this model already has a GradGuard attached ({others[0]!r}); a second guard would apply "
                "every action twice. Call .remove() on the first guard, or pass replace=True to "
                "remove it and attach this one."
            )
        for other in others:
            _LIVE_GUARDS.discard(other)
        _LIVE_GUARDS.add(guard)
    for other in others:
        other.remove()


def _holds(other: LiveGuard, model: nn.Module, guard: LiveGuard) -> bool:
    """Whether ``other`` (attached, or still attaching) guards ``model`` or one of the tensors ``guard`` binds."""
    attachment: Attachment | None = other.__dict__.get("_attachment")
    if attachment is not None and not attachment.open:
        return False
    theirs = other._model_ref()
    if theirs is None:
        return False  # its model is gone, and with it the tensors whose ids it holds
    if theirs is model:
        return True
    by_id = other._plans.binding.by_id
    return any(
        (entry := by_id.get(key)) is not None and (tensor := entry.ref()) is not None and tensor is mine.ref()
        for key, mine in guard._plans.binding.by_id.items()
    )


def forget(guard: LiveGuard) -> None:
    """The guard was removed (or failed to attach): its model may be claimed again."""
    with _LIVE_LOCK:
        _LIVE_GUARDS.discard(guard)


@atexit.register
def _remove_all_at_exit() -> None:
    for guard in live_guards():
        # A daemon thread may have been stopped in a step, holding the lock for good: exit must not hang.
        locked = guard._lock.acquire(timeout=_EXIT_LOCK_TIMEOUT_S)
        try:
            if guard.attached:
                guard._finalizer.detach()
                guard._attachment.close("interpreter-exit")
        finally:
            if locked:
                guard._lock.release()


def weak_call(method: Callable[[Binding, list[str]], None]) -> Callable[[Binding, list[str]], None]:
    """Calls ``method`` while its object lives, without keeping it alive (a guard must stay collectable)."""
    ref = weakref.WeakMethod(method)

    def call(binding: Binding, replaced: list[str]) -> None:
        bound = ref()
        if bound is not None:
            bound(binding, replaced)

    return call


def deepspeed_parts(model: nn.Module) -> tuple[Any | None, nn.Module]:
    """``(the DeepSpeed engine, its own model)`` where ``model`` is an engine, else ``(None, model)``."""
    engine = deepspeed_engine(model)
    return (engine, engine.module) if engine is not None else (None, model)


def deepspeed_boundary(guard: LiveGuard, engine: Any, model: nn.Module) -> list[DeepSpeedBoundary]:
    """The guard's step at each update of a DeepSpeed engine at ZeRO 1/2 (``hooks.deepspeed_boundary``); none at
    ZeRO 0, where the client optimizer steps the model's own reduced gradients and the optimizer hooks treat them."""
    if engine is None:
        return []
    guard._reloader.check = functools.partial(refuse_under_deepspeed, engine, per_micro_batch=False)  # reloads too
    if not needs_update_hook(engine):
        return []
    guard._attachment.inside_deepspeed = True
    ref = weakref.ref(guard)

    def treat(context: StepContext) -> bool:
        live = ref()
        if live is None:
            return True
        with live._lock:
            if not live._attachment.open:
                return True
            live._at_boundary()
            enforcer = live._attachment.enforcer
            proceed = enforcer.run(live._plans.current(), context)
            live._record(proceed and not enforcer.book.scaler_skip_at_boundary)
            return proceed  # an fp16 overflow stays DeepSpeed's to skip (its loss scale is updated)

    def skipped(loss_scale: float | None) -> None:
        live = ref()
        if live is None:
            return
        with live._lock:
            enforcer = live._attachment.enforcer
            live._record(False)
            enforcer.record_scaler_skip((), step=enforcer.step - 1, loss_scale=loss_scale)  # once a step

    return [DeepSpeedBoundary(engine, list(model.parameters()), treat, skipped)]
