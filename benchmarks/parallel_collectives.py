"""Collectives per training step under FSDP2, tensor parallel, FSDP2 over TP and a pipeline, with and without a guard.

Every collective a step makes (forward, backward, the optimizer's step and the guard's) is counted where torch
dispatches it: a ``TorchDispatchMode`` sees DTensor's functional collectives, FSDP2's and the guard's
``torch.distributed`` calls and the pipeline's sends and receives alike (``wait_tensor`` and wrappers are not
collectives and are left out). The third step of each layout is counted, after the first two settled every lazy
initialisation; each layout runs on real gloo ranks of the CPU. The figures are counts, not times: the same on any
machine.

    python benchmarks/parallel_collectives.py            # the table
    python benchmarks/parallel_collectives.py --json out.json
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support: the decoder and its layouts
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from gradguard import GradGuard, Policy

NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier")
LAYOUTS = {"fsdp2": 2, "tp": 2, "fsdp2_tp": 4, "pp": 2}
POLICIES = {
    "none": None,
    "default": {"shipped": "default"},
    "group clip": {
        "version": 1,
        "rules": [
            {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
            {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.2, "scope": "group"}]},
        ],
    },
}


class Collectives(TorchDispatchMode):
    """Counts the collectives dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket).rsplit(".", 1)[-1]
        if "c10d" in func.namespace and name not in NOT_COLLECTIVES:
            self.counts[name.rstrip("_")] += 1
        return func(*args, **(kwargs or {}))


def _layout(name: str, rank: int, world: int) -> tuple[torch.nn.Module, Any, Any]:
    """(the module this rank trains, the mesh the guard is given or None, a step function)."""
    from support.parallel_models import apply_torchtitan_tp, batch, loss_of, make_decoder, stage_modules
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    tokens, targets = batch(0)
    if name == "pp":
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
        module = stage_modules(make_decoder(), rank, 2)
        schedule = ScheduleGPipe(PipelineStage(module, rank, 2, torch.device("cpu")), 2, loss_fn=loss_of)

        def pipeline_step() -> None:
            schedule.step(tokens) if rank == 0 else schedule.step(target=targets)

        return module, mesh, pipeline_step
    module = make_decoder()
    mesh = None
    if name in ("tp", "fsdp2_tp"):
        shape, names = ((2, world // 2), ("dp_shard", "tp")) if name == "fsdp2_tp" else ((world,), ("tp",))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        apply_torchtitan_tp(module, mesh["tp"])
    if name in ("fsdp2", "fsdp2_tp"):
        dp = mesh["dp_shard"] if mesh is not None else init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        for block in module.layers.values():
            fully_shard(block, mesh=dp)
        fully_shard(module, mesh=dp)
        mesh = mesh if mesh is not None else dp

    def plain_step() -> None:
        loss_of(module(tokens), targets).backward()

    return module, mesh, plain_step


def count(name: str, policy: str, rank: int, world: int) -> dict[str, int]:
    """The collectives of the third step of layout ``name`` under ``policy``, by kind."""
    module, mesh, forward_backward = _layout(name, rank, world)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    spec = POLICIES[policy]
    guard = None
    if spec is not None:
        chosen = Policy.shipped(spec["shipped"]) if "shipped" in spec else Policy.from_dict(spec)
        guard = GradGuard(module, chosen, logger=None, device_mesh=mesh if name != "fsdp2" else None)
    counts: collections.Counter[str] = collections.Counter()
    for step in range(3):
        opt.zero_grad()
        counter = Collectives()
        with counter:
            forward_backward()
            opt.step()
        if step == 2:
            counts = counter.counts
    if guard is not None:
        guard.remove()
    return dict(counts)


def _rank(rank: int, world: int, name: str, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {policy: count(name, policy, rank, world) for policy in POLICIES}
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        gc.collect()  # the models' DDP and FSDP2 state before their process group, or gloo may abort at exit
        dist.barrier()
        dist.destroy_process_group()


def measure() -> dict[str, dict[str, dict[str, int]]]:
    from support.gloo_ranks import free_port

    table = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, world in LAYOUTS.items():
            out = str(Path(folder) / f"{name}.json")
            torch.multiprocessing.spawn(_rank, args=(world, name, free_port(), out), nprocs=world, join=True)
            table[name] = json.loads(Path(out).read_text())
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="also write the counts here")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    table = measure()
    print(f"{'layout':<10}{'policy':<12}{'collectives':>12}  by kind (rank 0, one step: forward, backward, update)")
    for name, rows in table.items():
        for policy, counts in rows.items():
            kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items()))
            print(f"{name:<10}{policy:<12}{sum(counts.values()):>12}  {kinds}")
    if args.json is not None:
        args.json.write_text(json.dumps(table, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
