"""A model of four parameter families whose gradient norms differ by four orders of magnitude, and its runs.

Each of ``blocks`` blocks holds four bias-free linear maps, ``huge``, ``large``, ``small`` and ``tiny``; each
regresses a fixed teacher's outputs (the student starts at the teacher) plus noise, its loss weighted by
:data:`SCALES`, so its gradient is that weight times noise: stationary, log-normal-ish, and
``1 : 1e-1 : 1e-2 : 1e-4`` across the families. A *spike* multiplies one family's noise (or every family's)
by :data:`SPIKE` on one step; a *NaN* makes one family's targets NaN.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradguard import GradGuard, GradientHalt, Policy

__all__ = ["MONITOR_RULE", "SCALES", "SPIKE", "FourFamilies", "Run", "Schedule", "record_run"]

SCALES: dict[str, float] = {"huge": 1.0, "large": 1e-1, "small": 1e-2, "tiny": 1e-4}
SPIKE = 100.0
MONITOR_RULE = {"name": "norms", "match": "*", "actions": [{"action": "monitor", "stats": ["norm"], "every": 1}]}


class FourFamilies(nn.Module):
    """``blocks.<i>.<family>.weight`` for each family of :data:`SCALES`."""

    def __init__(
        self, blocks: int = 3, width: int = 8, scales: Mapping[str, float] = SCALES, bias: bool = False
    ) -> None:
        super().__init__()
        self.width = width
        self.scales = dict(scales)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({name: nn.Linear(width, width, bias=bias) for name in scales}) for _ in range(blocks)
        )

    def loss(self, x: torch.Tensor, targets: Sequence[Mapping[str, torch.Tensor]]) -> torch.Tensor:
        total = x.new_zeros(())
        for block, wanted in zip(self.blocks, targets, strict=True):
            for name, scale in self.scales.items():
                total = total + scale * ((block[name](x) - wanted[name]) ** 2).mean()  # type: ignore[operator]
        return total


@dataclass
class Schedule:
    """Which family spikes (``"all"``: every one) and which goes NaN, on which steps."""

    steps: int = 400
    spikes: dict[int, str] = field(default_factory=dict)
    nans: dict[int, str] = field(default_factory=dict)
    spike: float = SPIKE
    """How many times its usual noise a spiking family gets."""


@dataclass
class Run:
    """Where a run's audit log is, where it halted (if it did) and which steps the guard skipped."""

    log: Path
    halted_at: int | None
    skipped: list[int]


def record_run(
    log: Path,
    policy: Policy | Mapping[str, Any],
    schedule: Schedule,
    *,
    seed: int = 0,
    batch: int = 16,
    scales: Mapping[str, float] = SCALES,
    bias: bool = False,
) -> Run:
    """Train :class:`FourFamilies` under ``policy`` for ``schedule.steps`` steps, writing the audit log to ``log``."""
    torch.manual_seed(seed)
    model = FourFamilies(scales=scales, bias=bias)
    teacher = copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    if not isinstance(policy, Policy):
        policy = Policy.from_dict(policy)
    generator = torch.Generator().manual_seed(seed + 1)
    skipped: list[int] = []
    halted_at = None
    with GradGuard(model, policy, audit_log=log) as guard:
        for step in range(schedule.steps):
            x = torch.randn(batch, model.width, generator=generator)
            targets = []
            for block in teacher.blocks:
                wanted = {}
                for name in scales:
                    noise = torch.randn(batch, model.width, generator=generator)
                    if schedule.spikes.get(step) in (name, "all"):
                        noise = noise * schedule.spike
                    value = block[name](x) + noise  # type: ignore[operator]
                    if schedule.nans.get(step) == name:
                        value = torch.full_like(value, float("nan"))
                    wanted[name] = value
                targets.append(wanted)
            optimizer.zero_grad()
            model.loss(x, targets).backward()
            try:
                optimizer.step()
            except GradientHalt:
                halted_at = step
                break
            if guard.last_step_skipped:
                skipped.append(step)
    return Run(log, halted_at, skipped)
