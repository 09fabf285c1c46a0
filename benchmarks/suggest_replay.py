"""How fast ``gradguard suggest`` and ``gradguard replay`` read a long recorded run, and in how much memory.

Writes a synthetic run recorded by a ``monitor`` of every tensor's norm on every step (``--params``
tensors, default 300, x ``--steps`` steps, default 10,000: about 150 MB of ``stats`` lines in the guard's
exact event format; see ``write_norm_run`` in ``tests/support/synthetic_log.py``), then runs, each in a
fresh process as a user would:

- ``gradguard suggest LOG -o suggested.yaml``;
- ``gradguard replay suggested.yaml LOG --format json``;

and reports wall seconds (interpreter start, imports and exit included; the median of ``--repeats``) and
peak resident memory (``ru_maxrss``), at the full length and at a quarter of it: memory must stay flat in
the log's length (both commands stream; per family they keep a bounded histogram of ``ln(norm)``). It
also checks that the replay catches every injected spike.

Side by side, in the same run:

- ``--baseline TREE``: the same commands from another checkout of gradguard (``PYTHONPATH=TREE``, e.g. a
  ``git worktree`` of an older main), alternating with this one's, and the ratio (target: 3x);
- in one process, on the longer log: the standard library's ``json.loads`` of every line (what reading
  costs at the least), and the suggested policy's replay decided a block of steps at a time (as the
  command does) against one step at a time (``Replayer.in_blocks = False``), with their verdicts equal.

Run: ``python benchmarks/suggest_replay.py [--params P] [--steps N] [--baseline TREE] [--repeats R]
[--json OUT] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# The synthetic-log builder is test support code, kept out of the package: import it from tests/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from audit_throughput import run_measured
from support.synthetic_log import write_norm_run

THIS_TREE = Path(__file__).resolve().parents[1]
"""The checkout this benchmark belongs to: the "now" runs import its gradguard, whatever is installed."""
TARGET_SPEEDUP = 3.0
"""Each command, against the baseline tree (``--baseline``)."""

_IN_PROCESS = """
import json, sys, time
from pathlib import Path
from gradguard import Policy
from gradguard.tuning.records import Recording, recorded_steps
from gradguard.tuning.replay import Replayer
log, policy = Path(sys.argv[1]), Policy.load(sys.argv[2])
def parse():
    with open(log, "rb") as handle:
        for line in handle:
            json.loads(line)
def replay(in_blocks):
    recording, replayer = Recording(), Replayer(policy)
    replayer.in_blocks = in_blocks
    for recorded in recorded_steps([log], recording):
        if not replayer.feed(recorded):
            break
    return replayer.result(recording).as_json()
started = time.perf_counter()
parse()
out = {"stdlib_parse_s": time.perf_counter() - started}
verdicts = {}
for name, in_blocks in (("blocks_s", True), ("steps_s", False)):
    started = time.perf_counter()
    verdicts[name] = replay(in_blocks)
    out[name] = time.perf_counter() - started
out["verdicts_equal"] = verdicts["blocks_s"] == verdicts["steps_s"]
print(json.dumps(out))
"""
"""Times, in one process: the stdlib's parse of every line, and the replay in blocks and one step at a time."""


def _commands(log: Path, policy: Path) -> dict[str, list[str]]:
    cli = [sys.executable, "-m", "gradguard.cli"]
    return {
        "suggest": [*cli, "suggest", str(log), "-o", str(policy)],
        "replay": [*cli, "replay", str(policy), str(log), "--format", "json"],
    }


def measure(directory: Path, params: int, steps: int, baseline: Path | None, repeats: int) -> dict[str, Any]:
    """Write a run of ``steps`` steps, then time suggest and replay on it (and from ``baseline``, alternating)."""
    log = directory / f"norms-{steps}.jsonl"
    spikes = write_norm_run(log, params=params, steps=steps)
    trees = {"now": THIS_TREE, "before": baseline} if baseline is not None else {"now": THIS_TREE}
    times: dict[str, list[float]] = {}
    peaks: dict[str, int] = {}
    for _ in range(repeats):
        for label, tree in trees.items():
            env = {**os.environ, "PYTHONPATH": str(tree)}
            policy = directory / f"suggested-{steps}-{label}.yaml"
            for command, argv in _commands(log, policy).items():
                out = directory / f"{command}-{label}.out"
                # From the log's directory: `python -m` puts the working directory first on the path, before
                # PYTHONPATH, so a run from this tree's root would import this tree's gradguard as the baseline.
                seconds, peak, code = run_measured(argv, out, env, cwd=directory)
                if code != 0:
                    raise SystemExit(f"{command} ({label}) exited {code}: {' '.join(argv)}")
                times.setdefault(f"{command}_{label}_s", []).append(seconds)
                peaks[f"{command}_{label}_peak_mb"] = max(peaks.get(f"{command}_{label}_peak_mb", 0), peak)
    actions = json.loads((directory / "replay-now.out").read_text())["actions"]
    caught = set().union(*(set(entry["steps"]) for entry in actions if entry["action"] == "clip_norm"))
    row: dict[str, Any] = {"steps": steps, "params": params, "log_mb": log.stat().st_size / 1e6}
    row |= {key: statistics.median(values) for key, values in times.items()}
    row |= {key: value / 1e6 for key, value in peaks.items()}
    row |= {"spikes": len(spikes), "spikes_caught": len(set(spikes) & caught)}
    row["other_steps_clipped"] = len(caught - set(spikes))
    row["log"], row["policy"] = str(log), str(directory / f"suggested-{steps}-now.yaml")
    row["imported"] = {label: imported(tree, directory) for label, tree in trees.items()}
    return row


def imported(tree: Path, directory: Path) -> str:
    """The gradguard package a command run with ``PYTHONPATH=tree`` from ``directory`` imports."""
    done = subprocess.run(
        [sys.executable, "-c", "import gradguard; print(gradguard.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=directory,
        env={**os.environ, "PYTHONPATH": str(tree)},
    )
    return str(Path(done.stdout.strip()).parent)


def in_process(log: str, policy: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", _IN_PROCESS, log, policy],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(log).parent,
        env={**os.environ, "PYTHONPATH": str(THIS_TREE)},
    )
    figures: dict[str, Any] = json.loads(done.stdout)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=300, help="parameter tensors recorded on each step")
    parser.add_argument("--steps", type=int, default=10_000, help="recorded steps of the long log")
    parser.add_argument("--baseline", type=Path, help="another gradguard checkout to time side by side")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each command (the median is shown)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one run each, for a smoke test")
    args = parser.parse_args(argv)
    params, steps = (20, 1200) if args.quick else (args.params, args.steps)
    repeats = 1 if args.quick else args.repeats
    with tempfile.TemporaryDirectory(prefix="gradguard-suggest-") as tmp:
        rows = [measure(Path(tmp), params, steps // 4, args.baseline, repeats)]
        rows.append(measure(Path(tmp), params, steps, args.baseline, repeats))
        engine = in_process(rows[-1]["log"], rows[-1]["policy"])
    before = args.baseline is not None
    print(f"suggest and replay on {params} tensors, fresh processes, median of {repeats}")
    trees = rows[-1]["imported"]
    print(f"now: {trees['now']}; " + (f"before: {trees['before']}\n" if before else "no --baseline: no before\n"))
    heads = ["steps", "log MB", "suggest s"] + (["before s", "x"] if before else [])
    heads += ["replay s"] + (["before s", "x"] if before else []) + ["peak MB", "spikes caught", "other steps"]
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for row in rows:
        cells = [f"{row['steps']:,}", f"{row['log_mb']:.1f}"]
        for command in ("suggest", "replay"):
            cells.append(f"{row[f'{command}_now_s']:.2f}")
            if before:
                speedup = row[f"{command}_before_s"] / row[f"{command}_now_s"]
                row[f"{command}_speedup"] = speedup
                cells += [f"{row[f'{command}_before_s']:.2f}", f"**{speedup:.2f}**"]
        peak = max(row["suggest_now_peak_mb"], row["replay_now_peak_mb"])
        cells += [f"{peak:.0f}", f"{row['spikes_caught']}/{row['spikes']}", str(row["other_steps_clipped"])]
        print("| " + " | ".join(cells) + " |")
    growth = max(rows[-1][key] / rows[0][key] for key in ("suggest_now_peak_mb", "replay_now_peak_mb"))
    print(f"\npeak memory x{growth:.2f} for a log 4x longer")
    if before:
        met = all(rows[-1][f"{command}_speedup"] >= TARGET_SPEEDUP for command in ("suggest", "replay"))
        print(f"at least {TARGET_SPEEDUP:.0f}x faster than before at {steps:,} steps: {'yes' if met else 'NO'}")
    print(
        f"\nin one process, {steps:,} steps: stdlib json.loads of every line {engine['stdlib_parse_s']:.2f} s; "
        f"the replay in blocks {engine['blocks_s']:.2f} s "
        f"({engine['blocks_s'] / engine['stdlib_parse_s']:.2f}x the parse), one step at a time "
        f"{engine['steps_s']:.2f} s ({engine['steps_s'] / engine['blocks_s']:.1f}x the blocks); "
        f"verdicts equal: {'yes' if engine['verdicts_equal'] else 'NO'}"
    )
    if args.json is not None:
        for row in rows:
            del row["log"], row["policy"]
        args.json.write_text(json.dumps({"rows": rows, "in_process": engine, "memory_growth": growth}, indent=2))
    return 0 if engine["verdicts_equal"] and all(row["spikes_caught"] == row["spikes"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
