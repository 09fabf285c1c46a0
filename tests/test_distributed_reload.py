"""Hot reload on a real 2-rank gloo group: the ranks switch at the same step, or neither does.

The scenarios run in their own processes (tests/reload_scenarios.py) under a hard timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

SCRIPT = Path(__file__).parent / "reload_scenarios.py"
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")
NAMES = ["reload_switch", "reload_bad_then_good"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    sys.path.insert(0, str(Path(__file__).parent))
    from test_distributed import free_port

    outdir = tmp_path_factory.mktemp("reload")
    path = os.pathsep.join(filter(None, [str(SCRIPT.parent.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TORCH_DISTRIBUTED_DEBUG": "INFO", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    command = [sys.executable, str(SCRIPT), ",".join(NAMES), "2", str(outdir), str(free_port())]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return {name: [json.loads((outdir / name / f"rank{r}.json").read_text()) for r in range(2)] for name in NAMES}


def test_both_ranks_switch_to_a_rewritten_policy_at_the_same_step(results: dict[str, list[dict[str, Any]]]) -> None:
    """Rank 0 notices the file at once, rank 1 only reloads on demand before step 8: both switch at step 8."""
    ranks = results["reload_switch"]
    steps = [[event["step"] for event in rank["reloads"]] for rank in ranks]
    assert len(steps[0]) == 1
    assert steps[0] == steps[1]
    assert steps[0] == [8]
    assert [rank["max_norm"] for rank in ranks] == [1e-3, 1e-3]
    assert ranks[0]["digests"] == ranks[1]["digests"]
    assert not ranks[0]["failures"]
    assert not ranks[1]["failures"]


def test_a_bad_file_keeps_both_ranks_on_the_old_policy_until_a_good_one(
    results: dict[str, list[dict[str, Any]]],
) -> None:
    """A syntax error: both ranks (polling at 0.02 s and 0.15 s) log policy_reload_failed once and stay on the old
    policy; the fixed file switches both at the same step."""
    ranks = results["reload_bad_then_good"]
    for rank in ranks:
        assert len(rank["failures"]) == 1
        assert "invalid policy" in rank["failures"][0]["error"]
        assert 3 <= rank["failures"][0]["step"] < 15
        (reload,) = rank["reloads"]
        assert reload["step"] >= 15
        assert reload["changed"] == ["clip"]
    assert ranks[0]["reloads"][0]["step"] == ranks[1]["reloads"][0]["step"]
    assert ranks[0]["digests"] == ranks[1]["digests"]
    assert ranks[0]["digests"][:3] == results["reload_switch"][0]["digests"][:3]
