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
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

deepspeed = pytest.importorskip("deepspeed")

from support.deepspeed_ranks import (  # noqa: E402
    assert_update_held_by_the_clip,
    batch,
    loss_of,
    make_engine,
    make_model,
    own_gradient_as_tapped,
    torchrun_scenarios,
    train_step,
)
from support.gloo_ranks import main  # noqa: E402

from gradguard import GradGuard, GradientHalt, GuardStateError, Policy  # noqa: E402

SCRIPT = Path(__file__)
LR, MOMENTUM, DECAY = 0.05, 0.9, 0.01
FROZEN = ("0.bias",)
STEPS = 4
CONFIGS = ["1_1", "2_2", "2_1_rr", "3_1", "3_2"]
"""ZeRO 1 and 2, with and without accumulation, round_robin_gradients (another order of the flat partition), and
ZeRO 3, where every parameter is cut in two (inside a row of ``0.weight`` and ``4.weight``)."""
ZERO3 = ["3_1", "3_2", "3_2_released"]
"""ZeRO 3 with and without accumulation; ``released``: ``stage3_param_persistence_threshold`` 0, so no parameter stays
gathered between forwards (by default these small ones all do)."""
CUT = "2.weight"
HALT = {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}
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


def zero3_engine(gas: int, released: bool, **options: Any) -> Any:
    zero: dict[str, Any] = {"stage3_param_persistence_threshold": 0} if released else {}
    return make_engine(3, gas, lr=LR, **options, **zero)


def masters_and_state(engine: Any) -> list[torch.Tensor]:
    """This rank's fp32 master partitions and momentum buffers at its parameters' real elements (read straight from
    DeepSpeed's ZeRO 3 optimizer: a last partition's padding holds whatever its memory held, guarded or not)."""
    opt, rank = engine.optimizer, dist.get_rank()
    out = []
    for g, params in enumerate(opt.fp16_groups):
        flat = opt.fp32_partitioned_groups_flat[g]
        momentum = opt.optimizer.state.get(flat, {}).get("momentum_buffer")
        for param in params:
            offset = int(opt.grad_position[opt.get_param_id(param)][1])
            real = max(0, min(param.partition_numel(), param.ds_numel - rank * param.partition_numel()))
            out += [held.narrow(0, offset, real).clone() for held in (flat, momentum) if held is not None]
    return out


def poison(engine: Any, rank: int, at: int, steps: list[int]) -> Any:
    """NaN in ``CUT``'s local gradient on rank 1 at step ``at`` (the reduce-scatter carries it to both pieces)."""
    param = dict(engine.module.named_parameters())[CUT]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if rank == 1 and steps[-1] == at:
            grad = grad.clone()
            grad.view(-1)[0] = float("nan")
        return grad

    return param.register_hook(hook)


def zero3_halt(gas: int, rank: int, released: bool) -> dict[str, Any]:
    engine = zero3_engine(gas, released, clip=None, momentum=0.9)  # DeepSpeed's default config: its clip at 1.0
    steps = [0]
    handle = poison(engine, rank, 5, steps)
    result: dict[str, Any] = {"halted": None}
    with GradGuard(engine, Policy.from_dict({"version": 1, "rules": [HALT]}), logger=None) as guard:
        for step in range(8):
            steps.append(step)
            before, held = full_weights(engine), masters_and_state(engine)
            try:
                train_step(engine, step, gas, rank)
            except GradientHalt as halt:
                after, kept = full_weights(engine), masters_and_state(engine)
                result["halted"] = {"step": halt.step, "params": halt.params, "kind": halt.kind}
                result["untouched"] = all(torch.equal(before[n], after[n]) for n in before)
                result["state_untouched"] = len(held) == 2 * len(before) and all(map(torch.equal, held, kept))
                break
        result["counters"] = guard.counters.snapshot()
    handle.remove()
    return result


def zero3_clip(gas: int, rank: int) -> dict[str, Any]:
    engine = zero3_engine(gas, False)
    tight = {"name": "tight", "match": CUT, "actions": [{"action": "clip_norm", "max_norm": 1e-3}]}
    moved: list[float] = []
    others: list[float] = []
    with GradGuard(engine, Policy.from_dict({"version": 1, "rules": [tight, HALT]}), logger=None) as guard:
        for step in range(5):
            before = full_weights(engine)
            train_step(engine, step, gas, rank)
            after = full_weights(engine)
            moved.append(float((after[CUT] - before[CUT]).double().norm()))
            others.append(min(float((after[n] - before[n]).double().norm()) for n in after if n != CUT))
        counters = guard.counters.snapshot()
    mine = torch.cat([t.reshape(-1) for t in full_weights(engine).values()]).double()
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    same = all(torch.equal(gathered[0], other) for other in gathered[1:])
    return {"moved": moved, "others": others, "counters": counters, "same": same}


def zero3_clean(gas: int, rank: int, released: bool) -> dict[str, Any]:
    """Unguarded and guarded by a policy that never acts, in DeepSpeed's default config (its clip at 1.0)."""
    quiet = {"name": "quiet", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 1e6}]}
    runs, counters = [], {}
    for guarded in (False, True):
        engine = zero3_engine(gas, released, clip=None, momentum=0.9)
        if guarded:
            with GradGuard(engine, Policy.from_dict({"version": 1, "rules": [quiet, HALT]}), logger=None) as guard:
                for step in range(5):
                    train_step(engine, step, gas, rank)
                counters = guard.counters.snapshot()
        else:
            for step in range(5):
                train_step(engine, step, gas, rank)
        runs.append(full_weights(engine) | {f"state{k}": t for k, t in enumerate(masters_and_state(engine))})
    return {"bitwise": all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0]), "counters": counters}


def zero3_tap(gas: int, rank: int) -> dict[str, Any]:
    """Each rank's own gradient as the tap noted it before the reduce-scatter, rank 1's NaN in the first
    micro-batch only; read before the guard's step takes it."""
    return own_gradient_as_tapped(zero3_engine(gas, False), rank, gas, CUT)


def zero3_refusals() -> dict[str, str]:
    found: dict[str, str] = {}
    untested = {"zero_force_ds_cpu_optimizer": False}  # DeepSpeed insists on its CPU Adam under offload otherwise
    attempts: dict[str, Callable[[], Any]] = {
        "offload_param": lambda: GradGuard(
            make_engine(3, 1, untested, offload_param={"device": "cpu"}), Policy.from_dict(HALT_POLICY), logger=None
        ),
        "offload_optimizer": lambda: GradGuard(
            make_engine(3, 1, untested, offload_optimizer={"device": "cpu"}),
            Policy.from_dict(HALT_POLICY),
            logger=None,
        ),
        "recovery": lambda: GradGuard(
            make_engine(3, 1), Policy.from_dict(HALT_POLICY | {"recovery": {"snapshot_every": 5}}), logger=None
        ),
        "replicas": lambda: GradGuard(
            make_engine(3, 1), Policy.from_dict(HALT_POLICY | {"ranks": {"check_replicas_every": 5}}), logger=None
        ),
    }
    for name, attempt in attempts.items():
        try:
            attempt().remove()
            found[name] = ""
        except GuardStateError as error:
            found[name] = str(error)
    log = Path(f"attach-zero3-{dist.get_rank()}.jsonl")
    GradGuard(make_engine(3, 1), Policy.from_dict(HALT_POLICY), logger=None, audit_log=log).remove()
    found["boundary"] = next(e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "attach")[
        "boundary"
    ]
    log.unlink()
    return found


HALT_POLICY: dict[str, Any] = {"version": 1, "rules": [HALT]}


def scenario(name: str, rank: int, world: int, outdir: Path) -> dict[str, Any]:
    kind, *numbers = name.split("_")
    released = numbers[-1:] == ["released"]
    if kind == "halt3":
        return zero3_halt(int(numbers[0]), rank, released)
    if kind == "clip3":
        return zero3_clip(int(numbers[0]), rank)
    if kind == "clean3":
        return zero3_clean(int(numbers[0]), rank, released)
    if kind == "tap3":
        return zero3_tap(int(numbers[0]), rank)
    if kind == "refusals3":
        return zero3_refusals()
    zero = {"round_robin_gradients": True} if numbers[-1:] == ["rr"] else {}
    return pieces_scenario(int(numbers[0]), int(numbers[1]), rank, outdir, **zero)


# --- the tests ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[dict[str, Any]]]:
    names = [f"pieces_{config}" for config in CONFIGS]
    names += [f"{kind}_{config}" for kind in ("halt3", "clean3") for config in ZERO3]
    names += ["clip3_1", "clip3_2", "tap3_1", "tap3_2", "refusals3"]
    return torchrun_scenarios(SCRIPT, names, tmp_path_factory.mktemp("deepspeed_partitions"), timeout=540)


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


@pytest.mark.parametrize("config", ZERO3)
def test_at_zero_3_a_nan_on_one_rank_halts_every_rank_naming_the_parameter_with_weights_masters_and_state_untouched(
    runs: Callable[[str], list[dict[str, Any]]], config: str
) -> None:
    """The guard acts on the reduce-scattered partitions before DeepSpeed's clip (its default 1.0) and update: the
    gathered weights, this rank's fp32 master partitions and its momentum are as before the step, on every rank."""
    for result in runs(f"halt3_{config}"):
        assert result["halted"] == {"step": 5, "params": [CUT], "kind": "nan"}
        assert result["untouched"]
        assert result["state_untouched"]
        assert result["counters"]["nonfinite"] == {"nan": 1, "halt_on_nonfinite": 1}


@pytest.mark.parametrize("gas", [1, 2])
def test_at_zero_3_a_per_tensor_clip_bounds_that_parameter_s_sgd_update_at_every_step_counted_once_per_step(
    runs: Callable[[str], list[dict[str, Any]]], gas: int
) -> None:
    """``2.weight``'s norm is made of both ranks' partitions: its update is at most lr x 1e-3 (to the float32 weights'
    rounding of a 5e-5 update), held there by the clip, while the others move freely; every rank ends the same."""
    for result in runs(f"clip3_{gas}"):
        assert_update_held_by_the_clip(result, LR * 1e-3)


@pytest.mark.parametrize("config", ZERO3)
def test_at_zero_3_a_guard_that_never_intervenes_ends_bitwise_equal_to_the_unguarded_run(
    runs: Callable[[str], list[dict[str, Any]]], config: str
) -> None:
    """Weights, fp32 master partitions and momentum, in DeepSpeed's default config (its clip at 1.0)."""
    for result in runs(f"clean3_{config}"):
        assert result["bitwise"]
        assert result["counters"] == {}


@pytest.mark.parametrize("gas", [1, 2])
def test_at_zero_3_each_rank_s_own_gradient_is_noted_before_the_reduce_scatter(
    runs: Callable[[str], list[dict[str, Any]]], gas: int
) -> None:
    """Rank 1 made the NaN (in the first micro-batch); after the reduce-scatter both ranks' partitions hold it, but
    rank 0's own gradient was finite."""
    mine, theirs = runs(f"tap3_{gas}")
    for found in (mine, theirs):
        assert found["seen"] == "DeepSpeed ZeRO 3 reduction"
        assert found["unseen"] is None
    assert mine["norm"] is not None
    assert math.isfinite(mine["norm"])
    assert mine["norm"] > 0
    assert theirs["norm"] is not None
    assert math.isnan(theirs["norm"])


def test_at_zero_3_offload_and_a_replica_check_are_refused_with_why_and_what_works_and_a_recovery_section_attaches(
    runs: Callable[[str], list[dict[str, Any]]],
) -> None:
    """A recovery section is no longer refused at ZeRO 3 (its rewinds: ``tests/test_deepspeed_recovery.py``)."""
    for found in runs("refusals3"):
        assert "parameter offload" in found["offload_param"]
        assert "optimizer offload" in found["offload_optimizer"]
        for name in ("offload_param", "offload_optimizer"):
            assert "What works: ZeRO stage 0 (fp32), 1, 2 or 3" in found[name]
        assert found["recovery"] == ""
        assert "check_replicas_every" in found["replicas"]
        assert "works at ZeRO 0, 1 and 2" in found["replicas"]
        assert found["boundary"] == (
            "DeepSpeed ZeRO 3: inside engine.step(), after the reduction, before DeepSpeed's overflow check, clip and "
            "update"
        )


if __name__ == "__main__":
    main(scenario, sys.argv[1:])
