"""What the ``rerun`` section costs: on a clean step (keeping the random number generators' states) and on a
suspect step (one more forward and backward), against the same guard without the section, side by side.

    python benchmarks/rerun_cost.py            # about half a minute on a CPU
    python benchmarks/rerun_cost.py --quick    # seconds

A small decoder-like MLP with dropout, ``AdamW``, ``optimizer.step(closure)``. Rounds interleave the treatments
in a shuffled order; a treatment's cost is the median over rounds of its median step time over the baseline's
of the same round (paired). ``suspect`` poisons every step's first computation (so every step is computed twice
and goes on): its ratio is what a suspect step costs, not what a run pays (a run re-runs a step per fault).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gradguard import GradGuard, Policy

HALT = {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}
TREATMENTS = ("guard", "guard + rerun", "suspect")


def model(width: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1)]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def segment(treatment: str, width: int, steps: int) -> float:
    net = model(width)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    data: dict[str, Any] = {"version": 1, "rules": [HALT]}
    if treatment != "guard":
        data["rerun"] = {}
    x, y = torch.randn(64, width), torch.randn(64, 1)
    times = []
    with GradGuard(net, Policy.from_dict(data), logger=None):
        for step in range(steps + 1):
            calls = [0]

            def closure(calls: list[int] = calls) -> torch.Tensor:
                calls[0] += 1
                opt.zero_grad()
                loss = nn.functional.mse_loss(net(x), y)
                if treatment == "suspect" and calls[0] == 1:
                    loss = loss * float("nan")
                loss.backward()
                return loss

            started = time.perf_counter()
            opt.step(closure)
            if step:  # the first step makes AdamW's state
                times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    width, rounds, steps = (64, 3, 10) if args.quick else (256, 9, 30)
    ratios: dict[str, list[float]] = {name: [] for name in TREATMENTS[1:]}
    base: list[float] = []
    for _ in range(rounds):
        order = list(TREATMENTS)
        random.shuffle(order)
        times = {name: segment(name, width, steps) for name in order}
        base.append(times["guard"])
        for name in TREATMENTS[1:]:
            ratios[name].append(times[name] / times["guard"])
    print(f"**rerun cost** (Linear({width}) x 5 with dropout, AdamW, closure steps; {rounds} rounds x {steps} steps)")
    print()
    print("| treatment | step (ms) | over the guard without rerun |")
    print("|---|---|---|")
    print(f"| guard | {statistics.median(base) * 1e3:.3f} | 1 |")
    for name in TREATMENTS[1:]:
        print(f"| {name} | | {statistics.median(ratios[name]):.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
