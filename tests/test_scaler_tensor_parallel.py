"""GradScaler under tensor parallel (tests/scaler_tp_scenarios.py, 2 gloo ranks): torch reduces the scaler's
found-inf flag over the mesh only where the first gradient of a group is not replicated, so an Inf in one rank's shard
made that rank's scaler skip its update alone while the other updated and then waited for it (gloo aborted on the
mismatched collective, guarded or not). The guard makes the flag the same on every rank at ``unscale_``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.gloo_ranks import free_port

sys.path.insert(0, str(Path(__file__).parent))
import scaler_tp_scenarios as scenarios

SCRIPT = Path(__file__).parent / "scaler_tp_scenarios.py"
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


def test_an_inf_in_one_rank_s_shard_makes_every_rank_s_scaler_skip_that_step_alike(tmp_path: Path) -> None:
    """Both ranks' scalers skip the faulty step (the sharded weight does not move there, and moves at every other
    step), halve their scale alike, count one scaler skip, and keep the replicated norms equal; with the scaler given
    to the guard (``scaler=``) and without."""
    path = os.pathsep.join(filter(None, [str(SCRIPT.parent.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    command = [sys.executable, str(SCRIPT), "scaler_tp", "2", str(tmp_path), str(free_port())]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    ranks = [json.loads((tmp_path / "scaler_tp" / f"rank{rank}.json").read_text()) for rank in range(2)]
    for mode in ("given", "loop"):
        runs = [rank[mode] for rank in ranks]
        assert runs[0]["steps"] == runs[1]["steps"], mode
        moved = {step: moves for step, _, moves in runs[0]["steps"]}
        assert moved == {step: step != scenarios.BAD_STEP for step in range(scenarios.STEPS)}
        scales = [scale for _, scale, _ in runs[0]["steps"]]
        assert scales[scenarios.BAD_STEP] == scales[scenarios.BAD_STEP - 1] / 2
        for run in runs:  # the guard given the scaler counts its skip; a loop's own scaler skips unseen
            assert run["counters"] == ({"grad_scaler": {"skip": 1}} if mode == "given" else {})
            assert run["replicas_agree"]
