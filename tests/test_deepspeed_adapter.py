"""The DeepSpeed adapter (gradguard.enforce.distributed.deepspeed) on real ZeRO 0/1/2 engines, 2 gloo ranks.

The file is also the ranks' script: the tests launch it once under torchrun (``--torchrun NAMES OUTDIR``),
every scenario below runs in the same two processes, writes each rank's findings as JSON, and the tests
judge them. The model (111 elements, 56 per rank) has ``2.weight`` cut by the partition boundary.
The client optimizer is torch's SGD with momentum (``zero_allow_untested_optimizer``): no CPU-Adam build.
fp16 cannot run on this CPU (no mkldnn fp16): its scenario overrides only the accelerator's
``is_fp16_supported`` so that DeepSpeed's dynamic loss scaler runs; everything else is unpatched.
"""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

deepspeed = pytest.importorskip("deepspeed")

from support.deepspeed_ranks import batch, loss_of, make_model, torchrun_scenarios, train_step  # noqa: E402
from support.deepspeed_ranks import make_engine as plain_engine  # noqa: E402
from support.gloo_ranks import main  # noqa: E402

from gradguard.enforce.distributed import deepspeed as adapter  # noqa: E402
from gradguard.enforce.distributed import deepspeed_state  # noqa: E402
from gradguard.enforce.distributed.deepspeed_update import UpdateHook  # noqa: E402
from gradguard.errors import GuardStateError  # noqa: E402

SCRIPT = Path(__file__)
CUT = "2.weight"
CONFIGS = [(stage, gas) for stage in (1, 2) for gas in (1, 2)]
SCENARIOS = [
    *(f"checks_{s}_{g}" for s, g in [*CONFIGS, (0, 1), (0, 2)]),
    *(f"bitwise_{s}_{g}" for s, g in [*CONFIGS, (0, 1)]),
    "bf16_overflow",
    "bf16_optimizer",
    "fp16_scaler",
    "refusals",
]


# --- the ranks ------------------------------------------------------------------------------------


def make_engine(stage: int, gas: int, precision: dict[str, Any] | None = None, **zero: Any) -> Any:
    """ZeRO clips inside its step (the hook sees unclipped pieces); at stage 0 the adapter refuses DeepSpeed's clip."""
    return plain_engine(stage, gas, precision, clip=1.0 if stage else 0.0, momentum=0.9, **zero)


def weights(engine: Any) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()]).clone()


def reference(engine: Any, step: int, gas: int, rank: int) -> list[torch.Tensor]:
    """A plain data-parallel gradient at the engine's current weights: backward of loss/gas, sum / world."""
    ref = make_model()
    with torch.no_grad():
        for mine, theirs in zip(ref.parameters(), engine.module.parameters(), strict=True):
            mine.copy_(theirs.float())
    with torch.enable_grad():
        for micro in range(gas):
            x, y = batch(step, micro, rank)
            (loss_of(ref(x), y) / gas).backward()
    grads = []
    for p in ref.parameters():
        grad = p.grad.detach().double().reshape(-1)
        dist.all_reduce(grad)
        grads.append(grad / dist.get_world_size())
    return grads


def assemble(grads: adapter.ZeroGradients, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """The whole gradients from the pieces: the ranks' pieces of a parameter, in rank order."""
    if grads.whole:
        return [piece.detach().double() for piece in pieces]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [piece.detach().double() for piece in pieces])
    return [torch.cat([held[i] for held in gathered]) for i in range(len(pieces))]


def worst(full: list[torch.Tensor], ref: list[torch.Tensor], scale: float = 1.0) -> float:
    return max(float((a / scale - b).abs().max()) for a, b in zip(full, ref, strict=True))


def state_of(engine: Any) -> list[torch.Tensor]:
    """Weights, the fp32 masters and the momentum buffers, read straight from DeepSpeed."""
    opt = engine.optimizer
    masters = getattr(opt, "single_partition_of_fp32_groups", None) or getattr(opt, "fp32_groups_flat_partition", [])
    inner = getattr(opt, "optimizer", opt)
    momentum = [s["momentum_buffer"] for s in inner.state.values() if "momentum_buffer" in s]
    return [weights(engine), *(m.detach().clone() for m in masters), *(m.clone() for m in momentum)]


def weights_by_param(engine: Any) -> list[torch.Tensor]:
    return [p.detach().float().reshape(-1).clone() for p in engine.module.parameters()]


def split(engine: Any, flat: torch.Tensor) -> list[torch.Tensor]:
    return list(flat.split([p.numel() for p in engine.module.parameters()]))


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def ranks_agree(value: torch.Tensor) -> bool:
    gathered = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, value)
    return all(torch.equal(gathered[0], other) for other in gathered)


def checks(stage: int, gas: int, rank: int) -> dict[str, Any]:
    """Step 0 reads and zeroes the cut parameter, step 1 skips, step 2 runs, step 3's ``before`` raises."""
    engine = make_engine(stage, gas)
    names = [name for name, _ in engine.module.named_parameters()]
    grads = adapter.ZeroGradients(engine)
    out: dict[str, Any] = {"refusal": adapter.refusal(engine), "whole": grads.whole, "diff": [], "afters": []}
    step = 0

    def before() -> bool:
        pieces = grads.pieces()
        out["diff"].append(worst(assemble(grads, pieces), reference(engine, step, gas, rank)))
        out.setdefault("lengths", [p.numel() for p in pieces])
        out["dtypes"] = sorted({str(p.dtype) for p in pieces})
        out["boundary"] = bool(engine.is_gradient_accumulation_boundary())
        if step == 0:
            pieces[names.index(CUT)].mul_(0)
        if step == 3:
            raise RuntimeError("before failed")
        return step != 1

    hook = UpdateHook(engine, before, lambda overflow: out["afters"].append((step, overflow)))
    for step in range(4):
        held, skipped = state_of(engine), engine.skipped_steps
        try:
            train_step(engine, step, gas, rank)
        except RuntimeError as error:
            out["raised"] = str(error)
        moved = [
            float((a - b).abs().max()) for a, b in zip(weights_by_param(engine), split(engine, held[0]), strict=True)
        ]
        if step == 0:
            out["cut_moved"] = moved[names.index(CUT)]
            out["others_moved"] = min(m for name, m in zip(names, moved, strict=True) if name != CUT)
        if step == 1:
            out["skip_unchanged"] = same(held, state_of(engine))
            out["skipped_steps"] = [skipped, engine.skipped_steps]
        if step == 3:
            out["raise_unchanged"] = same(held, state_of(engine))
            held_grads = getattr(engine.optimizer, "averaged_gradients", None)
            if held_grads is None:  # ZeRO 0: the reduced gradients were p.grad
                out["dropped"] = all(p.grad is None for p in engine.module.parameters())
            else:
                out["dropped"] = all(v is None for v in held_grads.values())
    hook.remove()
    left = vars(engine.optimizer)  # ZeRO 0: the client SGD gets its own step back, and no `overflow` is left
    out["removed"] = "step" not in left and (stage != 0 or "overflow" not in left)
    out["ranks_agree"] = ranks_agree(weights(engine))
    return out


def bitwise(stage: int, gas: int, rank: int) -> dict[str, Any]:
    """Unguarded 4 steps; guarded read-only 4 steps with a capture at 2; restore; replay 2 and 3."""
    plain = make_engine(stage, gas)
    for step in range(4):
        train_step(plain, step, gas, rank)
    unguarded = weights(plain)
    engine = make_engine(stage, gas)
    grads = adapter.ZeroGradients(engine)

    def before() -> bool:  # what a guard reads: per-tensor sums of squares, one collective
        sums = torch.stack([p.detach().double().pow(2).sum() for p in grads.pieces()])
        if not grads.whole:
            dist.all_reduce(sums)
        return bool(torch.isfinite(sums).all())

    hook = UpdateHook(engine, before)
    for step in range(2):
        train_step(engine, step, gas, rank)
    captured, at_capture = deepspeed_state.capture(engine), state_of(engine)
    for step in range(2, 4):
        train_step(engine, step, gas, rank)
    guarded = weights(engine)
    deepspeed_state.restore(engine, captured)
    restored = state_of(engine)
    for step in range(2, 4):
        train_step(engine, step, gas, rank)
    hook.remove()
    return {
        "read_only_equal": torch.equal(unguarded, guarded),
        "restore_equal": same(at_capture, restored),
        "replay_equal": torch.equal(guarded, weights(engine)),
    }


def precision_run(config: dict[str, Any], stage: int, rank: int) -> dict[str, Any]:
    """Step 0 runs, step 1 has a NaN in rank 1's local gradient of the cut parameter, step 2 is skipped."""
    engine = make_engine(stage, 1, config)
    grads = adapter.ZeroGradients(engine)
    out: dict[str, Any] = {
        "optimizer": type(engine.optimizer).__name__,
        "whole": grads.whole,
        "scales": [],
        "afters": [],
        "nonfinite": [],
        "rel": [],
    }
    step = 0

    def before() -> bool:
        pieces, scale = grads.pieces(), grads.loss_scale()
        out["scales"].append(scale)
        out["dtypes"] = sorted({str(p.dtype) for p in pieces})
        bad = torch.tensor([float((~torch.isfinite(p)).sum()) for p in pieces])
        if not grads.whole:
            dist.all_reduce(bad)
        out["nonfinite"].append(int(bad.sum()))
        if step == 0:
            full, ref = assemble(grads, pieces), reference(engine, step, 1, rank)
            out["rel"] = max(float((a / scale).norm() / b.norm() - 1) for a, b in zip(full, ref, strict=True))
        return step != 2

    hook = UpdateHook(engine, before, lambda overflow: out["afters"].append(overflow))
    cut = dict(engine.module.named_parameters())[CUT]
    for step in range(3):
        handle = cut.register_hook(lambda g: g * float("nan")) if step == 1 and rank == 1 else None
        held = state_of(engine)
        if step == 1:
            captured, at_capture = deepspeed_state.capture(engine), held
        train_step(engine, step, 1, rank)
        if handle is not None:
            handle.remove()
        if step:
            out.setdefault("unchanged", []).append(same(held, state_of(engine)))
    out["skipped_steps"] = engine.skipped_steps
    out["scale_after"] = adapter.loss_scale(engine)
    deepspeed_state.restore(engine, captured)  # the loss scaler comes back with the masters and the momentum
    out["restored"] = [same(at_capture, state_of(engine)), adapter.loss_scale(engine)]
    hook.remove()
    return out


def refusals(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    engine = make_engine(1, 1)
    out["detected"] = [adapter.deepspeed_engine(engine) is engine, adapter.deepspeed_engine(engine.module) is None]
    clipped = make_engine(0, 1)
    clipped._config.gradient_clipping = 1.0
    out["stage0_clip"] = adapter.refusal(clipped)
    out["round_robin"] = adapter.refusal(make_engine(2, 1, round_robin_gradients=True))
    zero3 = make_engine(3, 1)
    out["zero3"] = adapter.refusal(zero3)
    out["zero3_layout"] = adapter.ZeroGradients(zero3).layout
    return out


def scenario(name: str, rank: int, world: int, outdir: Path) -> dict[str, Any]:
    started = time.perf_counter()
    kind, *numbers = name.split("_")
    if kind == "checks":
        result = checks(int(numbers[0]), int(numbers[1]), rank)
    elif kind == "bitwise":
        result = bitwise(int(numbers[0]), int(numbers[1]), rank)
    elif name == "bf16_overflow":
        result = precision_run({"bf16": {"enabled": True}}, 2, rank)
    elif name == "bf16_optimizer":  # bf16 + fp32 accumulation at ZeRO 1: DeepSpeed's BF16_Optimizer
        config = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
        result = precision_run(config, 1, rank)
    elif name == "fp16_scaler":
        from deepspeed.accelerator import get_accelerator

        get_accelerator().is_fp16_supported = lambda: True  # this CPU has no mkldnn fp16 (test-only override)
        fp16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1, "min_loss_scale": 1}
        result = precision_run({"fp16": fp16}, 2, rank)
    else:
        result = refusals(rank)
    result["seconds"] = time.perf_counter() - started
    return result


# --- the tests ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[dict[str, Any]]]:
    return torchrun_scenarios(SCRIPT, SCENARIOS, tmp_path_factory.mktemp("deepspeed"), timeout=240)


def fp32_runs(runs: Callable[[str], list[dict[str, Any]]], kind: str) -> list[tuple[str, dict[str, Any]]]:
    configs = [*CONFIGS, (0, 1), (0, 2)] if kind == "checks" else [*CONFIGS, (0, 1)]
    return [
        (f"{kind}_{s}_{g} rank {r}", result) for s, g in configs for r, result in enumerate(runs(f"{kind}_{s}_{g}"))
    ]


def test_zero_1_and_2_engines_are_detected_and_accepted(runs: Callable[[str], list[dict[str, Any]]]) -> None:
    for label, result in fp32_runs(runs, "checks"):
        assert result["refusal"] is None, label
        assert result["boundary"], label
    for result in runs("refusals"):
        assert result["detected"] == [True, True]


def test_pieces_reassembled_across_ranks_equal_a_plain_data_parallel_gradient(
    runs: Callable[[str], list[dict[str, Any]]],
) -> None:
    for label, result in fp32_runs(runs, "checks"):
        assert len(result["diff"]) == 4, label  # one hook call per update, at gas 1 and 2
        assert max(result["diff"]) < 1e-6, label
        assert result["dtypes"] == ["torch.float32"], label  # the empty pieces too
    for stage in (1, 2):
        first, second = runs(f"checks_{stage}_1")
        assert first["lengths"] == [35, 7, 14, 0, 0, 0]  # 2.weight is cut by the partition boundary
        assert second["lengths"] == [0, 0, 28, 6, 18, 3]
        assert not first["whole"]
    for rank in runs("checks_0_1"):
        assert rank["whole"]  # ZeRO 0: every rank holds the whole reduced gradient
        assert rank["lengths"] == [35, 7, 42, 6, 18, 3]


def test_zeroing_one_parameter_s_pieces_in_before_freezes_it_and_moves_the_others(
    runs: Callable[[str], list[dict[str, Any]]],
) -> None:
    for label, result in fp32_runs(runs, "checks"):
        assert result["cut_moved"] == 0.0, label
        assert result["others_moved"] > 1e-3, label
        assert result["ranks_agree"], label


def test_before_returning_false_leaves_weights_masters_and_momentum_bitwise_unchanged(
    runs: Callable[[str], list[dict[str, Any]]],
) -> None:
    for label, result in fp32_runs(runs, "checks"):
        assert result["skip_unchanged"], label
        assert result["skipped_steps"] == [0, 1], label
        assert [step for step, _ in result["afters"]] == [0, 2], label  # no after() for the guard's own skip
        assert result["diff"][2] < 1e-6, label  # the step after the skip matches the reference: nothing stale


def test_an_exception_in_before_propagates_with_the_weights_untouched(
    runs: Callable[[str], list[dict[str, Any]]],
) -> None:
    for label, result in fp32_runs(runs, "checks"):
        assert result["raised"] == "before failed", label
        assert result["raise_unchanged"], label
        assert result["dropped"], label
        assert result["removed"], label


def test_a_read_only_before_ends_bitwise_equal_to_an_unguarded_run(
    runs: Callable[[str], list[dict[str, Any]]],
) -> None:
    for label, result in fp32_runs(runs, "bitwise"):
        assert result["read_only_equal"], label


def test_capture_and_restore_rewind_exactly_and_the_replay_is_bitwise_equal(
    runs: Callable[[str], list[dict[str, Any]]],
) -> None:
    for label, result in fp32_runs(runs, "bitwise"):
        assert result["restore_equal"], label
        assert result["replay_equal"], label


@pytest.mark.parametrize("name", ["bf16_overflow", "bf16_optimizer", "fp16_scaler"])
def test_deepspeed_s_own_overflow_reaches_after_a_guard_skip_keeps_the_loss_scale_and_restore_brings_it_back(
    runs: Callable[[str], list[dict[str, Any]]], name: str
) -> None:
    for result in runs(name):
        assert result["nonfinite"] == [0, 42, 0]  # rank 1's NaN reaches every rank's pieces through the reduction
        assert result["afters"] == [False, True]  # step 1: DeepSpeed skipped it itself; step 2: the guard did
        assert result["unchanged"] == [True, True]
        assert result["skipped_steps"] == 2
        assert result["rel"] < 1e-2  # low precision against an fp32 reference, after dividing by the loss scale
    optimizer, dtypes, whole = {
        "bf16_overflow": ("DeepSpeedZeroOptimizer", ["torch.bfloat16"], False),
        "bf16_optimizer": ("BF16_Optimizer", ["torch.float32"], True),
        "fp16_scaler": ("DeepSpeedZeroOptimizer", ["torch.float16"], False),
    }[name]
    for result in runs(name):
        assert (result["optimizer"], result["dtypes"], result["whole"]) == (optimizer, dtypes, whole)
        if name == "fp16_scaler":
            assert result["scales"] == [256.0, 256.0, 128.0]  # halved by DeepSpeed's overflow, not by the skip
            assert result["scale_after"] == 128.0
            assert result["restored"] == [True, 256.0]
        else:
            assert result["scales"] == [1.0, 1.0, 1.0]
            assert result["restored"] == [True, 1.0]


def test_zero_3_round_robin_and_a_stage_0_clip_are_all_mapped(
    runs: Callable[[str], list[dict[str, Any]]],
) -> None:
    for result in runs("refusals"):
        assert result["zero3"] is None  # its partitions: tests/test_deepspeed_partitions.py
        assert result["zero3_layout"] == "stage3"
        assert result["round_robin"] is None  # mapped through ZeRO's own offset tables (test_deepspeed_guard.py)
        assert result["stage0_clip"] is None  # DeepSpeed's clip at stage 0 runs after the guard's step


if __name__ == "__main__":
    main(scenario, sys.argv[1:])


def test_capture_and_restore_refuse_a_zero_3_engine_naming_recovery_instead() -> None:
    """At ZeRO 3 the inner optimizer's groups hold the masters only inside its step: a record would hold nothing
    and a restore put nothing back, silently. Both refuse, naming the recovery section (whose snapshots hold the
    partitions); the class name is what ``layout`` reads."""
    stage3 = type("DeepSpeedZeroOptimizer_Stage3", (), {})
    engine = types.SimpleNamespace(optimizer=stage3())
    with pytest.raises(GuardStateError, match=r"cannot record a ZeRO 3 engine.*recovery section"):
        deepspeed_state.capture(engine)
    with pytest.raises(GuardStateError, match="cannot record a ZeRO 3 engine"):
        deepspeed_state.restore(engine, deepspeed_state.DeepSpeedState([], [], [], {}))
