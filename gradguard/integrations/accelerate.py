"""gradguard for plain ``accelerate`` loops: the guard acts before ``accelerator.clip_grad_norm_``.

``accelerator.clip_grad_norm_`` (and ``clip_grad_value_``) first calls
``accelerator.unscale_gradients()`` (GradScaler's unscale under fp16, a no-op otherwise) and then
torch's clip, which turns one NaN gradient into NaN everywhere.
[`guard_accelerator`][gradguard.integrations.accelerate.guard_accelerator] places the guard's explicit step boundary,
``guard.step(optimizer)``, right after that unscale, on the step's final gradient (``accelerator.sync_gradients``):
thresholds apply to true (unscaled) gradients, a halt names the parameter that went bad, and the optimizer's coming
``step()`` does not treat the gradients again after the global clip changed them.

Install with ``pip install 'gradguard[transformers]'`` (it brings ``accelerate``).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any

try:
    import accelerate
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler
except ImportError as exc:  # pragma: no cover - exercised by a test that hides accelerate
    raise ImportError(
        "gradguard.integrations.accelerate needs accelerate: pip install 'gradguard[transformers]'"
    ) from exc

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_post_hook

from gradguard import GradGuard, Policy
from gradguard.enforce.recovery.schedulers import holdable

__all__ = ["AcceleratorBoundary", "InstancePatch", "guard_accelerator", "hand_schedulers", "unwrap_scheduler"]

_MISSING = object()


class InstancePatch:
    """Sets ``obj.<name>`` on the instance; ``remove()`` restores what the instance had (or nothing)."""

    def __init__(self, obj: Any, name: str, replacement: Callable[..., Any]) -> None:
        self.obj = obj
        self.name = name
        self.replacement = replacement
        self.original: Callable[..., Any] = getattr(obj, name)
        """What ``obj.<name>`` was before: the replacement calls it."""
        self.previous = obj.__dict__.get(name, _MISSING)
        setattr(obj, name, replacement)

    def remove(self) -> None:
        if self.obj.__dict__.get(self.name) is not self.replacement:
            return  # wrapped again by someone else since: leave theirs
        if self.previous is _MISSING:
            del self.obj.__dict__[self.name]
        else:
            setattr(self.obj, self.name, self.previous)


def _unwrap(optimizer: Any) -> Optimizer | None:
    """The ``torch.optim.Optimizer`` inside an ``AcceleratedOptimizer`` (any depth)."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer if isinstance(optimizer, Optimizer) else None


def unwrap_scheduler(scheduler: Any) -> Any:
    """The LR scheduler inside an ``AcceleratedScheduler`` (any depth): the one whose ``base_lrs`` set the LR."""
    while isinstance(scheduler, AcceleratedScheduler):
        scheduler = scheduler.scheduler
    return scheduler


def hand_schedulers(guard: GradGuard, schedulers: Sequence[Any]) -> None:
    """Tell ``guard``'s recovery the loop's LR schedulers (unwrapped; those it knows already are left alone).

    A rewind then takes them back to the snapshot's step with the weights, holds them through the skip
    window, and ``lr_factor`` lowers what they recompute the LR from, so it holds through their later steps.
    Anything without ``state_dict``/``load_state_dict`` (DeepSpeed's ``DummyScheduler``) is passed over.
    """
    recovery = guard._enforcer.recovery
    for given in schedulers:
        scheduler = unwrap_scheduler(given)
        if holdable(scheduler):
            recovery.add_scheduler(scheduler)


class AcceleratorBoundary:
    """Calls ``guard.step(optimizer)`` inside ``accelerator.unscale_gradients``, after the real unscale.

    Installed on the accelerator *instance* (its ``unscale_gradients`` and ``backward``); ``remove()``
    puts back what was there. The boundary acts only on the step's last micro-batch
    (``accelerator.sync_gradients``) and at most once per optimizer per step: a second
    ``unscale_gradients`` in the same step (``clip_grad_norm_`` then ``clip_grad_value_``) does not
    treat the already-treated, since clipped, gradients again. A new step begins at the optimizer's
    ``step()`` or at the next ``accelerator.backward``.

    Args:
        accelerator: the ``accelerate.Accelerator`` whose ``unscale_gradients`` is wrapped.
        guard_of: returns the guard to call; looked up at every call.
        remove_with_guard: take the boundary off when ``guard_of()`` is ``None`` or removed.
    """

    def __init__(
        self,
        accelerator: accelerate.Accelerator,
        guard_of: Callable[[], GradGuard | None],
        *,
        remove_with_guard: bool = True,
    ) -> None:
        self.accelerator = accelerator
        self.guard_of = guard_of
        self.remove_with_guard = remove_with_guard
        self._treated: set[int] = set()
        self._unscale = InstancePatch(accelerator, "unscale_gradients", self._unscale_gradients)
        self._backward_patch = InstancePatch(accelerator, "backward", self._backward)
        ref = weakref.ref(self)
        self._post_hook = register_optimizer_step_post_hook(
            lambda optimizer, args, kwargs: _stepped(ref, optimizer)  # an optimizer has stepped: a new step
        )
        self.installed = True

    def remove(self) -> None:
        """Put the accelerator's methods back as they were; safe to call more than once."""
        if not self.installed:
            return
        self.installed = False
        self._post_hook.remove()
        self._unscale.remove()  # each leaves a wrapper someone added after us in place
        self._backward_patch.remove()
        self._treated.clear()

    # --- the wrappers -----------------------------------------------------------------------------

    def _unscale_gradients(self, optimizer: Any = None) -> None:
        self._unscale.original(optimizer=optimizer)
        guard = self.guard_of()
        if guard is None or not guard.attached:
            if self.remove_with_guard:
                self.remove()  # the guard is gone (removed or garbage-collected): so is its boundary
            return
        if not self.accelerator.sync_gradients:
            return  # a micro-batch that does not end the step: its gradients are not final yet
        if optimizer is None:
            chosen: Sequence[Any] = list(self.accelerator._optimizers)
        elif isinstance(optimizer, list | tuple):
            chosen = optimizer
        else:
            chosen = [optimizer]
        targets: list[Optimizer | None] = [opt for opt in map(_unwrap, chosen) if opt is not None] or [None]
        for target in targets:
            key = id(target)
            if key in self._treated:
                continue  # treated at this step's boundary already (and clipped since, perhaps)
            guard.step(target)
            self._treated.add(key)

    def _backward(self, loss: torch.Tensor, **kwargs: Any) -> Any:
        self._treated.clear()  # new gradients: the next boundary treats them
        guard = self.guard_of()
        if guard is not None and guard.attached and self.accelerator._schedulers:
            hand_schedulers(guard, self.accelerator._schedulers)  # prepared since the guard attached
        return self._backward_patch.original(loss, **kwargs)

    def _stepped(self, optimizer: Optimizer) -> None:
        self._treated.discard(id(optimizer))
        self._treated.discard(id(None))  # a model-wide boundary (no optimizer prepared) ends at any step


def _stepped(ref: weakref.ReferenceType[AcceleratorBoundary], optimizer: Optimizer) -> None:
    boundary = ref()
    if boundary is not None:
        boundary._stepped(optimizer)


class _AcceleratorGuard(GradGuard):
    """A GradGuard that also takes its boundary off the accelerator when removed."""

    _boundary: AcceleratorBoundary | None = None

    def remove(self) -> None:
        super().remove()
        if self._boundary is not None:
            self._boundary.remove()


def guard_accelerator(
    accelerator: accelerate.Accelerator,
    model: nn.Module,
    policy: Policy | str | os.PathLike[str],
    **guard_options: Any,
) -> GradGuard:
    """Attach a [`GradGuard`][gradguard.GradGuard] to ``model`` and act before accelerate's gradient clip.

    The guard treats each step's final gradients inside ``accelerator.unscale_gradients`` (which
    ``accelerator.clip_grad_norm_`` and ``clip_grad_value_`` call first), after GradScaler's unscale:
    so a NaN is attributed to the one parameter that produced it before the global clip spreads it,
    and the policy's clips come before the global one. Steps without such a call are treated at the
    optimizer's ``step()``, as by a plain ``GradGuard``.

    Call it before or after ``accelerator.prepare``; pass the model you train (prepared or not). The
    accelerator's GradScaler (fp16) is given to the guard as ``scaler=`` unless you pass one, so a
    step the scaler skips is logged and never halts. Use the result as a context manager or call
    ``guard.remove()``: that also puts the accelerator's methods back.

    With a policy's ``recovery`` section, the LR schedulers given to ``accelerator.prepare`` (before or
    after this call; found at the next ``accelerator.backward``) and the accelerator's GradScaler are
    rewound with the weights and held through the skip window, and ``lr_factor`` holds through the
    schedulers' later steps. A loop may save the compute of skipped steps with ``if guard.pass_step():
    continue`` at the top of a step.

    Args:
        accelerator: the ``accelerate.Accelerator`` of the loop.
        model: the module whose parameters are guarded.
        policy: a [`Policy`][gradguard.Policy] or the path of a policy file.
        **guard_options: passed to [`GradGuard`][gradguard.GradGuard] (``audit_log``, ``logger``,
            ``start_step``, ``optimizer``, ``lr_scheduler``, ``summary_every``, ...); an
            ``AcceleratedScheduler`` given as ``lr_scheduler`` is unwrapped.
    """
    guard_options.setdefault("scaler", accelerator.scaler)
    given = guard_options.get("lr_scheduler")
    if given is not None:
        given = list(given) if isinstance(given, list | tuple) else [given]
        guard_options["lr_scheduler"] = [unwrap_scheduler(scheduler) for scheduler in given]
    guard = _AcceleratorGuard(model, policy, **guard_options)
    hand_schedulers(guard, accelerator._schedulers)
    guard_ref = weakref.ref(guard)
    guard._boundary = AcceleratorBoundary(accelerator, guard_ref)
    return guard
