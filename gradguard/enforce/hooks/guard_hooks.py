"""What the process-wide hooks (``torch_hooks``) ask of a guard, and which of torch's clip functions they wrap."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.optim import Optimizer

from gradguard.enforce.triggers.loss import LossWatch

__all__ = ["CLIPS", "CLIP_SITES", "ClipCall", "GuardHooks"]


class GuardHooks(Protocol):
    """What a guard offers the process-wide hooks ([`gradguard.GradGuard`][gradguard.GradGuard] implements it)."""

    def _on_optimizer_step(
        self, optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None: ...

    def _after_optimizer_step(self, optimizer: Optimizer) -> None: ...

    def _before_clip(self, call: ClipCall) -> bool: ...

    def _after_clip(self) -> None: ...

    def _loss_watch(self) -> LossWatch | None: ...

    def _clip_instead(
        self, name: str, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any: ...


@dataclass(frozen=True)
class ClipCall:
    """A call of one of torch's clip functions, as a guard sees it before the clip runs."""

    name: str
    """The function's public name, e.g. ``"torch.nn.utils.clip_grad_norm_"``."""
    tensors: list[torch.Tensor]
    """The parameters it was given, or the gradients (``get_total_norm``)."""
    of_grads: bool
    """``tensors`` are gradients, not parameters."""


# (module, attribute, takes gradients?, its first argument's name)
CLIP_SITES: tuple[tuple[str, str, bool, str], ...] = (
    ("torch.nn.utils", "clip_grad_norm_", False, "parameters"),
    ("torch.nn.utils", "clip_grad_norm", False, "parameters"),
    ("torch.nn.utils", "clip_grad_value_", False, "parameters"),
    ("torch.nn.utils", "clip_grads_with_norm_", False, "parameters"),
    ("torch.nn.utils", "get_total_norm", True, "tensors"),
    ("torch.nn.utils.clip_grad", "clip_grad_norm_", False, "parameters"),
    ("torch.nn.utils.clip_grad", "clip_grad_norm", False, "parameters"),
    ("torch.nn.utils.clip_grad", "clip_grad_value_", False, "parameters"),
)
CLIPS: tuple[str, ...] = tuple(f"{module}.{name}" for module, name, _, _ in CLIP_SITES)
"""Every spelling of torch's clips that a guard intercepts."""
