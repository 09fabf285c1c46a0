"""The per-step cost of gradguard under DDP (gloo, CPU), against the same run without the guard.

    python benchmarks/ddp_agreement.py [--ranks 2] [--rounds 12] [--steps 10]

Each rank trains the same DDP model. Rounds alternate (in a shuffled order that every rank shares):
no guard; the guard with only ``halt_on_nonfinite`` on every parameter (its cost is the
agreement all-reduce plus the norms); the same without the agreement all-reduce (``--`` a measurement
only: the guard keeps it, see docs/distributed.md; this is what dropping it would save);
and ``policies/default.yaml`` (halt + per-tensor clip). Rank 0 prints the median step time of each,
the paired ratio against no guard, and what the agreement all-reduce alone costs.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from gradguard import GradGuard, Policy

ROOT = Path(__file__).resolve().parent.parent
HALT_ONLY = {"version": 1, "rules": [{"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}]}


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def timed_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int, width: int) -> list[float]:
    times = []
    for _ in range(steps):
        x = torch.randn(64, width)
        start = time.perf_counter()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x.mean(1, keepdim=True)).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def worker(rank: int, world: int, port: int, rounds: int, steps: int, width: int, depth: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = nn.parallel.DistributedDataParallel(make_model(width, depth))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    policies = {
        "none": None,
        "halt only": Policy.from_dict(HALT_ONLY),
        "halt, no a-r": Policy.from_dict(HALT_ONLY),
        "default.yaml": Policy.from_file(ROOT / "policies" / "default.yaml"),
    }
    medians: dict[str, list[float]] = {name: [] for name in policies}
    timed_steps(model, opt, steps, width)  # warm-up
    order = list(policies)
    shuffler = random.Random(0)  # the same order on every rank
    for _ in range(rounds):
        shuffler.shuffle(order)
        for name in order:
            policy = policies[name]
            guard = GradGuard(model, policy, logger=None, summary_every=0) if policy is not None else None
            if guard is not None and name == "halt, no a-r":
                # Measurement only (every rank does it in the same round): the step makes no collective.
                setattr(guard._enforcer.collective, "active", lambda: False)  # noqa: B010
            medians[name].append(statistics.median(timed_steps(model, opt, steps, width)))
            if guard is not None:
                guard.remove()
    flags = torch.zeros(2 * sum(1 for _ in model.parameters()))
    for _ in range(20):
        dist.all_reduce(flags)
    start = time.perf_counter()
    for _ in range(200):
        dist.all_reduce(flags)
    collective_ms = (time.perf_counter() - start) / 200 * 1e3
    if rank == 0:
        tensors = sum(1 for _ in model.parameters())
        print(f"DDP, gloo, {world} ranks, {tensors} parameter tensors, width {width}, depth {depth}")
        print(f"{'treatment':<14}{'median step ms':>16}{'ratio vs none':>16}")
        for name, values in medians.items():
            ratios = [value / base for value, base in zip(values, medians["none"], strict=True)]
            print(f"{name:<14}{statistics.median(values) * 1e3:>16.3f}{statistics.median(ratios):>16.4f}")
        print(f"the agreement all_reduce alone ({flags.numel()} floats): {collective_ms:.3f} ms per call")
    del model, opt
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.multiprocessing.spawn(
        worker, args=(args.ranks, port, args.rounds, args.steps, args.width, args.depth), nprocs=args.ranks
    )


if __name__ == "__main__":
    main()
