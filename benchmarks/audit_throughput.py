"""How fast ``gradguard audit`` reads a large log, next to the standard library's parse of the same lines.

The log (``--lines``, default 1,000,000) is made of real lines: a real guarded training run (200
parameter tensors; per-tensor ``clip_norm`` on half of them, ``zclip`` at tensor scope on the other
half, a ``monitor`` of every tensor's norm every 5 steps, a NaN batch every 97 steps skipped by
``skip_step_on_nonfinite``, ``counters`` every 100 steps; ``--steps`` steps, default 300) is written by
the guard itself, then repeated with shifted steps, each repetition a run of its own (``run-1``,
``run-2``, ...) resumed where the one before ended, until the log has the lines asked for.
``--kind synthetic`` writes the older synthetic log instead (``write_synthetic_run`` in
``tests/support/synthetic_log.py``: shorter lines, almost all tensor clips).

Then, in one fresh process (``--repeats`` times, alternating, best of each kept):

- the standard library: ``json.loads`` of every line of the file, nothing else;
- ``gradguard audit LOG --format json``, in the same process (the command's code, output to a file);

and prints both times and their ratio (wall clock; CPU time beside it, steadier on a shared machine).
The audit's totals must equal the counters the guard reported (exact). It also runs the command in a
process of its own, as a user would, for its peak resident memory, next to the same command's on a
3-line log (the interpreter and imports alone): memory stays flat in the log's length.

Run: ``python benchmarks/audit_throughput.py [--lines N] [--kind real|synthetic] [--log PATH] [--keep]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The synthetic-log builder is test support code, kept out of the package: import it from tests/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.synthetic_log import LogBuilder, write_synthetic_run

TENSORS = 200
POLICY: dict[str, Any] = {
    "version": 1,
    "rules": [
        {"name": "nonfinite", "match": "*", "actions": [{"action": "skip_step_on_nonfinite"}]},
        {"name": "clip", "match": ["re:[0-4]?[0-9]\\..*"], "actions": [{"action": "clip_norm", "max_norm": 6.0}]},
        {
            "name": "zclip",
            "match": ["re:[5-9][0-9]\\..*"],
            "actions": [{"action": "zclip", "warmup_steps": 5, "z_thresh": 1.0}],
        },
        {"name": "norms", "match": "*", "actions": [{"action": "monitor", "stats": ["norm"], "every": 5}]},
    ],
}

STEP_FIELDS = ("step", "start_step", "steps")
"""The fields of a step number a repetition shifts: each repetition is a run resumed where the one before ended
(its guard attached at ``start_step``, counting its steps on from there), so the audit sees the steps each ran."""

_LAUNCHER = """
import json, os, subprocess, sys, time
started = time.perf_counter()
with open(sys.argv[1], "wb") as out:
    process = subprocess.Popen(sys.argv[2:], stdout=out)
    _, status, usage = os.wait4(process.pid, 0)
elapsed = time.perf_counter() - started
print(json.dumps([elapsed, usage.ru_maxrss, os.waitstatus_to_exitcode(status)]))
"""
"""A lean parent for the measured process: on Linux a child's ru_maxrss starts at its parent's peak
(the pages it was forked from), so the benchmark, which has just written a large log, must not be
that parent."""

_SIDE_BY_SIDE = """
import json, sys, time
from click.testing import CliRunner
from gradguard.cli import main
log, out, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
best = {"stdlib": [1e9, 1e9], "audit": [1e9, 1e9]}
def stdlib():
    with open(log, "rb") as handle:
        for line in handle:
            json.loads(line)
def audit():
    result = CliRunner().invoke(main, ["audit", log, "--format", "json", "--no-progress"])
    with open(out, "w") as handle:
        handle.write(result.stdout)
for _ in range(repeats):
    for name, work in (("stdlib", stdlib), ("audit", audit)):
        wall, cpu = time.perf_counter(), time.process_time()
        work()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        best[name] = [min(best[name][0], wall), min(best[name][1], cpu)]
print(json.dumps(best))
"""
"""Times the stdlib's parse of every line and the audit in one process, alternating, best of each."""


def run_measured(
    command: list[str], out: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> tuple[float, int, int]:
    """Wall seconds, peak RSS in bytes, and exit code of ``command`` run in a fresh process (stdout to ``out``;
    ``env`` and ``cwd``: its environment and directory, else this one's)."""
    done = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, str(out), *command],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=cwd,
    )
    elapsed, maxrss, code = json.loads(done.stdout)
    peak = maxrss * (1 if sys.platform == "darwin" else 1024)  # bytes on macOS, KiB on Linux
    return float(elapsed), int(peak), int(code)


def run_audit(log: Path, out: Path) -> tuple[float, int, int]:
    """Wall seconds, peak RSS in bytes, and exit code of `python -m gradguard.cli audit LOG --format json`."""
    command = [sys.executable, "-m", "gradguard.cli", "audit", str(log), "--format", "json", "--no-progress"]
    return run_measured(command, out)


def side_by_side(log: Path, out: Path, repeats: int) -> dict[str, list[float]]:
    """``{"stdlib": [wall, cpu], "audit": [wall, cpu]}``: the best of ``repeats`` of each, in one fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", _SIDE_BY_SIDE, str(log), str(out), str(repeats)],
        capture_output=True,
        text=True,
        check=True,
    )
    best: dict[str, list[float]] = json.loads(done.stdout)
    return best


def real_run(log: Path, steps: int) -> dict[str, dict[str, int]]:
    """A real guarded training run of ``steps`` steps (see the module's docstring); the guard's counters."""
    import torch
    from torch import nn

    from gradguard import GradGuard, Policy

    class Wide(nn.ModuleList):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.stack([layer(x) for layer in self]).sum(0)

    torch.manual_seed(0)
    model = Wide([nn.Linear(8, 8) for _ in range(TENSORS // 2)])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-9)
    with GradGuard(model, Policy.from_dict(POLICY), audit_log=log, logger=None, summary_every=100) as guard:
        for step in range(steps):
            x = torch.randn(4, 8) * (31.0 if step % 13 == 0 else 1.0)
            if step % 97 == 50:
                x[0, 0] = float("nan")
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
    counters: dict[str, dict[str, int]] = guard.counters.snapshot()
    return counters


def repeated(base: Path, log: Path, lines: int, steps: int) -> dict[str, dict[str, int]]:
    """``base``'s run repeated into ``log`` until it has ``lines`` lines (each repetition a run of its own, its
    steps shifted by ``steps``); the summed counters of every repetition's detach event."""
    events = [json.loads(line) for line in base.read_text().splitlines()]
    totals: dict[str, dict[str, int]] = {}
    written = 0
    with open(log, "w", encoding="utf-8") as out:
        repetition = 0
        while written < lines:
            batch = []
            for event in events[: lines - written]:
                shifted = dict(event, run=f"run-{repetition}")
                for key in STEP_FIELDS:
                    if key in shifted:
                        shifted[key] += repetition * steps
                batch.append(json.dumps(shifted))
                if event["event"] == "detach":
                    for rule, by_action in event["counters"].items():
                        into = totals.setdefault(rule, {})
                        for action, n in by_action.items():
                            into[action] = into.get(action, 0) + n
            out.write("\n".join(batch) + "\n")
            written += len(batch)
            repetition += 1
    if written % len(events):
        raise SystemExit("--lines must be a multiple of the base run's lines for exact totals; use the default")
    return totals


def write_log(kind: str, log: Path, lines: int, steps: int, workdir: Path) -> dict[str, dict[str, int]]:
    if kind == "synthetic":
        return write_synthetic_run(log, events=lines, params=TENSORS)
    base = workdir / "base.jsonl"
    base.unlink(missing_ok=True)
    real_run(base, steps)
    per_run = len(base.read_text().splitlines())
    return repeated(base, log, max(per_run, lines - lines % per_run), steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=1_000_000, help="lines of the log (about)")
    parser.add_argument("--steps", type=int, default=300, help="steps of the real run that is repeated")
    parser.add_argument("--kind", choices=("real", "synthetic"), default="real")
    parser.add_argument("--repeats", type=int, default=3, help="times each is measured (best kept)")
    parser.add_argument("--log", type=Path, default=None, help="where to write the log (default: a temporary file)")
    parser.add_argument("--keep", action="store_true", help="keep the log afterwards")
    parser.add_argument("--reuse", action="store_true", help="read --log as it is (its totals are not checked)")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="gradguard-bench-"))
    log = args.log or workdir / "audit.jsonl"
    started = time.perf_counter()
    expected = None
    if not (args.reuse and log.exists()):
        log.unlink(missing_ok=True)
        expected = write_log(args.kind, log, args.lines, args.steps, workdir)
    generated = time.perf_counter() - started
    with open(log, "rb") as handle:
        lines = sum(chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 24), b""))
    size = log.stat().st_size

    tiny = workdir / "tiny.jsonl"
    with LogBuilder(tiny) as small:
        small.attach({"r": 1})
        small.clip(0, "r", "w", 2.0)
        small.detach(1)
    _, baseline, _ = run_audit(tiny, workdir / "tiny.json")

    best = side_by_side(log, workdir / "side.json", args.repeats)
    elapsed, peak, code = run_audit(log, workdir / "result.json")
    result: dict[str, Any] = json.loads((workdir / "result.json").read_text())
    same = json.loads((workdir / "side.json").read_text())["totals"] == result["totals"]
    ok = same and result["events"] == lines and result["mismatches_total"] == 0 and result["bad_lines_total"] == 0
    if expected is not None:
        ok = ok and result["totals"] == expected
    (stdlib_wall, stdlib_cpu), (audit_wall, audit_cpu) = best["stdlib"], best["audit"]

    print(f"machine: {os.cpu_count()} CPU cores, Python {sys.version.split()[0]}, {sys.platform}")
    shape = f"{lines:,} lines ({result['events']:,} events), {size / 1e6:,.0f} MB, {size / lines:.0f} B a line"
    print(f"log ({'as given' if expected is None else args.kind}): {shape}")
    print(f"stdlib json.loads of every line: {stdlib_wall:.2f} s wall, {stdlib_cpu:.2f} s CPU (best of {args.repeats})")
    print(f"gradguard audit, same process:   {audit_wall:.2f} s wall, {audit_cpu:.2f} s CPU (best of {args.repeats})")
    print(
        f"audit / stdlib parse: {audit_wall / stdlib_wall:.2f} wall, {audit_cpu / stdlib_cpu:.2f} CPU (target: <= 0.5)"
    )
    print(f"gradguard audit in a fresh process: {elapsed:.2f} s wall ({lines / elapsed:,.0f} lines/s), exit {code}")
    print(f"peak memory (RSS): {peak / 2**20:,.1f} MiB; the same command on a 3-line log: {baseline / 2**20:,.1f} MiB")
    print(
        f"totals equal the guard's counters, no mismatch, no unreadable line: {ok} (log written in {generated:.0f} s)"
    )
    if not args.keep and args.log is None:
        log.unlink(missing_ok=True)
    for leftover in workdir.iterdir():
        if leftover != log:
            leftover.unlink()
    if not any(workdir.iterdir()):
        workdir.rmdir()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
