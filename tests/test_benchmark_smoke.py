"""The step-overhead benchmark still starts: its ``--quick`` run finishes in seconds and reports everything.

The benchmark itself (``python benchmarks/step_overhead.py``, minutes) is not part of the test run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(BENCHMARKS / script), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, check=False, cwd=ROOT)


def test_the_quick_benchmark_run_prints_every_table_and_the_targets(tmp_path: Path) -> None:
    """``--quick`` measures every treatment on both models and the sweep, and writes its JSON."""
    out = tmp_path / "result.json"
    done = run("step_overhead.py", "--quick", "--json", str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    for heading in ("**gpt**", "**deep**", "**sweep**", "**targets**"):
        assert heading in done.stdout, done.stdout
    result = json.loads(out.read_text())
    assert set(result["models"]) == {"gpt", "deep"}
    rows = {row["name"]: row for row in result["models"]["gpt"]["rows"]}
    for name in ("none", "global", "loop", "item-hook", "anomaly", "gg-a", "gg-a0", "gg-b", "gg-c0", "gg-c"):
        assert name in rows, sorted(rows)
    assert rows["gg-a"]["extra_syncs"] == 1, "gradguard reads its figures back in one sync per step"
    assert rows["gg-a"]["backward_syncs"] == 0, "and none while backward runs"
    assert rows["item-hook"]["backward_syncs"] > 0, "the sync counter sees a sync inside a hook"
    assert len(result["sweep"]["sizes"]) == 2


def test_the_cuda_sync_check_says_it_is_skipped_without_a_gpu() -> None:
    """Without CUDA the sync check exits 0 and says why it checked nothing (with --require it fails)."""
    import torch

    if torch.cuda.is_available():
        return  # on a GPU machine it runs for real: python benchmarks/cuda_sync_check.py
    done = run("cuda_sync_check.py")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "skipped, no CUDA device" in done.stdout
    assert run("cuda_sync_check.py", "--require").returncode == 1
