"""How fast ``gradguard suggest`` and ``gradguard replay`` read a long recorded run, and in how much memory.

Writes a synthetic run recorded by a ``monitor`` of every tensor's norm on every step (``--params``
tensors, default 300, x ``--steps`` steps, default 10,000: about 150 MB of ``stats`` lines in the guard's
exact event format; see ``write_norm_run`` in ``tests/support/synthetic_log.py``), then runs, each in a
fresh process as a user would:

- ``gradguard suggest LOG -o suggested.yaml``;
- ``gradguard replay suggested.yaml LOG --format json``;

and reports wall seconds (interpreter start and imports included) and peak resident memory
(``ru_maxrss``), at the full length and at a quarter of it: memory must stay flat in the log's length
(both commands stream; per family they keep a bounded histogram of ``ln(norm)``). It also checks that the
replay catches every injected spike. Target: each command under 60 s at 10,000 steps.

Run: ``python benchmarks/suggest_replay.py [--params P] [--steps N] [--json OUT] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

# The synthetic-log builder is test support code, kept out of the package: import it from tests/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from audit_throughput import run_measured
from support.synthetic_log import write_norm_run

TARGET_S = 60.0


def measure(directory: Path, params: int, steps: int) -> dict[str, Any]:
    """Write a run of ``steps`` steps, then time suggest and replay on it."""
    log = directory / f"norms-{steps}.jsonl"
    spikes = write_norm_run(log, params=params, steps=steps)
    policy = directory / f"suggested-{steps}.yaml"
    cli = [sys.executable, "-m", "gradguard.cli"]
    suggest_s, suggest_rss, suggest_code = run_measured([*cli, "suggest", str(log), "-o", str(policy)], directory / "s")
    report = directory / "replay.json"
    replay_command = [*cli, "replay", str(policy), str(log), "--format", "json"]
    replay_s, replay_rss, replay_code = run_measured(replay_command, report)
    actions = json.loads(report.read_text())["actions"]
    caught = set().union(*(set(entry["steps"]) for entry in actions if entry["action"] == "clip_norm"))
    return {
        "steps": steps,
        "params": params,
        "log_mb": log.stat().st_size / 1e6,
        "suggest_s": suggest_s,
        "suggest_peak_mb": suggest_rss / 1e6,
        "suggest_exit": suggest_code,
        "replay_s": replay_s,
        "replay_peak_mb": replay_rss / 1e6,
        "replay_exit": replay_code,
        "spikes": len(spikes),
        "spikes_caught": len(set(spikes) & caught),
        "other_steps_clipped": len(caught - set(spikes)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=300, help="parameter tensors recorded on each step")
    parser.add_argument("--steps", type=int, default=10_000, help="recorded steps of the long log")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    args = parser.parse_args(argv)
    params, steps = (20, 1200) if args.quick else (args.params, args.steps)
    with tempfile.TemporaryDirectory(prefix="gradguard-suggest-") as tmp:
        rows = [measure(Path(tmp), params, steps // 4), measure(Path(tmp), params, steps)]
    print(f"suggest and replay on {params} tensors (target: under {TARGET_S:.0f} s each at the longer log)\n")
    print("| steps | log MB | suggest s | suggest peak MB | replay s | replay peak MB | spikes caught | other steps |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['steps']:,} | {row['log_mb']:.1f} | {row['suggest_s']:.1f} | {row['suggest_peak_mb']:.0f} "
            f"| {row['replay_s']:.1f} | {row['replay_peak_mb']:.0f} | {row['spikes_caught']}/{row['spikes']} "
            f"| {row['other_steps_clipped']} |"
        )
    long = rows[-1]
    within = long["suggest_s"] < TARGET_S and long["replay_s"] < TARGET_S
    growth = max(long[key] / rows[0][key] for key in ("suggest_peak_mb", "replay_peak_mb"))
    print(f"\nunder {TARGET_S:.0f} s: {'yes' if within else 'NO'}; peak memory x{growth:.2f} for a log 4x longer")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "within_target": within, "memory_growth": growth}, indent=2))
    ok = all(row["suggest_exit"] == 0 and row["replay_exit"] == 0 for row in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
