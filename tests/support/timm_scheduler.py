"""A stand-in for timm's LR schedulers (``timm.scheduler.Scheduler`` and ``CosineLRScheduler``), which gradguard's
tests cannot install (timm pulls torchvision): the same API and the same state, written for these tests.

As timm's: the position is the loop's own count, given at every call (``step(epoch)`` at the end of an epoch,
``step_update(num_updates)`` after each update); nothing in the scheduler counts. The LR is computed from
``base_values`` (each group's ``initial_lr``, set at construction), ``lr_min``, ``warmup_lr_init`` and the
per-group warm-up slopes ``warmup_steps``; ``state_dict()`` is the scheduler's ``__dict__`` without the optimizer,
and ``load_state_dict`` updates the ``__dict__`` with it. A group's ``lr_scale`` (layer decay) multiplies its LR.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["CosineLRScheduler", "Scheduler"]


class Scheduler:
    """timm's base: a field of every param group (``lr``) set from values the subclass computes at ``t``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        param_group_field: str,
        t_in_epochs: bool = True,
        noise_range_t: Any = None,
        noise_type: str = "normal",
        noise_pct: float = 0.67,
        noise_std: float = 1.0,
        noise_seed: int | None = None,
        initialize: bool = True,
    ) -> None:
        self.optimizer = optimizer
        self.param_group_field = param_group_field
        self._initial_param_group_field = f"initial_{param_group_field}"
        for index, group in enumerate(optimizer.param_groups):
            if initialize:
                if param_group_field not in group:
                    raise KeyError(f"{param_group_field} missing from param_groups[{index}]")
                group.setdefault(self._initial_param_group_field, group[param_group_field])
            elif self._initial_param_group_field not in group:
                raise KeyError(f"{self._initial_param_group_field} missing from param_groups[{index}]")
        self.base_values = [group[self._initial_param_group_field] for group in optimizer.param_groups]
        self.metric: float | None = None
        self.t_in_epochs = t_in_epochs
        self.noise_range_t = noise_range_t
        self.noise_pct = noise_pct
        self.noise_type = noise_type
        self.noise_std = noise_std
        self.noise_seed = 42 if noise_seed is None else noise_seed
        self.update_groups(self.base_values)

    def state_dict(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.__dict__.update(state_dict)

    def _get_lr(self, t: float) -> list[float]:
        raise NotImplementedError

    def _get_values(self, t: float, on_epoch: bool = True) -> list[float] | None:
        return self._get_lr(t) if on_epoch == self.t_in_epochs else None

    def step(self, epoch: int, metric: float | None = None) -> None:
        self.metric = metric
        values = self._get_values(epoch, on_epoch=True)
        if values is not None:
            self.update_groups(self._add_noise(values, epoch))

    def step_update(self, num_updates: int, metric: float | None = None) -> None:
        self.metric = metric
        values = self._get_values(num_updates, on_epoch=False)
        if values is not None:
            self.update_groups(self._add_noise(values, num_updates))

    def update_groups(self, values: float | list[float]) -> None:
        if not isinstance(values, list | tuple):
            values = [values] * len(self.optimizer.param_groups)
        for group, value in zip(self.optimizer.param_groups, values, strict=False):
            group[self.param_group_field] = value * group["lr_scale"] if "lr_scale" in group else value

    def _add_noise(self, lrs: list[float], t: float) -> list[float]:
        if self.noise_range_t is None:
            return lrs
        low, high = self.noise_range_t if isinstance(self.noise_range_t, list | tuple) else (self.noise_range_t, None)
        if t < low or (high is not None and t >= high):
            return lrs
        generator = torch.Generator().manual_seed(self.noise_seed + int(t))
        if self.noise_type == "normal":
            while abs(noise := torch.randn(1, generator=generator).item() * self.noise_std) >= self.noise_pct:
                pass
        else:
            noise = 2 * (torch.rand(1, generator=generator).item() - 0.5) * self.noise_pct
        return [v + v * noise for v in lrs]


class CosineLRScheduler(Scheduler):
    """timm's cosine decay with a linear warm-up and restarts (cycles), from ``base_values`` down to ``lr_min``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        t_initial: int,
        lr_min: float = 0.0,
        cycle_mul: float = 1.0,
        cycle_decay: float = 1.0,
        cycle_limit: int = 1,
        warmup_t: int = 0,
        warmup_lr_init: float = 0.0,
        warmup_prefix: bool = False,
        t_in_epochs: bool = True,
        k_decay: float = 1.0,
        **noise: Any,
    ) -> None:
        super().__init__(optimizer, param_group_field="lr", t_in_epochs=t_in_epochs, **noise)
        assert t_initial > 0
        assert lr_min >= 0
        self.t_initial = t_initial
        self.lr_min = lr_min
        self.cycle_mul = cycle_mul
        self.cycle_decay = cycle_decay
        self.cycle_limit = cycle_limit
        self.warmup_t = warmup_t
        self.warmup_lr_init = warmup_lr_init
        self.warmup_prefix = warmup_prefix
        self.k_decay = k_decay
        if warmup_t:
            self.warmup_steps = [(v - warmup_lr_init) / warmup_t for v in self.base_values]
            super().update_groups(warmup_lr_init)
        else:
            self.warmup_steps = [1 for _ in self.base_values]

    def _get_lr(self, t: float) -> list[float]:
        if t < self.warmup_t:
            return [self.warmup_lr_init + t * s for s in self.warmup_steps]
        if self.warmup_prefix:
            t -= self.warmup_t
        if self.cycle_mul != 1:
            i = math.floor(math.log(1 - t / self.t_initial * (1 - self.cycle_mul), self.cycle_mul))
            t_i = self.cycle_mul**i * self.t_initial
            t_curr = t - (1 - self.cycle_mul**i) / (1 - self.cycle_mul) * self.t_initial
        else:
            i = int(t // self.t_initial)
            t_i = self.t_initial
            t_curr = t - self.t_initial * i
        if i >= self.cycle_limit:
            return [self.lr_min for _ in self.base_values]
        gamma, k = self.cycle_decay**i, self.k_decay
        return [
            self.lr_min + 0.5 * (v * gamma - self.lr_min) * (1 + math.cos(math.pi * t_curr**k / t_i**k))
            for v in self.base_values
        ]
