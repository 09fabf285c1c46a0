"""Diagnostics on a GPU, not figures of record (those are gpu_check.py's): where a small model's step time goes,
and whether the step's small device-to-host read queues behind a large host copy on a side stream.

    python benchmarks/gpu_probe.py out.json     # about 45 s on an H200

- ``copy_engine``: a 300-float read (pageable, pinned, or after a kernel) timed while a 4 GiB copy to pinned host
  memory runs on a side stream, and while a 256 MiB one does (docs/performance.md has the H200's figures).
- ``decompose_<size>``: gpu_check's GPT at 7M and 163M, arms taken apart (none, global clip, the per-tensor guard
  with and without provenance, halt alone with and without it, the shipped default): step time, host time (until
  ``opt.step()`` returns, before the sync) and the ratio to the global clip; then kernels per step and the top
  host costs under torch.profiler. A step whose host time is its whole time is launch-bound.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import SIZES, TINY, build_bench
from step_overhead import per_tensor_policy

from gradguard import GradGuard, Policy

OUT: dict[str, object] = {}


def copy_engine(dev: torch.device) -> None:
    big = torch.empty(4 * 2**30, dtype=torch.uint8, device=dev)
    host = torch.empty(big.numel(), dtype=torch.uint8, pin_memory=True)
    small = torch.randn(300, device=dev)
    pinned = torch.empty(300, pin_memory=True)
    side = torch.cuda.Stream(dev)
    res: dict[str, float] = {}

    def timed_big() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.cuda.stream(side):
            host.copy_(big, non_blocking=True)
        side.synchronize()
        return time.perf_counter() - t

    res["big_d2h_ms"] = timed_big() * 1e3
    res["big_d2h_ms"] = timed_big() * 1e3
    for name in ("pageable", "pinned", "d2d_then_pageable"):
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            host.copy_(big, non_blocking=True)
        t = time.perf_counter()
        if name == "pageable":
            small.to("cpu").tolist()
        elif name == "pinned":
            pinned.copy_(small, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            ev.synchronize()
        else:
            s2 = small * 2
            s2.to("cpu").tolist()
        res[f"small_read_{name}_during_big_ms"] = (time.perf_counter() - t) * 1e3
        side.synchronize()
    # chunked: 16 chunks of 256 MiB; a read between chunk 1 and 2
    torch.cuda.synchronize()
    chunk = 2**28
    with torch.cuda.stream(side):
        host[:chunk].copy_(big[:chunk], non_blocking=True)
    t = time.perf_counter()
    small.to("cpu").tolist()
    res["small_read_during_256MiB_chunk_ms"] = (time.perf_counter() - t) * 1e3
    side.synchronize()
    # H2D pinned (the restore direction) while a D2H is in flight
    OUT["copy_engine"] = res
    print("copy_engine", json.dumps(res), flush=True)


def decompose(size_name: str, rounds: int, steps: int, dev: torch.device | None = None) -> None:
    dev = dev or torch.device("cuda")
    bench = build_bench(SIZES.get(size_name, TINY), dev)
    halt = Policy.from_dict(
        {"version": 1, "rules": [{"name": "nf", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}]}
    )
    arms = {
        "none": (None, False, None),
        "global": (None, True, None),
        "guard": (lambda: per_tensor_policy(1.0), False, "first_fault"),
        "guard_noprov": (lambda: per_tensor_policy(1.0), False, None),
        "halt_only": (lambda: halt, False, None),
        "halt_prov": (lambda: halt, False, "first_fault"),
        "default": (lambda: Policy.shipped("default"), False, "first_fault"),
    }
    for _ in range(3):
        bench.step(False)
    host_ms: dict[str, list[float]] = {k: [] for k in arms}
    total_ms: dict[str, list[float]] = {k: [] for k in arms}
    import random

    order = list(arms)
    rnd = random.Random(0)
    for _ in range(rounds):
        rnd.shuffle(order)
        for k in order:
            pol, clip, prov = arms[k]
            g = GradGuard(bench.model, pol(), logger=None, provenance=prov) if pol else None
            bench.step(clip)
            hs, ts = [], []
            for _ in range(steps):
                bench.sync()
                t0 = time.perf_counter()
                bench.opt.zero_grad(set_to_none=True)
                bench.loss().backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(bench.params, 1.0, foreach=True)
                bench.opt.step()
                t1 = time.perf_counter()
                bench.sync()
                t2 = time.perf_counter()
                hs.append(t1 - t0)
                ts.append(t2 - t0)
            if g is not None:
                g.remove()
            host_ms[k].append(statistics.median(hs) * 1e3)
            total_ms[k].append(statistics.median(ts) * 1e3)
    res = {}
    for k in arms:
        ratios = [a / b for a, b in zip(total_ms[k], total_ms["global"], strict=True)]
        res[k] = {
            "total_ms": round(statistics.median(total_ms[k]), 3),
            "host_ms": round(statistics.median(host_ms[k]), 3),
            "vs_global": round(statistics.median(ratios), 4),
        }
    # kernels per step under the profiler
    from torch.profiler import ProfilerActivity, profile

    for k in ("global", "guard", "default"):
        pol, clip, prov = arms[k]
        g = GradGuard(bench.model, pol(), logger=None, provenance=prov) if pol else None
        bench.step(clip)
        bench.sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                bench.step(clip)
        if g is not None:
            g.remove()
        events = prof.key_averages()
        kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        res[k]["kernels_per_step"] = kernels / 3
        top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
        res[k]["top_cpu"] = [(e.key, round(e.self_cpu_time_total / 3 / 1e3, 3), e.count // 3) for e in top]
    OUT[f"decompose_{size_name}"] = res
    print(size_name, json.dumps(res, indent=1), flush=True)
    del bench
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    dev = torch.device("cuda")
    OUT["device"] = torch.cuda.get_device_name(dev)
    OUT["torch"] = torch.__version__
    copy_engine(dev)
    decompose("7M", 8, 10)
    decompose("163M", 4, 6)
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("gpu_probe.json")
    out.write_text(json.dumps(OUT, indent=1))


if __name__ == "__main__":
    main()
