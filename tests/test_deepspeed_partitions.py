"""What the guard reads across DeepSpeed's partitions (issue #49 item 5): ``monitor``'s ``mean``, ``std`` and
``grad_to_weight``, ``agc`` per output unit and per group, and ``drop``, on real ZeRO engines, 2 gloo ranks, each
against the same policy acting on one process on the whole gradient.

The file is also the ranks' script (``--torchrun NAMES OUTDIR``, as ``tests/test_deepspeed_guard.py``): each rank
trains a DeepSpeed engine and, beside it, a plain copy of the model over both ranks' batches (the averaged gradient
DeepSpeed reduces) under a guard of its own on a process group of one rank. ``0.bias`` is frozen, so that at ZeRO 1
and 2 the partition boundary falls inside a row (a unit of ``agc``) of ``2.weight``; SGD has momentum and weight
decay, so a parameter whose gradient were only zeroed would still move.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

deepspeed = pytest.importorskip("deepspeed")

from support.deepspeed_ranks import batch, loss_of, make_engine, make_model, torchrun_scenarios  # noqa: E402
from support.gloo_ranks import main  # noqa: E402

from gradguard import GradGuard, Policy  # noqa: E402

SCRIPT = Path(__file__)
LR, MOMENTUM, DECAY = 0.05, 0.9, 0.01
FROZEN = ("0.bias",)
STEPS = 4
CONFIGS = ["1_1", "2_2", "2_1_rr"]
"""ZeRO 1 and 2, with and without accumulation, and round_robin_gradients (another order of the flat partition)."""
RULES: list[dict[str, Any]] = [
    {"name": "halt", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
    {
        "name": "watch",
        "match": "*",
        "actions": [{"action": "monitor", "every": 1, "stats": ["norm", "max_abs", "mean", "std", "grad_to_weight"]}],
    },
    {
        "name": "modules",
        "match": "*",
        "actions": [{"action": "monitor", "every": 1, "scope": "module", "stats": ["mean", "std", "grad_to_weight"]}],
    },
    {"name": "units", "match": ["0.weight", "2.*"], "actions": [{"action": "agc", "clipping": 0.1}]},
    {"name": "joint", "match": ["4.weight"], "actions": [{"action": "agc", "clipping": 0.05, "scope": "group"}]},
    {"name": "still", "match": ["4.bias"], "actions": [{"action": "drop"}]},
]


# --- the ranks ------------------------------------------------------------------------------------


def full_weights(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter whole (gathered at ZeRO 3: a collective, on every rank)."""
    params = dict(engine.module.named_parameters())
    if int(engine.zero_optimization_stage()) < 3:
        return {name: p.detach().float().clone() for name, p in params.items()}
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: p.detach().float().clone() for name, p in params.items()}


def adaptive_clips(log: Path) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in log.read_text().splitlines()]
    keys = ("step", "rule", "scope", "params", "units", "units_clipped")
    return [{key: event.get(key) for key in keys} for event in events if event["event"] == "adaptive_clip"]


def pieces_scenario(stage: int, gas: int, rank: int, outdir: Path, **zero: Any) -> dict[str, Any]:
    """Four updates of the engine and of the plain copy beside it, the same policy on both."""
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank makes every group
    engine = make_engine(stage, gas, lr=LR, momentum=MOMENTUM, weight_decay=DECAY, frozen=FROZEN, **zero)
    plain = make_model()
    for name, param in plain.named_parameters():
        param.requires_grad_(name not in FROZEN)
    optimizer = torch.optim.SGD(
        [p for p in plain.parameters() if p.requires_grad], lr=LR, momentum=MOMENTUM, weight_decay=DECAY
    )
    label = f"{stage}_{gas}{'_rr' if zero else ''}"
    logs = outdir / f"engine_{label}_{rank}.jsonl", outdir / f"plain_{label}_{rank}.jsonl"
    start = full_weights(engine)
    figures: list[dict[str, list[float]]] = []
    rules = Policy.from_dict({"version": 1, "rules": RULES})
    with (
        GradGuard(engine, rules, logger=None, audit_log=logs[0]) as guard,
        GradGuard(plain, rules, logger=None, audit_log=logs[1], process_group=alone[rank]) as alone_guard,
    ):
        for step in range(STEPS):
            optimizer.zero_grad()
            losses = [loss_of(plain(x), y) for r in range(2) for x, y in (batch(step, m, r) for m in range(gas))]
            torch.autograd.backward(torch.stack(losses).sum() / (2 * gas))
            optimizer.step()
            for micro in range(gas):
                x, y = batch(step, micro, rank)
                engine.backward(loss_of(engine(x), y))
                engine.step()
            mine, theirs = guard.metrics(), alone_guard.metrics()
            watched = sorted(key for key in theirs if key.startswith(("gradguard/watch/", "gradguard/modules/")))
            figures.append({key: [mine.get(key, float("nan")), theirs[key]] for key in watched})
        counters = [guard.counters.snapshot(), alone_guard.counters.snapshot()]
    end = full_weights(engine)
    plain_end = {name: p.detach().float().clone() for name, p in plain.named_parameters()}
    return {
        "figures": figures,
        "counters": counters,
        "clips": [adaptive_clips(logs[0]), adaptive_clips(logs[1])],
        "still": torch.equal(start["4.bias"], end["4.bias"]),
        "still_plain": torch.equal(start["4.bias"], plain_end["4.bias"]),
        "worst": max(float((end[n] - plain_end[n]).abs().max()) for n in end),
        "moved": min(float((end[n] - start[n]).abs().max()) for n in end if n not in ("4.bias", *FROZEN)),
        "split": split_rows(engine, rank),
    }


def split_rows(engine: Any, rank: int) -> list[str]:
    """The two-dimensional parameters whose rows this rank's partition begins or ends inside of (read through the
    guard's own view of DeepSpeed's partitions, at an update)."""
    from gradguard.enforce.distributed.deepspeed import ZeroGradients
    from gradguard.enforce.distributed.deepspeed_update import UpdateHook

    source = ZeroGradients(engine)
    found: list[str] = []
    names = [name for name, _ in engine.module.named_parameters()]

    def before() -> bool:
        pieces = source.pieces()
        for name, param, piece, start in zip(names, source.params, pieces, source.starts, strict=True):
            shape = source.shape(param)
            width = shape[1] if len(shape) == 2 else 0
            if width and piece.numel() and (start % width or (start + piece.numel()) % width):
                found.append(name)
        return False  # a skipped update: nothing moves

    hook = UpdateHook(engine, before)
    for micro in range(int(engine.gradient_accumulation_steps())):
        x, y = batch(0, micro, rank)
        engine.backward(loss_of(engine(x), y))
        engine.step()
    hook.remove()
    return found


def scenario(name: str, rank: int, world: int, outdir: Path) -> dict[str, Any]:
    _, *numbers = name.split("_")
    zero = {"round_robin_gradients": True} if numbers[-1:] == ["rr"] else {}
    return pieces_scenario(int(numbers[0]), int(numbers[1]), rank, outdir, **zero)


# --- the tests ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[dict[str, Any]]]:
    names = [f"pieces_{config}" for config in CONFIGS]
    return torchrun_scenarios(SCRIPT, names, tmp_path_factory.mktemp("deepspeed_partitions"), timeout=420)


@pytest.mark.parametrize("config", CONFIGS)
def test_a_monitor_s_mean_std_and_grad_to_weight_are_those_of_the_whole_gradient_on_every_rank(
    runs: Callable[[str], list[dict[str, Any]]], config: str
) -> None:
    """Per tensor and per module, at every update: what one process measures on the whole averaged gradient (to
    float64 sums' rounding against torch's float32 ones), not the mean of a rank's piece."""
    for result in runs(f"pieces_{config}"):
        assert len(result["figures"]) == STEPS
        for figures in result["figures"]:
            stats = {key.split("/")[2] for key in figures}
            assert {"mean", "std", "grad_to_weight", "norm", "max_abs"} <= stats
            assert any(key.startswith("gradguard/modules/") for key in figures)
            for key, (mine, whole) in figures.items():
                assert mine == pytest.approx(whole, rel=2e-5, abs=1e-8), key


@pytest.mark.parametrize("config", CONFIGS)
def test_agc_clips_the_same_units_as_on_one_process_where_a_partition_boundary_cuts_a_unit_in_two(
    runs: Callable[[str], list[dict[str, Any]]], config: str
) -> None:
    """Each unit's norms are summed over the ranks' pieces: the same units clipped at the same updates (some, not
    all), a group clip too, and the weights end where one process's policy takes them."""
    for result in runs(f"pieces_{config}"):
        mine, whole = result["clips"]
        assert mine == whole
        clipped = [event for event in mine if event["scope"] == "tensor"]
        assert clipped, "the threshold clips some units"
        assert any(k < n for event in clipped for k, n in zip(event["units_clipped"], event["units"], strict=True))
        assert any(event["scope"] == "group" for event in mine)
        assert result["counters"][0] == result["counters"][1]
        assert result["worst"] < 1e-5
        assert result["moved"] > 1e-4
    splits = [result["split"] for result in runs(f"pieces_{config}")]
    assert any(splits), "a partition boundary falls inside a row of some parameter"


@pytest.mark.parametrize("config", CONFIGS)
def test_drop_keeps_a_parameter_bitwise_still_under_momentum_and_weight_decay_as_on_one_process(
    runs: Callable[[str], list[dict[str, Any]]], config: str
) -> None:
    """DeepSpeed updates its flat partitions whole: the dropped parameter's weights, master piece and momentum are put
    back after each update, so it ends bitwise where it began (weight decay would move a zeroed gradient's)."""
    for result in runs(f"pieces_{config}"):
        assert result["still"]
        assert result["still_plain"]
        assert result["counters"][0]["still"] == {"drop": STEPS}


if __name__ == "__main__":
    main(scenario, sys.argv[1:])
