"""Recovery under real torch.distributed (gloo on the CPU, 2 ranks): DDP and FSDP2 rewind together.

A NaN injected into ONE rank's gradient at step 23 (after DDP's all-reduce, or into one rank's FSDP2 shard,
so only the guard's agreement collective carries it) turns into a rewind on every rank, at the same step,
to the same snapshot; each rank restores its own replica (DDP) or its own shards (FSDP2), and the run
ends bitwise equal to the run that never trained on the undone batches (20 .. 27), whose guard step jumped
from 20 to 28. One launch runs every scenario (tests/recovery_distributed_scenarios.py) in its own
processes under a hard timeout, so a hang fails fast; a module-scoped fixture shares it between the tests.
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
from support.gloo_ranks import TIMEOUT, free_port

sys.path.insert(0, str(Path(__file__).parent))
import recovery_distributed_scenarios as scenarios

SCRIPT = Path(__file__).parent / "recovery_distributed_scenarios.py"
WORLD = 2
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")

WINDOW = list(range(scenarios.FAULT + 1, scenarios.SKIP_UNTIL))
"""Steps after the fault whose updates are skipped."""


def launch(names: list[str], outdir: Path, timeout: float = 300) -> None:
    """Run the scenarios in one launch of WORLD processes; fail fast on a hang or a crash."""
    # Not under TORCH_DISTRIBUTED_DEBUG=DETAIL, which crashes DDP's constructor on the CPU in torch 2.13 (see
    # test_distributed.py): ranks whose collectives differed would hang into the 30 s timeout, or differ.
    # The checkout's gradguard, not whichever one is installed: the script's own folder is tests/.
    path = os.pathsep.join(filter(None, [str(SCRIPT.parent.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TORCH_DISTRIBUTED_DEBUG": "INFO", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    command = [sys.executable, str(SCRIPT), ",".join(names), str(WORLD), str(outdir), str(free_port())]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "mismatch" not in output.lower(), output[-4000:]


def results_of(outdir: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads((outdir / name / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every scenario in one launch: starting the processes (importing torch twice) costs more than training."""
    outdir = tmp_path_factory.mktemp("recovery")
    launch(["ddp", "ddp_pass_step", "fsdp2"], outdir)
    return outdir


def assert_every_rank_rewound_together(results: list[dict[str, Any]]) -> None:
    """One rewind event per rank, each in that rank's own log, at the fault, to the same snapshot step."""
    for rank, result in enumerate(results):
        run = result["recovery"]
        events = run["events"]
        assert {event["rank"] for event in events} == {rank}
        assert not [event for event in events if event["event"] == "halt"]
        rewinds = [event for event in events if event["event"] == "rewind"]
        assert len(rewinds) == 1, rewinds
        rewind = rewinds[0]
        assert rewind["step"] == scenarios.FAULT
        assert rewind["to_step"] == scenarios.REWOUND_TO
        assert rewind["skip_until"] == scenarios.SKIP_UNTIL
        assert rewind["rewinds"] == 1
        assert (rewind["rule"], rewind["kind"], rewind["params"]) == ("nonfinite", "nan", ["body.weight"])
        window = scenarios.SKIP_UNTIL - scenarios.FAULT - 1  # the window's steps, counted as skipped
        assert run["counters"] == {"nonfinite": {"nan": 1, "rewind": 1}, "recovery": {"skip": window}}
        assert run["metrics"]["gradguard/recovery/rewinds"] == 1.0
        assert run["guard_steps"] == scenarios.STEPS
        # A hang guard, not a speed claim: a rank left waiting in a collective would wait out its timeout.
        assert run["fault_seconds"] < TIMEOUT.total_seconds(), "a rank waited for a collective's timeout"


def assert_equal_to_the_run_that_skipped_the_batches(result: dict[str, Any]) -> None:
    """Parameters (full), this rank's parameters and optimizer state, and the guard's statistics: bit for bit."""
    run, reference = result["recovery"], result["reference"]
    assert reference["counters"] == {}
    assert sorted(run["final_full"]) == sorted(reference["final_full"])
    for name, data in run["final_full"].items():
        assert data == reference["final_full"][name], name
    assert run["final_local"] == reference["final_local"]
    assert run["guard_state"] == reference["guard_state"]
    assert run["guard_state"]["statistics"]["zclip"]  # the adaptive statistics are there, and were compared


def assert_restored_to_the_snapshot(run: dict[str, Any]) -> None:
    """Right after the rewound step this rank holds what it held at the snapshot's step (the end of step 19)."""
    after = run["after_step"]
    assert after[str(scenarios.FAULT)] == after[str(scenarios.REWOUND_TO - 1)]
    assert after[str(scenarios.REWOUND_TO)] != after[str(scenarios.REWOUND_TO - 1)]  # steps 20 .. 22 did train
    for step in WINDOW:  # skipped updates: nothing this rank holds moves
        assert after.get(str(step), after[str(scenarios.FAULT)]) == after[str(scenarios.FAULT)], step


# --- DDP ------------------------------------------------------------------------------------------


def test_ddp_a_nan_on_one_rank_rewinds_every_rank_at_the_same_step_to_the_same_snapshot(runs: Path) -> None:
    """NaN in rank 1's gradient after the all-reduce: rank 0, whose gradient is finite, rewinds with it."""
    results = results_of(runs, "ddp")
    assert_every_rank_rewound_together(results)
    for result in results:
        assert result["recovery"]["skipped"] == [scenarios.FAULT, *WINDOW]


def test_ddp_replicas_stay_bitwise_identical_through_the_rewind(runs: Path) -> None:
    """Every step's parameters and optimizer state are the same bits on both ranks, before, at and after it."""
    for name in ("ddp", "ddp_pass_step"):
        first, second = (result["recovery"] for result in results_of(runs, name))
        assert first["after_step"] == second["after_step"]
        assert first["final_full"] == second["final_full"]
        assert first["final_local"] == second["final_local"]


def test_ddp_the_rewind_restores_each_replica_and_the_window_moves_nothing(runs: Path) -> None:
    for result in results_of(runs, "ddp"):
        assert_restored_to_the_snapshot(result["recovery"])
        before = str(scenarios.REWOUND_TO - 1)  # the end of step 19: the state step 20's snapshot holds
        assert result["recovery"]["after_step"][before] == result["reference"]["after_step"][before]


def test_ddp_rewound_run_ends_bitwise_equal_to_the_run_that_never_trained_the_undone_batches(runs: Path) -> None:
    """Batches 20 .. 27 undone: the same parameters, AdamW state and guard statistics as never training on them."""
    for result in results_of(runs, "ddp"):
        assert_equal_to_the_run_that_skipped_the_batches(result)
        last = str(scenarios.STEPS - 1)
        assert result["recovery"]["after_step"][last] == result["reference"]["after_step"][last]


def test_ddp_a_loop_that_passes_the_skipped_steps_agrees_on_every_rank(runs: Path) -> None:
    """``if guard.pass_step(): continue`` skips forward and backward on both ranks alike, with the same end."""
    results = results_of(runs, "ddp_pass_step")
    assert_every_rank_rewound_together(results)
    for result in results:
        run = result["recovery"]
        assert run["passed"] == WINDOW
        assert run["skipped"] == [scenarios.FAULT]
        assert_restored_to_the_snapshot(run)
        assert_equal_to_the_run_that_skipped_the_batches(result)


# --- FSDP2 ----------------------------------------------------------------------------------------


def test_fsdp2_a_nan_in_one_ranks_shard_rewinds_every_rank_together(runs: Path) -> None:
    """fully_shard: a NaN in rank 1's shard of body.weight; both ranks rewind at step 23 to step 20."""
    results = results_of(runs, "fsdp2")
    assert_every_rank_rewound_together(results)
    for result in results:
        assert result["recovery"]["skipped"] == [scenarios.FAULT, *WINDOW]


def test_fsdp2_each_rank_restores_its_own_shards_of_parameters_and_optimizer_state(runs: Path) -> None:
    """Each rank's local shards (parameters, AdamW's exp_avg and exp_avg_sq) are back to step 20's, bit for bit."""
    results = results_of(runs, "fsdp2")
    for result in results:
        assert_restored_to_the_snapshot(result["recovery"])
    first, second = (result["recovery"] for result in results)
    assert first["final_local"] != second["final_local"]  # the ranks hold different shards (3 + 2 rows)
    assert first["final_full"] == second["final_full"]  # which gather to the same tensors


def test_fsdp2_snapshots_hold_only_the_local_shards(runs: Path) -> None:
    """Each FSDP2 rank's snapshots hold its shards: together, one DDP replica's (and each rank's AdamW step scalars)."""
    replica = results_of(runs, "ddp")[0]["recovery"]["metrics"]["gradguard/recovery/snapshot_bytes"]
    shards = [r["recovery"]["metrics"]["gradguard/recovery/snapshot_bytes"] for r in results_of(runs, "fsdp2")]
    assert all(0 < held < replica for held in shards), (shards, replica)
    params = len(results_of(runs, "ddp")[0]["recovery"]["final_full"])
    step_scalars = params * 4 * scenarios.KEEP  # AdamW's per-parameter step, a float32 scalar on every rank
    assert sum(shards) == replica + (WORLD - 1) * step_scalars


def test_fsdp2_rewound_run_ends_bitwise_equal_to_the_run_that_never_trained_the_undone_batches(
    runs: Path,
) -> None:
    """Gathered parameters, each rank's shards of parameters and optimizer state, and the guard's statistics."""
    for result in results_of(runs, "fsdp2"):
        assert_equal_to_the_run_that_skipped_the_batches(result)
