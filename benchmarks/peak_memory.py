"""What a guarded step holds at its peak, against the same step unguarded: the guard's footprint.

    python benchmarks/peak_memory.py                 # CPU: a 4-layer GPT, every treatment (about a minute)
    python benchmarks/peak_memory.py --device cuda   # the same on a GPU (the allocator's statistics)
    python benchmarks/peak_memory.py --check         # exit 1 if a treatment is over its bound

Each row trains one model (a GPT-style decoder, 53 tensors) from the same seed with one optimizer and one
loop, with and without a guard, and compares the peak of tensor bytes allocated during one step (zero_grad,
forward, backward, the loop's own clip where the row has one, ``opt.step()``) above the level at its start:

- CPU: the profiler's allocation events (``profile_memory=True``), summed in time order: exact and
  deterministic, not RSS. The profiler knows the size of a tensor only if it was allocated while profiling,
  so the step before the measured one runs under the profiler too.
- CUDA: ``torch.cuda.max_memory_allocated`` around the step, after ``reset_peak_memory_stats``.

Treatments: the shipped ``default`` policy; a per-tensor ``clip_norm`` + ``halt_on_nonfinite``; that policy
with a ``loss`` section (a spike watch); and with a ``recovery`` section that snapshots at every step (the
measured step takes a snapshot into buffers that earlier snapshots made: the steady state). Each with unfused
and fused AdamW, without and with the loop's own ``clip_grad_norm_``. The bound (issue 41): a guarded step's
peak is at most ``max(256 KiB, 2% of the gradients' bytes)`` above the unguarded step's. A snapshot's own
buffers (what ``recovery.keep`` asks for) are allocated once, outside the steady state, and are reported apart.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_overhead import MAX_NORM, Workload, decoder_workload, per_tensor_policy

from gradguard import GradGuard, Policy

KIB = 2**10
FLOOR_BYTES = 256 * KIB
"""The bound's floor: a small model's figures (a few per tensor) and the allocator's rounding."""
GRADIENT_SHARE = 0.02
"""The bound's share of the gradients' bytes."""
STEADY_STEPS = 4
"""Steps run before the measured ones: every buffer a guard keeps across steps (snapshots, statistics) exists."""


def with_loss_section(policy: Policy) -> Policy:
    data = policy.model_dump(mode="python", exclude_none=True)
    data["loss"] = {"nonfinite": "halt", "spike": {"factor": 10, "window": 20, "warmup": 1}}
    return Policy.from_dict(data, source=f"{policy.source} + loss")


def with_recovery_section(policy: Policy) -> Policy:
    data = policy.model_dump(mode="python", exclude_none=True)
    data["recovery"] = {"snapshot_every": 1, "keep": 2, "min_age": 1, "memory": "device"}
    return Policy.from_dict(data, source=f"{policy.source} + recovery")


POLICIES: dict[str, Callable[[], Policy]] = {
    "shipped default": lambda: Policy.shipped("default"),
    "clip + halt": lambda: per_tensor_policy(MAX_NORM),
    "clip + halt + loss": lambda: with_loss_section(per_tensor_policy(MAX_NORM)),
    "clip + halt + recovery": lambda: with_recovery_section(per_tensor_policy(MAX_NORM)),
}


@dataclass
class Row:
    policy: str
    fused: bool
    loop_clip: bool
    unguarded: int
    guarded: int
    gradients: int
    update_unguarded: int
    """The update's peak (CPU only; -1 on CUDA): where the guard's own tensors show, below the step's peak."""
    update_guarded: int

    @property
    def over(self) -> int:
        return self.guarded - self.unguarded

    @property
    def bound(self) -> int:
        return max(FLOOR_BYTES, int(GRADIENT_SHARE * self.gradients))

    @property
    def ok(self) -> bool:
        return self.over <= self.bound


def small_gpt(device: torch.device) -> Workload:
    """4 layers, width 128, vocabulary 512, 64 tokens, batch 8: 53 tensors, 3.6 MiB of gradients in float32."""
    return decoder_workload("gpt-4", device, vocab=512, width=128, depth=4, heads=4, batch=8, length=64)


def step(work: Workload, loop_clip: bool) -> None:
    work.opt.zero_grad(set_to_none=True)
    loss = work.loss()
    loss.backward()  # type: ignore[no-untyped-call]
    with _named("peak_memory::update"):
        if loop_clip:
            torch.nn.utils.clip_grad_norm_(work.params, MAX_NORM)
        work.opt.step()
    del loss


def _named(name: str) -> Any:
    from torch.profiler import record_function

    return record_function(name)


def step_peak(work: Workload, loop_clip: bool) -> tuple[int, int]:
    """The peak of tensor bytes allocated during one step, above the level at its start; and during its update
    (the loop's clip and ``opt.step()``, where the guard runs), above the level at the update's start."""
    if work.device.type == "cuda":
        torch.cuda.synchronize(work.device)
        start = torch.cuda.memory_allocated(work.device)
        torch.cuda.reset_peak_memory_stats(work.device)
        step(work, loop_clip)
        torch.cuda.synchronize(work.device)
        return torch.cuda.max_memory_allocated(work.device) - start, -1
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(work, loop_clip)  # makes every tensor the measured step frees known to the profiler
        with _named("peak_memory::step"):
            step(work, loop_clip)
    events = prof.profiler.kineto_results.events()
    host = torch._C._autograd.DeviceType.CPU
    window = next(e for e in events if e.name() == "peak_memory::step" and e.device_type() == host)
    update = [e for e in events if e.name() == "peak_memory::update" and e.device_type() == host][-1]
    return (
        _peak_above_start(events, window.start_ns(), window.end_ns()),
        _peak_above_start(events, update.start_ns(), update.end_ns()),
    )


def _peak_above_start(events: Sequence[Any], start_ns: int, end_ns: int) -> int:
    allocations = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    level, start_level, peak = 0, None, 0
    for time_ns, nbytes in allocations:
        if time_ns > end_ns:
            break
        if time_ns >= start_ns and start_level is None:
            start_level = peak = level
        level += nbytes
        if start_level is not None:
            peak = max(peak, level)
    return peak - (start_level if start_level is not None else level)


def measure(device: torch.device, policy: str, *, fused: bool, loop_clip: bool, base: Workload | None = None) -> Row:
    """One row: the same model, data and optimizer, unguarded and guarded."""
    peaks = []
    for guarded in (False, True):
        work = small_gpt(device)
        if base is not None:
            work.model.load_state_dict(base.model.state_dict())
        work.opt = torch.optim.AdamW(work.model.parameters(), lr=1e-5, fused=fused)
        guard = GradGuard(work.model, POLICIES[policy](), logger=None) if guarded else None
        # Without the garbage collector: what a reference cycle keeps alive shows, whenever the collector would run.
        gc.collect()
        gc.disable()
        try:
            for _ in range(STEADY_STEPS):
                step(work, loop_clip)
            peaks.append(step_peak(work, loop_clip))
        finally:
            if guard is not None:
                guard.remove()
            gc.enable()
    gradients = sum(p.numel() * p.element_size() for p in work.params)
    (unguarded, update_unguarded), (guarded, update_guarded) = peaks
    return Row(policy, fused, loop_clip, unguarded, guarded, gradients, update_unguarded, update_guarded)


def rows(device: torch.device, policies: Sequence[str] = tuple(POLICIES)) -> Iterator[Row]:
    base = small_gpt(device)
    for policy in policies:
        for fused in (False, True):
            for loop_clip in (False, True):
                yield measure(device, policy, fused=fused, loop_clip=loop_clip, base=base)


def table(results: Sequence[Row]) -> str:
    lines = [
        "| policy | AdamW | loop's clip | unguarded peak | guarded peak | over | bound | | update's peak: unguarded, "
        "guarded |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results:
        lines.append(
            f"| {row.policy} | {'fused' if row.fused else 'foreach'} | {'yes' if row.loop_clip else 'no'} | "
            f"{row.unguarded / KIB:,.1f} KiB | {row.guarded / KIB:,.1f} KiB | {row.over / KIB:+,.1f} KiB | "
            f"{row.bound / KIB:,.0f} KiB | {'ok' if row.ok else 'OVER'} | "
            + (
                f"{row.update_unguarded / KIB:,.1f}, {row.update_guarded / KIB:,.1f} KiB |"
                if row.update_unguarded >= 0
                else "n/a (CPU only) |"
            )
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--check", action="store_true", help="exit 1 if a treatment is over its bound")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = list(rows(device))
    finally:
        torch.set_num_threads(threads)
    print(f"peak memory of one step, {small_gpt(device).description}, on {device}")
    print(table(results))
    return 1 if args.check and not all(row.ok for row in results) else 0


if __name__ == "__main__":
    sys.exit(main())
