"""``per_micro_batch=True`` across ranks, for tests/test_micro_batch_parallel.py: real gloo ranks, the decoder.

``zero_bubble``: a 4-layer decoder in 4 pipeline stages, 2 a rank, under ``ScheduleInterleaved1F1B`` and the two
zero-bubble schedules (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, whose weight pass adds
``torch.autograd.grad``'s results into ``.grad`` by hand), each guarded with per-micro-batch clips.
``tensor_parallel``: the decoder under torchtitan's tensor-parallel plan on 2 ranks, guarded with per-micro-batch
clips (refused at attach) and a per-micro-batch scale (trained).
Run as ``python tests/micro_batch_scenarios.py NAMES WORLD OUTDIR PORT`` (support.gloo_ranks).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from support.gloo_ranks import main
from support.parallel_models import apply_torchtitan_tp, batch, loss_of, make_decoder, stage_modules
from torch import nn

from gradguard import GradGuard, GuardStateError, Policy

STEPS = 3
LR = 0.5
MICRO_BATCHES = 2
CLIPS = {
    "version": 1,
    "rules": [
        {"name": "norm", "match": "*attention*", "actions": [{"action": "clip_norm", "max_norm": 0.01}]},
        {
            "name": "value",
            "match": "*",
            "exclude": ["*attention*"],
            "actions": [{"action": "clip_value", "limit": 0.002}],
        },
    ],
}
"""Tight enough that every contribution of every tensor is clipped: a clip left out changes the weights."""
ACTIONS = {
    "clip_value": {"action": "clip_value", "limit": 0.002},
    "clip_norm": {"action": "clip_norm", "max_norm": 0.02},
    "scale": {"action": "scale", "factor": 0.5},
}
SCHEDULES = ["interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble"]


def one_rule(action: str) -> Policy:
    return Policy.from_dict({"version": 1, "rules": [{"name": "r", "match": "*", "actions": [ACTIONS[action]]}]})


def pipeline(rank: int, schedule: str) -> dict[str, Any]:
    """The 4 stages under ``schedule``, rank ``rank``'s two of them guarded as one model (torchtitan's
    ``model_parts``): each stage's weights and the guard's counters after ``STEPS`` steps."""
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh

    kind = {
        "interleaved_1f1b": pipelining.ScheduleInterleaved1F1B,
        "interleaved_zero_bubble": pipelining.ScheduleInterleavedZeroBubble,
        "zbv_zero_bubble": pipelining.ScheduleZBVZeroBubble,
    }[schedule]
    ids = (rank, 3 - rank) if schedule.startswith("zbv") else (rank, rank + 2)  # a V, or a loop, over the ranks
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    parts = [stage_modules(make_decoder(layers=4), s, 4) for s in ids]
    stages = [
        pipelining.PipelineStage(p, s, 4, torch.device("cpu"), group=mesh.get_group())
        for p, s in zip(parts, ids, strict=True)
    ]
    runner = kind(stages, n_microbatches=MICRO_BATCHES, loss_fn=loss_of)
    opt = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=LR)
    with GradGuard(parts, Policy.from_dict(CLIPS), logger=None, device_mesh=mesh, per_micro_batch=True) as guard:
        for step in range(STEPS):
            tokens, targets = batch(step)
            opt.zero_grad()
            inputs = (tokens,) if rank == 0 else ()  # stage 0 is rank 0's; the last stage (3) is rank 0's under the V
            runner.step(*inputs, target=targets if 3 in ids else None)
            opt.step()
        counters = guard.counters.snapshot()
    return {"weights": weights(parts), "counters": counters}


def weights(parts: list[nn.Module]) -> dict[str, list[float]]:
    named = [item for part in parts for item in part.named_parameters()]
    return {name: getattr(p, "full_tensor", p.detach)().detach().reshape(-1).tolist() for name, p in named}


def tensor_parallel(rank: int, world: int) -> dict[str, Any]:
    """Each per-micro-batch action on the tensor-parallel decoder: the error at attach, or the weights it trained."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    return each_action(lambda model: apply_torchtitan_tp(model, mesh))


def each_action(shard: Callable[[nn.Module], Any]) -> dict[str, Any]:
    """Each of ``ACTIONS`` per micro-batch on a decoder ``shard`` lays out: the error at attach, or what it trained."""
    out: dict[str, Any] = {}
    for action in ACTIONS:
        model = make_decoder()
        shard(model)
        try:
            out[action] = {"error": None} | train(model, one_rule(action))
        except GuardStateError as error:
            out[action] = {"error": str(error)}
        dist.barrier()
    return out


def train(model: nn.Module, policy: Policy) -> dict[str, Any]:
    """``STEPS`` steps of 2 micro-batches under ``policy``, per micro-batch, as a pipeline's schedule runs them (a
    backward of each micro-batch's loss, then the gradients divided by their number): the same in one process (the
    reference) and on every tensor-parallel rank."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with GradGuard(model, policy, logger=None, per_micro_batch=True) as guard:
        for step in range(STEPS):
            opt.zero_grad()
            tokens, targets = batch(step)
            for half in range(MICRO_BATCHES):
                rows = slice(half * 2, half * 2 + 2)
                loss_of(model(tokens[rows]), targets[rows]).backward()
            with torch.no_grad():
                for param in model.parameters():
                    param.grad.div_(MICRO_BATCHES)
            opt.step()
        counters = guard.counters.snapshot()
    return {"weights": weights([model]), "counters": counters}


def fsdp2(rank: int, world: int) -> dict[str, Any]:
    """Each per-micro-batch action on the decoder under FSDP2: the error at attach (none trains: FSDP2's parameters
    get their gradients from its reduce-scatter, where no tensor hook runs)."""
    from torch.distributed.fsdp import fully_shard

    return each_action(fully_shard)


def scenario(name: str, rank: int, world: int, outdir: Path) -> dict[str, Any]:
    if name == "zero_bubble":
        return {schedule: pipeline(rank, schedule) for schedule in SCHEDULES}
    if name == "tensor_parallel":
        return tensor_parallel(rank, world)
    if name == "fsdp2":
        return fsdp2(rank, world)
    raise ValueError(name)


if __name__ == "__main__":
    main(scenario, sys.argv[1:])
