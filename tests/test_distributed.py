"""DDP and FSDP2 with real gloo process groups on the CPU: one verdict on every rank.

Each scenario runs in its own processes (tests/distributed_scenarios.py) under a hard timeout, so a
hang fails fast instead of stalling the suite.
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
from support.gloo_ranks import TIMEOUT, free_port
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import distributed_scenarios as scenarios

SCRIPT = Path(__file__).parent / "distributed_scenarios.py"
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


def launch(names: list[str], world: int, outdir: Path, *, torchrun: bool = False, timeout: float = 240) -> None:
    """Run the scenarios in one launch of ``world`` processes; fail fast on a hang or a crash."""
    # DETAIL wraps the process group to check that every rank calls the same collectives. In torch 2.13
    # (CPU) it crashes DDP's constructor itself (in its logger), so DDP scenarios run under INFO.
    debug = "DETAIL" if all(name.startswith("fsdp2") for name in names) else "INFO"
    # The checkout's gradguard, not whichever one is installed: the script's own folder is tests/.
    path = os.pathsep.join(filter(None, [str(SCRIPT.parent.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TORCH_DISTRIBUTED_DEBUG": debug, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    joined = ",".join(names)
    if torchrun:
        command = [
            *(sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}"),
            *(f"--master_port={free_port()}", str(SCRIPT), "--torchrun", joined, str(outdir)),
        ]
    else:
        command = [sys.executable, str(SCRIPT), joined, str(world), str(outdir), str(free_port())]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "mismatch" not in output.lower(), output[-4000:]


def results_of(outdir: Path, name: str, world: int) -> list[dict[str, Any]]:
    return [json.loads((outdir / name / f"rank{rank}.json").read_text()) for rank in range(world)]


DDP_SCENARIOS = [
    "ddp_clip",
    "ddp_no_sync",
    "ddp_unused",
    "ddp_nan_one_rank",
    "ddp_skip_one_rank",
    "ddp_metrics",
    "ddp_loss_spike_one_rank",
    "ddp_rerun_transient_one_rank",
]
FSDP2_SCENARIOS = [
    "fsdp2_clip",
    "fsdp2_nan_one_rank",
    "fsdp2_attach_before_shard",
    "fsdp2_loss_spike_one_rank",
    *scenarios.RERUNS,
]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    outdir = tmp_path_factory.mktemp("ddp")
    launch(DDP_SCENARIOS, 2, outdir)
    return outdir


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    outdir = tmp_path_factory.mktemp("fsdp2")
    launch(FSDP2_SCENARIOS, 2, outdir)
    return outdir


def reference_run(micro_batches: int = 1, world: int = 2) -> dict[str, torch.Tensor]:
    """One process, the ranks' gradients averaged by hand, the policy applied with torch's own clips."""
    model = scenarios.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(scenarios.STEPS):
        opt.zero_grad()
        for rank in range(world):
            for micro in range(micro_batches):
                x, y = scenarios.batch(rank, step, micro)
                (nn.functional.mse_loss(model(x), y) / (micro_batches * world)).backward()
        for param in (model.embed.weight, model.embed.bias):
            torch.nn.utils.clip_grad_norm_([param], 0.05)
        rest = [p for name, p in model.named_parameters() if not name.startswith("embed.")]
        torch.nn.utils.clip_grad_norm_(rest, 0.1)
        opt.step()
    return {name: p.detach().reshape(-1) for name, p in model.named_parameters()}


def assert_matches_reference(
    result: dict[str, Any], reference: dict[str, torch.Tensor], *, exact: bool = False
) -> None:
    """The rank's final parameters against the one-process reference: bitwise with ``exact``, else to float32's
    rounding (where the reference divides or sums in another order than DDP: by 3 micro-batches, over 4 ranks)."""
    for name, values in result["final"].items():
        tolerance = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": 1e-5, "atol": 1e-6}
        torch.testing.assert_close(torch.tensor(values), reference[name], **tolerance, msg=name)


def test_ddp_policy_acts_on_the_averaged_gradient_identically_on_every_rank(ddp_runs: Path) -> None:
    """DDP, 2 ranks: the result equals, bitwise, torch's clips of the averaged gradient computed in one process (the
    reference's backward of each rank's loss / 2 halves the rank's gradient exactly, and DDP's sum of two, halved,
    rounds as the reference's sum of the halves), and replicas stay bit-identical."""
    results = results_of(ddp_runs, "ddp_clip", 2)
    assert results[0]["digests"] == results[1]["digests"]
    assert len(results[0]["digests"]) == scenarios.STEPS
    assert results[0]["counters"] == results[1]["counters"]
    assert results[0]["counters"]["embed"]["clip_norm"] > 0
    assert_matches_reference(results[0], reference_run(), exact=True)
    assert [r["log_ranks"] for r in results] == [[0], [1]]


def test_ddp_with_four_ranks_keeps_replicas_identical(tmp_path: Path) -> None:
    """DDP, 4 ranks: the same verdict and the same parameters on every rank."""
    launch(["ddp_clip"], 4, tmp_path)
    results = results_of(tmp_path, "ddp_clip", 4)
    assert all(r["digests"] == results[0]["digests"] for r in results)
    assert_matches_reference(results[0], reference_run(world=4))


def test_ddp_started_by_torchrun_behaves_like_multiprocessing(tmp_path: Path) -> None:
    """torchrun, 2 ranks: the same result as the torch.multiprocessing launch."""
    launch(["ddp_clip"], 2, tmp_path, torchrun=True)
    results = results_of(tmp_path, "ddp_clip", 2)
    assert results[0]["digests"] == results[1]["digests"]
    assert_matches_reference(results[0], reference_run())


def test_ddp_no_sync_accumulation_clips_the_synchronised_sum_once(ddp_runs: Path) -> None:
    """no_sync for two micro-batches, sync on the third: clip acts on the averaged sum, once per step (to float32's
    rounding: a third is not exact, and the reference divides each micro-batch's loss where DDP's sum is divided)."""
    results = results_of(ddp_runs, "ddp_no_sync", 2)
    assert results[0]["digests"] == results[1]["digests"]
    assert_matches_reference(results[0], reference_run(micro_batches=3))


def test_ddp_with_find_unused_parameters_guards_the_used_ones(ddp_runs: Path) -> None:
    """find_unused_parameters=True: unused parameters have no gradient and are skipped on every rank alike."""
    results = results_of(ddp_runs, "ddp_unused", 2)
    assert results[0]["digests"] == results[1]["digests"]
    assert len(results[0]["digests"]) == scenarios.STEPS


def test_a_nan_on_one_rank_halts_every_rank_promptly_with_no_collective_timeout(ddp_runs: Path) -> None:
    """NaN injected into rank 1's gradient only: both ranks halt at the same step, before any collective's timeout."""
    results = results_of(ddp_runs, "ddp_nan_one_rank", 2)
    for result in results:
        halt = result["halt"]
        assert halt is not None, result
        assert halt["step"] == scenarios.BAD_STEP
        assert halt["params"] == ["body.weight"]
        assert halt["kind"] == "nan"
        assert halt["unchanged"]
        # A hang guard, not a speed claim: a rank left waiting in a collective would wait out its timeout.
        assert halt["seconds"] < TIMEOUT.total_seconds(), "a rank waited for a collective's timeout"
    assert results[0]["digests"] == results[1]["digests"]


def test_an_inf_on_one_rank_skips_the_step_on_every_rank(ddp_runs: Path) -> None:
    """Inf injected into rank 0's gradient only, skip policy: every rank skips that step and continues in step."""
    results = results_of(ddp_runs, "ddp_skip_one_rank", 2)
    for result in results:
        assert result["skipped"] == [{"step": scenarios.BAD_STEP, "unchanged": True}]
        assert len(result["digests"]) == scenarios.STEPS
        assert result["counters"]["nonfinite"]["skip_step_on_nonfinite"] == 1
        assert result["counters"]["nonfinite"]["inf"] == 1
    assert results[0]["digests"] == results[1]["digests"]


def test_the_audit_of_both_ranks_logs_counts_the_skip_and_each_clip_once(ddp_runs: Path) -> None:
    """The issue's reproduction on real logs: both ranks write the skip at BAD_STEP and every clip; the audit of
    the two files reads 1 step skipped and each rank's clip count, not twice it, and names the job's ranks."""
    from gradguard.audit.command import render_summary, summarize_files
    from gradguard.audit.filters import Filters

    results = results_of(ddp_runs, "ddp_skip_one_rank", 2)
    logs = [ddp_runs / "ddp_skip_one_rank" / f"audit-rank{rank}.jsonl" for rank in (0, 1)]
    summary = summarize_files(logs, Filters(), progress=False)
    assert (summary.skips.events, summary.skips.steps) == (1, [scenarios.BAD_STEP])
    clips = results[0]["counters"]["clip"]["clip_norm"]
    assert clips > 0
    assert summary.intervention_count == clips
    assert summary.totals == results[0]["counters"] == results[1]["counters"]
    assert [run.counters for run in summary.runs] == [result["counters"] for result in results]
    assert summary.mismatches_total == 0
    assert [sorted(job.ranks) for job in summary.jobs] == [[0, 1]]
    text = render_summary(summary, "table", 10)
    assert f"1 step skipped by the guard (rule nonfinite 1) at steps {scenarios.BAD_STEP}" in text
    assert f"{clips} gradients changed" in text
    transient = results_of(ddp_runs, "ddp_rerun_transient_one_rank", 2)
    logs = [ddp_runs / "ddp_rerun_transient_one_rank" / f"audit-rank{rank}.jsonl" for rank in (0, 1)]
    by_rank = {row.rank: row for row in summarize_files(logs, Filters(), progress=False).by_rank}
    assert by_rank[1].transient == 1  # the re-run both ranks wrote, once, against the rank that differed
    assert all(row.transient == 0 for rank, row in by_rank.items() if rank not in transient[0]["reruns"][0]["ranks"])


@pytest.mark.parametrize("runs", ["ddp_runs", "fsdp2_runs"])
def test_a_loss_spike_on_one_rank_skips_the_step_on_every_rank(runs: str, request: pytest.FixtureRequest) -> None:
    """The ranks judge the mean of their losses (one collective in the step): rank 1's 50x loss is a spike of the
    mean, and both ranks skip the same step, with the same parameters after."""
    name = "ddp_loss_spike_one_rank" if runs == "ddp_runs" else "fsdp2_loss_spike_one_rank"
    results = results_of(request.getfixturevalue(runs), name, 2)
    for result in results:
        assert result["halt"] is None
        assert result["skipped"] == [{"step": scenarios.BAD_STEP, "unchanged": True}]
        assert result["counters"]["loss"] == {"spike": 1}
    assert results[0]["final"] == results[1]["final"] or runs == "fsdp2_runs"


def test_a_transient_fault_on_one_rank_is_computed_again_on_both_and_both_go_on(ddp_runs: Path) -> None:
    """The rerun section under DDP: rank 1's first computation of the step is NaN; the verdict is agreed, both ranks
    compute the step again, agree that it was transient (naming rank 1), and go on with identical replicas."""
    results = results_of(ddp_runs, "ddp_rerun_transient_one_rank", 2)
    for result in results:
        assert result["steps"] == scenarios.STEPS
        assert result["counters"]["rerun"] == {"transient": 1}
        (rerun,) = result["reruns"]
        assert (rerun["step"], rerun["verdict"]) == (scenarios.BAD_STEP, "transient")
        assert 1 in rerun["ranks"]
        # The NaN was made in rank 1's own backward (before DDP's all-reduce), and not made there again: rank 1's
        # device is the suspect, its host named.
        assert rerun["origin_ranks"] == {"1": socket.gethostname()}
        assert rerun["recurred"] == {}
    assert results[0]["final"] == results[1]["final"]


def test_under_fsdp2_a_nan_in_one_rank_s_shard_is_transient_when_the_step_computed_again_does_not_make_it(
    fsdp2_runs: Path,
) -> None:
    """The rerun section under FSDP2: rank 1's shard of body.weight's gradient is NaN in the first computation of the
    step only. Both ranks compare the whole tensors' norms (the loss alone agrees), call it transient, name rank 1
    and go on; the same NaN made again in the second computation is reproducible on both, and the policy halts."""
    for result in results_of(fsdp2_runs, "fsdp2_rerun_transient_one_rank", 2):
        assert (result["halt"], result["steps"]) == (None, scenarios.STEPS)
        assert result["counters"]["rerun"] == {"transient": 1}
        (rerun,) = result["reruns"]
        assert (rerun["step"], rerun["verdict"], rerun["params"]) == (scenarios.BAD_STEP, "transient", ["body.weight"])
        assert rerun["loss_first"] == rerun["loss_second"]
        assert rerun["ranks"] == [1]  # the rank whose own shard differed, on both
        assert (rerun["origin_ranks"], rerun["recurred"]) == ({"1": socket.gethostname()}, {})
    for result in results_of(fsdp2_runs, "fsdp2_rerun_reproducible_one_rank", 2):
        halt = {"step": scenarios.BAD_STEP, "kind": "nan", "rule": "nonfinite", "params": ["body.weight"]}
        assert result["halt"] == halt
        assert result["counters"]["rerun"] == {"reproducible": 1}
        (rerun,) = result["reruns"]
        assert (rerun["verdict"], rerun["params"], rerun["ranks"], rerun["max_rel_diff"]) == ("reproducible", [], [], 0)


def test_under_ddp_each_rank_serves_its_own_metrics_labelled_with_its_rank(ddp_runs: Path) -> None:
    """With metrics_port=0 the ranks serve on different ports; each scrape carries its rank and its counters."""
    parser = pytest.importorskip("prometheus_client.parser")
    results = results_of(ddp_runs, "ddp_metrics", 2)
    if results[0]["metrics"] is None:
        pytest.skip("prometheus_client is not installed")
    assert len({result["url"] for result in results}) == 2
    for result in results:
        samples = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in parser.text_string_to_metric_families(result["metrics"])
            for sample in family.samples
        }
        rank = str(result["rank"])
        assert {dict(labels)["rank"] for _, labels in samples} == {rank}
        assert samples[("gradguard_steps_total", (("rank", rank),))] == result["steps"]
        skips = result["counters"]["nonfinite"]["skip_step_on_nonfinite"]
        assert skips == 1  # the Inf on rank 0 skipped the step on both ranks
        assert samples[("gradguard_skipped_steps_total", (("rank", rank), ("rule", "nonfinite")))] == skips
        clips = result["counters"]["clip"]["clip_norm"]
        assert (
            samples[("gradguard_interventions_total", (("action", "clip_norm"), ("rank", rank), ("rule", "clip")))]
            == clips
        )


@pytest.fixture(scope="module")
def agreement(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    outdir = tmp_path_factory.mktemp("agreement")
    launch(["ddp_agreement"], 2, outdir)
    return [result["flags"] for result in results_of(outdir, "ddp_agreement", 2)]


# DDP options and comm hooks whose reduction carries a NaN/Inf injected on one rank (before the
# all-reduce) to every rank, in the same parameter, with the same NaN/Inf flags (docs/distributed.md).
AGREEING = [
    "default",
    "gradient_as_bucket_view",
    "static_graph",
    "find_unused_parameters",
    "fp16_compress_hook",
    "powerSGD_hook",
    "no_sync_after_sync",
]
ONE_RANK = ["nan", "+inf", "-inf"]


@pytest.mark.parametrize("config", AGREEING)
def test_ddp_reduction_carries_a_nonfinite_on_one_rank_to_every_rank(
    agreement: list[dict[str, Any]], config: str
) -> None:
    """A NaN/Inf in one rank's gradient before DDP's all-reduce is non-finite on every rank after it."""
    for injection in scenarios.AGREEMENT_INJECTIONS:
        seen = [flags[config][injection] for flags in agreement]
        assert seen[0] == seen[1], (config, injection, seen)
        bad = {name for name, value in seen[0].items() if value is not None and any(value)}
        if injection == "1e5":
            # fp16 compression turns a finite value past 65504 into +Inf, on every rank alike.
            expected = {"body.weight"} if config == "fp16_compress_hook" else set()
            assert bad == expected, (config, injection, seen[0])
            continue
        assert bad == {"body.weight"}, (config, injection, seen[0])
        has_nan, has_inf = seen[0]["body.weight"]
        if config == "powerSGD_hook":
            assert has_nan  # the low-rank factors turn an Inf into NaN (on every rank alike)
        elif injection in ONE_RANK:
            assert (has_nan, has_inf) == (injection == "nan", injection != "nan")
        else:
            assert (has_nan, has_inf) == (True, False)  # +Inf + -Inf
    if config == "find_unused_parameters":
        for flags in agreement:
            assert flags[config]["nan"]["unused.weight"] is None  # no gradient, on every rank


@pytest.mark.parametrize("config", ["no_sync_inside", "after_allreduce"])
def test_without_ddp_reduction_a_nonfinite_stays_on_its_rank(agreement: list[dict[str, Any]], config: str) -> None:
    """Inside no_sync, or injected after the all-reduce, only the rank that made it sees it: the flags'
    collective is what makes every rank agree there."""
    for injection in ONE_RANK:
        seen = [flags[config][injection]["body.weight"] for flags in agreement]
        assert seen[0] == [False, False], (config, injection, seen)
        assert any(seen[1]), (config, injection, seen)
    both = [flags[config]["+inf/-inf"]["body.weight"] for flags in agreement]
    assert both == [[False, True], [False, True]]  # each rank sees only its own Inf, no NaN


def test_bf16_compression_is_unavailable_on_gloo_or_agrees(agreement: list[dict[str, Any]]) -> None:
    seen = [flags["bf16_compress_hook"] for flags in agreement]
    assert seen[0] == seen[1]


def test_fsdp2_norms_are_those_of_the_full_unsharded_gradient(fsdp2_runs: Path) -> None:
    """fully_shard, 2 ranks: per-tensor and group clips equal the unsharded reference on every rank."""
    results = results_of(fsdp2_runs, "fsdp2_clip", 2)
    assert results[0]["digests"] == results[1]["digests"]
    assert results[0]["counters"] == results[1]["counters"]
    assert_matches_reference(results[0], reference_run())


def test_fsdp2_a_nan_in_one_ranks_shard_halts_every_rank(fsdp2_runs: Path) -> None:
    """fully_shard: a NaN in rank 1's local shard halts both ranks at the same step, parameters unchanged."""
    results = results_of(fsdp2_runs, "fsdp2_nan_one_rank", 2)
    for result in results:
        assert result["halt"] is not None
        assert result["halt"]["step"] == scenarios.BAD_STEP
        assert result["halt"]["params"] == ["body.weight"]
        assert result["halt"]["unchanged"]


def test_fsdp2_guard_attached_before_sharding_rebinds_to_the_sharded_parameters(fsdp2_runs: Path) -> None:
    """Attach, then fully_shard: the guard notices the new parameters, re-binds, says so and keeps guarding."""
    results = results_of(fsdp2_runs, "fsdp2_attach_before_shard", 2)
    for result in results:
        assert "rebind" in result["events"]
        assert result["counters"]["embed"]["clip_norm"] >= 1
    assert results[0]["digests"] == results[1]["digests"]


ATTACH_SCENARIOS = [
    "attach_agree",
    "attach_fails_on_one_rank",
    "attach_policy_differs",
    "attach_params_differ",
    "attach_missing_rank",
]


@pytest.fixture(scope="module")
def attach_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    outdir = tmp_path_factory.mktemp("attach")
    launch(ATTACH_SCENARIOS, 2, outdir, timeout=120)  # the missing rank comes last: it leaves the others' count behind
    return outdir


def test_ranks_that_attach_the_same_guard_agree_and_step(attach_runs: Path) -> None:
    """Two ranks attaching the same policy to the same model both attach and step; agreement is quick."""
    for result in results_of(attach_runs, "attach_agree", 2):
        assert result["attached"]
        assert result["error"] is None
        assert result["steps"] == 1
        assert result["seconds"] < scenarios.ATTACH_TIMEOUT


def test_a_rank_whose_attach_raises_is_named_at_once_on_the_others_with_its_host_and_error(attach_runs: Path) -> None:
    """Rank 0's policy has a rule that matches none of its parameters: its binding raises PolicyError before any
    agreement. Rank 0 raises that, unchanged; rank 1, waiting for rank 0 in the attach agreement, raises RankFailed
    naming rank 0, its host and its PolicyError within seconds, not "did not attach" at attach_timeout. The scenarios
    after it agree as before: the failed attach took its place in the ranks' count of attaches."""
    failed, waiting = results_of(attach_runs, "attach_fails_on_one_rank", 2)
    assert not failed["attached"]
    assert failed["error"]["type"] == "PolicyError"
    assert "rule 'nowhere' matches no parameter" in failed["error"]["message"]
    assert not waiting["attached"]
    assert waiting["error"]["type"] == "RankFailed"
    assert waiting["error"]["failed_rank"] == 0
    message = waiting["error"]["message"]
    assert message.startswith(f"rank 0 (host {socket.gethostname()}) failed to attach its GradGuard: PolicyError: ")
    assert "rule 'nowhere' matches no parameter" in message
    assert "did not attach" not in message
    assert waiting["seconds"] < scenarios.FAILING_ATTACH_TIMEOUT / 3


def test_ranks_with_different_policies_are_refused_on_every_rank_naming_the_ranks(attach_runs: Path) -> None:
    """A policy that differs on rank 1 raises GuardStateError on both ranks, naming the field and both sides."""
    for result in results_of(attach_runs, "attach_policy_differs", 2):
        assert not result["attached"]
        assert result["error"]["type"] == "GuardStateError"
        message = result["error"]["message"]
        assert "policy differs (ranks [0]: content" in message
        assert "ranks [1]: content" in message
        assert "parameters differs" not in message
        assert result["seconds"] < scenarios.ATTACH_TIMEOUT


def test_ranks_with_different_parameters_are_refused_on_every_rank(attach_runs: Path) -> None:
    """A model with one more parameter on rank 1 is named as a parameters difference on both ranks."""
    for result in results_of(attach_runs, "attach_params_differ", 2):
        assert result["error"]["type"] == "GuardStateError"
        assert "parameters differs (ranks [0]: 6 guarded tensors" in result["error"]["message"]
        assert "ranks [1]: 8 guarded tensors" in result["error"]["message"]


def test_a_rank_that_never_attaches_is_named_within_the_attach_timeout(attach_runs: Path) -> None:
    """Rank 0 attaches, rank 1 does not: rank 0 raises GuardStateError naming rank 1 after the timeout, no hang."""
    waiting, missing = results_of(attach_runs, "attach_missing_rank", 2)
    assert missing["error"] is None
    assert not missing["attached"]
    assert waiting["error"]["type"] == "GuardStateError"
    assert "rank(s) [1] did not attach a GradGuard within 3 s" in waiting["error"]["message"]
    assert scenarios.ATTACH_TIMEOUT <= waiting["seconds"] < scenarios.ATTACH_TIMEOUT + 5
