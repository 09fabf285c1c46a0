"""Tensor, sequence and 2-D parallel: the guard's figures are the whole model's, as in one process.

Each layout (tests/parallel_scenarios.py) trains the decoder on real gloo ranks under every policy of
``parallel_scenarios.POLICIES``; the reference is the same decoder, guarded by the same policy, in this process on the
full batch, and for the clips also torch's own ``clip_grad_norm_``. Weights agree within 1e-5 after 3 steps, the
monitor's figures within 1e-4 of the largest.
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
from support.parallel_models import batch, loss_of, make_decoder

sys.path.insert(0, str(Path(__file__).parent))
import parallel_scenarios as scenarios

SCRIPT = Path(__file__).parent / "parallel_scenarios.py"
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


def launch(name: str, world: int, outdir: Path, timeout: float = 400) -> list[dict[str, Any]]:
    path = os.pathsep.join(filter(None, [str(SCRIPT.parent.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    command = [sys.executable, str(SCRIPT), name, str(world), str(outdir), str(free_port())]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return [json.loads((outdir / name / f"rank{rank}.json").read_text()) for rank in range(world)]


def reference(policy: str, layers: int = 2) -> dict[str, Any]:
    """The decoder (of ``layers`` blocks) in one process on the full batch, guarded by the same policy."""
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"gradguard-tp-reference-{os.getpid()}-{policy}.jsonl"
    log.unlink(missing_ok=True)
    result = scenarios.train(make_decoder(layers=layers), policy, log)
    stats = scenarios.stats_of(log)
    log.unlink()
    return result | {"stats": stats}


def torch_clipped(group: bool, layers: int = 2) -> dict[str, list[float]]:
    """The decoder trained with torch's own clip: per tensor at 0.05, or over all of it at 0.2."""
    model = make_decoder(layers=layers)
    opt = torch.optim.SGD(model.parameters(), lr=scenarios.LR)
    for step in range(scenarios.STEPS):
        opt.zero_grad()
        tokens, targets = batch(step)
        loss_of(model(tokens), targets).backward()
        if group:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2)
        else:
            for param in model.parameters():
                torch.nn.utils.clip_grad_norm_([param], 0.05)
        opt.step()
    return {name: param.detach().reshape(-1).tolist() for name, param in model.named_parameters()}


def assert_weights_close(found: dict[str, list[float]], expected: dict[str, list[float]]) -> None:
    assert found.keys() == expected.keys()
    for name, values in expected.items():
        torch.testing.assert_close(torch.tensor(found[name]), torch.tensor(values), atol=1e-5, rtol=0, msg=name)


def assert_stats_close(found: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    assert len(found) == len(expected) == scenarios.STEPS
    for mine, theirs in zip(found, expected, strict=True):
        assert mine["figures"].keys() == theirs["figures"].keys()
        for stat, by_name in theirs["figures"].items():
            assert mine["figures"][stat].keys() == by_name.keys()
            largest = max(abs(value) for value in by_name.values() if not isinstance(value, str))
            for name, value in by_name.items():
                if isinstance(value, str):  # a figure JSON cannot hold (a std of one element: "NaN")
                    assert mine["figures"][stat][name] == value, (stat, name)
                else:
                    assert abs(mine["figures"][stat][name] - value) <= 1e-4 * largest, (stat, name)


def test_a_healthy_run_on_four_tensor_parallel_ranks_is_the_unguarded_one_to_the_last_bit(tmp_path: Path) -> None:
    """The shipped default changes nothing in a healthy run: its Partial gradients (the SequenceParallel norms') are
    reduced one all-reduce each, as the update would reduce them (one joined buffer summed each element in another
    order on four ranks, and every weight ended a few ulp away)."""
    for result in launch("tp_unguarded_twin", 4, tmp_path):
        assert result["differing"] == []


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("clip", sorted(scenarios.TWIN_CLIPS))
def test_a_healthy_run_whose_loop_clips_is_the_unguarded_one_to_the_last_bit(
    tmp_path: Path, clip: str, world: int
) -> None:
    """The guard's step runs at the loop's clip (torch's ``clip_grad_norm_`` or torchtitan's), which then scales each
    rank's addend of a Partial gradient, and the update sums the scaled addends. The guard reads a reduced copy of
    each Partial gradient and leaves the gradient itself as it came (the default's zclip multiplies the copy by 1,
    which changes nothing): reduced in place, it was scaled as a sum, and 28 of the 37 weights ended an ulp away after
    4 steps (only the 10 Partial gradients at the first). The clip's change to a gradient left Partial is no new
    gradient: the optimizer's step treats nothing again (one guard step a training step)."""
    for result in launch(f"tp_unguarded_twin_{clip}", world, tmp_path):
        assert min(result["norms"]) > scenarios.TWIN_MAX_NORM  # the clip scaled every step, guarded and not
        assert result["differing"] == []
        assert result["steps"] == scenarios.STEPS + 1


LAYOUTS = [("tp_plain", 2), ("tp_titan", 2), ("tp_fsdp2_titan", 4)]


@pytest.fixture(scope="module", params=LAYOUTS, ids=[name for name, _ in LAYOUTS])
def layout_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    name, world = request.param
    return launch(name, world, tmp_path_factory.mktemp(name))


@pytest.mark.parametrize("policy", [name for name in scenarios.POLICIES if name != "monitor"])
def test_every_rank_ends_with_the_weights_one_process_would_have(
    layout_runs: list[dict[str, Any]], policy: str
) -> None:
    """Per-tensor and group clips, agc, clip_value and the shipped default: the whole weights after 3 steps are the
    single-process run's, on every rank."""
    if policy not in layout_runs[0]:
        pytest.skip("torchtitan's clip needs every gradient a DTensor: the plain layout's are not all")
    expected = reference(policy)["final"]
    for result in layout_runs:
        assert_weights_close(result[policy]["final"], expected)


@pytest.mark.parametrize("group", [False, True], ids=["per_tensor", "group"])
def test_the_clips_match_torch_s_own_clip_grad_norm(layout_runs: list[dict[str, Any]], group: bool) -> None:
    """The weights after a per-tensor or a group clip are those torch's own clip_grad_norm_ gives in one process."""
    expected = torch_clipped(group)
    for result in layout_runs:
        assert_weights_close(result["group_clip" if group else "per_tensor_clip"]["final"], expected)


@pytest.mark.parametrize("policy", list(scenarios.LOOP_CLIPS))
def test_torchtitan_s_clip_after_the_guard_sees_the_norm_one_process_sees(
    layout_runs: list[dict[str, Any]], policy: str
) -> None:
    """torchtitan's clip_grad_norm_ (get_total_norm on the DTensor gradients, full_tensor(), clip_grads_with_norm_)
    after the guard's step returns, at every step, the norm one process's torch clip returns after the same policy:
    the gradients' own where the guard treats nothing, the policy's where it clipped them."""
    if policy not in layout_runs[0]:
        pytest.skip("torchtitan's clip needs every gradient a DTensor: the plain layout's are not all")
    expected = reference(policy)["norms"]
    for result in layout_runs:
        torch.testing.assert_close(torch.tensor(result[policy]["norms"]), torch.tensor(expected), atol=1e-5, rtol=0)


def test_the_monitor_s_figures_are_the_whole_tensors(layout_runs: list[dict[str, Any]]) -> None:
    """norm, mean, std, max_abs and grad_to_weight of every tensor, on every rank, as one process sees them."""
    expected = reference("monitor")["stats"]
    for result in layout_runs:
        assert_stats_close(result["monitor"]["stats"], expected)


def test_a_nan_in_one_rank_s_shard_halts_every_rank_before_the_update(layout_runs: list[dict[str, Any]]) -> None:
    """A NaN written into the last rank's shard of a column-wise weight's gradient halts every rank at that step,
    naming the parameter, with every weight as it was."""
    for result in layout_runs:
        halted = result["halt"]["halted"]
        assert halted is not None
        assert halted["step"] == 1
        assert halted["params"] == ["layers.0.attention.q.weight"]
        assert halted["unchanged"]
        assert list(halted["ranks"]) == [str(len(layout_runs) - 1)]  # the rank whose shard it was, on every rank
    assert "It was not made on this rank (rank 0)" in layout_runs[0]["halt"]["halted"]["message"]


def test_a_nan_in_one_rank_s_shard_that_the_step_computed_again_does_not_make_halts_every_rank_as_transient(
    layout_runs: list[dict[str, Any]],
) -> None:
    """The rerun section (transient: halt) under optimizer.step(closure): the NaN in the last rank's shard of the first
    computation of step 1 is not made again, so every rank compares the whole tensors' norms (not its pieces' alone,
    nor the loss alone), finds the parameter whose norm differed, names the rank whose shard it was, and halts
    as one process would: transient, at step 1."""
    last = len(layout_runs) - 1
    for result in layout_runs:
        rerun = result["rerun"]
        assert rerun["halted"] == {
            "step": 1,
            "kind": "transient",
            "rule": "rerun",
            "params": ["layers.0.attention.q.weight"],
        }
        assert rerun["counters"]["rerun"] == {"transient": 1, "halt": 1}
        assert rerun["closures"] == 3  # steps 0 and 1, and step 1 again
        (event,) = rerun["reruns"]
        assert (event["step"], event["verdict"], event["params"]) == (1, "transient", ["layers.0.attention.q.weight"])
        assert event["ranks"] == [last]  # the rank whose own pieces differed, on every rank
        assert event["max_rel_diff"] == "Infinity"


def test_gradients_kept_between_steps_are_treated_at_every_step(layout_runs: list[dict[str, Any]]) -> None:
    """With ``zero_grad(set_to_none=False)`` backward accumulates into the same DTensor gradients, whose local tensors'
    versions DTensor's in-place ops leave as they were: every step after the first looked treated already, so no
    clip, no zclip, no halt acted on it (a NaN at step 3 halted as "step 1", and a NaN at a step the loop did not
    write into would have gone through). Every tensor is clipped at every clean step, and the NaN halts at its step."""
    for result in layout_runs:
        kept = result["kept_gradients"]
        assert kept["halted_at"] == scenarios.KEPT_STEPS - 1
        assert kept["first"] > 0
        assert kept["clips"] == (scenarios.KEPT_STEPS - 1) * kept["first"]
