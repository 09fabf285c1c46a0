"""What provenance costs (``GradGuard(provenance=...)``), on step_overhead.py's GPT or deep model, rows side by side.

    python benchmarks/provenance.py                          # GPT model, CPU, a few minutes; a Markdown table
    python benchmarks/provenance.py --model deep --rounds 300
    python benchmarks/provenance.py --only first_fault,always  # these rows (and off, off-2)
    python benchmarks/provenance.py --quick                  # tiny model, seconds (the figures mean nothing)
    python benchmarks/provenance.py --head --rounds 30       # a 50,304-token head: the trace's bytes and CPU time
    python benchmarks/provenance.py --fault                  # a fault's way to the halt: replay against the trace

Every row is a whole training step (zero_grad, forward, backward, AdamW step) under gradguard with
``policies/default.yaml``-like rules (halt + a per-tensor clip nothing reaches), on copies of one model
that share their weights and optimizer state (step_overhead.py's method: shuffled rounds, paired ratios
of the median step per round against ``off``, ``[p25-p75]``), by wall time and by the process's CPU
time (steadier on a machine shared with other jobs: time spent waiting for a core is not counted):

- ``off`` / ``off-2``: ``provenance=None`` twice: the A/A control, the measurement's floor;
- ``after_fault``: before any fault nothing is registered, so it must read as A/A;
- ``first_fault`` (the default): two hooks on the model that hold each forward (issue 56); a faulting step's
  forwards are replayed with the light trace;
- ``ff-light``: the light trace at every forward (the default before issue 56, and still on a model it cannot
  replay): a forward hook on the model's outermost levels of at most 32 modules that sums each output, and the
  model's pre-hook for the batch;
- ``ff-*``: the designs measured against it: with tensor hooks on the traced outputs (``-bwd``), on every
  module (``all``), 2-norms for sums (``-norm``), a depth limit, a larger budget;
- ``always``: module forward hooks and tensor hooks on every module's inputs and outputs, plus the
  gradient flags (a post-accumulate-grad hook per parameter).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import step_overhead as bench
import torch

import gradguard.enforce.provenance.provenance as provenance_module
from gradguard import GradientHalt
from gradguard.enforce.provenance.provenance import _peak

DEFAULT_ROWS = ("off", "off-2", "after_fault", "first_fault", "ff-light", "ff-bwd", "ff-all", "ff-all-bwd", "always")


class Traced(bench.Guarded):
    """A guard with ``provenance=None``, then a :class:`Provenance` in ``mode`` with these ``tracing`` knobs."""

    def __init__(self, name: str, label: str, policy: Any, mode: str, tracing: provenance_module.Tracing) -> None:
        super().__init__(name, label, policy, guard_options={"provenance": None})
        self.mode, self.tracing = mode, tracing

    def setup(self, work: bench.Workload, scratch: Path) -> None:
        super().setup(work, scratch)
        guard = self.guard
        assert guard is not None
        enforcer = guard._enforcer
        traced = provenance_module.Provenance(work.model, guard._plans.binding, self.mode, tracing=self.tracing)
        enforcer.provenance = traced
        guard._attachment.handles.append(traced)


def treatments() -> list[bench.Treatment]:
    policy = lambda: bench.per_tensor_policy(bench.NEVER)  # noqa: E731
    light = provenance_module.LIGHT
    return [
        bench.Guarded("off", "provenance=None", policy, guard_options={"provenance": None}),
        bench.Guarded("off-2", "provenance=None, again (A/A)", policy, guard_options={"provenance": None}),
        bench.Guarded(
            "after_fault", "after_fault, before any fault", policy, guard_options={"provenance": "after_fault"}
        ),
        bench.Guarded(
            "first_fault",
            f"first_fault (the default): output sums of the outermost levels of at most {light.budget} modules",
            policy,
            guard_options={"provenance": "first_fault"},
        ),
        *(
            Traced(name, label, policy, "first_fault", dataclasses.replace(light, replay=False, **knobs))
            for name, label, knobs in (
                ("ff-light", "the light trace at every forward (the default before issue 56)", {}),
                (
                    "ff-bwd",
                    "first_fault + tensor hooks on the traced outputs (their gradients' sums)",
                    {"backward": True},
                ),
                ("ff-all", "first_fault on every module (no budget)", {"budget": None}),
                ("ff-all-bwd", "ff-all + tensor hooks", {"budget": None, "backward": True}),
                (
                    "ff-all-bwd-norm",
                    "ff-all-bwd, 2-norms for sums",
                    {"budget": None, "backward": True, "reduce": _peak},
                ),
                (
                    "ff-depth2-bwd",
                    "ff-all-bwd on modules at most 2 dots deep",
                    {"budget": None, "backward": True, "depth": 2},
                ),
                ("ff-b128", "first_fault with a budget of 128 modules", {"budget": 128}),
            )
        ),
        bench.Guarded("always", "always", policy, guard_options={"provenance": "always"}),
    ]


SHAPES: dict[str, tuple[dict[str, int], int, int]] = {
    # step_overhead.py's configurations on CPU: (decoder shape, batch, length)
    "gpt": (dict(vocab=8192, width=384, depth=6, heads=6), 4, 64),
    "deep": (dict(vocab=2048, width=128, depth=24, heads=4), 4, 32),
    "quick": (dict(vocab=64, width=32, depth=1, heads=2), 2, 8),
    "head": (dict(vocab=50304, width=64, depth=2, heads=2), 4, 128),
}


def head_cost(rounds: int, seed: int, quick: bool = False) -> dict[str, Any]:
    """A GPT whose 50,304-token head makes its logits the largest activation by far (``--head``): per step, the
    bytes the light trace reads (the step's bytes with it minus without it, counted by dispatch_count.py's
    ``TorchDispatchMode``) as a multiple of the logits' bytes, and the thread's CPU time of a whole step against
    no trace (paired, shuffled rounds, one guard, the trace switched on and off as in ``toggled``). Arms:
    ``sum`` sums every traced output, the logits too (the trace before the head was watched through its
    weight); ``linear`` (the default) takes a plain Linear's figure from its weight, bias and (unless already
    traced) input."""
    from dispatch_count import count

    shape, batch, length = SHAPES["quick" if quick else "head"]
    work = bench.decoder_workload("head", torch.device("cpu"), **shape, batch=batch, length=length)
    guard = bench.GradGuard(work.model, bench.per_tensor_policy(bench.NEVER), logger=None, provenance=None)
    light = provenance_module.LIGHT
    traces = {
        name: provenance_module.Provenance(work.model, guard._plans.binding, "first_fault", tracing=tracing)
        for name, tracing in (
            ("sum", dataclasses.replace(light, linear=False, replay=False)),
            ("linear", dataclasses.replace(light, replay=False)),
        )
    }
    for traced in traces.values():
        traced._disarm_light()
        guard._attachment.handles.append(traced)

    def step(arm: str) -> tuple[float, float]:
        traced = traces.get(arm)
        if traced is not None:
            guard._enforcer.provenance = traced
            traced._arm_light()
        work.opt.zero_grad(set_to_none=True)
        wall, cpu = time.perf_counter(), time.thread_time()
        work.loss().backward()  # type: ignore[no-untyped-call]
        work.opt.step()
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        if traced is not None:
            traced._disarm_light()
            guard._enforcer.provenance = None
        return cpu, wall

    logits = batch * length * shape["vocab"] * 4
    arms = ["off", *traces]
    out: dict[str, Any] = {"description": work.description, "rounds": rounds, "logits_bytes": logits}
    try:
        for arm in arms:
            step(arm)
        read = {arm: count(lambda arm=arm: step(arm)).read for arm in arms}
        out["read_per_logits"] = {arm: (read[arm] - read["off"]) / logits for arm in traces}
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        shuffle = random.Random(seed)
        for _ in range(rounds):
            shuffle.shuffle(arms)
            for arm in arms:
                times[arm].append(step(arm)[0])
        out["cpu_vs_off"] = {arm: bench.paired(times[arm], times["off"]) for arm in traces}
        out["step_ms"] = statistics.median(times["off"]) * 1e3
    finally:
        guard.remove()
    return out


def run(model: str, rounds: int, seed: int, only: set[str] | None = None) -> dict[str, Any]:
    device = torch.device("cpu")
    shape, batch, length = SHAPES[model]
    only = only if only is not None else set(DEFAULT_ROWS)
    rows = [row for row in treatments() if row.name in only or row.name in ("off", "off-2")]
    works = [bench.decoder_workload(model, device, **shape, batch=batch, length=length) for _ in rows]
    bench.share_memory(works)
    with tempfile.TemporaryDirectory(prefix="gradguard-prov-") as scratch, bench.set_up(works, rows, Path(scratch)):
        times = bench.interleaved(works, rows, rounds, 1 if model == "quick" else 3, seed, "provenance")
        probes = [bench.probe(work, row) for work, row in zip(works, rows, strict=True)]
    wall = {row.name: [t.wall for t in steps] for row, steps in zip(rows, times, strict=True)}
    cpu = {row.name: [t.cpu for t in steps] for row, steps in zip(rows, times, strict=True)}
    return {
        "description": works[0].description,
        "rounds": rounds,
        "rows": [
            {
                "name": row.name,
                "label": row.label,
                "median_ms": statistics.median(wall[row.name]) * 1e3,
                "vs_off": bench.paired(wall[row.name], wall["off"]),
                "cpu_vs_off": bench.paired(cpu[row.name], cpu["off"]),
                "syncs": probe.syncs,
                "backward_syncs": probe.backward_syncs,
            }
            for row, probe in zip(rows, probes, strict=True)
        ],
    }


def toggled(model: str, rounds: int, seed: int) -> dict[str, bench.Ratio]:
    """One model, one guard (``provenance=None``) and a ``first_fault`` :class:`Provenance` whose light hooks are
    switched on and off between steps: ``on``, ``off`` and ``off`` again (the A/A control) each round, in a
    shuffled order; paired ratios of the thread's CPU time and of wall time per step against ``off``. The
    same parameters, optimizer state and memory in every arm: only the hooks differ."""
    shape, batch, length = SHAPES[model]
    work = bench.decoder_workload(model, torch.device("cpu"), **shape, batch=batch, length=length)
    policy = bench.per_tensor_policy(bench.NEVER)
    guard = bench.GradGuard(work.model, policy, logger=None, provenance=None)
    traced = provenance_module.Provenance(work.model, guard._plans.binding, "first_fault")
    guard._enforcer.provenance = traced
    guard._attachment.handles.append(traced)
    arms: dict[str, list[tuple[float, float]]] = {"on": [], "off": [], "off-2": []}
    order = list(arms)
    shuffle = random.Random(seed)
    try:
        for index in range(rounds + 3):
            shuffle.shuffle(order)
            for arm in order:
                if arm == "on":
                    traced._arm_light()
                work.opt.zero_grad(set_to_none=True)
                wall, cpu = time.perf_counter(), time.thread_time()
                work.loss().backward()  # type: ignore[no-untyped-call]
                work.opt.step()
                cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
                traced._disarm_light()
                if index >= 3:
                    arms[arm].append((cpu, wall))
    finally:
        guard.remove()
    out = {}
    for arm in ("on", "off-2"):
        out[f"{arm} cpu"] = bench.paired([c for c, _ in arms[arm]], [c for c, _ in arms["off"]])
        out[f"{arm} wall"] = bench.paired([w for _, w in arms[arm]], [w for _, w in arms["off"]])
    return out


FAULT_SHAPES: dict[str, tuple[dict[str, int], int, int]] = {
    "gpt": SHAPES["gpt"],
    # A 1.4B model's layer shape (width 2048, 16 heads, vocabulary 50,304) with 2 of its 24 layers: 306M parameters.
    "1.4B-shape": (dict(vocab=50304, width=2048, depth=2, heads=16), 1, 64),
    "quick": SHAPES["quick"],
}
FAULT_ARMS = {"light trace at every forward (before issue 56)": False, "replay (the default)": True}


def _faulting_step(shape: str, replay: bool, profiled: bool) -> dict[str, Any]:
    """One model with a guard whose ``first_fault`` provenance traces every forward or replays (``replay``), two
    clean steps, then a weight of the middle block's first MLP Linear made NaN: the faulting step's forward and
    backward, then ``opt.step()`` until its halt. Its times (ms), the origin named, and with ``profiled`` the peak of
    tensor bytes (the profiler's allocation events, as peak_memory.py counts them) during the forward and backward
    and during ``opt.step()`` (the guard's step, and the replay), each above the level at the step's start."""
    from peak_memory import _named, _peak_above_start
    from torch.profiler import ProfilerActivity, profile

    dims, batch, length = FAULT_SHAPES[shape]
    work = bench.decoder_workload(shape, torch.device("cpu"), **dims, batch=batch, length=length)
    work.opt = torch.optim.SGD(work.model.parameters(), lr=1e-5)  # no optimizer state: 306M parameters fit
    guard = bench.GradGuard(work.model, bench.per_tensor_policy(bench.NEVER), logger=None, provenance=None)
    tracing = dataclasses.replace(provenance_module.LIGHT, replay=replay)
    traced = provenance_module.Provenance(work.model, guard._plans.binding, "first_fault", tracing=tracing)
    guard._enforcer.provenance = traced
    guard._attachment.handles.append(traced)
    found: dict[str, Any] = {}
    try:
        for _ in range(2):
            work.opt.zero_grad(set_to_none=True)
            work.loss().backward()  # type: ignore[no-untyped-call]
            work.opt.step()
        block = work.model.blocks[len(work.model.blocks) // 2]
        with torch.no_grad():
            block.mlp[0].weight[0, 0] = float("nan")
        work.opt.zero_grad(set_to_none=True)
        with contextlib.ExitStack() as stack:
            prof = (
                stack.enter_context(profile(activities=[ProfilerActivity.CPU], profile_memory=True))
                if profiled
                else None
            )
            start = time.perf_counter()
            with _named("fault::backward"):
                loss = work.loss()
                loss.backward()  # type: ignore[no-untyped-call]
            middle = time.perf_counter()
            with _named("fault::step"):
                try:
                    work.opt.step()
                except GradientHalt as halt:
                    found["origin"] = halt.origin
            end = time.perf_counter()
        found |= {"to_halt_ms": (end - start) * 1e3, "step_ms": (end - middle) * 1e3}
        if prof is not None:
            events = prof.profiler.kineto_results.events()
            host = torch._C._autograd.DeviceType.CPU
            spans = {e.name(): e for e in events if e.name().startswith("fault::") and e.device_type() == host}
            first, second = spans["fault::backward"], spans["fault::step"]
            found["backward_peak"] = _peak_above_start(events, first.start_ns(), first.end_ns())
            level = _peak_above_start(events, first.start_ns(), second.end_ns())
            found["step_peak_above_backward"] = level - found["backward_peak"]
    finally:
        guard.remove()
    return found


def fault_to_halt(shape: str) -> list[dict[str, Any]]:
    """Each arm's faulting step (``_faulting_step``), timed once and once profiled for its memory."""
    rows = []
    for label, replay in FAULT_ARMS.items():
        timed, profiled = _faulting_step(shape, replay, False), _faulting_step(shape, replay, True)
        origin = timed.get("origin") or {}
        rows.append(
            {"arm": label, "named": (origin.get("phase"), origin.get("module"))}
            | timed
            | {
                "backward_peak": profiled["backward_peak"],
                "step_peak_above_backward": profiled["step_peak_above_backward"],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", choices=("gpt", "deep"), default="gpt")
    parser.add_argument("--only", default=None, help="comma-separated rows (off and off-2 always run)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--toggle", action="store_true", help="first_fault's hooks on/off on one model (see toggled)")
    parser.add_argument("--head", action="store_true", help="a 50,304-token head: the trace's bytes (see head_cost)")
    parser.add_argument("--fault", action="store_true", help="a fault's way to the halt (see fault_to_halt)")
    parser.add_argument("--shapes", default="gpt,1.4B-shape", help="--fault's shapes (gpt, 1.4B-shape, quick)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.fault:
        print(
            "| shape | arm | origin named | fault's step to the halt (ms) | of which opt.step() until the halt (ms) "
            "| forward+backward peak (MiB) | opt.step()'s peak above it (MiB) |"
        )
        print("|---|---|---|---:|---:|---:|---:|")
        for shape in ("quick",) if args.quick else args.shapes.split(","):
            for row in fault_to_halt(shape):
                print(
                    f"| {shape} | {row['arm']} | {row['named'][0]} {row['named'][1]} | {row['to_halt_ms']:.1f} | "
                    f"{row['step_ms']:.1f} | {row['backward_peak'] / 2**20:.1f} | "
                    f"{row['step_peak_above_backward'] / 2**20:+.1f} |"
                )
        return 0
    if args.head:
        result = head_cost(args.rounds or (2 if args.quick else 30), args.seed, args.quick)
        print(f"light trace at a large vocabulary ({result['description']}), {result['rounds']} rounds, CPU")
        print(f"whole step without the trace: {result['step_ms']:.1f} ms (median)\n")
        print("| arm | bytes the trace reads per step / the logits' bytes | thread CPU time of the step vs no trace |")
        print("|---|---:|---:|")
        for arm, ratio in result["cpu_vs_off"].items():
            print(f"| {arm} | {result['read_per_logits'][arm]:.3f} | {ratio} |")
        return 0
    if args.toggle:
        model = "quick" if args.quick else args.model
        rounds = args.rounds or (2 if args.quick else 300)
        print(f"first_fault on/off, {model} model, {rounds} rounds: {toggled(model, rounds, args.seed)}")
        return 0
    started = time.perf_counter()
    model = "quick" if args.quick else args.model
    only = set(args.only.split(",")) if args.only else None
    result = run(model, args.rounds or (2 if args.quick else 40), args.seed, only)
    print(f"## provenance cost, {model} model ({result['description']}), {result['rounds']} rounds, CPU\n")
    print(
        "| row | what | median step ms | whole step vs `off` | process CPU time vs `off` "
        "| host syncs/step (in backward) |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for row in result["rows"]:
        print(
            f"| {row['name']} | {row['label']} | {row['median_ms']:.1f} | {row['vs_off']} | {row['cpu_vs_off']} | "
            f"{row['syncs']} ({row['backward_syncs']}) |"
        )
    note = "; --quick: the figures mean nothing" if args.quick else ""
    print(f"\n(ran in {time.perf_counter() - started:.0f} s{note})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
