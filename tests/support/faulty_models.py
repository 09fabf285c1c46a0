"""Models built to fail at a known place (a forward NaN, a custom backward's Inf, a block's own code), shared by
tests/test_provenance.py and benchmarks/gpu_check.py (which runs them on a GPU)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["Block", "EmitsNaN", "Faults", "InfInBackward", "Net"]


class Faults:
    """Which fault is on now (tests switch them at a chosen step)."""

    def __init__(self) -> None:
        self.forward_nan = False
        self.backward_inf = False
        self.log_negative = False
        self.sqrt_negative = False


class EmitsNaN(nn.Module):
    """Identity, except that its output is NaN while ``faults.forward_nan`` is on."""

    def __init__(self, faults: Faults) -> None:
        super().__init__()
        self.faults = faults

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float("nan") if self.faults.forward_nan else x * 1.0


class _InfInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, on: bool) -> torch.Tensor:
        ctx.on = on
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (torch.full_like(grad, float("inf")) if ctx.on else grad), None


class InfInBackward(nn.Module):
    """Identity in forward; its backward (a custom autograd function) emits Inf while the fault is on."""

    def __init__(self, faults: Faults) -> None:
        super().__init__()
        self.faults = faults

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _InfInBackward.apply(x, self.faults.backward_inf)  # type: ignore[no-untyped-call]
        return out


class Block(nn.Module):
    """fc1 -> (fault points) -> fc2, with a residual; ``act`` and ``boom`` are the faulty modules."""

    def __init__(self, faults: Faults, width: int = 8) -> None:
        super().__init__()
        self.faults = faults
        self.fc1 = nn.Linear(width, width)
        self.act = EmitsNaN(faults)
        self.boom = InfInBackward(faults)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.boom(self.act(self.fc1(x)))
        if self.faults.log_negative:
            h = torch.log(h - 100.0)  # negative: NaN, made by the block's own code
        if self.faults.sqrt_negative:
            h = torch.sqrt(h - 100.0)
        out: torch.Tensor = x + self.fc2(torch.relu(h))
        return out


class Net(nn.Module):
    """Three blocks; only ``blocks.1`` carries faults (the others get a Faults that stays off)."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.faults = Faults()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block(Faults()), Block(self.faults), Block(Faults())])
        self.head = nn.Linear(8, 2)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpointed else block(h)
        out: torch.Tensor = self.head(h)
        return out

    def block(self, index: int) -> Block:
        block = self.blocks[index]
        assert isinstance(block, Block)
        return block
