"""GradGuard(engine, policy) on real DeepSpeed ZeRO 1 and 2 engines, 2 gloo ranks (issue 44).

The file is also the ranks' script: the tests launch it once under torchrun (``--torchrun NAMES OUTDIR``), every
scenario runs in the same two processes and writes each rank's findings as JSON, and the tests judge them. The model
(111 elements, 56 per rank) has ``2.weight`` cut by the partition boundary, so its per-tensor figures are made of
both ranks' pieces. The client optimizer is torch's SGD (``zero_allow_untested_optimizer``): no CPU-Adam build.
fp16 cannot run on this CPU (no mkldnn fp16): its scenario overrides only the accelerator's ``is_fp16_supported``
so that DeepSpeed's dynamic loss scaler runs; everything else is unpatched.
"""

from __future__ import annotations

import json
import math
import socket
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
    own_gradient_as_tapped,
    torchrun_scenarios,
    train_step,
)
from support.gloo_ranks import main  # noqa: E402

from gradguard import GradGuard, GradientHalt, GuardStateError, GuardWarning, Policy  # noqa: E402

SCRIPT = Path(__file__)
CUT = "2.weight"
LR = 0.05
CONFIGS = [(stage, gas) for stage in (1, 2) for gas in (1, 2)]
WITH_ZERO_0 = [(0, 1), (0, 2), *CONFIGS]  # ZeRO 0: the client optimizer's step, on the model's reduced p.grad
ROUND_ROBIN = ["1_2_rr", "2_2_rr"]
"""round_robin_gradients: ZeRO reorders the flat partition (another parameter may be the one cut in two)."""
NAMED = [f"{s}_{g}" for s, g in WITH_ZERO_0] + ROUND_ROBIN
SCENARIOS = [
    *(f"halt_{n}" for n in NAMED),
    *(f"clip_{n}" for n in NAMED),
    *(f"clean_{n}" for n in NAMED),
    "fp16_overflow",
    "refusals",
    "limits",
    "taps",
]
TAPPED: list[tuple[int, int, dict[str, Any]]] = [(0, 1, {}), (0, 2, {}), (1, 1, {}), (1, 2, {}), (2, 1, {}), (2, 2, {})]
TAPPED += [(2, 2, {"overlap_comm": True, "contiguous_gradients": True}), (2, 2, {"contiguous_gradients": False})]
TAPPED += [(2, 1, {"reduce_scatter": False}), (1, 2, {"overlap_comm": True})]
"""Each stage, with and without accumulation, and ZeRO's reduction switches that take other paths to the reduction."""


# --- the ranks ------------------------------------------------------------------------------------


def weights(engine: Any) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().clone() for name, p in engine.module.named_parameters()}


def all_equal_across_ranks(tensors: dict[str, torch.Tensor]) -> bool:
    mine = torch.cat([t.reshape(-1) for t in tensors.values()]).double()
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return all(torch.equal(gathered[0], other) for other in gathered[1:])


def policy(*rules: dict[str, Any], **sections: Any) -> Policy:
    return Policy.from_dict({"version": 1, "rules": list(rules), **sections})


HALT = {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}
FP16 = {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1, "min_loss_scale": 1}}


def poison(engine: Any, name: str, rank: int, at: int, steps: list[int], value: float = float("nan")) -> Any:
    """A tensor hook that puts ``value`` into ``name``'s local gradient on rank 1 at step ``at`` (DeepSpeed reduces
    it into the pieces of every rank that holds part of ``name``)."""
    param = dict(engine.module.named_parameters())[name]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if rank == 1 and steps[-1] == at:
            grad = grad.clone()
            grad.view(-1)[0] = value
        return grad

    return param.register_hook(hook)


def halt_scenario(stage: int, gas: int, rank: int, **zero: Any) -> dict[str, Any]:
    engine = make_engine(stage, gas, clip=None, lr=LR, **zero)  # DeepSpeed's default config: clips at 1.0, ZeRO 0 too
    steps = [0]
    handle = poison(engine, CUT, rank, 5, steps)
    result: dict[str, Any] = {"halted": None}
    with GradGuard(engine, policy(HALT), logger=None) as guard:
        for step in range(8):
            steps.append(step)
            before = weights(engine)
            try:
                train_step(engine, step, gas, rank)
            except GradientHalt as halt:
                after = weights(engine)
                result["halted"] = {"step": halt.step, "params": halt.params, "kind": halt.kind}
                result["untouched"] = all(torch.equal(before[n], after[n]) for n in before)
                result["guard_step"] = guard.step_count
                result["ranks"] = {str(r): h for r, h in halt.ranks.items()}
                result["made_on"] = f"made on rank 1 (host {socket.gethostname()})" in str(halt)
                break
        result["counters"] = guard.counters.snapshot()
    handle.remove()
    result["deepspeed_clip"] = float(engine.gradient_clipping())
    return result


def clip_scenario(stage: int, gas: int, rank: int, **zero: Any) -> dict[str, Any]:
    engine = make_engine(stage, gas, lr=LR, **zero)
    rules = [
        {"name": "tight", "match": CUT, "actions": [{"action": "clip_norm", "max_norm": 1e-3}]},
        HALT,
    ]
    moved: list[float] = []
    others: list[float] = []
    with GradGuard(engine, policy(*rules), logger=None) as guard:
        for step in range(5):
            before = weights(engine)
            train_step(engine, step, gas, rank)
            after = weights(engine)
            moved.append(float((after[CUT] - before[CUT]).double().norm()))
            others.append(min(float((after[n] - before[n]).double().norm()) for n in after if n != CUT))
        counters = guard.counters.snapshot()
    return {"moved": moved, "others": others, "counters": counters, "same": all_equal_across_ranks(weights(engine))}


def clean_scenario(stage: int, gas: int, rank: int, **zero: Any) -> dict[str, Any]:
    """Unguarded and guarded, in DeepSpeed's default config (its clip at 1.0). At ZeRO 0, where the guard's step runs
    before DeepSpeed's clip, also with a clip of 0.05 that acts at every step (it changes the run against no clip), so
    the guarded run matching the unguarded one shows DeepSpeed's clip running after the guard's step, unchanged."""
    quiet = {"name": "quiet", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 1e6}]}
    configs: list[tuple[bool, float | None]] = [(False, None), (True, None)]
    if stage == 0:
        configs += [(False, 0.05), (True, 0.05), (False, 0.0)]
    runs, counters = [], {}
    for guarded, clip in configs:
        engine = make_engine(stage, gas, clip=clip, lr=LR, **zero)
        if guarded:
            with GradGuard(engine, policy(quiet, HALT), logger=None) as guard:
                for step in range(5):
                    train_step(engine, step, gas, rank)
                counters = guard.counters.snapshot()
        else:
            for step in range(5):
                train_step(engine, step, gas, rank)
        runs.append(weights(engine))

    def equal(a: int, b: int) -> bool:
        return all(torch.equal(runs[a][n], runs[b][n]) for n in runs[a])

    result = {"bitwise": equal(0, 1), "counters": counters}
    if stage == 0:
        result |= {"bitwise_clipped": equal(2, 3), "clip_acted": not equal(2, 4)}
    return result


def taps_scenario(rank: int) -> dict[str, Any]:
    """One update's backwards with a NaN made on rank 1 only, in the first micro-batch: each rank's own gradient as
    the tap noted it before DeepSpeed's reduction (``collective.local``), read before the guard's step takes it."""
    found: dict[str, Any] = {}
    for stage, gas, zero in TAPPED:
        engine = make_engine(stage, gas, lr=LR, **zero)
        found[key(stage, gas, zero)] = own_gradient_as_tapped(engine, rank, gas, CUT)
    return found


def key(stage: int, gas: int, zero: dict[str, Any]) -> str:
    return f"{stage}_{gas}" + "".join(f"_{name}={value}" for name, value in sorted(zero.items()))


def fp16_scenario(rank: int) -> dict[str, Any]:
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True  # this CPU has no mkldnn fp16 (test-only override)
    fp16 = FP16
    result: dict[str, Any] = {}
    # One overflow: DeepSpeed skips it (and halves its scale); the guard counts it once and lets it pass.
    engine = make_engine(2, 2, fp16)
    steps = [0]
    handle = poison(engine, CUT, rank, 2, steps, float("inf"))
    with GradGuard(engine, policy(HALT), logger=None) as guard:
        scales, skipped = [], []
        for step in range(4):
            steps.append(step)
            train_step(engine, step, 2, rank)
            scales.append(float(engine.optimizer.loss_scale))
            skipped.append(guard.last_step_skipped)
        result["once"] = {"counters": guard.counters.snapshot(), "scales": scales, "skipped": skipped}
        result["once"]["deepspeed_skipped"] = int(engine.skipped_steps)
    handle.remove()
    # A persisting overflow halts, as under torch's GradScaler: more than max_scaler_skips in a row, or at a skip whose
    # loss scale (DeepSpeed's, 256 halved at each skip) has fallen to min_loss_scale.
    for name, limit in (("persisting", {"max_scaler_skips": 2}), ("floor", {"min_loss_scale": 64.0})):
        engine = make_engine(2, 1, fp16)
        steps = [0]
        param = dict(engine.module.named_parameters())[CUT]
        handle = param.register_hook(lambda g, steps=steps: g * float("inf") if rank == 1 and steps[-1] >= 1 else g)
        halting = {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite", **limit}]}
        with GradGuard(engine, policy(halting), logger=None) as guard:
            result[name] = None
            for step in range(8):
                steps.append(step)
                try:
                    train_step(engine, step, 1, rank)
                except GradientHalt as halt:
                    counters = guard.counters.snapshot()
                    result[name] = {"step": halt.step, "rule": halt.rule, "counters": counters, "why": halt.reason}
                    break
        handle.remove()
    # The policy meets the unscaled gradients and the unscaled loss, as under bf16: the same rules on both.
    result["unscaled"] = {
        name: fp16_thresholds(precision, rank) for name, precision in (("fp16", fp16), ("bf16", BF16))
    }
    try:
        GradGuard(make_engine(2, 1, fp16), policy(HALT, recovery={"snapshot_every": 5}), logger=None)
        result["recovery_refused"] = ""
    except GuardStateError as error:
        result["recovery_refused"] = str(error)
    return result


BF16 = {"bf16": {"enabled": True}}


def fp16_thresholds(precision: dict[str, Any], rank: int) -> dict[str, Any]:
    """A tight clip of one parameter, a loose one of another, AutoClip, a monitor and a loss section, four updates of
    two micro-batches: what the guard measured (the monitor's norm, the loss it judged) and what it clipped."""
    engine = make_engine(2, 2, precision, lr=LR)
    rules = [
        {"name": "tight", "match": CUT, "actions": [{"action": "clip_norm", "max_norm": 1e-3}]},
        {"name": "watch", "match": "0.weight", "actions": [{"action": "monitor", "every": 1, "stats": ["norm"]}]},
        {"name": "auto", "match": "4.*", "actions": [{"action": "autoclip", "percentile": 50.0}]},
        HALT,
    ]
    norms, judged, losses = [], [], []
    with GradGuard(engine, policy(*rules, loss={"nonfinite": "halt"}), logger=None) as guard:
        for step in range(4):
            total = 0.0
            for micro in range(2):
                x, y = batch(step, micro, rank)
                loss = loss_of(engine(x.to(torch.float16 if "fp16" in precision else torch.bfloat16)), y)
                engine.backward(loss)
                engine.step()
                total += float(loss) / 2
            losses.append(total)
            metrics = guard.metrics()
            norms.append(metrics["gradguard/watch/norm/0.weight"])
            judged.append(metrics["gradguard/loss"])
        counters = guard.counters.snapshot()
    mine = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mine)
    return {"norms": norms, "judged": judged, "losses": (mine / 2).tolist(), "counters": counters}


def refusals(rank: int) -> dict[str, Any]:
    found: dict[str, str] = {}
    attempts: dict[str, Callable[[], Any]] = {
        # DeepSpeed insists on its CPU Adam under offload unless told otherwise; the refusal comes before any step.
        "offload": lambda: GradGuard(
            make_engine(2, 1, {"zero_force_ds_cpu_optimizer": False}, offload_optimizer={"device": "cpu"}),
            policy(HALT),
            logger=None,
        ),
    }
    first_only = dist.new_group([0])  # every rank makes it; DeepSpeed reduces over both
    attempts["process_group"] = lambda: GradGuard(
        make_engine(2, 1), policy(HALT), logger=None, process_group=first_only
    )
    for name, attempt in attempts.items():
        try:
            attempt().remove()
            found[name] = ""
        except GuardStateError as error:
            found[name] = str(error)
    return found


def limits(rank: int, outdir: Path) -> dict[str, Any]:
    """What DeepSpeed's limits hold to beyond attach: a reload, guard.step(), a frozen parameter."""
    found: dict[str, Any] = {}
    good, bad = outdir / f"good{rank}.json", outdir / f"bad{rank}.json"
    good.write_text(json.dumps({"version": 1, "rules": [HALT]}))
    bad.write_text(json.dumps({"version": 1, "rules": [HALT], "recovery": {"snapshot_every": 5}}))
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True  # this CPU has no mkldnn fp16 (test-only override)
    engine = make_engine(2, 1, FP16, lr=LR)  # under fp16 a recovery section is refused
    with GradGuard(engine, good, logger=None, reload=True) as guard:
        with pytest.warns(GuardWarning, match="policy not reloaded") as warned:
            found["reloaded"] = guard.reload(bad)
        found["reload_warning"] = str(warned[0].message)
        train_step(engine, 0, 1, rank)
        try:
            guard.step()
            found["step"] = ""
        except GuardStateError as error:
            found["step"] = str(error)
        found["policy_rules"] = [rule.name for rule in guard.policy.rules]
    # The attach event names where in DeepSpeed's step the guard acts.
    found["boundaries"] = {}
    for stage, clip in ((0, None), (0, 0.0), (2, None)):
        log = outdir / f"attach_{stage}_{clip}_{rank}.jsonl"
        GradGuard(make_engine(stage, 1, clip=clip), policy(HALT), logger=None, audit_log=log).remove()
        attach = next(event for event in map(json.loads, log.read_text().splitlines()) if event["event"] == "attach")
        found["boundaries"][f"{stage}_{clip}"] = attach["boundary"]
    # A frozen parameter has no gradient: not a zero one (a monitor would call it vanishing).
    engine = make_engine(2, 1, lr=LR, frozen=("0.weight", "0.bias"))
    watch = {"name": "mon", "match": "*", "actions": [{"action": "monitor", "every": 1, "vanishing_below": 1e-12}]}
    with GradGuard(engine, policy(watch, HALT), logger=None) as guard:
        for step in range(3):
            train_step(engine, step, 1, rank)
        found["frozen_counters"] = guard.counters.snapshot()
    return found


def scenario(name: str, rank: int, world: int, outdir: Path) -> dict[str, Any]:
    kind, *numbers = name.split("_")
    zero = {"round_robin_gradients": True} if numbers[-1:] == ["rr"] else {}
    if kind == "halt":
        return halt_scenario(int(numbers[0]), int(numbers[1]), rank, **zero)
    if kind == "clip":
        return clip_scenario(int(numbers[0]), int(numbers[1]), rank, **zero)
    if kind == "clean":
        return clean_scenario(int(numbers[0]), int(numbers[1]), rank, **zero)
    if kind == "fp16":
        return fp16_scenario(rank)
    if kind == "limits":
        return limits(rank, outdir)
    if kind == "taps":
        return taps_scenario(rank)
    return refusals(rank)


# --- the tests ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[dict[str, Any]]]:
    return torchrun_scenarios(SCRIPT, SCENARIOS, tmp_path_factory.mktemp("deepspeed_guard"), timeout=420)


@pytest.mark.parametrize("config", NAMED)
def test_a_nan_in_one_parameter_on_one_rank_halts_every_rank_at_that_step_naming_it_with_the_weights_untouched(
    runs: Callable[[str], list[dict[str, Any]]], config: str
) -> None:
    """In DeepSpeed's default config, which clips at 1.0 (at ZeRO 0 before the client optimizer's step: the guard's
    step comes first, on the raw gradients, so the clip cannot spread the NaN to every parameter)."""
    for result in runs(f"halt_{config}"):
        assert result["deepspeed_clip"] == 1.0
        assert result["halted"] == {"step": 5, "params": [CUT], "kind": "nan"}
        assert result["untouched"]
        assert result["counters"]["nonfinite"] == {"nan": 1, "halt_on_nonfinite": 1}
        # Rank 1 made it in its own backward (#48): every rank names rank 1 and its host, in the halt and its words.
        assert result["ranks"] == {"1": socket.gethostname()}
        assert result["made_on"]


@pytest.mark.parametrize("config", NAMED)
def test_a_per_tensor_clip_of_one_parameter_bounds_its_sgd_update_at_every_step_counted_once_per_step(
    runs: Callable[[str], list[dict[str, Any]]], config: str
) -> None:
    """Its norm is made of both ranks' pieces (2.weight is cut by the partition boundary): under SGD its update is
    at most lr x 1e-3 at every step, the others move freely, every rank ends with the same weights."""
    for result in runs(f"clip_{config}"):
        assert_update_held_by_the_clip(result, LR * 1e-3)


@pytest.mark.parametrize("config", NAMED)
def test_a_guard_that_never_intervenes_ends_bitwise_equal_to_the_unguarded_deepspeed_run(
    runs: Callable[[str], list[dict[str, Any]]], config: str
) -> None:
    """In DeepSpeed's default config (its clip at 1.0); at ZeRO 0 also with DeepSpeed's clip acting at every step."""
    for result in runs(f"clean_{config}"):
        assert result["bitwise"]
        assert result["counters"] == {}
        if config.startswith("0_"):
            assert result["clip_acted"]
            assert result["bitwise_clipped"]


def test_an_fp16_overflow_is_deepspeeds_to_skip_counted_once_a_persisting_one_halts_and_recovery_is_refused(
    runs: Callable[[str], list[dict[str, Any]]],
) -> None:
    for result in runs("fp16_overflow"):
        once = result["once"]
        assert once["counters"] == {"grad_scaler": {"skip": 1}}
        assert once["deepspeed_skipped"] == 1
        assert once["skipped"] == [False, False, True, False]
        assert once["scales"][1] == 256.0
        assert once["scales"][2] == 128.0  # DeepSpeed's own search halved it; the guard did not touch it
        persisting = result["persisting"]
        assert persisting is not None
        assert persisting["rule"] == "nonfinite"
        assert persisting["counters"]["grad_scaler"]["skip"] == 3
        assert persisting["step"] == 3
        floor = result["floor"]
        assert floor is not None
        assert floor["step"] == 3  # scales 256, 128, 64 at the three overflows: the third is at the floor
        assert floor["counters"]["grad_scaler"]["skip"] == 3
        assert "64" in floor["why"]
        assert "recovery" in result["recovery_refused"]
        assert "bf16" in result["recovery_refused"]


def test_under_fp16_the_policy_meets_the_unscaled_gradients_and_loss_as_under_bf16(
    runs: Callable[[str], list[dict[str, Any]]],
) -> None:
    """DeepSpeed's loss scale (256 here) is divided out before the policy reads the gradients: the monitor measures
    what bf16 measures (within the two precisions' rounding, not 256 times it), the tight clip acts at every update,
    AutoClip runs, and the loss section judges the ranks' mean loss, not the scaled one."""
    for result in runs("fp16_overflow"):
        fp16, bf16 = result["unscaled"]["fp16"], result["unscaled"]["bf16"]
        for half, brain in zip(fp16["norms"], bf16["norms"], strict=True):
            assert half == pytest.approx(brain, rel=0.05)
        for run in (fp16, bf16):
            assert run["judged"] == pytest.approx(run["losses"], rel=1e-3)
            assert run["counters"]["tight"] == {"clip_norm": 4}
            assert "nonfinite" not in run["counters"]


def test_optimizer_offload_and_another_process_group_are_refused_at_attach_with_what_works(
    runs: Callable[[str], list[dict[str, Any]]],
) -> None:
    """ZeRO 3 and its refusals: ``tests/test_deepspeed_partitions.py``."""
    for found in runs("refusals"):
        assert "optimizer offload" in found["offload"]
        assert "What works" in found["offload"]
        assert "data-parallel group" in found["process_group"]


def test_a_reload_guard_step_and_a_frozen_parameter_meet_deepspeeds_limits_too(
    runs: Callable[[str], list[dict[str, Any]]],
) -> None:
    """A reloaded policy is held to what attach refuses (the old one stays), guard.step() says the guard acts inside
    engine.step(), and a frozen parameter is left out (no gradient), not read as a vanishing zero one."""
    for found in runs("limits"):
        assert found["reloaded"] is False
        assert "recovery" in found["reload_warning"]
        assert found["policy_rules"] == ["nonfinite"]
        assert "engine.step()" in found["step"]
        assert found["frozen_counters"] == {}


def test_the_attach_event_names_deepspeed_s_boundary_not_any_torch_optimizer(
    runs: Callable[[str], list[dict[str, Any]]],
) -> None:
    for found in runs("limits"):
        boundaries = found["boundaries"]
        assert boundaries["0_None"] == (
            "DeepSpeed ZeRO 0: inside engine.step(), before DeepSpeed's gradient_clipping and the SGD's step"
        )
        assert boundaries["0_0.0"] == "DeepSpeed ZeRO 0: the SGD's step inside engine.step()"
        assert boundaries["2_None"] == (
            "DeepSpeed ZeRO 2: inside engine.step(), after the reduction, before DeepSpeed's overflow check, clip and "
            "update"
        )


@pytest.mark.parametrize(("stage", "gas", "zero"), TAPPED, ids=[key(*config) for config in TAPPED])
def test_each_rank_s_own_gradient_is_noted_before_deepspeed_reduces_it_a_nan_in_a_first_micro_batch_included(
    runs: Callable[[str], list[dict[str, Any]]], stage: int, gas: int, zero: dict[str, Any]
) -> None:
    """Rank 1 made the NaN; after the reduction both ranks' gradients hold it, but rank 0's own was finite."""
    mine, theirs = (found[key(stage, gas, zero)] for found in runs("taps"))
    for found in (mine, theirs):
        assert found["seen"] == f"DeepSpeed ZeRO {stage} reduction"
        assert found["unseen"] is None
    assert mine["norm"] is not None
    assert math.isfinite(mine["norm"])
    assert mine["norm"] > 0
    assert theirs["norm"] is not None
    assert math.isnan(theirs["norm"])


if __name__ == "__main__":
    main(scenario, sys.argv[1:])
