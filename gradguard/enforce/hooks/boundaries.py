"""What a boundary the hooks find knows about the update it precedes (its ``StepContext``): the parameters a skipped
update must clear, and at an explicit boundary (``guard.step()``) what the guard's GradScaler and the loop's closure
say."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.optim import Optimizer

from gradguard.enforce.hooks.scaler import loss_scale_of, unscaled_found_inf, unscaled_optimizers
from gradguard.enforce.triggers.rerun import in_rerunnable_closure
from gradguard.enforce.work.step_work import StepContext

__all__ = ["explicit_context", "stepped_by"]


def stepped_by(
    optimizer: Optimizer | None, model_ref: weakref.ReferenceType[nn.Module]
) -> Callable[[], Iterable[torch.Tensor]]:
    """Every parameter a skipped step must clear: the optimizer's and the whole model's."""

    def stepped() -> Iterable[torch.Tensor]:
        if optimizer is not None:
            yield from (p for group in optimizer.param_groups for p in group["params"])
        model = model_ref()
        yield from model.parameters() if model is not None else ()

    return stepped


def explicit_context(
    optimizer: Optimizer | None, model_ref: weakref.ReferenceType[nn.Module], scaler: torch.amp.GradScaler | None
) -> StepContext:
    """An explicit boundary's context ([`GradGuard.step`][gradguard.GradGuard.step]): after the guard's GradScaler
    unscaled (its flags and loss scale read with the step), inside a closure the guard holds or not."""
    return StepContext(
        optimizer=optimizer,
        stepped_params=stepped_by(optimizer, model_ref),
        explicit=True,
        found_inf=unscaled_found_inf(scaler, optimizer),
        loss_scales=loss_scale_of(scaler),
        scaled_optimizers=unscaled_optimizers(scaler, optimizer),
        rerunnable=in_rerunnable_closure(),  # Lightning's boundary runs inside the closure the guard holds
    )
