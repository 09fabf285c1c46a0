"""The changes a step's one read showed are needed, made after it, to the tensors that need them only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gradguard.enforce.work.tensors import LOW_PRECISION, clamp_

__all__ = ["DeferredWrites"]


@dataclass
class DeferredWrites:
    """The changes the step's one read showed are needed, made after it: only to the tensors that need them.

    An action whose change is the last one a tensor gets in a step (``StepWork.final``) does not multiply every
    gradient by a coefficient on the device (most of them by 1, and a list of 0-dim coefficients is one kernel
    per tensor on a GPU); it queues the factors its reader finds below 1 here. Host floats take torch's
    multi-tensor fast path: one launch per (device, dtype), however many tensors, and a multiply by the float32
    coefficient as a host float is bitwise the multiply by it as a tensor.
    """

    scales: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[float]]] = field(default_factory=dict)
    clamps: dict[float, list[torch.Tensor]] = field(default_factory=dict)
    written: set[int] = field(default_factory=set)
    """Tensor indices changed here (their norms as they arrived no longer describe them)."""
    factors: dict[int, float] = field(default_factory=dict)
    """Tensor index -> the factor it was multiplied by here."""

    after: list[Callable[[], None]] = field(default_factory=list)
    """Work that needs these changes made first (a group clip after changes held for the read), run after them."""

    low_precision: tuple[list[torch.Tensor], list[torch.Tensor]] = field(default_factory=lambda: ([], []))
    """Half-precision gradients and their float32 factors as 0-dim device tensors: multiplied as torch's
    ``clip_grads_with_norm_`` multiplies them (a host float would be rounded to half precision first)."""

    def scale(self, index: int, grad: torch.Tensor, factor: float, on_device: Callable[[], torch.Tensor]) -> None:
        """Multiply ``grad`` by ``factor`` (``on_device()``: its float32 value on the gradient's device, taken only
        for half precision)."""
        if grad.dtype in LOW_PRECISION:
            self.low_precision[0].append(grad)
            self.low_precision[1].append(on_device())
        else:
            tensors, factors = self.scales.setdefault((grad.device, grad.dtype), ([], []))
            tensors.append(grad)
            factors.append(factor)
        self.written.add(index)
        self.factors[index] = factor

    def clamp(self, index: int, grad: torch.Tensor, limit: float) -> None:
        self.clamps.setdefault(limit, []).append(grad)
        self.written.add(index)
        self.factors.pop(index, None)

    def apply(self) -> None:
        for tensors, factors in self.scales.values():
            torch._foreach_mul_(tensors, factors)
        if self.low_precision[0]:
            torch._foreach_mul_(*self.low_precision)
            self.low_precision = ([], [])
        for limit, grads in self.clamps.items():
            for group in _by_device_and_dtype(grads):
                clamp_(group, limit)
        self.scales.clear()
        self.clamps.clear()
        after, self.after = self.after, []
        for work in after:
            work()


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return list(groups.values())
