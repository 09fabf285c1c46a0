"""``gradguard audit`` on the logs of real 2-rank gloo runs (tests/support/audit_rank_scenarios.py): a halt of the
``ranks`` section is counted as the guard counted it (no false counter mismatch), a tie of faults names no rank
above the other, and a skipped step shows the account of the rank that made its fault, whichever log comes first;
in text, Markdown and JSON (whose schema-1 keys stay)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from support.gloo_ranks import free_port

from gradguard.audit.summary import AuditSummary
from gradguard.cli import main

SCRIPT = Path(__file__).parent / "support" / "audit_rank_scenarios.py"
SCENARIOS = ("divergence_halt", "outlier_halt", "outlier_skip", "nan_both_ranks_skip", "nan_rank_one_skip")
SCHEMA_1_KEYS = {"schema", "exit_code"} | {field.name for field in fields(AuditSummary)} - {"series_counts", "added"}
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    outdir = tmp_path_factory.mktemp("audit-rank-runs")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(SCRIPT), ",".join(SCENARIOS), "2", str(outdir), str(free_port())]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400, check=False)
    except subprocess.TimeoutExpired as hung:  # a hang guard, not a speed claim
        raise AssertionError("the ranks hung") from hung
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return outdir


def logs(runs: Path, name: str, *, first: int = 0) -> list[Path]:
    """The scenario's two ranks' logs, rank ``first``'s first."""
    return [runs / name / f"audit-rank{rank}.jsonl" for rank in (first, 1 - first)]


def audit(fmt: str, paths: list[Path]) -> str:
    return CliRunner().invoke(main, ["audit", "--format", fmt, *map(str, paths)]).stdout


def audit_json(paths: list[Path]) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(audit("json", paths))
    assert set(data) == SCHEMA_1_KEYS
    assert data["schema"] == 1
    return data


@pytest.mark.parametrize(
    ("name", "kind", "column"),
    [("divergence_halt", "divergence", "divergences"), ("outlier_halt", "outlier", "outliers")],
)
def test_a_halt_of_the_ranks_section_is_counted_as_ranks_halt_and_no_mismatch_is_reported(
    runs: Path, name: str, kind: str, column: str
) -> None:
    data = audit_json(logs(runs, name))
    assert data["mismatches_total"] == 0, data["mismatches"]
    assert data["totals"] == {"ranks": {kind: 1, "halt": 1}}
    assert [(halt["rule"], halt["kind"], halt["ranks"]) for halt in data["halts"]] == [("ranks", kind, [0, 1])]
    assert data["findings"] == ["1 halt"]
    (rank_one,) = data["by_rank"]
    assert (rank_one["rank"], rank_one["halts"], rank_one[column]) == (1, 1, 1)
    for fmt in ("table", "markdown"):
        text = audit(fmt, logs(runs, name))
        assert "MISMATCH" not in text
        assert "halt_on_nonfinite" not in text
        assert "1 halt (exit 1)" in text


def test_an_outlier_skip_is_a_skipped_step_counted_as_the_guard_counted_it(runs: Path) -> None:
    data = audit_json(logs(runs, "outlier_skip"))
    assert data["mismatches_total"] == 0, data["mismatches"]
    assert data["totals"] == {"ranks": {"outlier": 1, "skip": 1}}
    assert (data["skips"]["steps"], data["skips_by_rule"]) == ([3], {"ranks": 1})
    assert data["findings"] == ["1 skipped step"]
    for fmt in ("table", "markdown"):
        text = audit(fmt, logs(runs, "outlier_skip"))
        assert "1 step skipped by the guard (rule ranks 1) at steps 3; a rank's own gradient norm far above" in text
        assert "MISMATCH" not in text


def test_a_fault_made_on_both_ranks_names_no_rank_as_the_one_with_most_faults(runs: Path) -> None:
    data = audit_json(logs(runs, "nan_both_ranks_skip"))
    assert [(row["rank"], row["skips"]) for row in data["by_rank"]] == [(0, 1), (1, 1)]
    for fmt in ("table", "markdown"):
        text = audit(fmt, logs(runs, "nan_both_ranks_skip"))
        assert "Ranks (" in text
        assert "most faults" not in text


@pytest.mark.parametrize("first", [0, 1])
def test_a_skip_shows_the_account_of_the_rank_that_made_it_whichever_log_comes_first(runs: Path, first: int) -> None:
    paths = logs(runs, "nan_rank_one_skip", first=first)
    (origin,) = audit_json(paths)["skip_origins"]
    assert origin["rank"] == 1
    assert origin["origin"]["phase"] != "received"
    for fmt in ("table", "markdown"):
        text = audit(fmt, paths)
        assert "rank 1) origin: It started in the gradients of 2's own parameters" in text
        assert "It was not made on this rank" not in text
