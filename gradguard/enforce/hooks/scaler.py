"""GradScaler at the step boundary: scaled gradients of fused optimizers, found-inf flags, skipped steps.

GradScaler unscales before a plain optimizer's step; a fused optimizer gets ``grad_scale`` and
``found_inf`` instead and unscales inside its kernel, so the guard unscales those gradients itself.
A step the scaler skips (inf/NaN in a normal loss-scale search) is the scaler's business: no halt and
no clip, only a ``scaler_skip`` event, counted once per training step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.amp.grad_scaler import OptState
from torch.optim import Optimizer

from gradguard.enforce.hooks.scaler_view import unscaled_by
from gradguard.enforce.work.participant import Participant, Ruling
from gradguard.enforce.work.step_work import Pending, StepContext, StepOutcome, StepWork
from gradguard.errors import GuardStateError

__all__ = [
    "ScalerFlags",
    "ScalerWatch",
    "adopt_fused_scaler",
    "has_unscaled",
    "loss_scale_of",
    "read_found_inf",
    "read_loss_scales",
    "stepped_when_skipped",
    "unscaled_found_inf",
    "unscaled_optimizers",
]


class ScalerFlags(Participant):
    """The GradScaler watch as a participant: its flags (and a fused optimizer's scaled gradients, unscaled) come
    before every figure of the step, and a step it found inf in is its own to skip (``skip``: the guard's record of
    that), so nothing else rules on it."""

    def __init__(self, skip: Callable[[StepWork, StepContext], bool]) -> None:
        self._skip = skip

    def before_figures(self, work: StepWork, context: StepContext) -> None:
        adopt_fused_scaler(context, work.pending, work.outcome)
        read_found_inf(context, work.pending, work.outcome)

    def ruling(self, work: StepWork, context: StepContext) -> Ruling | None:
        if not work.outcome.scaler_found_inf:
            return None
        skip = self._skip
        return Ruling(lambda: skip(work, context), final=True)


def adopt_fused_scaler(context: StepContext, pending: Pending, outcome: StepOutcome) -> None:
    """A fused optimizer under GradScaler still holds scaled gradients here; unscale them first.

    GradScaler hands such an optimizer ``grad_scale`` and ``found_inf`` instead of unscaling. We
    unscale every gradient of the optimizer ourselves (what its kernel would have done) and clear
    ``grad_scale``, so thresholds apply to true gradients; ``found_inf`` still makes the kernel skip.
    """
    optimizer = context.optimizer
    if optimizer is None:
        return
    grad_scale = getattr(optimizer, "grad_scale", None)
    found_inf = getattr(optimizer, "found_inf", None)
    if isinstance(grad_scale, torch.Tensor):
        # Exactly the gradients the fused kernel would have unscaled: this optimizer's, each once.
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for grad in grads:
            by_device.setdefault(grad.device, []).append(grad)
        inverse = grad_scale.double().reciprocal().float()
        for device, device_grads in by_device.items():
            torch._foreach_mul_(device_grads, inverse.to(device))
        optimizer.grad_scale = None
    if isinstance(found_inf, torch.Tensor):

        def read(values: list[float]) -> None:
            outcome.scaler_found_inf = values[0] > 0

        pending.add(found_inf.reshape(-1)[:1].float(), read)
        if isinstance(grad_scale, torch.Tensor):
            read_loss_scales([grad_scale], pending, outcome)


def read_found_inf(context: StepContext, pending: Pending, outcome: StepOutcome) -> None:
    """Read a GradScaler's inf/NaN flags with the step's one sync (explicit boundary after its unscale_)."""
    if not context.found_inf:
        return
    device = context.found_inf[0].device
    total = torch.stack([flag.reshape(-1)[:1].to(device, torch.float32) for flag in context.found_inf]).sum()

    def read(values: list[float]) -> None:
        outcome.scaler_found_inf = outcome.scaler_found_inf or values[0] > 0

    pending.add(total, read)
    if context.loss_scale is not None:
        outcome.loss_scale = context.loss_scale  # a host float: nothing to send to the device and read back
    read_loss_scales(context.loss_scales, pending, outcome)


def read_loss_scales(scales: Sequence[torch.Tensor], pending: Pending, outcome: StepOutcome) -> None:
    """The GradScalers' loss scales, with the step's one sync (the smallest goes to ``outcome.loss_scale``)."""
    if not scales:
        return
    device = scales[0].device
    smallest = torch.stack([scale.reshape(-1)[:1].to(device, torch.float32) for scale in scales]).min()

    def read(values: list[float]) -> None:
        outcome.loss_scale = values[0]

    pending.add(smallest, read)


def stepped_when_skipped(optimizers: Sequence[Optimizer]) -> bool:
    """Whether a GradScaler that skips still calls each optimizer's ``step()``.

    It does for a fused optimizer (``_step_supports_amp_scaling``): it hands the optimizer ``found_inf`` and the
    kernel skips the update. That call is the skipped step itself, not a new one.
    """
    return bool(optimizers) and all(getattr(optimizer, "_step_supports_amp_scaling", False) for optimizer in optimizers)


def unscaled_optimizers(scaler: torch.amp.GradScaler | None, optimizer: Optimizer | None) -> tuple[Optimizer, ...]:
    """The optimizers an explicit boundary's flags come from: ``optimizer``, or every one ``scaler`` unscaled."""
    if optimizer is not None:
        return (optimizer,)
    if scaler is None or not scaler.is_enabled():
        return ()
    return unscaled_by(scaler)


def has_unscaled(scaler: torch.amp.GradScaler, optimizer: Optimizer) -> bool:
    """Whether ``scaler`` has unscaled this optimizer's gradients in the current step (or is disabled)."""
    if not scaler.is_enabled():
        return True
    state = scaler._per_optimizer_states.get(id(optimizer))
    return state is not None and state["stage"] is OptState.UNSCALED


def unscaled_found_inf(scaler: torch.amp.GradScaler | None, optimizer: Optimizer | None) -> tuple[torch.Tensor, ...]:
    """A GradScaler's inf/NaN flags for the gradients it has unscaled (for an explicit boundary).

    Raises [`GuardStateError`][gradguard.GuardStateError] when the scaler still holds the gradients scaled: thresholds
    would be compared against scaled values.
    """
    if scaler is None or not scaler.is_enabled():
        return ()
    states = scaler._per_optimizer_states
    if optimizer is None:
        chosen = [state for state in states.values() if state["stage"] is OptState.UNSCALED]
    else:
        chosen = [states[id(optimizer)]] if has_unscaled(scaler, optimizer) else []
    if not chosen:
        raise GuardStateError(
            "guard.step() was called while the guard's GradScaler still holds scaled gradients; thresholds "
            "would be compared against the scaled values. Call scaler.unscale_(optimizer) first, then "
            "guard.step(optimizer), then scaler.step(optimizer)."
        )
    return tuple(flag for state in chosen for flag in state["found_inf_per_device"].values())


def loss_scale_of(scaler: torch.amp.GradScaler | None) -> tuple[torch.Tensor, ...]:
    """The scaler's loss scale as a device tensor, once it has scaled a loss."""
    scale = getattr(scaler, "_scale", None) if scaler is not None and scaler.is_enabled() else None
    return (scale,) if isinstance(scale, torch.Tensor) else ()


class ScalerWatch:
    """Wraps one GradScaler's ``step`` to see the steps it skips (inf/NaN in a loss-scale search).

    Without a fused optimizer, a skipping GradScaler never calls ``optimizer.step()``, so the guard's
    step pre-hook does not run: no halt and no clip, as it should be; ``on_skip`` logs the skip.
    ``steps(optimizer)`` counts that optimizer's ``step()`` calls, so an unchanged count means a skip
    (per optimizer: another thread's steps meanwhile do not hide it).
    """

    def __init__(
        self,
        scaler: torch.amp.GradScaler,
        steps: Callable[[Optimizer], int],
        on_skip: Callable[[Optimizer], None],
    ) -> None:
        self.scaler = scaler
        self.steps = steps
        self.on_skip = on_skip
        self.original = scaler.step
        scaler.step = self  # type: ignore[method-assign]

    def __call__(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        before = self.steps(optimizer)
        result = self.original(optimizer, *args, **kwargs)
        if self.steps(optimizer) == before:
            self.on_skip(optimizer)
        return result

    def remove(self) -> None:
        if self.scaler.__dict__.get("step") is self:
            del self.scaler.step
