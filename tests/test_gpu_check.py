"""benchmarks/gpu_check.py still runs: without CUDA it checks nothing and says so, and its correctness
sections pass on the CPU (``--device cpu``), so that the one run it gets on a GPU is not its first.

The script runs in this process (no second torch import), with torch's thread count put back after.
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
def gpu_check() -> Iterator[ModuleType]:
    threads = torch.get_num_threads()
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gpu_check

        yield gpu_check
    finally:
        sys.path.remove(str(BENCHMARKS))
        torch.set_num_threads(threads)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the script would run for minutes")
def test_without_cuda_it_checks_nothing_says_why_and_fails_only_when_required(
    gpu_check: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    assert gpu_check.main(["--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "checked nothing" in printed
    assert "no CUDA device is available" in printed
    assert json.loads(out.read_text())["checked"] is False
    assert gpu_check.main(["--require"]) == 1
    assert "checked nothing" in capsys.readouterr().out


def test_the_correctness_sections_pass_on_the_cpu(
    gpu_check: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Recovery (every optimizer implementation, with and without a GradScaler), provenance and torch.compile."""
    out = tmp_path / "result.json"
    argv = ["--device", "cpu", "--quick", "--only", "recovery,provenance,compile", "--json", str(out)]
    assert gpu_check.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| section | case | result | figures |" in printed
    result = json.loads(out.read_text())
    assert result["checked"] is True
    assert result["meta"]["torch"] == torch.__version__
    assert result["failures"] == []
    assert set(result["sections"]) == {"recovery", "provenance", "compile"}
    rows = [row for row in result["rows"] if row["result"] != "INFO"]
    results = {(row["section"], row["case"]): row["result"] for row in rows}
    assert all(value == "PASS" for value in results.values()), results
    cases = {section: [case for s, case in results if s == section] for section in result["sections"]}
    modes = len(gpu_check.recovery_memory_modes())
    in_flight = 2 if modes > 1 else 0  # host mode: fused AdamW with and without a GradScaler, copies held back
    assert len(cases["recovery"]) == 7 * modes + in_flight  # AdamW x3, SGD fused; AdamW x3 under a GradScaler
    assert sum("GradScaler" in case for case in cases["recovery"]) == 3 * modes + in_flight // 2
    assert sum("fused" in case for case in cases["recovery"]) == 3 * modes + in_flight
    assert sum("still in flight" in case for case in cases["recovery"]) == in_flight
    assert len(cases["provenance"]) == 4
    assert len(cases["compile"]) == 1


def test_the_snapshot_section_reports_the_bytes_each_memory_mode_held_before_the_guard_let_them_go(
    gpu_check: ModuleType, tmp_path: Path
) -> None:
    """Keep 2: twice the parameters and optimizer state that one copy moves, in every mode (the 2026-11-28 H200 run
    read the guard's metrics after ``remove()`` and printed 0.00 GiB held)."""
    out = tmp_path / "result.json"
    assert gpu_check.main(["--device", "cpu", "--quick", "--only", "snapshot", "--json", str(out)]) == 0
    rows = {row["case"]: row for row in json.loads(out.read_text())["rows"]}
    one_copy = next(row["data"]["bytes"] for case, row in rows.items() if "into device buffers" in case)
    held = {case: row["data"]["snapshot_bytes"] for case, row in rows.items() if "recovery every" in case}
    assert len(held) == len(gpu_check.recovery_memory_modes())
    assert set(held.values()) == {2 * one_copy}


def test_an_unknown_model_size_is_refused_naming_the_sizes_there_are(
    gpu_check: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cpu", "--sizes", "7M,9M"])
    assert "unknown size(s) ['9M']; the sizes are 7M, 163M, 1.4B" in capsys.readouterr().err
