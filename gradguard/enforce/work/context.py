"""What a step knows before it starts: the update it precedes (``StepContext``) and what it treats (``StepPlan``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from gradguard.enforce.work.places import Place
from gradguard.policy.matching import BoundRule, GuardedParam

__all__ = ["StepContext", "StepPlan"]


class StepPlan(Protocol):
    """What a step treats, as the step's participants and gradient sources see it (``enforce.plans.Plan`` is one)."""

    @property
    def names(self) -> dict[int, str]: ...
    @property
    def params(self) -> tuple[GuardedParam, ...]: ...
    @property
    def rules(self) -> tuple[tuple[BoundRule, tuple[GuardedParam, ...]], ...]: ...


@dataclass
class StepContext:
    """What one enforcement pass needs to know about the update it precedes."""

    optimizer: Any | None
    """The ``torch.optim.Optimizer`` about to step, or ``None`` for ``guard.step()``."""
    stepped_params: Callable[[], Iterable[torch.Tensor]]
    """Every parameter the update would change: a skipped step sets all their gradients to None."""
    explicit: bool = False
    """An explicit boundary (``guard.step()``, a framework integration), not an optimizer's step pre-hook:
    the gradients it treats are left alone by the optimizer's coming step, whatever changes them between."""
    found_inf: Sequence[torch.Tensor] = ()
    """A GradScaler's inf/NaN flags for gradients it has already unscaled: if set, the step is the
    scaler's to skip (no halt, no intervention counted)."""
    clipped_before: str | None = None
    """A clip the guard saw run over these gradients before this step (e.g. ``clip_grad_norm_`` while a
    GradScaler still held them scaled): it may have spread a NaN to every gradient it clipped."""
    loss_scales: Sequence[torch.Tensor] = ()
    loss_scale: float | None = None
    """The loss scale where the host holds it already (DeepSpeed's ``cur_scale``): taken as it is, not read back."""
    """The GradScaler's loss scale(s) with ``found_inf``: a skip at or below a floor halts."""
    rerunnable: bool = False
    """The guard holds the step's computation (a closure) and can run it again (the ``rerun`` section)."""
    scaled_optimizers: Sequence[Any] = ()
    """The optimizers whose gradients a GradScaler unscaled before this explicit boundary: if all are fused, a
    skipping scaler still calls their ``step()`` (the kernel skips on ``found_inf``), which is not a new step."""
    gradients: Callable[[StepPlan], dict[int, torch.Tensor]] | None = None
    """Where the gradients live when not in ``p.grad`` (DeepSpeed's partitions): the step's ``Plan`` -> tensor index
    -> this rank's piece of its gradient (edits in place reach the update). None: ``p.grad``."""
    pieces: bool = False
    """``gradients``' pieces are parts of each gradient spread over the ranks: per-tensor figures are combined."""
    places: dict[int, Place] = field(default_factory=dict)
    """Tensor index -> where its piece lies in its parameter: filled by ``gradients`` where it knows (DeepSpeed)."""
