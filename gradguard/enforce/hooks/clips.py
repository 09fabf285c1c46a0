"""A guard's view of the loop's own clips: where its step stands, and a clip seen before its step.

``gradguard.enforce.hooks.torch_hooks`` tells every live guard of a call of torch's clips; this decides
whether the call is this guard's step boundary: it clips gradients the guard covers, they are not
still scaled by a GradScaler, and acting before the clip is on (``GradGuard(before_clip=True)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim import Optimizer

from gradguard.enforce.hooks.guard_hooks import ClipCall
from gradguard.enforce.hooks.scaler_view import scaler_view
from gradguard.enforce.plans.plan_book import PlanBook

__all__ = ["ClipBoundary", "ClipWatch"]


@dataclass(frozen=True)
class ClipBoundary:
    """A clip that is the guard's step boundary."""

    params: list[torch.Tensor]
    """The guarded parameters among the clip's tensors."""
    found_inf: tuple[torch.Tensor, ...]
    """The inf/NaN flags of the GradScaler(s) that unscaled their gradients."""
    optimizer: Optimizer | None
    """The optimizer that steps them, where a GradScaler's unscale_ named exactly one."""
    loss_scales: tuple[torch.Tensor, ...] = ()
    """Those GradScalers' loss scales."""
    optimizers: tuple[Optimizer, ...] = ()
    """Every optimizer whose gradients those GradScalers unscaled."""


class ClipWatch:
    """Whether a guard acts at the loop's clips, and the clip it saw run before its step (if any)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._seen_before_step: str | None = None

    def boundary(self, call: ClipCall, plans: PlanBook) -> ClipBoundary | None:
        """The step boundary ``call`` is for the guard of ``plans``, or None (not its gradients, or not now).

        Gradients a GradScaler may still hold scaled are left to the optimizer's step, where they are
        unscaled: the clip is then noted as one that ran before the guard's step.
        """
        params = plans.guarded_among(call.tensors, of_grads=call.of_grads)
        if not params:
            return None
        scaled = scaler_view(p for p in params if p.grad is not None)
        if scaled.still_scaled or not self.enabled:
            self._seen_before_step = call.name
            return None
        optimizer = scaled.optimizers[0] if len(scaled.optimizers) == 1 else None
        return ClipBoundary(params, scaled.found_inf, optimizer, scaled.scales, scaled.optimizers)

    def take_seen(self) -> str | None:
        """The clip that ran over the gradients before this step, once (the step consumes it)."""
        seen, self._seen_before_step = self._seen_before_step, None
        return seen
