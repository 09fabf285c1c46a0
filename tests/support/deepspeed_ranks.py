"""What the DeepSpeed tests' ranks share: the model whose ``2.weight`` the partition boundary cuts (111 elements, 56
per rank), each rank's batches, and one torchrun of a scenario script (``tests/test_deepspeed_*.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from support.gloo_ranks import free_port

__all__ = [
    "assert_update_held_by_the_clip",
    "batch",
    "loss_of",
    "make_engine",
    "make_model",
    "own_gradient_as_tapped",
    "torchrun_scenarios",
    "train_step",
]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3))


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100000 + 1000 * step + 10 * micro + rank)
    return torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.float() - y) ** 2).mean()


def make_engine(
    stage: int,
    gas: int,
    precision: dict[str, Any] | None = None,
    *,
    clip: float | None = 0.0,
    lr: float = 0.05,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    frozen: tuple[str, ...] = (),
    decay: float | None = None,
    **zero: Any,
) -> Any:
    """A DeepSpeed engine over ``make_model()`` (``frozen``: parameters made not to require gradients) with torch's
    SGD as its client optimizer (no CPU-Adam build); ``decay``: the engine's LR scheduler multiplies the LR by it at
    each update (torch's LambdaLR on the client optimizer); ``clip=None`` leaves ``gradient_clipping`` out of the
    config, as DeepSpeed's default config does (DeepSpeed then clips at 1.0)."""
    import deepspeed
    import torch.distributed as dist

    model = make_model()
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "train_batch_size": 4 * gas * dist.get_world_size(),
        "zero_optimization": {"stage": stage, **zero},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        **({"gradient_clipping": clip} if clip is not None else {}),
        **(precision or {}),
    }
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trained, lr=lr, momentum=momentum, weight_decay=weight_decay)
    scheduler = None
    if decay is not None:
        rate = decay
        scheduler = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: rate**step)  # noqa: E731
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, lr_scheduler=scheduler)
    return engine


def train_step(engine: Any, step: int, gas: int, rank: int) -> None:
    """One update: ``gas`` micro-batches through ``engine.backward`` and ``engine.step``."""
    dtype = next(engine.module.parameters()).dtype
    for micro in range(gas):
        x, y = batch(step, micro, rank)
        engine.backward(loss_of(engine(x.to(dtype)), y))
        engine.step()


def own_gradient_as_tapped(engine: Any, rank: int, gas: int, param_name: str) -> dict[str, Any]:
    """One update's backwards with a NaN made on rank 1 only, in the first micro-batch (a hook on ``param_name``):
    this rank's own gradient as the guard's tap noted it before DeepSpeed's reduction (``collective.local``), read
    before the guard's step takes it; with where the tap reads (``seen``) or why it cannot (``unseen``)."""
    from gradguard import GradGuard, Policy

    param = dict(engine.module.named_parameters())[param_name]
    micro = [0]
    handle = param.register_hook(lambda g: g * float("nan") if rank == 1 and micro[0] == 0 else g)
    halt = {"version": 1, "rules": [{"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}]}
    with GradGuard(engine, Policy.from_dict(halt), logger=None) as guard:
        local = guard._enforcer.collective.local
        for micro[0] in range(gas):
            x, y = batch(0, micro[0], rank)
            engine.backward(loss_of(engine(x), y))
            if micro[0] < gas - 1:
                engine.step()  # not a boundary: no update, no guard step
        taken = local.take(torch.device("cpu"))
        found = {"norm": None if taken is None else float(taken), "seen": local.seen, "unseen": local.unseen}
    handle.remove()
    return found


def assert_update_held_by_the_clip(result: dict[str, Any], bound: float) -> None:
    """A per-tensor clip's parameter moved by ``bound`` (lr x max_norm) at every step, no more and, the clip being
    what held it, hardly less; the others moved freely; the clip counted at each of 5 steps; every rank the same.

    The update is measured as the float32 weights' difference: each element of the new weights is rounded to half an
    ulp (~1.5e-8 at |w| ~ 0.3), so the measured norm of a 5e-5 update is exact to ~2e-3 relative."""
    assert all(moved <= bound * (1 + 5e-3) for moved in result["moved"]), result["moved"]
    assert all(moved > bound * (1 - 5e-3) for moved in result["moved"])
    assert all(other > 10 * bound for other in result["others"]), result["others"]
    assert result["counters"]["tight"] == {"clip_norm": 5}
    assert result["same"]


def torchrun_scenarios(
    script: Path, scenarios: list[str], outdir: Path, timeout: float
) -> Callable[[str], list[dict[str, Any]]]:
    """Run ``script``'s scenarios once on 2 ranks; returns each scenario's results by rank."""
    path = os.pathsep.join(filter(None, [str(script.parent.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"),
        *(str(script), "--torchrun", ",".join(scenarios), str(outdir)),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return lambda name: [json.loads((outdir / name / f"rank{r}.json").read_text()) for r in range(2)]
