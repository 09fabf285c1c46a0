"""What provenance costs (``GradGuard(provenance=...)``), on step_overhead.py's GPT model, rows side by side.

    python benchmarks/provenance.py              # CPU, a few minutes; prints a Markdown table
    python benchmarks/provenance.py --quick      # tiny model, seconds (the figures mean nothing)

Every row is a whole training step (zero_grad, forward, backward, AdamW step) under gradguard with
``policies/default.yaml``-like rules (halt + a per-tensor clip nothing reaches), on copies of one model
that share their weights and optimizer state (step_overhead.py's method: shuffled rounds, paired ratios
of the median step per round against ``off``, ``[p25-p75]``):

- ``off`` / ``off-2``: ``provenance=None`` twice: the A/A control, the measurement's floor;
- ``after_fault``: the default, before any fault: nothing is registered, so it must read as A/A;
- ``after_fault+flags``: ``after_fault`` with the post-accumulate-grad flags on from the start (one
  2-norm kernel per guarded gradient in backward): what turning them on by default would cost;
- ``always``: module forward hooks and tensor hooks on every module's inputs and outputs, plus the flags.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import step_overhead as bench
import torch

import gradguard.enforce.provenance as provenance_module

ROWS = ("off", "off-2", "after_fault", "after_fault+flags", "always")


class WithFlags(bench.Guarded):
    """``after_fault`` with the gradient flags on from the start for this guard (a module switch, read at attach)."""

    def setup(self, work: bench.Workload, scratch: Path) -> None:
        with flags(True):
            super().setup(work, scratch)


@contextlib.contextmanager
def flags(on: bool) -> Iterator[None]:
    saved = provenance_module.GRADIENT_FLAGS_BY_DEFAULT
    provenance_module.GRADIENT_FLAGS_BY_DEFAULT = on  # type: ignore[misc]
    try:
        yield
    finally:
        provenance_module.GRADIENT_FLAGS_BY_DEFAULT = saved  # type: ignore[misc]


def treatments() -> list[bench.Treatment]:
    policy = lambda: bench.per_tensor_policy(bench.NEVER)  # noqa: E731
    return [
        bench.Guarded("off", "provenance=None", policy, guard_options={"provenance": None}),
        bench.Guarded("off-2", "provenance=None, again (A/A)", policy, guard_options={"provenance": None}),
        bench.Guarded("after_fault", "after_fault (the default), before any fault", policy),
        WithFlags("after_fault+flags", "after_fault with the gradient flags on from the start", policy),
        bench.Guarded("always", "always", policy, guard_options={"provenance": "always"}),
    ]


def run(quick: bool, rounds: int, seed: int) -> dict[str, Any]:
    device = torch.device("cpu")
    shape: dict[str, int] = (
        dict(vocab=64, width=32, depth=1, heads=2) if quick else dict(vocab=8192, width=384, depth=6, heads=6)
    )
    batch, length = (2, 8) if quick else (4, 64)
    rows = treatments()
    works = [bench.decoder_workload("gpt", device, **shape, batch=batch, length=length) for _ in rows]
    bench.share_memory(works)
    with tempfile.TemporaryDirectory(prefix="gradguard-prov-") as scratch, bench.set_up(works, rows, Path(scratch)):
        times = bench.interleaved(works, rows, rounds, 1 if quick else 3, seed, "provenance")
        probes = [bench.probe(work, row) for work, row in zip(works, rows, strict=True)]
    wall = {row.name: [t.wall for t in steps] for row, steps in zip(rows, times, strict=True)}
    return {
        "description": works[0].description,
        "rounds": rounds,
        "rows": [
            {
                "name": row.name,
                "label": row.label,
                "median_ms": statistics.median(wall[row.name]) * 1e3,
                "vs_off": bench.paired(wall[row.name], wall["off"]),
                "syncs": probe.syncs,
                "backward_syncs": probe.backward_syncs,
            }
            for row, probe in zip(rows, probes, strict=True)
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    result = run(args.quick, args.rounds or (2 if args.quick else 40), args.seed)
    print(f"## provenance cost, GPT model ({result['description']}), {result['rounds']} rounds, CPU\n")
    print("| row | what | median step ms | whole step vs `off` | host syncs/step (in backward) |")
    print("|---|---|---:|---:|---:|")
    for row in result["rows"]:
        print(
            f"| {row['name']} | {row['label']} | {row['median_ms']:.1f} | {row['vs_off']} | "
            f"{row['syncs']} ({row['backward_syncs']}) |"
        )
    note = "; --quick: the figures mean nothing" if args.quick else ""
    print(f"\n(ran in {time.perf_counter() - started:.0f} s{note})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
