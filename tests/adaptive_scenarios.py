"""Adaptive actions under DDP and FSDP2, for tests/test_distributed_adaptive.py (run by distributed_scenarios.py).

Every rank trains on its own batches; a gradient spike is injected on rank 1 only (its loss is scaled
before backward, so the spike reaches every rank through the all-reduce). Each rank records which steps
it skipped, its weights after every step and the guard's statistics; a single-process reference
(:func:`reference`) runs the same policy on the ranks' gradients averaged by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from distributed_scenarios import final_params
from torch import nn

from gradguard import GradGuard, Policy

STEPS = 16
SPIKE_STEP = 11
SPIKE_SCALE = 500.0

POLICY = {
    "version": 1,
    "rules": [
        {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
        {
            "name": "spikes",
            "match": "*",
            "actions": [{"action": "skip_step_on_spike", "window": 8, "min_samples": 4, "z_thresh": 3.0}],
        },
        {"name": "embed", "match": "embed.*", "actions": [{"action": "autoclip", "history": 6, "percentile": 50.0}]},
        {
            "name": "rest",
            "match": "*",
            "exclude": "embed.*",
            "actions": [
                {"action": "zclip", "warmup_steps": 3, "alpha": 0.9, "z_thresh": 1.5},
                {"action": "zclip", "warmup_steps": 3, "scope": "group", "z_thresh": 1.5},
            ],
        },
    ],
}


def scale_of(rank: int, step: int) -> float:
    return SPIKE_SCALE if (step == SPIKE_STEP and rank == 1) else 1.0


def train(
    rank: int, model: nn.Module, batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], outdir: Path
) -> dict[str, Any]:
    """SGD steps under the guard; the weights (full tensors) after each step, the skips, the statistics."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    result: dict[str, Any] = {"rank": rank, "skipped": [], "weights": []}
    with GradGuard(model, Policy.from_dict(POLICY), logger=None, audit_log=outdir / f"audit-rank{rank}.jsonl") as guard:
        for step in range(STEPS):
            opt.zero_grad()
            x, y = batch(rank, step)
            (nn.functional.mse_loss(model(x), y) * scale_of(rank, step)).backward()
            opt.step()
            if guard.last_step_skipped:
                result["skipped"].append(step)
            result["weights"].append(final_params(model))
        result["statistics"] = guard.state_dict()["statistics"]
        result["counters"] = guard.counters.snapshot()
    return result


def reference(
    make_model: Callable[[], nn.Module], batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], world: int
) -> dict[str, Any]:
    """One process: each step's gradient is the ranks' gradients averaged by hand, then the guard acts."""

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    result: dict[str, Any] = {"skipped": [], "weights": []}
    with GradGuard(model, Policy.from_dict(POLICY), logger=None) as guard:
        for step in range(STEPS):
            opt.zero_grad()
            for rank in range(world):
                x, y = batch(rank, step)
                (nn.functional.mse_loss(model(x), y) * scale_of(rank, step) / world).backward()
            opt.step()
            if guard.last_step_skipped:
                result["skipped"].append(step)
            result["weights"].append(final_params(model))
        result["statistics"] = guard.state_dict()["statistics"]
    return result


def run(
    name: str, rank: int, world: int, outdir: Path, make_model: Callable[[], nn.Module], batch: Any
) -> dict[str, Any]:
    if name == "adaptive_ddp":
        from torch.nn.parallel import DistributedDataParallel as Ddp

        return train(rank, Ddp(make_model()), batch, outdir)
    if name == "adaptive_fsdp2":
        from torch.distributed.fsdp import fully_shard

        model = make_model()
        for module in (model.embed, model.body, model.head):
            fully_shard(module)
        fully_shard(model)
        return train(rank, model, batch, outdir)
    raise SystemExit(f"unknown scenario {name!r}")
