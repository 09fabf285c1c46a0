"""What a ranks halt says (issue 58, item 8): a replica divergence once, an outlier with the norms that made it one,
and a console line without ``count=0 ... params=[]``. Run on three real gloo ranks (``rank_scenarios.py``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support.gloo_ranks import free_port

from gradguard.enforce.recovery.decisions import HaltReport
from gradguard.events.log import console_fields

SCRIPT = Path(__file__).parent / "rank_scenarios.py"
WORLD = 3


@pytest.fixture(scope="module")
def halted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not built")
    outdir = tmp_path_factory.mktemp("ranks")
    path = os.pathsep.join(filter(None, [str(SCRIPT.parent.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    command = [sys.executable, str(SCRIPT), "outlier,drift", str(WORLD), str(outdir), str(free_port())]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return outdir


def messages(outdir: Path, name: str) -> list[str]:
    found = []
    for rank in range(WORLD):
        result: dict[str, Any] = json.loads((outdir / name / f"rank{rank}.json").read_text())
        found.append(result["halt"]["message"])
    return found


def test_a_replica_divergence_says_that_the_weights_differ_once_and_how_many_ranks_agree(halted: Path) -> None:
    for message in messages(halted, "drift"):
        assert message.count("differ") == 1, message
        assert message.startswith(
            "replica divergence (the data-parallel replicas' weights differ bitwise) at step 4 in 1"
        )
        assert "6 parameters compared; 2 of the 3 ranks agree, the rank(s) named hold another copy" in message


def test_an_outlier_halt_gives_the_norms_that_made_it_one(halted: Path) -> None:
    for message in messages(halted, "outlier"):
        found = re.search(
            r"rank 1's own gradient norm (\S+) is (\S+) x the other ranks' median (\S+) \(outlier_factor 10; "
            r"norms by rank: 0: (\S+), 1: (\S+), 2: (\S+)\)",
            message,
        )
        assert found is not None, message
        norm, times, median, *by_rank = (float(value.rstrip(",")) for value in found.groups())
        assert norm == by_rank[1]
        assert median == pytest.approx((by_rank[0] + by_rank[2]) / 2, rel=1e-3)  # the median of the other two
        assert times == pytest.approx(norm / median, rel=1e-2)
        assert times > 10


def test_a_ranks_halts_console_line_names_the_ranks_without_an_empty_parameter_list() -> None:
    report = HaltReport(7, "ranks", [], {}, "outlier", "rank 1's own gradient norm ...", None, {1: "node-17"})
    shown = console_fields("halt", report.fields())
    assert "params" not in shown
    assert "count" not in shown
    assert "kinds" not in shown
    assert shown["ranks"] == {"1": "node-17"}
    assert (shown["step"], shown["kind"], shown["rule"]) == (7, "outlier", "ranks")


def test_a_parameter_halts_console_line_still_counts_and_names_its_parameters() -> None:
    report = HaltReport(3, "halt", ["0.weight", "0.bias"], {"0.weight": "nan", "0.bias": "nan"}, "nan", None, None)
    shown = console_fields("halt", report.fields())
    assert (shown["count"], shown["params"], shown["kinds"]) == (2, ["0.weight", "0.bias"], {"nan": 2})
    assert "ranks" not in shown  # one process: no ranks to name
