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
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim import Optimizer

from gradguard.enforce.distributed.deepspeed import deepspeed_engine, inner_optimizer, layout
from gradguard.enforce.distributed.deepspeed_state import stage3_partitions
from gradguard.enforce.distributed.deepspeed_taps import tap_reduction
from gradguard.enforce.distributed.mesh import ModelParts
from gradguard.enforce.hooks.boundaries import explicit_context
from gradguard.enforce.hooks.deepspeed_boundary import (
    ClipHook,
    DeepSpeedBoundary,
    boundary_name,
    clips_before_step,
    needs_update_hook,
    refuse_under_deepspeed,
)
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
        """The guard's step runs inside a DeepSpeed engine's update (ZeRO 1-3): no other boundary is the guard's."""

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
    ranks: dict[str, Any] | None = None,
    *,
    engine: Any = None,
) -> None:
    boundary = "any torch.optim optimizer"
    if engine is not None:  # a DeepSpeed engine: where in its step the guard acts
        boundary = boundary_name(engine)
    elif optimizers is not None:
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
        **({"ranks": ranks} if ranks is not None else {}),
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


def deepspeed_parts(model: nn.Module | Sequence[nn.Module]) -> tuple[Any | None, nn.Module]:
    """``(the DeepSpeed engine, its own model)`` where ``model`` is an engine, else ``(None, model)``; a list of
    modules (torchtitan's ``model_parts``) is guarded as one model (``ModelParts``)."""
    if not isinstance(model, nn.Module):
        return None, ModelParts(model)
    engine = deepspeed_engine(model)
    if engine is not None and type(engine).__name__ == "PipelineEngine":
        raise GuardStateError(
            "DeepSpeed's pipeline engine (PipelineEngine) is not built: its stages reduce, clip and step inside "
            "train_batch() where the guard cannot give them one verdict. What is built: DeepSpeed ZeRO 0-3 engines, "
            "and pipelines of torch.distributed.pipelining with GradGuard(stage, policy, device_mesh=mesh) "
            "(docs/distributed.md)."
        )
    return (engine, engine.module) if engine is not None else (None, model)


def deepspeed_boundary(guard: LiveGuard, engine: Any, model: nn.Module) -> list[Removable]:
    """The guard's step at each update of a DeepSpeed engine (``hooks.deepspeed_boundary``): inside its update at ZeRO
    1-3; at ZeRO 0 the client optimizer's step, where the optimizer hooks treat the model's reduced gradients, or
    before DeepSpeed's own clip where it clips (``ClipHook``). With the tap of each rank's own gradient before the
    reduction (``distributed.deepspeed_taps``) and, under recovery, the engine's master partitions, optimizer state
    and LR scheduler in the snapshots."""
    if engine is None:
        return []
    guard._reloader.check = functools.partial(refuse_under_deepspeed, engine, per_micro_batch=False)  # reloads too
    enforcer = guard._attachment.enforcer
    handles: list[Removable] = []
    if enforcer.collective.active():  # one rank has no "which rank": nothing to note, nobody to take the notes
        tap = tap_reduction(engine, enforcer.collective.local)
        handles += [tap] if tap is not None else []
    _recover_deepspeed(enforcer.recovery, engine)
    ref = weakref.ref(guard)
    if not needs_update_hook(engine):
        if clips_before_step(engine):
            handles.append(ClipHook(engine, functools.partial(_before_deepspeed_clip, ref, inner_optimizer(engine))))
        return handles
    guard._attachment.inside_deepspeed = True

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
            # Only the update is left of this step (no forward moves the buffers now): a snapshot due next keeps them.
            enforcer.recovery.at_step_start(enforcer.step)
            return proceed  # an fp16 overflow stays DeepSpeed's to skip (its loss scale is updated)

    def skipped(loss_scale: float | None) -> None:
        live = ref()
        if live is None:
            return
        with live._lock:
            enforcer = live._attachment.enforcer
            live._record(False)
            enforcer.record_scaler_skip((), step=enforcer.step - 1, loss_scale=loss_scale)  # once a step

    return [*handles, DeepSpeedBoundary(engine, list(model.parameters()), treat, skipped)]


def _recover_deepspeed(recovery: Recovery, engine: Any) -> None:
    """Under a ``recovery`` section, the snapshots hold what DeepSpeed updates: the torch optimizer it steps (at ZeRO
    1/2 its parameters are this rank's fp32 master partitions, outside the model: copied and put back with its state;
    at ZeRO 3 it holds them only inside its step, so the masters and each parameter's own partition of the weights join
    as ``Stage3Partitions``) and the engine's LR scheduler (rewound to the snapshot's step; DeepSpeed does not step it
    on a skipped update)."""
    if not recovery.active:
        return
    recovery.saw_optimizer(inner_optimizer(engine))  # at ZeRO 3 its groups' LRs only: their params are empty here
    if layout(engine) == "stage3":
        recovery.saw_optimizer(stage3_partitions(engine))
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and holdable(scheduler):
        recovery.add_scheduler(scheduler)


def _before_deepspeed_clip(ref: weakref.ReferenceType[LiveGuard], optimizer: Optimizer) -> bool:
    """ZeRO 0 with DeepSpeed's clip: the guard's step on the raw reduced gradients, as at ``guard.step(optimizer)``;
    False where it skipped the update (the gradients are gone: DeepSpeed's clip is left out)."""
    live = ref()
    if live is None:
        return True
    with live._lock:
        if not live._attachment.open:
            return True
        live._at_boundary()
        plan = live._plans.for_optimizer(optimizer)
        if plan is None:
            return True
        enforcer = live._attachment.enforcer
        enforcer.recovery.saw_optimizer(optimizer)
        proceed = enforcer.run(plan, explicit_context(optimizer, live._model_ref, None))
        if enforcer.last_run_treated:
            live._record(proceed)
        return proceed
