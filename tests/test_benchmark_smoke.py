"""The step-overhead benchmark still starts: its ``--quick`` run finishes in seconds and reports everything.

The benchmark itself (``python benchmarks/step_overhead.py``, minutes) is not part of the test run.
Both scripts run in this process (no second torch import), with torch's thread count restored after.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def benchmarks() -> Iterator[dict[str, ModuleType]]:
    """The benchmark scripts as modules; torch's intra-op thread count is put back afterwards."""
    threads = torch.get_num_threads()
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import cuda_sync_check
        import step_overhead

        yield {"step_overhead": step_overhead, "cuda_sync_check": cuda_sync_check}
    finally:
        sys.path.remove(str(BENCHMARKS))
        torch.set_num_threads(threads)


def test_the_quick_benchmark_run_prints_every_table_and_the_targets(
    benchmarks: dict[str, ModuleType], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--quick`` measures every treatment on both models and the sweep, and writes its JSON."""
    out = tmp_path / "result.json"
    assert benchmarks["step_overhead"].main(["--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for heading in ("**gpt**", "**deep**", "**sweep**", "**targets**"):
        assert heading in printed, printed
    result = json.loads(out.read_text())
    assert set(result["models"]) == {"gpt", "deep"}
    rows = {row["name"]: row for row in result["models"]["gpt"]["rows"]}
    for name in ("none", "global", "loop", "item-hook", "anomaly", "gg-a", "gg-a0", "gg-b", "gg-c0", "gg-c"):
        assert name in rows, sorted(rows)
    assert rows["gg-a"]["extra_syncs"] == 1, "gradguard reads its figures back in one sync per step"
    assert rows["gg-a"]["backward_syncs"] == 0, "and none while backward runs"
    assert rows["item-hook"]["backward_syncs"] > 0, "the sync counter sees a sync inside a hook"
    assert len(result["sweep"]["sizes"]) == 2
    assert not torch.is_anomaly_enabled(), "the anomaly row switched detection off again"


def test_the_cuda_sync_check_says_it_is_skipped_without_a_gpu(
    benchmarks: dict[str, ModuleType], capsys: pytest.CaptureFixture[str]
) -> None:
    """Without CUDA the sync check exits 0 and says why it checked nothing; with --require it fails."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run python benchmarks/cuda_sync_check.py for the real check")
    check = benchmarks["cuda_sync_check"]
    assert check.main([]) == 0
    assert "skipped, no CUDA device" in capsys.readouterr().out
    assert check.main(["--require"]) == 1
