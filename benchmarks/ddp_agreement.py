"""The per-step cost of gradguard under DDP (gloo, CPU), against the same run without the guard.

    python benchmarks/ddp_agreement.py [--ranks 2] [--rounds 12] [--steps 10] [--shape mlp|gpt]

Each rank trains one DDP model per treatment (the same weights; each guard attached for the whole run: DDP's
communication hook, once registered, stays). Rounds alternate (in a shuffled order that every rank shares):
no guard; the guard with only ``halt_on_nonfinite`` on every parameter (its cost is the agreement all-reduce
plus the norms); the same without the agreement all-reduce (a measurement only: the guard keeps it, see
docs/distributed.md; this is what dropping it would save); ``policies/default.yaml`` (halt, per-tensor clip,
monitor; each rank's own gradient tapped at DDP's communication hook, its flag riding the all-reduce); and the
same guard untapped, as before the origin rank was named (a measurement only: what naming it costs). ``--shape
gpt`` trains nanoGPT's smallest GPT (``benchmarks/host_time.py``) in nanoGPT's loop, with its own clip. Rank 0
prints the median step time of each, the paired ratio against no guard, and what the all-reduce alone costs.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import socket
import statistics
import sys
import time
from collections.abc import Callable
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


def mlp_step(model: nn.Module, opt: torch.optim.Optimizer, width: int) -> None:
    x = torch.randn(64, width)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), x.mean(1, keepdim=True)).backward()
    opt.step()


def gpt_step(model: nn.Module, opt: torch.optim.Optimizer, width: int) -> None:
    """nanoGPT's loop: forward, backward, the loop's own clip, step."""
    tokens = torch.randint(0, 65, (8, 65))
    _, loss = model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def timed_steps(step: Callable[[], None], steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def untapped(model: nn.Module, policy: Policy) -> GradGuard:
    """The guard as it was before each rank's own gradient was tapped (round 6): a measurement only."""
    from gradguard.enforce.step import ranks

    tap, ranks.tap_local_gradients = ranks.tap_local_gradients, lambda model, local: None  # type: ignore[assignment]
    try:
        return GradGuard(model, policy, logger=None, summary_every=0)
    finally:
        ranks.tap_local_gradients = tap


def worker(rank: int, world: int, port: int, rounds: int, steps: int, width: int, depth: int, shape: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    default = Policy.from_file(ROOT / "policies" / "default.yaml")
    treatments: dict[str, Callable[[nn.Module], GradGuard | None]] = {
        "none": lambda model: None,
        "halt only": lambda model: GradGuard(model, Policy.from_dict(HALT_ONLY), logger=None, summary_every=0),
        "halt, no a-r": lambda model: GradGuard(model, Policy.from_dict(HALT_ONLY), logger=None, summary_every=0),
        "default.yaml": lambda model: GradGuard(model, default, logger=None, summary_every=0),
        "default, untapped": lambda model: untapped(model, default),
    }
    # One model each, its guard attached for the whole run: DDP's communication hook, once registered, stays.
    steps_of: dict[str, Callable[[], None]] = {}
    for name, attach in treatments.items():
        if shape == "gpt":
            sys.path.insert(0, str(ROOT / "benchmarks"))
            from host_time import GPT

            torch.manual_seed(1337)
            model = nn.parallel.DistributedDataParallel(GPT(vocab=65, context=64, layers=2, heads=2, width=64))
            opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
            step = gpt_step
        else:
            model = nn.parallel.DistributedDataParallel(make_model(width, depth))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            step = mlp_step
        guard = attach(model)
        if guard is not None and name == "halt, no a-r":
            # Measurement only (every rank does it): the step makes no collective.
            setattr(guard._enforcer.collective, "active", lambda: False)  # noqa: B010
        steps_of[name] = lambda step=step, model=model, opt=opt, guard=guard: step(model, opt, width)
        timed_steps(steps_of[name], steps)  # warm-up
    medians: dict[str, list[float]] = {name: [] for name in treatments}
    order = list(treatments)
    shuffler = random.Random(0)  # the same order on every rank
    for _ in range(rounds):
        shuffler.shuffle(order)
        for name in order:
            medians[name].append(statistics.median(timed_steps(steps_of[name], steps)))
    tensors = sum(1 for _ in model.parameters())
    flags = torch.zeros(2 * tensors)
    for _ in range(20):
        dist.all_reduce(flags)
    start = time.perf_counter()
    for _ in range(200):
        dist.all_reduce(flags)
    collective_ms = (time.perf_counter() - start) / 200 * 1e3
    # The replica check (ranks.check_replicas_every): what one check adds to its step, the fingerprints and the MAX
    # all-reduce of two int64 per parameter, as the guard's participant takes them.
    from gradguard.enforce.step.ranks import fingerprints

    params = list(model.parameters())
    start = time.perf_counter()
    for _ in range(50):
        mine = fingerprints(params)
        both = torch.cat([mine, ~mine])
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        bool(torch.eq(both[: len(params)], ~both[len(params) :]).all())
    check_ms = (time.perf_counter() - start) / 50 * 1e3
    if rank == 0:
        print(
            f"DDP, gloo, {world} ranks, {shape}, {tensors} parameter tensors"
            + (f", width {width}, depth {depth}" if shape == "mlp" else "")
        )
        print(f"{'treatment':<18}{'median step ms':>16}{'ratio vs none':>16}")
        for name, values in medians.items():
            ratios = [value / base for value, base in zip(values, medians["none"], strict=True)]
            print(f"{name:<18}{statistics.median(values) * 1e3:>16.3f}{statistics.median(ratios):>16.4f}")
        print(f"the agreement all_reduce alone ({flags.numel()} floats): {collective_ms:.3f} ms per call")
        step_ms = statistics.median(medians["default.yaml"]) * 1e3
        print(
            f"a replica check: {check_ms:.3f} ms ({check_ms / step_ms:.1%} of a default-guarded step); at "
            f"check_replicas_every: 100, {check_ms / step_ms / 100:.3%} of a step"
        )
    steps_of.clear()
    del model, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--shape", choices=["mlp", "gpt"], default="mlp", help="gpt: nanoGPT's smallest, its loop")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.multiprocessing.spawn(
        worker, args=(args.ranks, port, args.rounds, args.steps, args.width, args.depth, args.shape), nprocs=args.ranks
    )


if __name__ == "__main__":
    main()
