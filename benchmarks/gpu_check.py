"""A GPU check in one command: gradguard's correctness on CUDA, and what it costs there.

    python benchmarks/gpu_check.py                  # one H100 or H200: under 5 minutes; one Markdown table
    python benchmarks/gpu_check.py --json out.json  # also every figure, written after each section
    python benchmarks/gpu_check.py --quick          # the timings on the 7M model only
    python benchmarks/gpu_check.py --only recovery,sync --budget 120
    python benchmarks/gpu_check.py --only overhead --sizes 7M,163M   # the overhead table at two sizes
    python benchmarks/gpu_check.py --require        # exit 1 when there is no CUDA device

Without a CUDA device it checks nothing, says why, and exits 0 (1 with ``--require``). CI never runs it:
it is written to be run once on a GPU and read afterwards, so every section (and every case in one) runs
on its own: an exception is recorded as an ERROR row with its text, and the next one goes on. Progress
lines are printed as it goes; the JSON (``--json``) is rewritten after every section, so a run cut short
keeps what it had. ``--budget`` (seconds, default 270) is shared by all sections: a section that would
not fit in what is left is skipped, saying so, and the timing sections fit their rounds to it. A
watchdog (``--hard-limit``, default 295 s) dumps every thread's stack and exits if a section hangs.

Sections (``--only`` / ``--skip`` name them):

1. ``recovery`` (correctness): ``tests/test_recovery.py``'s contract on the device. A small model
   (Linear, LayerNorm, Linear), the policy of those tests (halt_on_nonfinite, zclip, skip_step_on_spike)
   with ``recovery: {snapshot_every: 5, keep: 2, min_age: 3, skip_steps: 4}``, 40 steps with a NaN loss
   at step 23: the run must end bitwise equal (``torch.equal``: weights, optimizer state, the guard's
   statistics, the scaler) to the run that trained batches 0-19 and 28-39 with the guard's step jumped
   to 28. AdamW for-loop, foreach and fused, and SGD (momentum) fused; then fp16 autocast with a
   GradScaler (unscale, clip, step, update), NaN at steps 21-23 and ``max_scaler_skips: 2``, for the
   three AdamW implementations. If the policy's recovery section has a ``memory`` key, every case runs
   with ``device``, ``host`` and ``auto``. A mismatch is re-checked against a second reference run:
   when the reference itself does not repeat bitwise on the device, the case is INCONCLUSIVE, not FAIL.
2. ``sync`` (correctness): ``benchmarks/cuda_sync_check.py``'s ``main()``: no host sync in backward,
   exactly one per step, and a NaN halts before the update.
3. ``provenance`` (correctness): ``tests/test_provenance.py``'s faulty model on the device: a NaN made
   by one module's forward, an Inf made by one module's custom backward, a weight with a NaN element,
   and a NaN in one gradient in a loop that clips globally; the halt must name that module (or
   parameter).
4. ``compile`` (correctness): an MLP compiled with inductor, a NaN put into one parameter's gradient
   (a tensor hook) at step 3: the guard halts at step 3 naming that parameter, the weights untouched,
   after clipping the compiled model's gradients on the steps before.
5. ``overhead`` (timing): step_overhead.py's GPT (``Decoder``) at ~7M (53 tensors, batch 16x256),
   ~163M (149 tensors, 16x1024) and ~1.4B parameters (293 tensors, 8x1024), bf16 autocast,
   ``AdamW(fused=True)``. Treatments: none; global ``clip_grad_norm_(params, 1.0, foreach=True)``;
   gradguard with a per-tensor clip_norm 1.0 + halt_on_nonfinite; the same guard reading before the update
   (as before its read waited for the fused update, docs/where-the-guard-acts.md: the A/B of that change);
   the shipped ``default`` policy; the per-tensor guard in a loop that also clips globally before
   ``opt.step()``. One model and optimizer
   per size; each round runs every treatment once, in a new shuffled order, as a segment (attach,
   one warm-up step, ``steps`` timed steps, detach; its time is the median step); a ratio is the median
   over rounds of the two segments' ratio in the same round, with the quartiles.
6. ``snapshot`` (timing): at ~163M and ~1.4B, a step of the per-tensor guard with
   ``recovery: {snapshot_every: 8, keep: 2}`` (a snapshot every 8 steps) against the same guard without
   recovery, and the floor: one ``torch._foreach_copy_`` of the parameters and AdamW state into
   preallocated device buffers (and into pinned host buffers). With a ``memory`` key, once per ``device``
   / ``host`` / ``auto``, each row saying where the snapshots lived (device and host GiB from
   ``guard.metrics()``) and the step's cost amortized at ``snapshot_every: 100`` (issue 32: <= 1.002x).

Results: PASS / FAIL / ERROR / INCONCLUSIVE for the correctness checks, OK / ERROR for the timings,
SKIPPED for what did not run. The exit status is 1 if any correctness check FAILed or hit an ERROR, else
0. ``--device cpu`` (hidden) runs the sections on the CPU with tiny timing models, to test the script.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import gc
import io
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support: the models tests/test_provenance.py runs

from step_overhead import Decoder, per_tensor_policy

import gradguard
from gradguard import GradGuard, GradientHalt, Policy
from tests.support.faulty_models import Net
from tests.support.fused import reading_first

SECTIONS = ("recovery", "sync", "provenance", "compile", "overhead", "snapshot")
CORRECTNESS = frozenset({"recovery", "sync", "provenance", "compile"})
MIN_SECONDS = {"recovery": 10.0, "sync": 10.0, "provenance": 5.0, "compile": 30.0, "overhead": 15.0, "snapshot": 15.0}
"""A section starts only with at least this much of the budget left."""
FAILING = frozenset({"FAIL", "ERROR"})

# --- results ----------------------------------------------------------------------------------------


@dataclass
class Row:
    section: str
    case: str
    result: str
    """PASS, FAIL, ERROR or INCONCLUSIVE (a correctness check); OK (a measurement); SKIPPED; INFO."""
    figures: str = ""
    data: dict[str, Any] = field(default_factory=dict)


class Budget:
    """The seconds the whole check may take, counted from its start."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()


class Report:
    """The rows so far, printed as they come, and the JSON, rewritten after every section."""

    def __init__(self, meta: dict[str, Any], budget: Budget, path: Path | None) -> None:
        self.meta = meta
        self.budget = budget
        self.path = path
        self.rows: list[Row] = []
        self.sections: dict[str, dict[str, Any]] = {}
        self.current: str | None = None
        """The section running now."""

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        figures = f" | {row.figures}" if row.figures else ""
        print(f"[{self.budget.elapsed():6.1f}s] {row.section} | {row.case} | {row.result}{figures}", flush=True)
        return row

    def failures(self) -> list[Row]:
        return [row for row in self.rows if row.section in CORRECTNESS and row.result in FAILING]

    def document(self) -> dict[str, Any]:
        return {
            "checked": True,
            "meta": self.meta,
            "elapsed_s": round(self.budget.elapsed(), 2),
            "sections": self.sections,
            "rows": [asdict(row) for row in self.rows],
            "failures": [f"{row.section}: {row.case}" for row in self.failures()],
        }

    def save(self) -> None:
        if self.path is None:
            return
        try:
            write_json(self.path, self.document())
        except Exception as error:  # the JSON is a by-product: never let it stop the check
            print(f"gpu_check: could not write {self.path}: {type(error).__name__}: {error}", flush=True)

    def table(self) -> str:
        lines = ["| section | case | result | figures |", "|---|---|---|---|"]
        for row in self.rows:
            cells = (row.section, row.case, row.result, row.figures)
            lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
        return "\n".join(lines)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(document, indent=2, default=str) + "\n")
    partial.replace(path)


def error_text(error: BaseException, limit: int = 400) -> str:
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class Context:
    device: torch.device
    quick: bool
    budget: Budget
    report: Report
    scratch: Path
    selected: tuple[str, ...]
    seed: int
    sizes: tuple[str, ...] | None = None
    """``--sizes``: the model sizes the timing sections run (None: each section's own)."""

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def check(self, section: str, case: str, run: Callable[[], tuple[str, str, dict[str, Any]]]) -> Row:
        """One correctness case: ``run`` returns (result, figures, data); an exception is an ERROR row."""
        started = time.perf_counter()
        try:
            result, figures, data = run()
        except Exception as error:
            result, figures, data = "ERROR", error_text(error), {"traceback": traceback.format_exc()}
        data["seconds"] = round(time.perf_counter() - started, 3)
        return self.report.add(Row(section, case, result, figures, data))

    def skip(self, section: str, case: str, why: str) -> Row:
        return self.report.add(Row(section, case, "SKIPPED", why))


def free_memory(host: bool = False) -> None:
    """Give cached device memory back (and, with ``host``, the pinned host buffers torch keeps for reuse)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if host and empty_host is not None:
            empty_host()
        torch.cuda.reset_peak_memory_stats()


def verdict(problems: Sequence[str]) -> str:
    return "PASS" if not problems else "FAIL"


def recovery_memory_modes() -> list[str | None]:
    """``["device", "host", "auto"]`` if the policy's recovery section has a ``memory`` key, else ``[None]``."""
    from gradguard.policy import schema

    section = getattr(schema, "Recovery", None) or getattr(schema, "RecoverySection", None)
    fields = getattr(section, "model_fields", {}) if section is not None else {}
    return ["device", "host", "auto"] if "memory" in fields else [None]


# --- comparing training states ------------------------------------------------------------------------


def differences(a: Any, b: Any, where: str) -> list[str]:
    """Where ``a`` and ``b`` differ: tensors bitwise (NaN in the same places counts as equal), containers deep."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
        if a.shape != b.shape or a.dtype != b.dtype:
            return [f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"]
        x, y = a.detach().cpu(), b.detach().cpu()
        if torch.equal(x, y):
            return []
        if x.is_floating_point() and torch.equal(x.isnan(), y.isnan()) and torch.equal(x[~x.isnan()], y[~y.isnan()]):
            return []
        return [f"{where} differs"]
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [problem for key in a for problem in differences(a[key], b[key], f"{where}.{key}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items vs {len(b)}"]
        return [
            problem for i, (x, y) in enumerate(zip(a, b, strict=True)) for problem in differences(x, y, f"{where}[{i}]")
        ]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


# --- 1. recovery --------------------------------------------------------------------------------------

STEPS = 40
FAULT = 23
RECOVERY = {"snapshot_every": 5, "keep": 2, "min_age": 3, "skip_steps": 4}
NEVER_LEARNED = range(20, 28)  # the snapshot's step (20) to the end of the window (23 + 4)
HALT_RULE: dict[str, Any] = {"name": "nonfinite", "match": ["*"], "actions": [{"action": "halt_on_nonfinite"}]}
STATEFUL: list[dict[str, Any]] = [
    HALT_RULE,
    {"name": "adaptive", "match": ["*"], "actions": [{"action": "zclip", "max_norm": 5.0, "warmup_steps": 3}]},
    {
        "name": "spikes",
        "match": ["*"],
        "actions": [{"action": "skip_step_on_spike", "z_thresh": 4.0, "window": 8, "min_samples": 4}],
    },
]
SCALER_RULES: list[dict[str, Any]] = [
    {"name": "nonfinite", "match": ["*"], "actions": [{"action": "halt_on_nonfinite", "max_scaler_skips": 2}]}
]
IMPLEMENTATIONS: dict[str, dict[str, bool]] = {
    "for-loop": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


class RecoveryNet(nn.Module):
    """tests/test_recovery.py's ``Net``: made on the CPU under seed 0, then moved, so every device starts alike."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(torch.tanh(self.norm(self.inp(x))))
        return out


@dataclass(frozen=True)
class RecoveryCase:
    optimizer: str  # "adamw" or "sgd"
    implementation: str  # a key of IMPLEMENTATIONS
    scaler: bool
    memory: str | None
    in_flight: bool = False
    """Host mode with its chunks never pumped: every snapshot's copy to the host is still in flight when the next
    staging or the fault's restore comes, which queue the rest at once (the device waits)."""

    @property
    def name(self) -> str:
        what = "GradScaler fp16, NaN at 21-23" if self.scaler else "NaN at 23"
        memory = f", memory: {self.memory}" if self.memory else ""
        flight = ", each host copy still in flight" if self.in_flight else ""
        return f"{self.optimizer} {self.implementation}, {what}{memory}{flight}"

    def poisoned(self, i: int) -> bool:
        return 21 <= i <= FAULT if self.scaler else i == FAULT

    def rules(self) -> list[dict[str, Any]]:
        return SCALER_RULES if self.scaler else STATEFUL


Trained = tuple[nn.Module, torch.optim.Optimizer, GradGuard, torch.amp.GradScaler | None]


def recovery_batches(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    made = [(torch.randn(6, 8, generator=gen), torch.randn(6, 2, generator=gen)) for _ in range(STEPS)]
    return [(x.to(device), y.to(device)) for x, y in made]


def recovery_train(
    device: torch.device,
    case: RecoveryCase,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    steps: list[int],
    *,
    recovery: dict[str, Any] | None,
    poison: Callable[[int], bool] = lambda i: False,
    jump: tuple[int, int] | None = None,
    log: Path | None = None,
) -> Trained:
    """tests/test_recovery.py's ``train``: ``jump=(i, step)`` sets the guard's step before batch ``i``."""
    model = RecoveryNet().to(device)
    options = IMPLEMENTATIONS[case.implementation]
    opt: torch.optim.Optimizer
    if case.optimizer == "sgd":
        opt = torch.optim.SGD(
            model.parameters(), lr=0.05, momentum=0.9, foreach=options.get("foreach"), fused=options.get("fused")
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=options.get("foreach"), fused=options.get("fused"))
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10) if case.scaler else None
    document: dict[str, Any] = {"version": 1, "rules": case.rules()}
    if recovery is not None:
        document["recovery"] = recovery
    with GradGuard(model, Policy.from_dict(document), logger=None, scaler=scaler, audit_log=log) as guard:
        for i in steps:
            if jump is not None and i == jump[0]:
                state = guard.state_dict()
                state["step"] = jump[1]
                guard.load_state_dict(state)
            x, y = data[i]
            opt.zero_grad()
            if scaler is None:
                loss = functional.mse_loss(model(x), y)
                (loss * float("nan") if poison(i) else loss).backward()  # type: ignore[no-untyped-call]
                opt.step()
                continue
            with torch.autocast(device.type, dtype=torch.float16):
                out = model(x)
            loss = functional.mse_loss(out.float(), y)
            scaler.scale(loss * float("nan") if poison(i) else loss).backward()  # type: ignore[no-untyped-call]
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # timm's order: unscale, clip, step
            scaler.step(opt)
            scaler.update()
    return model, opt, guard, scaler


def training_differences(got: Trained, want: Trained) -> list[str]:
    """tests/test_recovery.py's ``assert_same_training``, as a list of what differs."""
    problems = differences(got[0].state_dict(), want[0].state_dict(), "model")
    problems += differences(got[1].state_dict(), want[1].state_dict(), "optimizer")
    mine, theirs = got[2].state_dict(), want[2].state_dict()
    problems += differences(mine.get("statistics"), theirs.get("statistics"), "guard.statistics")
    problems += differences(mine.get("skips"), theirs.get("skips"), "guard.skips")
    if not mine.get("step") == theirs.get("step") == STEPS:
        problems.append(f"guard.step: {mine.get('step')} and {theirs.get('step')}, not {STEPS}")
    if got[3] is not None and want[3] is not None:
        problems += differences(got[3].state_dict(), want[3].state_dict(), "scaler")
    return problems


def read_events(log: Path, kind: str) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [e for line in log.read_text().splitlines() if line.strip() and (e := json.loads(line))["event"] == kind]


@contextlib.contextmanager
def held_back_copies() -> Iterator[None]:
    """Host mode's chunks are not pumped after the step's reads (``RecoveryCase.in_flight``)."""
    from gradguard.enforce.recovery.snapshot_memory import Stager

    pump = Stager.pump
    Stager.pump = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        Stager.pump = pump  # type: ignore[method-assign]


def recovery_case(ctx: Context, case: RecoveryCase, log: Path) -> tuple[str, str, dict[str, Any]]:
    device = ctx.device
    data = recovery_batches(device)
    recovery = {**RECOVERY, **({"memory": case.memory} if case.memory else {})}
    with held_back_copies() if case.in_flight else contextlib.nullcontext():
        got = recovery_train(device, case, data, list(range(STEPS)), recovery=recovery, poison=case.poisoned, log=log)
    kept = [i for i in range(STEPS) if i not in NEVER_LEARNED]
    jump = (NEVER_LEARNED.stop, NEVER_LEARNED.stop)

    def reference() -> Trained:
        return recovery_train(device, case, data, kept, recovery=None, jump=jump)

    want = reference()
    problems = training_differences(got, want)
    rewinds = read_events(log, "rewind")
    state = got[2].state_dict().get("recovery", {})
    expected_kind = "overflow" if case.scaler else "nan"
    data_out: dict[str, Any] = {"rewind_events": rewinds, "recovery_state": state}
    shape_problems: list[str] = []
    if len(rewinds) != 1:
        shape_problems.append(f"{len(rewinds)} rewind events, not 1")
    else:
        rewind = rewinds[0]
        seen = (rewind.get("step"), rewind.get("to_step"), rewind.get("skip_until"), rewind.get("kind"))
        if seen != (FAULT, 20, 28, expected_kind):
            shape_problems.append(f"rewind (step, to_step, skip_until, kind) = {seen}")
    if state.get("rewinds") != 1:
        shape_problems.append(f"guard state recovery = {state}")
    if read_events(log, "halt"):
        shape_problems.append("a halt event was logged")
    scaler_skips = len(read_events(log, "scaler_skip"))
    if case.scaler and scaler_skips != 3:
        shape_problems.append(f"{scaler_skips} scaler_skip events, not 3 (steps 21-23)")
    rewind_text = "no rewind"
    if rewinds:
        r = rewinds[0]
        rewind_text = (
            f"rewind {r.get('step')}->{r.get('to_step')}, skipped until {r.get('skip_until')}, {r.get('kind')}"
        )
    if problems:
        again = reference()
        repeat = training_differences(again, want)
        data_out["differences"] = problems[:20]
        if repeat:
            data_out["reference_repeat_differences"] = repeat[:20]
            why = (
                f"the reference run does not repeat bitwise on {device.type} ({repeat[0]}); recovery run: {problems[0]}"
            )
            return "INCONCLUSIVE", f"{rewind_text}; {why}", data_out
        return "FAIL", f"{rewind_text}; {len(problems)} differences: {'; '.join(problems[:3])}", data_out
    if shape_problems:
        data_out["problems"] = shape_problems
        return "FAIL", f"{rewind_text}; bitwise equal, but {'; '.join(shape_problems)}", data_out
    tensors = len(want[0].state_dict()) + sum(len(s) for s in want[1].state_dict()["state"].values())
    what = f"{tensors} tensors, the guard's state" + (", the scaler" if case.scaler else "")
    return "PASS", f"{rewind_text}; bitwise equal to the reference ({what})", data_out


def section_recovery(ctx: Context) -> None:
    memories = recovery_memory_modes()
    cases: list[RecoveryCase] = []
    for memory in memories:
        cases += [RecoveryCase("adamw", impl, False, memory) for impl in IMPLEMENTATIONS]
        cases.append(RecoveryCase("sgd", "fused", False, memory))
        cases += [RecoveryCase("adamw", impl, True, memory) for impl in IMPLEMENTATIONS]
        if memory == "host":
            cases += [RecoveryCase("adamw", "fused", scaler, memory, in_flight=True) for scaler in (False, True)]
    if memories == [None]:
        ctx.report.add(
            Row("recovery", "recovery.memory", "INFO", "the policy has no recovery.memory key: default only")
        )
    for index, case in enumerate(cases):
        if ctx.budget.left() < 2:
            ctx.skip("recovery", case.name, f"budget spent ({ctx.budget.seconds:.0f} s)")
            continue
        log = ctx.scratch / f"recovery-{index}.jsonl"
        ctx.check("recovery", case.name, functools.partial(recovery_case, ctx, case, log))


# --- 2. sync ------------------------------------------------------------------------------------------


def section_sync(ctx: Context) -> None:
    if ctx.device.type != "cuda":
        ctx.skip("sync", "cuda_sync_check.main()", "needs CUDA (torch.cuda.set_sync_debug_mode)")
        return
    import cuda_sync_check

    captured = io.StringIO()

    def run() -> tuple[str, str, dict[str, Any]]:
        with contextlib.redirect_stdout(captured):
            status = cuda_sync_check.main([])
        return ("PASS" if status == 0 else "FAIL"), f"exit status {status}", {"output": captured.getvalue()}

    row = ctx.check("sync", "cuda_sync_check.main()", run)
    for line in captured.getvalue().splitlines():
        print(f"    {line}", flush=True)
        verdict_word, _, rest = line.partition("  ")
        if verdict_word in ("PASS", "FAIL"):
            name, _, detail = rest.partition(": ")
            ctx.report.add(Row("sync", name, verdict_word, detail))
        elif verdict_word == "info":
            row.figures += f"; {rest}"


# --- 3. provenance ------------------------------------------------------------------------------------

PROVENANCE_HALT: dict[str, Any] = {
    "version": 1,
    "rules": [{"name": "halt", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}],
}


def fault_batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(6, 4, generator=gen).to(device), torch.randn(6, 2, generator=gen).to(device)


def halt_of(
    device: torch.device,
    provenance: str | None,
    at: int,
    fault: Callable[[Net, int], None],
    *,
    clip: bool = False,
) -> tuple[GradientHalt | None, str]:
    """Train a Net until step ``at`` (``fault(model, step)`` switches its fault); the halt, or why none."""
    torch.manual_seed(0)
    model = Net().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with GradGuard(model, Policy.from_dict(PROVENANCE_HALT), logger=None, provenance=provenance):
        for step in range(at + 1):
            fault(model, step)
            x, y = fault_batch(step, device)
            opt.zero_grad()
            functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
            try:
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the guard's step runs first
                opt.step()
            except GradientHalt as halt:
                if step != at:
                    return None, f"halted at step {step}, before the fault at {at}: {halt}"
                return halt, ""
    return None, f"no halt at step {at}"


def origin_check(
    halt: GradientHalt | None, why: str, at: int, want: dict[str, Any], want_params: tuple[str, ...] | None = None
) -> tuple[str, str, dict[str, Any]]:
    if halt is None:
        return "FAIL", why, {}
    origin = halt.origin or {}
    seen = {key: origin.get(key) for key in want}
    problems = [f"{key}: {seen[key]!r}, not {value!r}" for key, value in want.items() if seen[key] != value]
    if halt.step != at:
        problems.append(f"halt.step {halt.step}, not {at}")
    if want_params is not None and halt.params != want_params:
        problems.append(f"halt.params {halt.params}, not {want_params}")
    named = f"{list(halt.params)[:3]}" + (f" and {len(halt.params) - 3} more" if len(halt.params) > 3 else "")
    figures = ", ".join(f"{key}={value!r}" for key, value in seen.items()) + f"; halt.params {named}"
    if problems:
        figures = "; ".join(problems) + f" (origin: {origin})"
    data = {"origin": origin, "params": list(halt.params), "step": halt.step, "message": str(halt)}
    return verdict(problems), figures, data


def section_provenance(ctx: Context) -> None:
    device = ctx.device

    def forward_nan(model: Net, step: int) -> None:
        model.faults.forward_nan = step == 3

    def backward_inf(model: Net, step: int) -> None:
        model.faults.backward_inf = step == 2

    def nan_weight(model: Net, step: int) -> None:
        if step == 2:
            with torch.no_grad():
                model.block(1).fc1.weight[0, 0] = float("nan")

    hooked: dict[str, Any] = {}

    def nan_gradient(model: Net, step: int) -> None:
        if "handle" not in hooked:
            weight = model.block(2).fc1.weight
            poison = lambda g: g * float("nan") if hooked["on"] else g  # noqa: E731
            hooked["handle"] = weight.register_hook(poison)  # type: ignore[no-untyped-call]
        hooked["on"] = step == 4

    cases: list[tuple[str, Callable[[], tuple[str, str, dict[str, Any]]]]] = [
        (
            "forward NaN in blocks.1.act (provenance always)",
            lambda: origin_check(
                *halt_of(device, "always", 3, forward_nan),
                3,
                {"phase": "forward", "module": "blocks.1.act", "kind": "nan", "input_nonfinite": False},
            ),
        ),
        (
            "Inf from blocks.1.boom's custom backward (provenance always)",
            lambda: origin_check(
                *halt_of(device, "always", 2, backward_inf),
                2,
                {"phase": "backward", "module": "blocks.1.boom", "kind": "inf"},
            ),
        ),
        (
            "NaN element in blocks.1.fc1.weight (provenance always)",
            lambda: origin_check(
                *halt_of(device, "always", 2, nan_weight), 2, {"phase": "forward", "module": "blocks.1.fc1"}
            ),
        ),
        (
            "NaN gradient of blocks.2.fc1.weight, loop clips globally (after_fault)",
            lambda: origin_check(
                *halt_of(device, "after_fault", 4, nan_gradient, clip=True),
                4,
                {"spread": False},
                ("blocks.2.fc1.weight",),
            ),
        ),
    ]
    for name, run in cases:
        ctx.check("provenance", name, run)


# --- 4. torch.compile ---------------------------------------------------------------------------------

COMPILE_FAULT = 3


class CompileNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.hidden = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(torch.tanh(self.hidden(torch.tanh(self.inp(x)))))
        return out


def compile_case(ctx: Context) -> tuple[str, str, dict[str, Any]]:
    import torch._inductor.config as inductor_config

    device = ctx.device
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = CompileNet().to(device)
    compiled = torch.compile(model, backend="inductor")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)) for _ in range(COMPILE_FAULT + 1)]
    state = {"poison": False}
    poison = lambda g: g * float("nan") if state["poison"] else g  # noqa: E731
    handle = model.hidden.weight.register_hook(poison)  # type: ignore[no-untyped-call]
    policy = Policy.from_dict(
        {
            "version": 1,
            "rules": [
                HALT_RULE,
                {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.01}]},
            ],
        }
    )
    problems: list[str] = []
    halt: GradientHalt | None = None
    started = time.perf_counter()
    first_step = 0.0
    try:
        with (
            inductor_config.patch(compile_threads=1),
            GradGuard(cast(nn.Module, compiled), policy, logger=None) as guard,
        ):
            names = list(guard.guarded)
            if any(name.startswith("_orig_mod") for name in names):
                problems.append(f"the guard sees compiled names: {names[:3]}")
            for step, (x, y) in enumerate(batches):
                state["poison"] = step == COMPILE_FAULT
                opt.zero_grad()
                functional.mse_loss(compiled(x.to(device)), y.to(device)).backward()  # type: ignore[no-untyped-call]
                before = {name: p.detach().clone() for name, p in model.named_parameters()}
                try:
                    opt.step()
                except GradientHalt as caught:
                    halt = caught
                    untouched = all(torch.equal(before[name], p) for name, p in model.named_parameters())
                    if not untouched:
                        problems.append("the weights changed at the halted step")
                    break
                finally:
                    if step == 0:
                        ctx.sync()
                        first_step = time.perf_counter() - started
            clips = guard.counters.total("clip_norm")
            steps = guard.step_count
    finally:
        handle.remove()
        torch._dynamo.reset()
    if halt is None:
        problems.append(f"no halt by step {COMPILE_FAULT}")
    else:
        if halt.step != COMPILE_FAULT:
            problems.append(f"halted at step {halt.step}, not {COMPILE_FAULT}")
        if halt.params != ("hidden.weight",):
            problems.append(f"halt.params {halt.params}, not ('hidden.weight',)")
        if halt.kind != "nan":
            problems.append(f"halt.kind {halt.kind!r}")
    if clips < COMPILE_FAULT:
        problems.append(f"{clips} clips on {COMPILE_FAULT} steps (clip_norm 0.01 should bite every step)")
    figures = (
        f"halt at step {halt.step if halt else None} naming {list(halt.params) if halt else []}; "
        f"{clips} clips on steps 0-{COMPILE_FAULT - 1}; guard step_count {steps}; "
        f"first step (compiling) {first_step:.1f} s"
    )
    if problems:
        figures = "; ".join(problems) + f" ({figures})"
    data = {"halt_params": list(halt.params) if halt else None, "clips": clips, "compile_s": round(first_step, 2)}
    return verdict(problems), figures, data


def section_compile(ctx: Context) -> None:
    name = f"inductor MLP, NaN in hidden.weight's gradient at step {COMPILE_FAULT}"
    ctx.check("compile", name, lambda: compile_case(ctx))


# --- 5. overhead and 6. snapshot: the GPT models --------------------------------------------------------


@dataclass(frozen=True)
class Size:
    name: str
    vocab: int
    width: int
    depth: int
    heads: int
    batch: int
    length: int
    rounds: int
    steps: int


SIZES = {
    "7M": Size("7M", vocab=8192, width=256, depth=4, heads=4, batch=16, length=256, rounds=30, steps=10),
    "163M": Size("163M", vocab=50304, width=768, depth=12, heads=12, batch=16, length=1024, rounds=16, steps=10),
    "1.4B": Size("1.4B", vocab=50304, width=2048, depth=24, heads=16, batch=8, length=1024, rounds=5, steps=10),
}
TINY = Size("tiny", vocab=256, width=32, depth=2, heads=2, batch=2, length=16, rounds=2, steps=2)
"""The stand-in on the CPU (``--device cpu``): exercises the code, measures nothing worth reading."""


@dataclass
class Bench:
    size: Size
    model: nn.Module
    opt: torch.optim.Optimizer
    loss: Callable[[], torch.Tensor]
    device: torch.device
    description: str

    @property
    def params(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def sync(self) -> None:
        # The compute stream only, as a loop that reads its loss waits: a host copy of a snapshot runs on a side
        # stream across the next steps, and waiting for every stream would put it back into each step.
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def step(self, clip: bool) -> float:
        """One whole training step (zero_grad, forward, backward, [global clip], AdamW); its seconds."""
        self.sync()
        started = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        self.loss().backward()  # type: ignore[no-untyped-call]
        if clip:
            torch.nn.utils.clip_grad_norm_(self.params, 1.0, foreach=True)
        self.opt.step()
        self.sync()
        return time.perf_counter() - started


def build_bench(size: Size, device: torch.device) -> Bench:
    """step_overhead.py's ``Decoder``, made on the device, bf16 autocast, ``AdamW(fused=True)``."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Decoder(size.vocab, size.width, size.depth, size.heads, size.length)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    gen = torch.Generator(device=device).manual_seed(0)

    def loss() -> torch.Tensor:
        tokens = torch.randint(0, size.vocab, (size.batch, size.length + 1), generator=gen, device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
            out = functional.cross_entropy(logits.reshape(-1, size.vocab), tokens[:, 1:].reshape(-1))
        return out

    count = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    description = (
        f"{size.depth} layers, width {size.width}, vocab {size.vocab}, {count / 1e6:.1f}M parameters in "
        f"{tensors} tensors, batch {size.batch}x{size.length}, bf16 autocast, AdamW(fused=True)"
    )
    return Bench(size, model, opt, loss, device, description)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


@dataclass(frozen=True)
class Treatment:
    name: str
    label: str
    policy: Callable[[], Policy] | None
    clip: bool
    read_first: bool = False
    """The guard's read before the fused update, as before it waited for it (``FusedUpdate.takes`` off)."""


TREATMENTS = (
    Treatment("none", "no treatment", None, False),
    Treatment("global", "clip_grad_norm_(params, 1.0, foreach=True)", None, True),
    Treatment("guard", "gradguard: per-tensor clip_norm 1.0 + halt", lambda: per_tensor_policy(1.0), False),
    Treatment(
        "guard-first",
        "gradguard: the same, its read before the fused update",
        lambda: per_tensor_policy(1.0),
        False,
        read_first=True,
    ),
    Treatment("default", "gradguard: shipped `default` policy", lambda: Policy.shipped("default"), False),
    Treatment(
        "guard+clip", "gradguard per-tensor + halt, + the loop's global clip", lambda: per_tensor_policy(1.0), True
    ),
)


def segment(
    bench: Bench, policy: Policy | None, clip: bool, warmup: int, steps: int
) -> tuple[list[float], Any, int | None, dict[str, float]]:
    """Attach (if a policy), ``warmup`` untimed steps, ``steps`` timed ones, detach; the times, the guard, the peak
    of allocated bytes over the timed steps (CUDA; None elsewhere), and the guard's metrics before it was detached
    (``remove()`` gives its snapshots back: read after it, recovery's held bytes are 0)."""
    guard = GradGuard(bench.model, policy, logger=None) if policy is not None else None
    cuda = bench.device.type == "cuda"
    metrics: dict[str, float] = {}
    try:
        for _ in range(warmup):
            bench.step(clip)
        if cuda:
            bench.sync()
            torch.cuda.reset_peak_memory_stats(bench.device)
        times = [bench.step(clip) for _ in range(steps)]
        peak = torch.cuda.max_memory_allocated(bench.device) if cuda else None
        metrics = guard.metrics() if guard is not None else {}
    finally:
        if guard is not None:
            guard.remove()
    return times, guard, peak, metrics


@dataclass
class Ratio:
    median: float
    p25: float
    p75: float

    def __str__(self) -> str:
        return f"{self.median:.3f} [{self.p25:.3f}-{self.p75:.3f}]"


def paired(values: Sequence[float], reference: Sequence[float]) -> Ratio:
    ratios = sorted(v / r for v, r in zip(values, reference, strict=True))
    if len(ratios) == 1:
        return Ratio(ratios[0], ratios[0], ratios[0])
    q = statistics.quantiles(ratios, n=4, method="inclusive")
    return Ratio(statistics.median(ratios), q[0], q[2])


def fit_rounds(size: Size, step_s: float, segments: int, left: float) -> tuple[int, int]:
    """Rounds and timed steps per segment that fit ``left`` seconds (each segment: one warm-up step more)."""
    per_step = max(step_s, 1e-4) * 1.15 + 0.002  # attaching a guard, the Python around the steps
    for steps in (size.steps, max(size.steps // 2, 2), 2):
        rounds = int(left / (segments * (steps + 1) * per_step))
        if rounds >= 2:
            return min(rounds, size.rounds), steps
    return 0, 0


def sizes_for(ctx: Context, names: Sequence[str]) -> list[Size]:
    if ctx.device.type != "cuda":
        return [TINY]
    if ctx.quick:
        return [SIZES["7M"]]
    return [SIZES[name] for name in names if ctx.sizes is None or name in ctx.sizes]


def overhead_size(ctx: Context, size: Size, left: float) -> None:
    bench = build_bench(size, ctx.device)
    try:
        warm = [bench.step(False) for _ in range(3)]  # kernels, the allocator, AdamW's state
        step_s = min(warm[1:])
        rounds, steps = fit_rounds(size, step_s, len(TREATMENTS), left)
        info = {"description": bench.description, "warm_step_ms": round(step_s * 1e3, 2)}
        if rounds == 0:
            ctx.skip(
                "overhead", f"{size.name}: all treatments", f"budget: {left:.0f} s left, a step {step_s * 1e3:.0f} ms"
            )
            return
        order = list(range(len(TREATMENTS)))
        shuffle = random.Random(ctx.seed)
        medians: list[list[float]] = [[] for _ in TREATMENTS]
        peaks: list[list[int]] = [[] for _ in TREATMENTS]
        notes: dict[str, str] = {}
        for round_index in range(rounds):
            shuffle.shuffle(order)
            gc.collect()
            for k in order:
                treatment = TREATMENTS[k]
                policy = treatment.policy() if treatment.policy is not None else None
                with reading_first(treatment.read_first):
                    times, guard, peak_bytes, _ = segment(bench, policy, treatment.clip, 1, steps)
                medians[k].append(statistics.median(times))
                if peak_bytes is not None:
                    peaks[k].append(peak_bytes)
                if guard is not None:
                    clips = guard.counters.total("clip_norm")
                    notes[treatment.name] = f"{clips / max(guard.step_count, 1):.0f} clips/step"
            print(f"  overhead {size.name}: round {round_index + 1}/{rounds}", flush=True)
        info.update(rounds=rounds, steps=steps, peak_gib=peak_gib(ctx.device))
        peak = f", peak {info['peak_gib']:.1f} GiB" if info["peak_gib"] is not None else ""
        ctx.report.add(
            Row(
                "overhead",
                f"{size.name}: model",
                "INFO",
                f"{bench.description}; {rounds} rounds x {steps} steps{peak}",
                info,
            )
        )
        by_name = {t.name: medians[k] for k, t in enumerate(TREATMENTS)}
        none_peak = max(peaks[0]) if peaks[0] else None
        for k, treatment in enumerate(TREATMENTS):
            ms = statistics.median(medians[k]) * 1e3
            vs_global, vs_none = paired(medians[k], by_name["global"]), paired(medians[k], by_name["none"])
            note = f"; {notes[treatment.name]}" if treatment.name in notes else ""
            peak_bytes = max(peaks[k]) if peaks[k] else None
            memory = ""
            if peak_bytes is not None and none_peak:
                # Issue 41's target: every treatment's peak within 2% of the unguarded run's.
                memory = f"; peak {peak_bytes / 2**30:.2f} GiB ({peak_bytes / none_peak:.3f}x none's)"
            figures = f"{ms:.2f} ms/step; vs global {vs_global}; vs none {vs_none}{memory}{note}"
            data = {
                "treatment": treatment.name,
                "step_ms": ms,
                "segment_medians_ms": [m * 1e3 for m in medians[k]],
                "vs_global": asdict(vs_global),
                "vs_none": asdict(vs_none),
                "peak_bytes": peak_bytes,
                "peak_vs_none": peak_bytes / none_peak if peak_bytes is not None and none_peak else None,
            }
            ctx.report.add(Row("overhead", f"{size.name}: {treatment.label}", "OK", figures, data))
    finally:
        del bench
        free_memory()


def section_overhead(ctx: Context) -> None:
    sizes = sizes_for(ctx, ["7M", "163M", "1.4B"])
    shares = {"7M": 0.15, "163M": 0.35, "1.4B": 0.5, "tiny": 1.0}
    reserve = 110.0 if "snapshot" in ctx.selected and ctx.device.type == "cuda" and not ctx.quick else 0.0
    for index, size in enumerate(sizes):
        available = ctx.budget.left() - reserve
        later = sum(shares[s.name] for s in sizes[index:])
        left = available * shares[size.name] / later  # this size's share of what is left to the timings
        if left < 5:
            ctx.skip("overhead", f"{size.name}: all treatments", f"budget spent ({ctx.budget.left():.0f} s left)")
            continue
        try:
            overhead_size(ctx, size, left)
        except Exception as error:
            ctx.report.add(
                Row("overhead", f"{size.name}", "ERROR", error_text(error), {"traceback": traceback.format_exc()})
            )
            free_memory()


def state_tensors(bench: Bench) -> list[torch.Tensor]:
    """The parameters and the AdamW state: what a snapshot copies (buffers: none in this model)."""
    sources: list[torch.Tensor] = [p.detach() for p in bench.params]
    for p in bench.params:
        sources += [t for t in bench.opt.state[p].values() if isinstance(t, torch.Tensor)]
    return sources


def copy_floor(bench: Bench, sources: list[torch.Tensor], target: str, reps: int) -> float:
    """Median seconds of one ``torch._foreach_copy_`` of ``sources`` into preallocated buffers."""
    if target == "device":
        buffers = [torch.empty_like(t) for t in sources]
    else:
        buffers = [torch.empty_like(t, device="cpu", pin_memory=True) for t in sources]
    try:
        times = []
        for _ in range(reps + 1):
            bench.sync()
            started = time.perf_counter()
            torch._foreach_copy_(buffers, sources, non_blocking=True)
            bench.sync()
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:])
    finally:
        del buffers
        free_memory(host=True)


SNAPSHOT_EVERY = 8
"""Snapshots every 8 steps in the timing: a host copy (310 ms at 1.4B on an H200) goes on in chunks after the next
steps' reads, each about half a step long, so it needs about 5 steps at 1.4B before the next staging."""


def snapshot_policy(keep: int, memory: str | None) -> Policy:
    data = per_tensor_policy(1.0).model_dump(mode="python")
    data["recovery"] = {"snapshot_every": SNAPSHOT_EVERY, "keep": keep, **({"memory": memory} if memory else {})}
    return Policy.from_dict(data, source=f"per-tensor + recovery every {SNAPSHOT_EVERY} steps, keep {keep}, {memory}")


def snapshot_size(ctx: Context, size: Size, left: float) -> None:
    bench = build_bench(size, ctx.device)
    try:
        warm = [bench.step(False) for _ in range(3)]
        step_s = min(warm[1:])
        sources = state_tensors(bench)
        state_bytes = sum(t.numel() * t.element_size() for t in sources)
        gib = state_bytes / 2**30
        ctx.report.add(
            Row(
                "snapshot",
                f"{size.name}: model",
                "INFO",
                f"{bench.description}; parameters + AdamW state {gib:.2f} GiB",
            )
        )
        for target in ("device", "pinned host") if ctx.device.type == "cuda" else ("device",):
            if ctx.budget.left() < 5:
                ctx.skip("snapshot", f"{size.name}: copy floor to {target}", "budget spent")
                continue
            try:
                seconds = copy_floor(bench, sources, "device" if target == "device" else "host", reps=3)
                figures = f"{seconds * 1e3:.2f} ms for {gib:.2f} GiB ({gib / max(seconds, 1e-9):.0f} GiB/s)"
                floor = {"ms": seconds * 1e3, "bytes": state_bytes}
                ctx.report.add(
                    Row("snapshot", f"{size.name}: one _foreach_copy_ into {target} buffers", "OK", figures, floor)
                )
            except Exception as error:
                ctx.report.add(Row("snapshot", f"{size.name}: copy floor to {target}", "ERROR", error_text(error)))
                free_memory()
        del sources
        variants: list[tuple[str, Callable[[], Policy]]] = [("no recovery", lambda: per_tensor_policy(1.0))]
        for memory in recovery_memory_modes():
            keep = 2
            if memory == "device" and ctx.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(ctx.device)
                headroom = free - 4 * 2**30  # the step's activations come on top
                keep = 2 if headroom > 2.1 * state_bytes else 1
                if headroom < 1.1 * state_bytes:
                    ctx.skip("snapshot", f"{size.name}: memory device", f"{free / 2**30:.0f} GiB free: no room")
                    continue
            label = f"recovery every {SNAPSHOT_EVERY} steps, keep {keep}" + (f", memory: {memory}" if memory else "")
            variants.append((label, functools.partial(snapshot_policy, keep, memory)))
        left = min(left, ctx.budget.left())
        per_step = step_s * 1.3 + state_bytes / 10e9 / SNAPSHOT_EVERY  # a snapshot: at least a copy at 10 GB/s
        steps = 2 * SNAPSHOT_EVERY  # two snapshot steps a segment, after the warm-up allocated every slot
        rounds = max(1, min(2, int(left / (len(variants) * (steps + 2 * SNAPSHOT_EVERY + 2) * per_step + 1e-9))))
        medians: dict[str, list[float]] = {label: [] for label, _ in variants}
        snapshot_steps: dict[str, list[float]] = {label: [] for label, _ in variants}
        other_steps: dict[str, list[float]] = {label: [] for label, _ in variants}
        held: dict[str, float] = {}
        where: dict[str, str] = {}
        errors: dict[str, str] = {}
        for round_index in range(rounds):
            for label, policy in variants:
                if label in errors:
                    continue
                if ctx.budget.left() < 3:
                    errors[label] = "budget spent"
                    continue
                try:
                    # Untimed: the first snapshot of each of the keep slots, which allocates its buffers (pinned
                    # host memory takes seconds at 1.4B), and the steps between.
                    warm = SNAPSHOT_EVERY * 2 + 2
                    times, guard, _, metrics = segment(bench, policy(), False, warm, steps)
                    medians[label].append(statistics.mean(times))
                    takes = [(i + warm) % SNAPSHOT_EVERY == 0 for i in range(len(times))]  # the guard's step i + warm
                    snapshot_steps[label].extend(t for t, take in zip(times, takes, strict=True) if take)
                    other_steps[label].extend(t for t, take in zip(times, takes, strict=True) if not take)
                    held[label] = metrics.get("gradguard/recovery/snapshot_bytes", 0.0)
                    on_device = metrics.get("gradguard/recovery/device_bytes", 0.0) / 2**30
                    on_host = metrics.get("gradguard/recovery/host_bytes", 0.0) / 2**30
                    where[label] = f"device {on_device:.2f} GiB, host {on_host:.2f} GiB"
                    del guard
                except Exception as error:
                    errors[label] = error_text(error)
                free_memory()
            print(f"  snapshot {size.name}: round {round_index + 1}/{rounds}", flush=True)
        base = medians.get("no recovery", [])
        for label, _ in variants:
            case = f"{size.name}: {label}"
            if label in errors and not medians[label]:
                result = "SKIPPED" if errors[label] == "budget spent" else "ERROR"
                ctx.report.add(Row("snapshot", case, result, errors[label]))
                continue
            ms = statistics.median(medians[label]) * 1e3
            figures = f"{ms:.2f} ms/step (mean of a segment)"
            data: dict[str, Any] = {"step_ms": ms, "segment_means_ms": [m * 1e3 for m in medians[label]]}
            if label != "no recovery" and base and snapshot_steps[label]:
                base_ms = statistics.median(base) * 1e3
                taking = statistics.median(snapshot_steps[label]) * 1e3
                others = statistics.median(other_steps[label]) * 1e3 if other_steps[label] else base_ms
                extra = taking - base_ms  # the step that takes a snapshot, over a step of the run without recovery
                window = (statistics.median(medians[label]) * 1e3 - base_ms) * SNAPSHOT_EVERY  # what a snapshot adds
                held_gib = held.get(label, 0.0) / 2**30
                figures += f"; the snapshot step {taking:.2f} ms ({extra:+.2f} ms), the others {others:.2f} ms"
                figures += f"; a snapshot adds {window:+.2f} ms over {SNAPSHOT_EVERY} steps; holds {held_gib:.2f} GiB"
                every_100 = (base_ms + max(extra, window) / 100) / base_ms  # the target: <= 1.002x
                figures += f" ({where.get(label, '?')}); at snapshot_every 100: {every_100:.4f}x"
                data.update(snapshot_step_ms=taking, other_steps_ms=others, extra_ms=extra, window_extra_ms=window)
                data.update(snapshot_bytes=held.get(label, 0.0), every_100=every_100)
            if label in errors:
                figures += f"; a later round: {errors[label]}"
            ctx.report.add(Row("snapshot", case, "OK", figures, data))
    finally:
        del bench
        free_memory(host=True)


def section_snapshot(ctx: Context) -> None:
    sizes = sizes_for(ctx, ["163M", "1.4B"])
    shares = {"7M": 1.0, "163M": 0.35, "1.4B": 0.65, "tiny": 1.0}
    for index, size in enumerate(sizes):
        later = sum(shares[s.name] for s in sizes[index:])
        left = ctx.budget.left() * shares[size.name] / later
        if left < 5:
            ctx.skip("snapshot", f"{size.name}: all cases", f"budget spent ({ctx.budget.left():.0f} s left)")
            continue
        try:
            snapshot_size(ctx, size, left)
        except Exception as error:
            ctx.report.add(
                Row("snapshot", f"{size.name}", "ERROR", error_text(error), {"traceback": traceback.format_exc()})
            )
            free_memory(host=True)


# --- driving ------------------------------------------------------------------------------------------

RUNNERS: dict[str, Callable[[Context], None]] = {
    "recovery": section_recovery,
    "sync": section_sync,
    "provenance": section_provenance,
    "compile": section_compile,
    "overhead": section_overhead,
    "snapshot": section_snapshot,
}


def run_section(ctx: Context, name: str) -> None:
    report = ctx.report
    report.current = name
    left = ctx.budget.left()
    if left < MIN_SECONDS[name]:
        needs = MIN_SECONDS[name]
        why = f"budget spent: {left:.0f} s left of {ctx.budget.seconds:.0f}, the section needs about {needs:.0f}"
        report.add(Row(name, "(section)", "SKIPPED", why))
        report.sections[name] = {"status": "skipped", "reason": why}
        return
    print(f"== {name} ({left:.0f} s of the budget left)", flush=True)
    before = len(report.rows)
    started = time.perf_counter()
    entry: dict[str, Any] = {"status": "done"}
    try:
        RUNNERS[name](ctx)
    except Exception as error:
        entry = {"status": "error", "error": error_text(error, 2000), "traceback": traceback.format_exc()}
        report.add(Row(name, "(section)", "ERROR", error_text(error)))
    finally:
        with contextlib.suppress(Exception):
            if ctx.device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        with contextlib.suppress(Exception):
            free_memory(host=True)
    entry["seconds"] = round(time.perf_counter() - started, 2)
    entry["results"] = {
        result: sum(1 for row in report.rows[before:] if row.result == result)
        for result in sorted({row.result for row in report.rows[before:]})
    }
    report.sections[name] = entry
    print(f"== {name}: {entry['seconds']:.1f} s, {entry['results']}", flush=True)
    report.save()


def metadata(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,  # type: ignore[no-untyped-call]
        "gradguard": getattr(gradguard, "__version__", None),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "budget_s": args.budget,
        "quick": args.quick,
        "sections": list(args.sections),
        "recovery_memory_modes": [m for m in recovery_memory_modes() if m],
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta["device_memory_gib"] = round(props.total_memory / 2**30, 1)
        meta["capability"] = f"{props.major}.{props.minor}"
    return meta


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--require", action="store_true", help="fail (exit 1) when no CUDA device is available")
    parser.add_argument("--json", type=Path, default=None, help="write every result to this file (after each section)")
    parser.add_argument("--quick", action="store_true", help="the timings on the 7M model only")
    parser.add_argument("--budget", type=float, default=270.0, help="seconds for the whole check (default 270)")
    parser.add_argument(
        "--hard-limit",
        type=float,
        default=None,
        help="seconds after which a hung run dumps every stack and exits (default: the budget + 25; 0: never)",
    )
    parser.add_argument("--only", default=None, help=f"comma-separated sections to run, of {','.join(SECTIONS)}")
    parser.add_argument("--skip", default=None, help="comma-separated sections to leave out")
    parser.add_argument("--seed", type=int, default=0, help="the shuffles of the timing rounds")
    parser.add_argument("--sizes", default=None, help=f"comma-separated model sizes to time, of {','.join(SIZES)}")
    parser.add_argument("--device", default=None, help=argparse.SUPPRESS)  # "cpu": test the script itself
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else list(SECTIONS)
    dropped = {s.strip() for s in args.skip.split(",") if s.strip()} if args.skip else set()
    unknown = sorted((set(chosen) | dropped) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {unknown}; the sections are {', '.join(SECTIONS)}")
    args.sections = tuple(s for s in SECTIONS if s in chosen and s not in dropped)
    args.sizes = tuple(s.strip() for s in args.sizes.split(",") if s.strip()) if args.sizes else None
    if args.sizes is not None and set(args.sizes) - set(SIZES):
        parser.error(f"unknown size(s) {sorted(set(args.sizes) - set(SIZES))}; the sizes are {', '.join(SIZES)}")
    return args


def pick_device(args: argparse.Namespace) -> tuple[torch.device | None, str]:
    if args.device is not None and torch.device(args.device).type != "cuda":
        return torch.device(args.device), ""
    if not torch.cuda.is_available():
        build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a build without CUDA"
        return None, f"no CUDA device is available (torch {torch.__version__}, {build})"
    return torch.device(args.device or "cuda"), ""


@contextlib.contextmanager
def watchdog(seconds: float, report: Report) -> Iterator[None]:
    """After ``seconds`` (a hung section): every thread's stack, the table and the JSON so far, exit status 1.

    A timer thread does it; should the main thread hold the GIL and never let it run, faulthandler dumps
    the stacks and exits 5 seconds later (the JSON then holds the sections done before)."""
    if seconds <= 0:
        yield
        return

    def expire() -> None:
        print(f"\ngpu_check: hard limit ({seconds:.0f} s) reached in section {report.current!r}", flush=True)
        faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
        report.add(Row(report.current or "?", "(hard limit)", "ERROR", f"still running after {seconds:.0f} s"))
        report.sections.setdefault(report.current or "?", {})["status"] = "hard limit"
        print(report.table(), flush=True)
        report.save()
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(seconds + 5, exit=True)
    try:
        yield
    finally:
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device, why = pick_device(args)
    if device is None:
        print(f"gpu_check: checked nothing: {why}", flush=True)
        if args.json is not None:
            write_json(args.json, {"checked": False, "reason": why, "torch": torch.__version__})
        return 1 if args.require else 0
    budget = Budget(args.budget)
    meta = metadata(device, args)
    print(
        f"gpu_check: {meta['device_name']} ({device}), torch {meta['torch']}, CUDA {meta['cuda']}, "
        f"gradguard {meta['gradguard']}; budget {args.budget:.0f} s; sections {', '.join(args.sections)}",
        flush=True,
    )
    report = Report(meta, budget, args.json)
    hard_limit = args.hard_limit if args.hard_limit is not None else (args.budget + 25 if device.type == "cuda" else 0)
    with watchdog(hard_limit, report), tempfile.TemporaryDirectory(prefix="gpu_check-") as scratch:
        ctx = Context(device, args.quick, budget, report, Path(scratch), args.sections, args.seed, args.sizes)
        for name in args.sections:
            run_section(ctx, name)
    failures = report.failures()
    print(flush=True)
    print(
        f"gpu_check on {meta['device_name']} ({device}): torch {meta['torch']}, CUDA {meta['cuda']}, "
        f"{budget.elapsed():.0f} s",
        flush=True,
    )
    print(flush=True)
    print(report.table(), flush=True)
    print(flush=True)
    skipped = sum(1 for row in report.rows if row.result == "SKIPPED")
    unsure = sum(1 for row in report.rows if row.result == "INCONCLUSIVE")
    errors = sum(1 for row in report.rows if row.section not in CORRECTNESS and row.result == "ERROR")
    if failures:
        summary = f"{len(failures)} correctness check(s) failed: " + "; ".join(
            f"{r.section}: {r.case}" for r in failures
        )
    elif unsure:
        summary = "no correctness check failed, but some were inconclusive"
    elif not any(row.result == "PASS" for row in report.rows):
        summary = "no correctness check ran"
    else:
        summary = "all correctness checks that ran passed"
    extras = [
        f"{n} {what}" for n, what in ((unsure, "inconclusive"), (skipped, "skipped"), (errors, "timing errors")) if n
    ]
    print(f"gpu_check: {summary}" + (f" ({', '.join(extras)})" if extras else ""), flush=True)
    report.save()
    if args.json is not None:
        print(f"gpu_check: results in {args.json}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
