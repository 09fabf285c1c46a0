"""Whether ``gradguard audit`` reads a job's per-rank logs as fast a line as one log: the two side by side.

Writes (or, with ``--reuse``, reads) the two logs of ``benchmarks/audit_throughput.py``, with the same lines: one log
of ``--lines`` lines (``LOG``), and the same lines as ``--ranks`` ranks' logs of one data-parallel job
(``LOG-rank0`` ... : each rank's runs ``run-K-rR``, its lines every other rank's replicas). Then, in one fresh
process, ``gradguard audit LOG --format json`` and ``gradguard audit LOG-rank0 ... --format json`` by turns
(``--repeats`` times each after a turn of each not counted; which goes first alternates), and prints each one's CPU
time a line (the median and the best) and, for each turn, the rank logs' time a line over the one log's: the median
of those ratios is the figure (turns side by side share the machine's state; on a shared machine, wall and CPU time
drift by a tenth within a minute). With ``--processes K``, K such processes one after the other, their ratios pooled:
the figure moved from one process to the next by more than it did within one (a process's hash seed and memory
layout are its own; medians of 15 turns from 0.967 to 1.034 for the same code). Both reports' totals must be the
guard's counters (exact), unless ``--reuse``.

Run: ``python benchmarks/audit_per_line.py [--lines N] [--ranks N] [--repeats N] [--processes K] [--log PATH] [--keep]
[--reuse]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from audit_throughput import count_lines, median, rank_logs, write_log

_BY_TURNS = """
import json, sys, time
from click.testing import CliRunner
from gradguard.cli import main
repeats, one, ranks = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
times, totals = {"one": [], "ranks": []}, {}
for turn in range(-1, repeats):  # turn -1 warms the process up (imports, the first allocations): not counted
    order = (("one", [one]), ("ranks", ranks))
    for name, logs in order if turn % 2 == 0 else order[::-1]:
        cpu = time.process_time()
        result = CliRunner().invoke(main, ["audit", *logs, "--format", "json", "--no-progress"])
        if turn >= 0:
            times[name].append(time.process_time() - cpu)
        report = json.loads(result.stdout)
        totals[name] = [report["totals"], report["events"], report["mismatches_total"], report["bad_lines_total"]]
print(json.dumps({"times": times, "totals": totals}))
"""
"""Audits the one log and the rank logs by turns in one process: CPU seconds of each turn, and each one's totals."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=1_000_000, help="lines of each log set (about)")
    parser.add_argument("--ranks", type=int, default=4, help="ranks of the job whose logs are read together")
    parser.add_argument("--steps", type=int, default=300, help="steps of the real run that is repeated")
    parser.add_argument("--repeats", type=int, default=9, help="turns of each in a process")
    parser.add_argument(
        "--processes", type=int, default=1, help="fresh processes, one after the other (their turns' ratios pooled)"
    )
    parser.add_argument("--log", type=Path, default=None, help="the one log's path; the ranks' beside it")
    parser.add_argument("--keep", action="store_true", help="keep the logs afterwards")
    parser.add_argument("--reuse", action="store_true", help="read the logs as they are (totals not checked)")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="gradguard-bench-"))
    one = args.log or workdir / "audit.jsonl"
    ranks = rank_logs(one, args.ranks)
    expected: dict[str, object] = {}
    for name, logs in (("one", [one]), ("ranks", ranks)):
        if not (args.reuse and all(path.exists() for path in logs)):
            for path in logs:
                path.unlink(missing_ok=True)
            expected[name] = write_log("real", logs, args.lines, args.steps, workdir)
    lines = {"one": count_lines([one]), "ranks": count_lines(ranks)}

    per_line: dict[str, list[float]] = {"one": [], "ranks": []}
    medians: list[float] = []
    ok = True
    for _ in range(args.processes):
        done = subprocess.run(
            [sys.executable, "-c", _BY_TURNS, str(args.repeats), str(one), *map(str, ranks)],
            capture_output=True,
            text=True,
            check=True,
        )
        measured = json.loads(done.stdout)
        for name, runs in measured["times"].items():
            per_line[name] += [seconds / lines[name] * 1e6 for seconds in runs]
        medians.append(median([ranks / one for one, ranks in zip(*measured["times"].values(), strict=True)]))
        for name, (totals, events, mismatches, bad) in measured["totals"].items():
            ok = ok and events == lines[name] and mismatches == 0 and bad == 0
            if name in expected:
                ok = ok and totals == expected[name]
    ratios = [ranks_us / one_us for one_us, ranks_us in zip(per_line["one"], per_line["ranks"], strict=True)]

    print(f"one log: {lines['one']:,} lines; {args.ranks} ranks' logs of one job: {lines['ranks']:,} lines in all")
    for name, label in (("one", "one log"), ("ranks", f"{args.ranks} ranks' logs")):
        values = per_line[name]
        print(f"{label}: {median(values):.3f} us a line CPU (median of {len(values)}; best {min(values):.3f})")
    shown = ", ".join(f"{ratio:.3f}" for ratio in ratios)
    print(f"ranks' logs / one log, a line, turn by turn: {shown}")
    if args.processes > 1:
        print(f"each process's median: {', '.join(f'{value:.3f}' for value in medians)}")
    print(f"median: {median(ratios):.3f} (target: <= 1.00)")
    print(f"each report's totals exact, no mismatch, no unreadable line: {ok}")
    if not args.keep and args.log is None:
        for path in [one, *ranks]:
            path.unlink(missing_ok=True)
    for leftover in workdir.iterdir():
        leftover.unlink()
    workdir.rmdir()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
