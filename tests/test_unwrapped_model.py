"""A guard on the module inside a DDP wrapper (nanoGPT's ``raw_model``) says at attach that it cannot name ranks,
and no rank's halt claims its own gradients (issue 58, item 3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.gloo_ranks import free_port

SCRIPT = Path(__file__).parent / "unwrapped_scenarios.py"
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


def test_a_guard_on_the_unwrapped_model_warns_at_attach_and_no_rank_claims_the_fault(tmp_path: Path) -> None:
    path = os.pathsep.join(filter(None, [str(SCRIPT.parent.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    command = [sys.executable, str(SCRIPT), "raw_model", "2", str(tmp_path), str(free_port())]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / "raw_model" / f"rank{rank}.json").read_text())
        assert len(result["warnings"]) == 1
        assert "neither DDP- nor FSDP2-wrapped" in result["warnings"][0]
        assert "nanoGPT's raw_model" in result["warnings"][0]
        assert "pass the DDP or FSDP2 model to GradGuard" in result["warnings"][0]
        halt = result["halt"]
        assert halt["step"] == 1
        assert halt["ranks"] == {}
        assert "Whether this rank made it cannot be told" in halt["message"]
