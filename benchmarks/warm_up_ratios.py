"""How far above its own warm-up scale a healthy run's gradient norm goes: what the default's ceiling must allow.

The shipped default holds each tensor's norm under ``max_norm_ratio`` (1000) times its warm-up scale, the mean of its
first 25 norms (``zclip``'s first mean), and never under ``ratio_floor`` (100). This trains ten small healthy runs
unguarded, records every tensor's raw gradient norm at every step (a tensor hook, float64), and prints for each run the
largest ratio of a norm after the warm-up to that tensor's warm-up scale (the tensor and the step), the run's largest
raw norm (the two regressions' are above the default's old fixed ceiling of 100), and the steps the default's ceiling
would clip: with its floor, and without (a tensor behind a gate or adapter initialised to 0, under a learning-rate
warm-up, has a warm-up scale thousands of times under its later norms). A tensor whose warm-up norms are all 0 has no
ceiling and is left out.

    python benchmarks/warm_up_ratios.py            # 200 to 3,000 steps a run, about a minute on a CPU
    python benchmarks/warm_up_ratios.py --quick    # 40 steps a run (the smoke test)
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from torch import nn

# The runs are test support code, shared with tests/test_default_policy_on_healthy_runs.py: import them from tests/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.healthy_runs import (
    Gated,
    LoRA,
    cnn,
    cnn_loop,
    gated_loop,
    gpt_loop,
    large_norms_loop,
    late_layer_loop,
    lora_loop,
    regression,
    teacher_loop,
    teacher_student,
    tiny_gpt,
    two_layers,
)

WARMUP = 25
"""The default's ``warmup_steps``: the norms whose mean is a tensor's warm-up scale."""
RATIO = 1000.0
"""The default's ``max_norm_ratio``."""
FLOOR = 100.0
"""The default's ``ratio_floor``."""


@dataclass
class Run:
    build: Callable[[], nn.Module]
    train: Callable[[nn.Module, int], None]
    steps: int


RUNS: dict[str, Run] = {
    "small GPT, the loop's clip": Run(tiny_gpt, gpt_loop, 200),
    "small GPT, lr warm-up 100 steps then decay": Run(tiny_gpt, partial(gpt_loop, warm_up=100), 400),
    "MLP learning a teacher, the loop's clip": Run(teacher_student, teacher_loop, 200),
    "regression, targets around 50": Run(regression, partial(large_norms_loop, sum_reduced=False), 200),
    "regression, a sum-reduced loss": Run(regression, partial(large_norms_loop, sum_reduced=True), 200),
    "CNN with BatchNorm, one-cycle SGD": Run(cnn, cnn_loop, 300),
    "LoRA adapter, B from 0": Run(LoRA, lora_loop, 400),
    "a layer unused for 30 steps": Run(two_layers, late_layer_loop, 200),
    "blocks behind gates from 0, lr warm-up 200": Run(Gated, gated_loop, 1500),
    "LoRA adapter, B from 0, lr 1e-4 warmed up over 1,000 steps": Run(
        LoRA, partial(lora_loop, lr=1e-4, warm_up=1000), 3000
    ),
}


@dataclass
class Measured:
    ratio: float
    """The largest norm after the warm-up over its tensor's warm-up scale."""
    tensor: str
    step: int
    largest: float
    """The largest raw norm of the run."""
    clipped: int
    """Steps at which a tensor's norm passes the default's ceiling (``RATIO`` times its scale, at least ``FLOOR``; in
    warm-up, its scale is the mean of its norms so far)."""
    clipped_without_floor: int
    """The same, were there no floor."""


def measure(run: Run, steps: int) -> Measured:
    model = run.build()
    norms: dict[str, list[float]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            seen = norms.setdefault(name, [])
            param.register_hook(lambda grad, seen=seen: seen.append(float(grad.double().norm())))
    run.train(model, steps)
    worst, where, when = 0.0, "", -1
    clipped: set[int] = set()
    unfloored: set[int] = set()
    for name, seq in norms.items():
        warm = [norm for norm in seq if math.isfinite(norm)][:WARMUP]
        scale = sum(warm) / len(warm) if warm else 0.0
        if scale <= 0 or len(seq) <= WARMUP:
            continue
        late = max(range(WARMUP, len(seq)), key=seq.__getitem__)
        if seq[late] / scale > worst:
            worst, where, when = seq[late] / scale, name, late
        # In warm-up the scale is the mean of the (finite) norms before the step; after it, of all the warm-up norms.
        scales = [_mean_so_far(seq, step) for step in range(WARMUP)] + [scale] * (len(seq) - WARMUP)
        over = [(step, norm, at) for step, (norm, at) in enumerate(zip(seq, scales, strict=True)) if at > 0]
        clipped.update(step for step, norm, at in over if norm > max(RATIO * at, FLOOR))
        unfloored.update(step for step, norm, at in over if norm > RATIO * at)
    largest = max((max(seq) for seq in norms.values() if seq), default=0.0)
    return Measured(worst, where, when, largest, len(clipped), len(unfloored))


def _mean_so_far(seq: list[float], step: int) -> float:
    finite = [norm for norm in seq[:step] if math.isfinite(norm)]
    return sum(finite) / len(finite) if finite else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="40 steps a run (the smoke test)")
    args = parser.parse_args()
    print(
        "| run | steps | largest norm / its warm-up scale (tensor, step) | largest raw norm "
        "| steps the default clips | without its floor |\n|---|---|---|---|---|---|"
    )
    overall, clipped = 0.0, 0
    for label, run in RUNS.items():
        steps = 40 if args.quick else run.steps
        got = measure(run, steps)
        overall, clipped = max(overall, got.ratio), clipped + got.clipped
        print(
            f"| {label} | {steps} | {got.ratio:.2f} ({got.tensor}, {got.step}) | {got.largest:.4g} "
            f"| {got.clipped} | {got.clipped_without_floor} |"
        )
    print(f"largest ratio of all: {overall:.2f}; the default's ceiling: {RATIO:g}x, at least {FLOOR:g}")
    print(f"steps of these healthy runs the default's ceiling clips: {clipped}")


if __name__ == "__main__":
    main()
