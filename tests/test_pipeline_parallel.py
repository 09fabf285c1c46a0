"""Pipeline parallel as one model: every stage's figures are the whole model's, and the stages take one verdict.

tests/pipeline_scenarios.py runs torch.distributed.pipelining's GPipe and 1F1B schedules on 2 gloo ranks (a stage
each), a pipeline of 2 stages over 2 FSDP2 replicas on 4 and one over torchtitan's TP plan on 4; each stage is
guarded with the job's ``device_mesh``.
The stages' weights together are compared with the decoder trained in one process on the full batch under the same
policy (and torch's own ``clip_grad_norm_`` for the clips).
"""

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
from parallel_scenarios import LOOP_CLIPS
from support.gloo_ranks import free_port
from test_tensor_parallel import assert_stats_close, assert_weights_close, reference, torch_clipped

sys.path.insert(0, str(Path(__file__).parent))
import pipeline_scenarios as scenarios

SCRIPT = Path(__file__).parent / "pipeline_scenarios.py"
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


def launch(names: list[str], world: int, outdir: Path, timeout: float = 400) -> None:
    path = os.pathsep.join(filter(None, [str(SCRIPT.parent.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    command = [sys.executable, str(SCRIPT), ",".join(names), str(world), str(outdir), str(free_port())]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def results(outdir: Path, name: str, world: int) -> list[dict[str, Any]]:
    return [json.loads((outdir / name / f"rank{rank}.json").read_text()) for rank in range(world)]


def whole_model(ranks: list[dict[str, Any]], policy: str) -> list[dict[str, list[float]]]:
    """Per data-parallel replica, the stages' weights together (rank r is stage r // dp... as the mesh lays them)."""
    world = len(ranks)
    dp = world // 2
    return [{**ranks[replica][policy]["final"], **ranks[dp + replica][policy]["final"]} for replica in range(dp)]


def merged_stats(ranks: list[dict[str, Any]], policy: str) -> list[dict[str, Any]]:
    """The monitor's events of stage 0 and stage 1 at each step, as one event of the whole model."""
    merged = []
    for first, second in zip(ranks[0][policy]["stats"], ranks[-1][policy]["stats"], strict=True):
        figures = {stat: {**first["figures"][stat], **second["figures"][stat]} for stat in first["figures"]}
        merged.append(first | {"figures": figures})
    return merged


LAYOUTS = [("pp_gpipe", 2), ("pp_1f1b", 2), ("pp_interleaved", 2), ("pp_dp", 4), ("pp_tp", 4)]
"""``pp_interleaved``: a 4-layer decoder in 4 stages, two a rank (torchtitan's ``model_parts``: one guarded model);
``pp_tp``: 2 stages, each over 2 tensor-parallel ranks (torchtitan's plan: sequence-parallel norms, a row-wise
embedding on the first stage, a column-wise head on the last)."""


@pytest.fixture(scope="module", params=LAYOUTS, ids=[name for name, _ in LAYOUTS])
def pipeline_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    name, world = request.param
    outdir = tmp_path_factory.mktemp(name)
    launch([name], world, outdir)
    return results(outdir, name, world)


@pytest.mark.parametrize("policy", [name for name in scenarios.POLICIES if name != "monitor"])
def test_the_stages_together_end_with_the_weights_one_process_would_have(
    pipeline_runs: list[dict[str, Any]], policy: str
) -> None:
    """Per-tensor and group clips (a group clip's norm over every stage), agc, clip_value and the shipped default."""
    expected = reference(policy, pipeline_runs[0]["layers"])["final"]
    for model in whole_model(pipeline_runs, policy):
        assert_weights_close(model, expected)


@pytest.mark.parametrize("group", [False, True], ids=["per_tensor", "group"])
def test_the_clips_match_torch_s_own_clip_grad_norm_over_the_whole_model(
    pipeline_runs: list[dict[str, Any]], group: bool
) -> None:
    expected = torch_clipped(group, pipeline_runs[0]["layers"])
    for model in whole_model(pipeline_runs, "group_clip" if group else "per_tensor_clip"):
        assert_weights_close(model, expected)


@pytest.mark.parametrize("policy", list(LOOP_CLIPS))
def test_torchtitan_s_clip_over_the_stages_after_the_guard_sees_the_norm_one_process_sees(
    pipeline_runs: list[dict[str, Any]], policy: str
) -> None:
    """torchtitan's clip_grad_norm_ with its pp_mesh, after the guard's step on each stage, returns on every stage the
    norm one process's clip returns after the same policy."""
    expected = torch.tensor(reference(policy, pipeline_runs[0]["layers"])["norms"])
    for result in pipeline_runs:
        torch.testing.assert_close(torch.tensor(result[policy]["norms"]), expected, atol=1e-5, rtol=0)


def test_each_stage_s_monitor_gives_the_whole_tensors_figures(pipeline_runs: list[dict[str, Any]]) -> None:
    assert_stats_close(
        merged_stats(pipeline_runs, "monitor"), reference("monitor", pipeline_runs[0]["layers"])["stats"]
    )


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    outdir = tmp_path_factory.mktemp("pp_faults")
    launch(["pp_faults", "pp_without_mesh", "pp_one_stage_rule", "refusals", "pp_rewind_twin"], 2, outdir)
    return outdir


def test_a_nan_on_one_stage_halts_every_stage_before_any_update(fault_runs: Path) -> None:
    """Stage 1 halts naming its parameter; stage 0, whose gradients are finite, halts at the same step naming stage 1's
    rank and host; neither stage's weights moved."""
    first, second = (result["halt"]["halted"] for result in results(fault_runs, "pp_faults", 2))
    for halted in (first, second):
        assert halted["step"] == scenarios.BAD_STEP
        assert halted["unchanged"]
        assert halted["ranks"] == {"1": second["ranks"]["1"]}
    assert second["params"] == ["layers.1.feed_forward.up.weight"]
    assert first["rule"] == "pipeline"
    assert "stage 1 of 2" in first["message"]
    assert "It was not made on this pipeline stage (rank 0)" in first["message"]


def test_a_nan_in_one_tensor_parallel_shard_of_one_stage_halts_all_four_ranks_before_any_update(
    tmp_path: Path,
) -> None:
    """PP over TP (2 stages of 2 tensor-parallel ranks): a NaN in rank 3's shard of stage 1's weight halts every rank
    at that step, none updated; stage 1's ranks name the parameter, every rank names rank 3 alone (its shard made
    it), stage 0's as a pipeline verdict; under a skip policy every rank skips that step and trains on after it."""
    launch(["pp_tp_faults"], 4, tmp_path)
    ranks = results(tmp_path, "pp_tp_faults", 4)
    halts = [result["halt"]["halted"] for result in ranks]
    for rank, halted in enumerate(halts):
        assert halted["step"] == scenarios.BAD_STEP, rank
        assert halted["unchanged"], rank
        assert list(halted["ranks"]) == ["3"], (rank, halted["ranks"])
        if rank >= 2:
            assert halted["params"] == ["layers.1.feed_forward.up.weight"], rank
        else:
            assert halted["rule"] == "pipeline", rank
            assert "stage 1 of 2" in halted["message"], rank
    for result in ranks:
        assert result["skip"]["halted"] is None
        assert result["skip"]["skipped"] == [scenarios.BAD_STEP]
        assert result["skip"]["changed"] == [True, False, True]


def test_a_nan_on_one_stage_halts_every_stage_before_a_fused_optimizer_s_update(fault_runs: Path) -> None:
    """With a fused AdamW on each stage (whose update a guard alone in its step lets run before its read), stage 0's
    gradients are finite, yet it must not update before the stages' verdict: every stage halts, none updated."""
    first, second = (result["halt_fused"]["halted"] for result in results(fault_runs, "pp_faults", 2))
    for halted in (first, second):
        assert halted["step"] == scenarios.BAD_STEP
        assert halted["unchanged"]
    assert second["params"] == ["layers.1.feed_forward.up.weight"]
    assert first["rule"] == "pipeline"


def test_a_skip_past_its_limit_on_one_stage_halts_every_stage_at_that_step(fault_runs: Path) -> None:
    """Stage 1 skips a NaN at step 1 and meets another at step 2, past ``max_consecutive_skips: 1``: its skip becomes a
    halt after the stages exchanged their verdicts, so the exchange must already say halt, or stage 0 skips on alone
    (and waits in the next step's send until the timeout)."""
    first, second = (result["skip_limit"] for result in results(fault_runs, "pp_faults", 2))
    for stage in (first, second):
        assert stage["skipped"] == [1]
        assert stage["halted"]["step"] == 2
        assert stage["halted"]["unchanged"]
    assert "skip limit exceeded" in second["halted"]["message"]
    assert first["halted"]["rule"] == "pipeline"


def test_skip_limits_count_the_skips_of_every_stage_as_one_process_would(fault_runs: Path) -> None:
    """A NaN on stage 1 at step 1, then one on stage 0 at step 2, under ``max_consecutive_skips: 1``: the model skipped
    two steps in a row, so step 2 halts on every stage before any update, as one process halts. Each stage's skip rule
    counts the skip the other stage made (it skipped step 1 for stage 1's NaN), or stage 0 would skip step 2 as its
    first and train on."""
    first, second = (result["skip_limit_across"] for result in results(fault_runs, "pp_faults", 2))
    for stage in (first, second):
        assert stage["skipped"] == [1]
        assert stage["halted"]["step"] == 2
        assert stage["halted"]["unchanged"]
    assert "skip limit exceeded" in first["halted"]["message"]
    assert first["halted"]["params"] == ["layers.0.feed_forward.up.weight"]
    assert second["halted"]["rule"] == "pipeline"


def test_a_stage_of_two_optimizers_beside_a_stage_of_one_takes_one_verdict_a_step(fault_runs: Path) -> None:
    """Stage 0 steps an optimizer per part (torchtitan's layout), stage 1 one: each stage's first optimizer step treats
    the stage's every gradient, so both make one exchange a step (the stage of two waited in a second one until the
    timeout before). Healthy: bitwise the unguarded run; a NaN on stage 1 halts both stages before any part moved."""
    for stage in results(fault_runs, "pp_faults", 2):
        runs = stage["several_optimizers"]
        assert runs["default"]["halted"] is None
        assert runs["default"]["final"] == runs["twin"]["final"]
        assert runs["halt"]["halted"]["step"] == scenarios.BAD_STEP
        assert runs["halt"]["halted"]["unchanged"]


def test_a_skip_past_its_limit_under_recovery_rewinds_every_stage_together(fault_runs: Path) -> None:
    """The same with recovery: every stage rewinds to the same snapshot at step 2 and trains on, one model."""
    first, second = (result["skip_limit_rewind"] for result in results(fault_runs, "pp_faults", 2))
    for stage in (first, second):
        assert stage["halted"] is None
        assert stage["changed"] == [True, False, True, True]  # step 2 restored the snapshot on both stages
        assert sum(counts.get("rewind", 0) for counts in stage["counters"].values()) == 1


def test_a_grad_scaler_on_the_stages_is_refused_on_every_stage_at_the_first_step(fault_runs: Path) -> None:
    """Each stage's GradScaler would skip its own update alone (an Inf on stage 1 skips stage 1's optimizer step while
    stage 0 updates and waits for it in the stages' exchange): refused at once, on every stage, at step 0."""
    for result in results(fault_runs, "pp_faults", 2):
        error = result["scaled"]["error"]
        assert result["scaled"]["step"] == 0
        assert error is not None
        assert error["type"] == "GuardStateError"
        assert error["message"].startswith("a GradScaler under pipeline parallel is not built"), error
        assert "bfloat16 autocast" in error["message"]
        assert error["seconds"] < error["timeout"] / 3, error


def test_a_failure_inside_one_stage_s_step_ends_every_stage_at_once_naming_its_rank(tmp_path: Path) -> None:
    """Stage 1's step raises before the stages' exchange, where stage 0 waits: both ranks raise at once, naming rank 1
    and what it raised, and log it; none waits for the process group's timeout."""
    launch(["pp_failure"], 2, tmp_path)
    for result in results(tmp_path, "pp_failure", 2):
        error = result["error"]
        assert error is not None, result
        assert error["type"] == "RankFailed"
        assert error["failed_rank"] == 1
        assert f"failed inside the guard's step {scenarios.BAD_STEP}" in error["message"]
        assert "ValueError: the device returned garbage" in error["message"]
        assert error["seconds"] < error["timeout"] / 3, error  # learned from the store, not the timeout
        assert result["steps"] == scenarios.BAD_STEP + 1
        (event,) = result["failures"]
        assert (event["failed_rank"], event["error"]) == (1, "ValueError: the device returned garbage")


def test_a_stage_with_nothing_to_treat_is_refused_on_every_stage_at_its_first_step(tmp_path: Path) -> None:
    """A frozen stage finds no gradient at its optimizer's step, so it would never join the stages' exchange, where
    the other stage waits until the process group's timeout: it is refused at once, naming the fix, and the other
    stage raises naming its rank, within seconds."""
    launch(["pp_frozen_stage"], 2, tmp_path)
    first, second = (result["error"] for result in results(tmp_path, "pp_frozen_stage", 2))
    assert second is not None
    assert first is not None
    assert second["type"] == "GuardStateError"
    assert second["message"].startswith("a pipeline stage with no gradient to treat at its first step")
    assert first["type"] == "RankFailed"
    assert first["failed_rank"] == 1
    assert "no gradient to treat" in first["message"]
    for error in (first, second):
        assert error["seconds"] < error["timeout"] / 3, error


def test_a_skip_on_one_stage_skips_every_stage(fault_runs: Path) -> None:
    """Under a skip policy no stage updates at the faulty step, and both go on training after it."""
    for result in results(fault_runs, "pp_faults", 2):
        skip = result["skip"]
        assert skip["halted"] is None
        assert skip["skipped"] == [scenarios.BAD_STEP]
        assert skip["changed"] == [True, False, True]


def test_a_rewind_under_a_pipeline_rewinds_every_stage_together(fault_runs: Path) -> None:
    """With recovery, both stages rewind at the same step and skip the same batches."""
    first, second = (result["rewind"] for result in results(fault_runs, "pp_faults", 2))
    assert first["counters"]["pipeline"]["rewind"] == 1
    assert second["counters"]["nonfinite"]["rewind"] == 1
    assert first["skipped"] == second["skipped"]
    assert first["changed"] == second["changed"]


def test_a_rewind_under_a_pipeline_ends_bitwise_equal_to_the_twin_that_never_trained_the_undone_batches(
    fault_runs: Path,
) -> None:
    """A NaN on stage 1 rewinds both stages to the same snapshot; each stage's weights at the end equal, bit for bit,
    those of the pipeline that trained only the batches the rewind kept."""
    for result in results(fault_runs, "pp_rewind_twin", 2):
        assert result["rewound"]["weights"] == result["twin"]["weights"]
        assert sum(counts.get("rewind", 0) for counts in result["rewound"]["counters"].values()) == 1


def test_a_stage_attached_without_a_mesh_is_refused_naming_the_pipeline_and_device_mesh(fault_runs: Path) -> None:
    for result in results(fault_runs, "pp_without_mesh", 2):
        assert "if this is a pipeline" in result["error"]
        assert "device_mesh=mesh" in result["error"]


def test_a_rule_matching_one_stage_only_attaches_on_every_stage_and_acts_on_the_stage_that_holds_it(
    fault_runs: Path,
) -> None:
    """A policy is written for the whole model: a rule matching the head, which only stage 1 holds, is no error on
    stage 0 (its tensors are another stage's), and stage 1 clips the head at each step."""
    first, last = (result["counters"] for result in results(fault_runs, "pp_one_stage_rule", 2))
    assert "head" not in first
    assert last["head"] == {"clip_norm": 4}  # two tensors, two steps


def test_a_rule_matching_no_stage_is_refused_on_every_stage_at_once_naming_the_rule(fault_runs: Path) -> None:
    """Each stage reads every stage's unmatched rules at the attach agreement: each raises the same PolicyError (the
    rule, "any pipeline stage", the fix), none waits for the other."""
    for result in results(fault_runs, "pp_one_stage_rule", 2):
        refused = result["no_stage"]
        assert refused["type"] == "PolicyError"
        assert "rule 'nowhere' matches no parameter of any pipeline stage (patterns ['no_such.*']" in refused["message"]
        assert "allow_no_match" in refused["message"]
        assert "rule 'head'" not in refused["message"]
        assert refused["seconds"] < refused["timeout"] / 3, refused


def test_a_stage_the_policy_guards_no_tensor_of_is_refused_on_every_stage_at_attach(fault_runs: Path) -> None:
    """A policy of the head's rule alone guards nothing on stage 0, which would never join the stages' exchange (the
    other stage waited for it until the process group's timeout): refused on both at the agreement, naming stage 0."""
    for result in results(fault_runs, "pp_one_stage_rule", 2):
        refused = result["unguarded_stage"]
        assert refused["type"] == "GuardStateError"
        assert refused["message"].startswith("the pipeline's stage(s) 0 (of 2) hold no tensor the policy guards")
        assert "'halt_on_nonfinite' rule on '*'" in refused["message"]
        assert refused["seconds"] < refused["timeout"] / 3, refused


def test_an_attach_that_raises_on_one_stage_before_the_agreement_is_named_at_once_on_the_other(
    fault_runs: Path,
) -> None:
    """Stage 0's attach raises its own error before the attach agreement; stage 1, waiting there, raises RankFailed
    naming rank 0, its host and that error within seconds, not "rank(s) [0] did not attach" at attach_timeout."""
    refused, waiting = (result["failed_before"] for result in results(fault_runs, "pp_one_stage_rule", 2))
    assert refused["type"] == "ValueError"
    assert "summary_every must be >= 0" in refused["message"]
    assert waiting["type"] == "RankFailed"
    assert waiting["failed_rank"] == 0
    assert waiting["message"].startswith(f"rank 0 (host {socket.gethostname()}) failed to attach its GradGuard: ")
    assert "ValueError: summary_every must be >= 0" in waiting["message"]
    assert "did not attach" not in waiting["message"]
    for error in (refused, waiting):
        assert error["seconds"] < error["timeout"] / 3, error


REFUSED = {
    "context_parallel": "GuardStateError: device_mesh has a dimension 'cp' of size 2: context parallel",
    "expert_parallel": "GuardStateError: device_mesh has a dimension 'ep' of size 2: expert parallel",
    "unknown_dimension": "GuardStateError: device_mesh has a dimension 'rows' the guard does not know",
    "mesh_and_group": "ValueError: pass device_mesh or process_group, not both",
    "loss_in_a_pipeline": "GuardStateError: the policy's 'loss' section cannot be used across pipeline stages",
    "group_monitor_in_a_pipeline": "GuardStateError: rule 'm': monitor with scope 'group' across pipeline stages",
    "reload_in_a_pipeline": "GuardStateError: reloading the policy across pipeline stages is not built yet",
}


@pytest.mark.parametrize("layout", list(REFUSED))
def test_a_layout_that_is_not_built_is_refused_at_attach_saying_why_and_what_works(
    fault_runs: Path, layout: str
) -> None:
    """Context and expert parallel, unknown mesh dimensions, a mesh beside a process group, the loss section,
    group figures other than a clip's and a policy reloaded across stages: refused on every rank, never silently
    wrong."""
    for result in results(fault_runs, "refusals", 2):
        error = result[layout]
        assert error is not None
        assert error.startswith(REFUSED[layout]), error
        fixes = ("docs/distributed.md", "not both", "Remove it", "Use scope", "without reload=True")
        assert any(fix in error for fix in fixes), error
    for result in results(fault_runs, "refusals", 2):
        assert result["pipeline_with_its_mesh"] is None


def test_reloading_a_pipeline_stage_s_policy_is_refused_and_the_old_policy_stays(fault_runs: Path) -> None:
    """The stages' reload agreement is not made over the pipeline: each would switch at its own step, so
    ``guard.reload()`` is refused on every stage (``reload=True`` at attach: the test above)."""
    for result in results(fault_runs, "refusals", 2):
        warning = result["reload_call_in_a_pipeline"]
        assert warning is not None
        assert "policy not reloaded, the old one stays in force" in warning
        assert "reloading the policy across pipeline stages is not built yet" in warning


def test_deepspeed_s_pipeline_engine_is_refused_naming_what_is_built() -> None:
    """DeepSpeed's PipelineEngine (its stages step inside train_batch()) is refused before anything is attached."""
    engine_module = pytest.importorskip("deepspeed.runtime.pipe.engine")
    engine = engine_module.PipelineEngine.__new__(engine_module.PipelineEngine)
    from gradguard import GradGuard, GuardStateError, Policy

    with pytest.raises(GuardStateError, match=r"PipelineEngine\) is not built.*device_mesh=mesh"):
        GradGuard(engine, Policy.shipped("default"), logger=None)
