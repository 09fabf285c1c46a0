"""How fast ``gradguard audit`` reads a large log, next to the standard library's parse of the same lines.

The log (``--lines``, default 1,000,000) is made of real lines: a real guarded training run (200
parameter tensors; per-tensor ``clip_norm`` on half of them, ``zclip`` at tensor scope on the other
half, a ``monitor`` of every tensor's norm every 5 steps, a NaN batch every 97 steps skipped by
``skip_step_on_nonfinite``, ``counters`` every 100 steps; ``--steps`` steps, default 300) is written by
the guard itself, then repeated with shifted steps, each repetition a run of its own (``run-1``,
``run-2``, ...) resumed where the one before ended, until the log has the lines asked for.
``--kind synthetic`` writes the older synthetic log instead (``write_synthetic_run`` in
``tests/support/synthetic_log.py``: shorter lines, almost all tensor clips).

``--ranks N`` writes the same lines as the logs of N ranks of one data-parallel job instead (``--lines`` in all,
each rank's file a share; each rank's runs ``run-K-rR``, its lines every other rank's replicas, as a job's ranks
write them), read at once: ``gradguard audit rank0.jsonl ... rankN-1.jsonl``.

Then, in one fresh process (``--repeats`` times, alternating; the median of each is the figure, the best beside it):

- the standard library: ``json.loads`` of every line of the files, nothing else;
- ``gradguard audit LOG... --format json``, in the same process (the command's code, output to a file);

and prints both times, their ratio and the audit's time per line (wall clock; CPU time beside it, steadier on a
shared machine).
The audit's totals must equal the counters the guard reported (exact). It also runs the command in a
process of its own, as a user would, for its peak resident memory, next to the same command's on a
3-line log (the interpreter and imports alone): memory stays flat in the log's length.

Run: ``python benchmarks/audit_throughput.py [--lines N] [--ranks N] [--kind real|synthetic] [--log PATH] [--keep]``.
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
out, repeats, logs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
times = {"stdlib": [], "audit": []}
def stdlib():
    for log in logs:
        with open(log, "rb") as handle:
            for line in handle:
                json.loads(line)
def audit():
    result = CliRunner().invoke(main, ["audit", *logs, "--format", "json", "--no-progress"])
    with open(out, "w") as handle:
        handle.write(result.stdout)
for _ in range(repeats):
    for name, work in (("stdlib", stdlib), ("audit", audit)):
        wall, cpu = time.perf_counter(), time.process_time()
        work()
        times[name].append([time.perf_counter() - wall, time.process_time() - cpu])
print(json.dumps(times))
"""
"""Times the stdlib's parse of every line and the audit in one process, alternating: every (wall, CPU) of each."""


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


def run_audit(logs: list[Path], out: Path) -> tuple[float, int, int]:
    """Wall seconds, peak RSS in bytes, and exit code of `python -m gradguard.cli audit LOG... --format json`."""
    command = [sys.executable, "-m", "gradguard.cli", "audit", *map(str, logs), "--format", "json", "--no-progress"]
    return run_measured(command, out)


def side_by_side(logs: list[Path], out: Path, repeats: int) -> dict[str, list[list[float]]]:
    """``{"stdlib": [[wall, cpu], ...], "audit": [...]}``: each of ``repeats`` runs, in one fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", _SIDE_BY_SIDE, str(out), str(repeats), *map(str, logs)],
        capture_output=True,
        text=True,
        check=True,
    )
    times: dict[str, list[list[float]]] = json.loads(done.stdout)
    return times


def rank_logs(log: Path, ranks: int) -> list[Path]:
    """The per-rank logs of ``--ranks N`` beside ``log``: ``LOG-rank0.jsonl`` ..."""
    return [log.with_name(f"{log.stem}-rank{rank}{log.suffix}") for rank in range(ranks)]


def count_lines(paths: list[Path]) -> int:
    """The lines of ``paths``, all together."""
    lines = 0
    for path in paths:
        with open(path, "rb") as handle:
            lines += sum(chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 24), b""))
    return lines


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


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


def repeated(base: Path, log: Path, lines: int, steps: int, rank: int | None = None) -> dict[str, dict[str, int]]:
    """``base``'s run repeated into ``log`` until it has ``lines`` lines (each repetition a run of its own, its
    steps shifted by ``steps``); the summed counters of every repetition's detach event. ``rank``: the lines are
    that rank's of a job (its runs ``run-K-rR``)."""
    events = [json.loads(line) for line in base.read_text().splitlines()]
    totals: dict[str, dict[str, int]] = {}
    written = 0
    with open(log, "w", encoding="utf-8") as out:
        repetition = 0
        while written < lines:
            batch = []
            for event in events[: lines - written]:
                shifted = dict(event, run=f"run-{repetition}")
                if rank is not None:
                    shifted.update(run=f"run-{repetition}-r{rank}", rank=rank)
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


def write_log(kind: str, logs: list[Path], lines: int, steps: int, workdir: Path) -> dict[str, dict[str, int]]:
    """The log (or every rank's, of ``lines`` in all); the totals the audit must give."""
    if kind == "synthetic":
        if len(logs) > 1:
            raise SystemExit("--ranks is for --kind real")
        return write_synthetic_run(logs[0], events=lines, params=TENSORS)
    base = workdir / "base.jsonl"
    base.unlink(missing_ok=True)
    real_run(base, steps)
    per_run = len(base.read_text().splitlines())
    share = lines // len(logs)
    share = max(per_run, share - share % per_run)
    if len(logs) == 1:
        return repeated(base, logs[0], share, steps)
    # Every rank counted the same events: the job's totals are one rank's (the audit counts each once).
    totals = [repeated(base, log, share, steps, rank) for rank, log in enumerate(logs)]
    return totals[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=1_000_000, help="lines of the log, of all ranks' (about)")
    parser.add_argument("--ranks", type=int, default=1, help="write the lines as this many ranks' logs of one job")
    parser.add_argument("--steps", type=int, default=300, help="steps of the real run that is repeated")
    parser.add_argument("--kind", choices=("real", "synthetic"), default="real")
    parser.add_argument("--repeats", type=int, default=3, help="times each is measured (the median is the figure)")
    parser.add_argument("--log", type=Path, default=None, help="where to write the log (default: a temporary file)")
    parser.add_argument("--keep", action="store_true", help="keep the log afterwards")
    parser.add_argument("--reuse", action="store_true", help="read --log as it is (its totals are not checked)")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="gradguard-bench-"))
    log = args.log or workdir / "audit.jsonl"
    logs = [log] if args.ranks == 1 else rank_logs(log, args.ranks)
    started = time.perf_counter()
    expected = None
    if not (args.reuse and all(path.exists() for path in logs)):
        for path in logs:
            path.unlink(missing_ok=True)
        expected = write_log(args.kind, logs, args.lines, args.steps, workdir)
    generated = time.perf_counter() - started
    lines = count_lines(logs)
    size = sum(path.stat().st_size for path in logs)

    tiny = workdir / "tiny.jsonl"
    with LogBuilder(tiny) as small:
        small.attach({"r": 1})
        small.clip(0, "r", "w", 2.0)
        small.detach(1)
    _, baseline, _ = run_audit([tiny], workdir / "tiny.json")

    times = side_by_side(logs, workdir / "side.json", args.repeats)
    elapsed, peak, code = run_audit(logs, workdir / "result.json")
    result: dict[str, Any] = json.loads((workdir / "result.json").read_text())
    same = json.loads((workdir / "side.json").read_text())["totals"] == result["totals"]
    ok = same and result["events"] == lines and result["mismatches_total"] == 0 and result["bad_lines_total"] == 0
    if expected is not None:
        ok = ok and result["totals"] == expected
    figures = {
        name: [median([wall for wall, _ in runs]), median([cpu for _, cpu in runs]), min(wall for wall, _ in runs)]
        for name, runs in times.items()
    }
    (stdlib_wall, stdlib_cpu, stdlib_best), (audit_wall, audit_cpu, audit_best) = figures["stdlib"], figures["audit"]
    of = f"median of {args.repeats}"

    print(f"machine: {os.cpu_count()} CPU cores, Python {sys.version.split()[0]}, {sys.platform}")
    shape = f"{lines:,} lines ({result['events']:,} events), {size / 1e6:,.0f} MB, {size / lines:.0f} B a line"
    ranks = "" if len(logs) == 1 else f", the logs of {len(logs)} ranks of one job"
    print(f"log ({'as given' if expected is None else args.kind}{ranks}): {shape}")
    print(
        f"stdlib json.loads of every line: {stdlib_wall:.2f} s wall, {stdlib_cpu:.2f} s CPU "
        f"({of}; best {stdlib_best:.2f})"
    )
    print(
        f"gradguard audit, same process:   {audit_wall:.2f} s wall, {audit_cpu:.2f} s CPU ({of}; best {audit_best:.2f})"
    )
    print(
        f"audit / stdlib parse: {audit_wall / stdlib_wall:.2f} wall, {audit_cpu / stdlib_cpu:.2f} CPU "
        f"(target: <= 0.40); the audit {audit_wall / lines * 1e6:.2f} us a line"
    )
    print(f"gradguard audit in a fresh process: {elapsed:.2f} s wall ({lines / elapsed:,.0f} lines/s), exit {code}")
    print(f"peak memory (RSS): {peak / 2**20:,.1f} MiB; the same command on a 3-line log: {baseline / 2**20:,.1f} MiB")
    print(
        f"totals equal the guard's counters, no mismatch, no unreadable line: {ok} (log written in {generated:.0f} s)"
    )
    if not args.keep and args.log is None:
        for path in logs:
            path.unlink(missing_ok=True)
    for leftover in workdir.iterdir():
        if leftover not in logs:
            leftover.unlink()
    if not any(workdir.iterdir()):
        workdir.rmdir()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
