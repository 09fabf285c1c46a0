"""Which rank, which host (#48): a fault named with the rank that made it, outliers, replicas that drift, and no rank
left waiting when one rank's step fails. Real DDP (3 gloo ranks) and FSDP2 (2) processes, tests/rank_scenarios.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support.gloo_ranks import free_port

sys.path.insert(0, str(Path(__file__).parent))
import rank_scenarios as scenarios

from gradguard.events.definitions import EVENT_DECODER, fields_of

COMMON = {"ts", "level", "event", "run", "rank"}

SCRIPT = Path(__file__).parent / "rank_scenarios.py"
HOST = socket.gethostname()
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")

DDP = [
    "nan_one_rank",
    "nan_one_rank_always",
    "nan_user_hook_before",
    "nan_user_hook_after",
    "nan_one_rank_untraced",
    "nan_two_ranks",
    "nan_after_reduction",
    "nan_after_reduction_everywhere",
    "nan_first_micro_batch",
    "outlier",
    "drift",
    "clean_every_check",
    "unguarded",
    "quiet_guard",
]
FSDP2 = ["fsdp2_nan_one_rank", "fsdp2_nan_first_micro_batch", "fsdp2_outlier", "fsdp2_monitor"]


def launch(names: list[str], world: int, outdir: Path, *, debug: str = "INFO") -> None:
    path = os.pathsep.join(filter(None, [str(SCRIPT.parent.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TORCH_DISTRIBUTED_DEBUG": debug, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    command = [sys.executable, str(SCRIPT), ",".join(names), str(world), str(outdir), str(free_port())]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400, check=False)
    except subprocess.TimeoutExpired as hung:  # a hang guard, not a speed claim
        raise AssertionError(f"the ranks hung: {names}") from hung
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def results(outdir: Path, name: str, world: int) -> list[dict[str, Any]]:
    return [json.loads((outdir / name / f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    outdir = tmp_path_factory.mktemp("which-rank-ddp")
    launch(DDP, 3, outdir)
    return outdir


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    outdir = tmp_path_factory.mktemp("which-rank-fsdp2")
    launch(FSDP2, 2, outdir)
    return outdir


def halts(outdir: Path, name: str, world: int) -> list[dict[str, Any]]:
    out = []
    for result in results(outdir, name, world):
        assert result["halt"] is not None, result
        out.append(result["halt"])
    return out


def logged(result: dict[str, Any], event: str) -> list[dict[str, Any]]:
    return [line for line in result["events"] if line["event"] == event]


def test_a_nan_made_in_one_ranks_own_backward_names_that_rank_and_host_on_every_rank(ddp: Path) -> None:
    for result in results(ddp, "nan_one_rank", 3):
        halt = result["halt"]
        assert (halt["step"], halt["params"], halt["unchanged"]) == (scenarios.BAD_STEP, ["2.weight"], True)
        assert halt["ranks"] == {"2": HOST}
        assert f"made on rank 2 (host {HOST})" in halt["message"]
        (event,) = logged(result, "halt")
        assert event["ranks"] == {"2": HOST}
        (attach,) = logged(result, "attach")
        assert attach["ranks"] == {"world": 3, "seen": "DDP communication hook", "unseen": None}
        rank = result["rank"]
        labels = f'event="halt",host="{HOST}",origin_rank="2",rank="{rank}"'
        assert f"gradguard_faults_by_rank_total{{{labels}}} 1.0" in result["scraped"]


def test_every_line_the_ranks_wrote_fits_its_definition_exactly(ddp: Path, fsdp2: Path) -> None:
    """The distributed events (rank_outlier, replica_divergence, rank_failure, ranks on halt and skip) as real gloo
    runs write them decode into their definitions, at their levels, with no field the definitions lack."""
    lines = [
        line
        for folder in (ddp, fsdp2)
        for log in sorted(folder.glob("*/audit-rank*.jsonl"))
        for line in log.read_text().splitlines()
    ]
    written = {json.loads(line)["event"] for line in lines}
    assert {"rank_outlier", "replica_divergence", "halt", "attach"} <= written
    for line in lines:
        event = EVENT_DECODER.decode(line)
        raw = json.loads(line)
        assert set(raw) - COMMON - set(fields_of(type(event))) == set(), line
        assert raw["level"] == type(event).LEVEL, line


def test_the_audit_of_the_ranks_logs_names_the_origin_rank_and_host_once(ddp: Path) -> None:
    logs = sorted(str(path) for path in (ddp / "nan_one_rank").glob("audit-rank*.jsonl"))
    done = subprocess.run(
        [sys.executable, "-m", "gradguard.cli", "audit", "--format", "json", *logs],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent)},
    )
    report = json.loads(done.stdout)
    assert done.returncode == report["exit_code"] == 1, done.stderr  # a halt in the run: the audit says so
    assert len(report["halts"]) == 1, report["halts"]
    by_rank = {str(row["rank"]): row for row in report["by_rank"]}
    assert by_rank["2"]["halts"] == 1
    assert HOST in by_rank["2"]["hosts"]


def test_a_rank_that_only_received_the_fault_says_so_and_the_origin_rank_names_the_module(ddp: Path) -> None:
    for name in ("nan_one_rank", "nan_one_rank_always", "nan_one_rank_untraced"):
        received, made = halts(ddp, name, 3)[:2], halts(ddp, name, 3)[2]
        for rank, halt in enumerate(received):
            assert halt["origin"]["phase"] == "received", (name, halt["origin"])
            assert halt["origin"]["rank"] == rank
            assert "It was not made on this rank" in halt["message"]
        assert made["origin"] is None or made["origin"]["phase"] != "received"
    made = halts(ddp, "nan_one_rank", 3)[2]
    assert (made["origin"]["phase"], made["origin"]["module"]) == ("gradient", "2")  # as on one process


def test_two_ranks_that_made_a_nan_at_once_are_both_named(ddp: Path) -> None:
    for halt in halts(ddp, "nan_two_ranks", 3):
        assert halt["ranks"] == {"1": HOST, "2": HOST}
        assert f"made on ranks 1 (host {HOST}) and 2 (host {HOST})" in halt["message"]


def test_a_nan_made_after_the_reduction_on_one_rank_names_that_rank_and_the_others_say_theirs_stayed_finite(
    ddp: Path,
) -> None:
    """Rank 1's reduced gradient made NaN between backward() and step(): no rank's own gradient was non-finite, the
    other replicas' reduced gradients stayed finite, so it was made after the reduction, on rank 1 (one bit per rank
    in the step's existing all-reduce)."""
    for result in results(ddp, "nan_after_reduction", 3):
        halt = result["halt"]
        assert (halt["step"], halt["params"], halt["ranks"]) == (scenarios.BAD_STEP, ["2.weight"], {"1": HOST})
        assert f"made on rank 1 (host {HOST})" in halt["message"]
        assert logged(result, "halt")[0]["ranks"] == {"1": HOST}
        assert halt["origin"]["after_reduction"] is True
        if result["rank"] == 1:
            assert halt["origin"]["phase"] != "received"
            assert halt["origin"]["rank"] == 1
            said = "Made after the reduction, on rank 1: the other ranks' reduced gradients stayed finite."
            assert said in halt["message"]
        else:
            assert (halt["origin"]["phase"], halt["origin"]["rank"]) == ("received", result["rank"])
            assert "its gradients are finite, before and after the reduction" in halt["message"]


def test_a_nan_made_after_the_reduction_on_every_rank_names_no_rank(ddp: Path) -> None:
    """Every replica's reduced gradient turned NaN (the reduction itself, or code every rank runs): no rank to drain."""
    for result in results(ddp, "nan_after_reduction_everywhere", 3):
        assert (result["halt"]["step"], result["halt"]["ranks"]) == (scenarios.BAD_STEP, {})
        assert logged(result, "halt")[0]["ranks"] == {}
        origin = result["halt"]["origin"]
        assert origin is None or "after_reduction" not in origin


def test_a_nan_in_the_first_micro_batch_under_no_sync_names_its_rank(ddp: Path) -> None:
    for halt in halts(ddp, "nan_first_micro_batch", 3):
        assert (halt["step"], halt["ranks"]) == (scenarios.BAD_STEP, {"1": HOST})


def test_a_rank_whose_own_gradient_is_far_off_the_others_is_named_and_halts(ddp: Path) -> None:
    for result in results(ddp, "outlier", 3):
        halt = result["halt"]
        assert (halt["step"], halt["kind"], halt["ranks"], halt["unchanged"]) == (
            scenarios.BAD_STEP,
            "outlier",
            {"1": HOST},
            True,
        )
        (event,) = logged(result, "rank_outlier")
        assert event["ranks"] == {"1": HOST}
        assert event["action"] == "halt"
        norms = event["norms"]
        assert norms["1"] > 1000 * max(norms["0"], norms["2"])  # the 1e4 times gradient, before the reduction


def test_one_ulp_changed_in_one_replicas_weight_is_named_with_the_parameter_at_the_next_check(ddp: Path) -> None:
    runs = results(ddp, "drift", 3)
    assert runs[0]["digest"] == runs[1]["digest"] != runs[2]["digest"]  # the premise: rank 2 drifted by one ulp
    for result in runs:
        halt = result["halt"]
        assert (halt["step"], halt["kind"], halt["params"], halt["ranks"]) == (4, "divergence", ["4.bias"], {"2": HOST})
        assert halt["unchanged"]
        (event,) = logged(result, "replica_divergence")
        assert event["params"] == ["4.bias"]
        assert event["checked"] == 6


def test_a_clean_run_with_every_check_on_raises_nothing_and_is_bitwise_the_unguarded_run(ddp: Path) -> None:
    unguarded = results(ddp, "unguarded", 3)
    for name in ("clean_every_check", "quiet_guard"):
        for result, reference in zip(results(ddp, name, 3), unguarded, strict=True):
            assert result["halt"] is None
            assert result["steps"] == scenarios.STEPS
            assert result["warnings"] == []
            assert not logged(result, "rank_outlier")
            assert not logged(result, "replica_divergence")
            assert result["digest"] == reference["digest"]
            assert result["notes_after_removal"] == 0


def test_under_fsdp2_a_nan_made_on_one_rank_names_it_on_every_rank(fsdp2: Path) -> None:
    for name, origin in (("fsdp2_nan_one_rank", 1), ("fsdp2_nan_first_micro_batch", 0)):
        for rank, result in enumerate(results(fsdp2, name, 2)):
            halt = result["halt"]
            assert (halt["step"], halt["ranks"], halt["unchanged"]) == (scenarios.BAD_STEP, {str(origin): HOST}, True)
            assert (halt["origin"]["phase"] == "received") == (rank != origin)
            assert logged(result, "attach")[0]["ranks"]["seen"] == "FSDP2 reduce-scatter"


def test_under_fsdp2_an_outlier_rank_is_named_and_its_step_skipped(fsdp2: Path) -> None:
    for result in results(fsdp2, "fsdp2_outlier", 2):
        assert result["halt"] is None
        assert result["steps"] == scenarios.STEPS
        (event,) = logged(result, "rank_outlier")
        assert (event["step"], event["ranks"], event["action"]) == (scenarios.BAD_STEP, {"1": HOST}, "skip")
        assert result["counters"]["ranks"] == {"outlier": 1, "skip": 1}
        # The skipped step's clips (only its gradients reach max_norm) did not happen: not counted, not logged.
        assert not logged(result, "intervention")
        assert "clip_norm" not in result["counters"].get("guard", {})


@pytest.mark.parametrize("name", ["failure_lives_on", "failure_exits"])
def test_a_failure_inside_one_ranks_step_ends_every_rank_at_once_naming_it(name: str, tmp_path: Path) -> None:
    launch([name], 2, tmp_path)
    for result in results(tmp_path, name, 2):
        error = result["error"]
        assert error is not None, result
        assert error["type"] == "RankFailed"
        assert error["failed_rank"] == 1
        assert f"rank 1 (host {HOST}) failed inside the guard's step {scenarios.BAD_STEP}" in error["message"]
        assert "ValueError: the device returned garbage" in error["message"]
        # Not the process group's timeout: the waiting rank learned of it from the store.
        assert error["seconds"] < error["timeout"] / 3, error
        (event,) = result["failures"]
        assert (event["failed_rank"], event["error"]) == (1, "ValueError: the device returned garbage")


def test_under_fsdp2_the_monitors_mean_and_std_are_the_whole_gradients_not_a_shards(fsdp2: Path) -> None:
    """#48 item 7: each rank's monitor reports the mean and std of the full gradient (its shards' sums and counts
    combined over the ranks), equal to the gathered gradient's, on every rank."""
    for result in results(fsdp2, "fsdp2_monitor", 2):
        for stat in ("mean", "std"):
            for name, value in result["expected"][stat].items():
                assert result["figures"][stat][name] == pytest.approx(value, rel=1e-5, abs=1e-9), (stat, name)


def test_a_users_communication_hook_before_the_guard_leaves_ranks_empty_and_attach_says_why(ddp: Path) -> None:
    for result in results(ddp, "nan_user_hook_before", 3):
        assert result["halt"]["step"] == scenarios.BAD_STEP
        assert result["halt"]["ranks"] == {}  # empty rather than wrong
        (attach,) = logged(result, "attach")
        assert attach["ranks"]["seen"] is None
        assert "communication hook of its own (allreduce_hook)" in attach["ranks"]["unseen"]


def test_a_users_communication_hook_after_the_guard_runs_inside_its_tap_and_the_rank_is_named(ddp: Path) -> None:
    runs = results(ddp, "nan_user_hook_after", 3)
    for result in runs:
        assert result["halt"]["ranks"] == {"2": HOST}
    # The user's hook did the reduction, the same on every rank: the replicas stayed equal up to the fault.
    assert len({result["digest"] for result in runs}) == 1


def test_an_outlier_check_that_could_never_fire_is_refused_at_attach_on_every_rank(tmp_path: Path) -> None:
    """``outlier_factor`` on a model that is neither DDP- nor FSDP2-wrapped (the same holds under tensor parallel
    alone): no rank's own gradient norm can be seen before the reduction, so no outlier would ever be named. It was
    accepted and inert; it is refused, saying why and what works."""
    launch(["outlier_unseen"], 2, tmp_path)
    for result in results(tmp_path, "outlier_unseen", 2):
        error = result["error"]
        assert error is not None
        assert "ranks.outlier_factor compares each rank's own gradient norm" in error
        assert "neither DDP- nor FSDP2-wrapped" in error
        assert "Remove outlier_factor" in error
