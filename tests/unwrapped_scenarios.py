"""A guard on the module inside a DDP wrapper (nanoGPT's ``raw_model``), for tests/test_unwrapped_model.py.

Run as ``python tests/unwrapped_scenarios.py raw_model 2 OUTDIR PORT`` (support.gloo_ranks).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from support.gloo_ranks import main
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradguard import GradGuard, GradientHalt, GuardWarning, Policy


def raw_model(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    raw = model.module
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GuardWarning)
        guard = GradGuard(raw, Policy.shipped("default"), logger=None)
    out: dict[str, Any] = {"warnings": [str(w.message) for w in caught if issubclass(w.category, GuardWarning)]}
    try:
        for step in range(3):
            opt.zero_grad()
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = model(x).pow(2).mean() * (float("nan") if step == 1 and rank == 1 else 1.0)
            loss.backward()
            opt.step()
    except GradientHalt as halt:
        out["halt"] = {"step": halt.step, "ranks": dict(halt.ranks), "message": str(halt)}
    guard.remove()
    del model, raw, opt
    return out


def scenario(name: str, rank: int, world: int, outdir: Path) -> dict[str, Any]:
    return raw_model(rank)


if __name__ == "__main__":
    main(scenario, sys.argv[1:])
