"""How fast ``gradguard audit`` reads a large log, and how much memory it takes.

Writes a synthetic audit log of at least ``--events`` events (default 1,000,000) shaped like a long
LLM run under the shipped policy (per-tensor clips of embeddings and attention on most steps, group
clips naming every parameter during warm-up, router clip_value, NaN batches skipped, a counters event
every 100 steps, a halt at the end; see ``write_synthetic_run`` in ``tests/support/synthetic_log.py``),
then runs ``gradguard audit --format json`` on it in a fresh process, as a user would, and reports:

- lines per second and MB per second (wall clock of the whole command, interpreter start included);
- the peak resident memory of that process (``ru_maxrss`` from ``os.wait4``), next to the peak of the
  same command on a tiny log (the interpreter and imports alone), and the log's size;
- whether the audit's totals equal the counters the generator kept (they must).

Run: ``python benchmarks/audit_throughput.py [--events N] [--params P] [--log PATH] [--keep]``.
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


def run_measured(command: list[str], out: Path) -> tuple[float, int, int]:
    """Wall seconds, peak RSS in bytes, and exit code of ``command`` run in a fresh process (stdout to ``out``)."""
    done = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, str(out), *command], capture_output=True, text=True, check=True
    )
    elapsed, maxrss, code = json.loads(done.stdout)
    peak = maxrss * (1 if sys.platform == "darwin" else 1024)  # bytes on macOS, KiB on Linux
    return float(elapsed), int(peak), int(code)


def run_audit(log: Path, out: Path) -> tuple[float, int, int]:
    """Wall seconds, peak RSS in bytes, and exit code of `python -m gradguard.cli audit LOG --format json`."""
    command = [sys.executable, "-m", "gradguard.cli", "audit", str(log), "--format", "json", "--no-progress"]
    return run_measured(command, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000, help="events to write (at least)")
    parser.add_argument("--params", type=int, default=200, help="parameter tensors of the synthetic model")
    parser.add_argument("--log", type=Path, default=None, help="where to write the log (default: a temporary file)")
    parser.add_argument("--keep", action="store_true", help="keep the log afterwards")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="gradguard-bench-"))
    log = args.log or workdir / "audit.jsonl"
    log.unlink(missing_ok=True)
    started = time.perf_counter()
    expected = write_synthetic_run(log, events=args.events, params=args.params)
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

    elapsed, peak, code = run_audit(log, workdir / "result.json")
    result: dict[str, Any] = json.loads((workdir / "result.json").read_text())
    ok = result["totals"] == expected and result["events"] == lines and result["mismatches_total"] == 0

    print(f"machine: {os.cpu_count()} CPU cores, Python {sys.version.split()[0]}, {sys.platform}")
    print(f"log: {lines:,} lines ({result['events']:,} events), {size / 1e6:,.0f} MB, written in {generated:.1f} s")
    print(f"gradguard audit --format json: {elapsed:.2f} s wall, exit {code}")
    print(f"throughput: {lines / elapsed:,.0f} lines/s, {size / 1e6 / elapsed:,.1f} MB/s")
    print(f"peak memory (RSS): {peak / 2**20:,.1f} MiB; the same command on a 3-line log: {baseline / 2**20:,.1f} MiB")
    print(f"totals equal the generator's counters: {ok}")
    if not args.keep:
        log.unlink(missing_ok=True)
    for leftover in workdir.iterdir():
        if leftover != log:
            leftover.unlink()
    if not args.keep and not any(workdir.iterdir()):
        workdir.rmdir()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
