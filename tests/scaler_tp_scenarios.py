"""GradScaler under tensor parallel, on real gloo ranks (tests/test_scaler_tensor_parallel.py): torchtitan's plan on
the decoder, an Inf written into the last rank's shard of one weight gradient at ``BAD_STEP``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from support.gloo_ranks import main
from support.parallel_models import apply_torchtitan_tp, batch, loss_of, make_decoder

from gradguard import GradGuard, Policy

STEPS = 4
BAD_STEP = 2


def inf_in_one_shard(rank: int, world: int, scaler_given: bool) -> dict[str, Any]:
    """Each step's loss scale after ``update()``, whether the update moved a sharded weight, the guard's counters, and
    whether the replicated parameters (the norms) still agree across the ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = make_decoder()
    apply_torchtitan_tp(model, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    given = scaler if scaler_given else None
    steps = []
    with GradGuard(model, Policy.shipped("default"), logger=None, scaler=given) as guard:
        for step in range(STEPS):
            opt.zero_grad()
            tokens, targets = batch(step)
            scaler.scale(loss_of(model(tokens), targets)).backward()
            if step == BAD_STEP and rank == world - 1:
                model.layers["0"].attention.q.weight.grad.to_local().view(-1)[0] = float("inf")
            before = model.layers["0"].attention.k.weight.to_local().clone()
            scaler.step(opt)
            scaler.update()
            moved = not torch.equal(before, model.layers["0"].attention.k.weight.to_local())
            steps.append([step, scaler.get_scale(), moved])
        counters = guard.counters.snapshot()
    replicated = [p.to_local() for name, p in model.named_parameters() if "norm" in name]
    mine = torch.cat([p.detach().reshape(-1) for p in replicated])
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return {"steps": steps, "counters": counters, "replicas_agree": all(torch.equal(every[0], v) for v in every)}


def scenario(name: str, rank: int, world: int, outdir: Path) -> dict[str, Any]:
    if name == "scaler_tp":
        return {"given": inf_in_one_shard(rank, world, True), "loop": inf_in_one_shard(rank, world, False)}
    raise ValueError(name)


if __name__ == "__main__":
    main(scenario, sys.argv[1:])
