"""``per_micro_batch=True`` across ranks: under a pipeline's zero-bubble schedules, and under tensor parallel.

tests/micro_batch_scenarios.py runs the decoder on 2 real gloo ranks: in 4 pipeline stages under
``ScheduleInterleaved1F1B`` and the two zero-bubble schedules (whose weight pass adds ``torch.autograd.grad``'s
results into ``.grad`` by hand), and under torchtitan's tensor-parallel plan. The reference is the decoder in this
process, its micro-batches run as the schedules run them, under the same per-micro-batch policy.
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
from support.gloo_ranks import free_port
from support.parallel_models import make_decoder
from test_tensor_parallel import assert_weights_close

sys.path.insert(0, str(Path(__file__).parent))
import micro_batch_scenarios as scenarios

from gradguard import Policy

SCRIPT = Path(__file__).parent / "micro_batch_scenarios.py"
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


def launch(name: str, outdir: Path, timeout: float = 400) -> list[dict[str, Any]]:
    path = os.pathsep.join(filter(None, [str(SCRIPT.parent.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    command = [sys.executable, str(SCRIPT), name, "2", str(outdir), str(free_port())]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return [json.loads((outdir / name / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def zero_bubble_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch("zero_bubble", tmp_path_factory.mktemp("zero_bubble"))


def clips(counters: list[dict[str, Any]]) -> dict[str, int]:
    """The clips of ``scenarios.CLIPS``'s two rules, over every rank."""
    return {rule: sum(c.get(rule, {}).get(action, 0) for c in counters) for rule, action in CLIP_OF.items()}


CLIP_OF = {"norm": "clip_norm", "value": "clip_value"}


@pytest.mark.parametrize("schedule", ["interleaved_zero_bubble", "zbv_zero_bubble"])
def test_per_micro_batch_clips_act_on_every_stage_under_a_zero_bubble_schedule_as_under_1f1b(
    zero_bubble_runs: list[dict[str, Any]], schedule: str
) -> None:
    """The zero-bubble weight pass takes each micro-batch's weight gradients with ``torch.autograd.grad`` and adds them
    into ``.grad`` itself: the per-micro-batch clips act there too, on every stage, so the stages' weights together are
    those of Interleaved1F1B (bit for bit) and of one process, with as many clips."""
    ranks = zero_bubble_runs
    found = {**ranks[0][schedule]["weights"], **ranks[1][schedule]["weights"]}
    looped = {**ranks[0]["interleaved_1f1b"]["weights"], **ranks[1]["interleaved_1f1b"]["weights"]}
    assert found == looped
    expected = scenarios.train(make_decoder(layers=4), Policy.from_dict(scenarios.CLIPS))
    assert_weights_close(found, expected["weights"])
    assert clips([rank[schedule]["counters"] for rank in ranks]) == clips([expected["counters"]])
    assert min(clips([expected["counters"]]).values()) > 0


def test_per_micro_batch_clips_of_tensor_parallel_parameters_are_refused_at_attach_and_scale_trains_as_one_process(
    tmp_path: Path,
) -> None:
    """A per-micro-batch clip of a DTensor needs the whole tensor's norm or peak, a collective in every micro-batch's
    backward: refused at attach on every rank, naming the rule, the action, the parameter and what to do instead (no
    internal traceback at the first step). A per-micro-batch scale, elementwise, trains as in one process."""
    ranks = launch("tensor_parallel", tmp_path)
    for result in ranks:
        for action in ("clip_value", "clip_norm"):
            error = result[action]["error"]
            assert error is not None, action
            assert f"rule 'r''s {action} on 'tok_embeddings.weight', a DTensor" in error
            assert "Turn per_micro_batch off" in error
            assert "(exclude)" in error
        assert result["scale"]["error"] is None
    expected = scenarios.train(make_decoder(), scenarios.one_rule("scale"))
    for result in ranks:
        assert_weights_close(result["scale"]["weights"], expected["weights"])
        assert result["scale"]["counters"] == expected["counters"]


def test_every_per_micro_batch_action_on_fsdp2_parameters_is_refused_at_attach(tmp_path: Path) -> None:
    """FSDP2 hands a parameter its gradient from the reduce-scatter, after the micro-batches accumulated: a tensor hook
    on it never runs, so a per-micro-batch ``scale`` or ``zero`` (which the step leaves to the hooks) never acted and
    nothing said so. Every per-micro-batch action on FSDP2's parameters is refused at attach, on every rank."""
    for result in launch("fsdp2", tmp_path):
        for action in scenarios.ACTIONS:
            error = result[action]["error"]
            assert error is not None, action
            assert f"rule 'r''s {action} on 'tok_embeddings.weight'" in error
            assert "Turn per_micro_batch off" in error
