"""Recovery, fp16 thresholds and the lifted refusals on real DeepSpeed engines, 2 gloo ranks (issue 49).

The file is also the ranks' script (one torchrun for every scenario, as ``tests/test_deepspeed_guard.py``). A rewind
is judged against the run that never trained the rewound batches: the same engine trained on the steps before the
snapshot and after the skip window only. Both end bitwise equal on every rank: the model's weights, this rank's fp32
master partitions (the tensors DeepSpeed's inner optimizer steps), its momentum and its LR. At ZeRO 3 the weights are
gathered whole and the masters and momentum are compared on their real elements (the last rank's partition of each
parameter ends in padding DeepSpeed never initialises).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from support.deepspeed_ranks import make_engine, torchrun_scenarios, train_step  # noqa: E402
from support.gloo_ranks import main  # noqa: E402

from gradguard import GradGuard, Policy  # noqa: E402
from gradguard.enforce.distributed.deepspeed import inner_optimizer  # noqa: E402

SCRIPT = Path(__file__)
CUT = "2.weight"
LR = 0.05
STEPS = 10
FAULT = 5
SNAPSHOT = 3
"""snapshot_every 3, min_age 1, skip_steps 1: the NaN at step 5 rewinds to step 3's snapshot and skips step 6."""
NEVER_TRAINED = range(SNAPSHOT, FAULT + 2)
BF16 = {"bf16": {"enabled": True}}
BF16_ACCUMULATING = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}  # BF16_Optimizer
RELEASED = {"stage3_param_persistence_threshold": 0}
"""ZeRO 3 with no parameter left gathered between forwards (by default these small ones all stay gathered)."""
PRECISIONS: dict[str, dict[str, Any]] = {"fp32": {}, "bf16": BF16, "bf16acc": BF16_ACCUMULATING, "released": {}}
ZERO: dict[str, dict[str, Any]] = {"released": RELEASED}
REWOUND = [
    *((0, 1, "fp32"), (1, 1, "fp32"), (2, 2, "fp32"), (2, 1, "bf16"), (1, 2, "bf16acc")),
    *((3, 1, "fp32"), (3, 2, "fp32"), (3, 2, "bf16"), (3, 1, "released")),
]
SCENARIOS = [f"recovery_{stage}_{gas}_{precision}" for stage, gas, precision in REWOUND]


def policy(*rules: dict[str, Any], **sections: Any) -> Policy:
    return Policy.from_dict({"version": 1, "rules": list(rules), **sections})


HALT = {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}
RECOVERY = {"snapshot_every": SNAPSHOT, "keep": 2, "min_age": 1, "skip_steps": 1}


def state_of(engine: Any, rank: int) -> dict[str, list[torch.Tensor] | list[float]]:
    """What must come out bitwise: the weights, this rank's masters, their momentum, the LR."""
    inner = inner_optimizer(engine)
    lrs = [float(group["lr"]) for group in inner.param_groups]
    if int(engine.zero_optimization_stage()) < 3:
        masters = [param for group in inner.param_groups for param in group["params"]]
        return {
            "weights": [param.detach().float().clone() for param in engine.module.parameters()],
            "masters": [master.detach().clone() for master in masters],
            "momentum": [inner.state[master]["momentum_buffer"].clone() for master in masters],
            "lr": lrs,
        }
    zero = engine.optimizer  # its inner optimizer's groups hold the masters only inside its step
    flats = list(zero.fp32_partitioned_groups_flat)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # a collective: every rank, same place
        weights = [param.detach().float().clone() for param in engine.module.parameters()]
    return {
        "weights": weights,
        "masters": [real_elements(zero, i, flat, rank) for i, flat in enumerate(flats)],
        "momentum": [real_elements(zero, i, inner.state[f]["momentum_buffer"], rank) for i, f in enumerate(flats)],
        "lr": lrs,
    }


def real_elements(zero: Any, sub_group: int, flat: torch.Tensor, rank: int) -> torch.Tensor:
    """``flat`` laid out as ZeRO 3's sub group ``sub_group`` (each parameter's ``partition_numel`` elements in turn),
    without the padding that ends the last rank's partition of a parameter."""
    pieces, offset = [], 0
    for param in zero.fp16_groups[sub_group]:
        size = param.partition_numel()
        pieces.append(flat.narrow(0, offset, max(0, min(size, param.ds_numel - rank * size))).clone())
        offset += size
    return torch.cat(pieces)


def same(a: dict[str, Any], b: dict[str, Any]) -> dict[str, bool]:
    out = {}
    for name, values in a.items():
        pairs = zip(values, b[name], strict=True)
        out[name] = all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in pairs)
    return out


def recovery_scenario(stage: int, gas: int, precision: str, rank: int) -> dict[str, Any]:
    zero = ZERO.get(precision, {})
    engine = make_engine(stage, gas, PRECISIONS[precision], lr=LR, momentum=0.9, decay=0.9, **zero)
    param = dict(engine.module.named_parameters())[CUT]
    steps = [0]
    handle = param.register_hook(lambda g: g * float("nan") if rank == 1 and steps[-1] == FAULT else g)
    with GradGuard(engine, policy(HALT, recovery=RECOVERY), logger=None) as guard:
        for step in range(STEPS):
            steps.append(step)
            train_step(engine, step, gas, rank)
        counters = guard.counters.snapshot()
        applied, rewinds = guard.applied_steps, guard._enforcer.recovery.rewinds
    handle.remove()
    rewound = state_of(engine, rank)
    counts = {"global_steps": int(engine.global_steps), "skipped_steps": int(engine.skipped_steps)}
    counts["scheduler_steps"] = int(engine.lr_scheduler.last_epoch)
    reference = make_engine(stage, gas, PRECISIONS[precision], lr=LR, momentum=0.9, decay=0.9, **zero)
    for step in range(STEPS):
        if step not in NEVER_TRAINED:
            train_step(reference, step, gas, rank)
    return {
        "same": same(rewound, state_of(reference, rank)),
        "counters": counters,
        "applied": applied,
        "rewinds": rewinds,
        "counts": counts,
        "reference_scheduler_steps": int(reference.lr_scheduler.last_epoch),
    }


def scenario(name: str, rank: int, world: int, outdir: Path) -> dict[str, Any]:
    kind, *rest = name.split("_")
    if kind == "recovery":
        return recovery_scenario(int(rest[0]), int(rest[1]), rest[2], rank)
    raise ValueError(name)


# --- the tests ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[dict[str, Any]]]:
    return torchrun_scenarios(SCRIPT, SCENARIOS, tmp_path_factory.mktemp("deepspeed_recovery"), timeout=420)


@pytest.mark.parametrize(("stage", "gas", "precision"), REWOUND)
def test_a_rewind_ends_bitwise_equal_on_every_rank_to_the_run_that_never_trained_the_rewound_batches(
    runs: Callable[[str], list[dict[str, Any]]], stage: int, gas: int, precision: str
) -> None:
    """A NaN made on rank 1 at step 5: both ranks rewind to step 3's snapshot at that step, skip step 6, and end with
    the weights, fp32 master partitions, momentum and LR of a run that trained steps 0-2 and 7-9 only."""
    for result in runs(f"recovery_{stage}_{gas}_{precision}"):
        assert result["same"] == {"weights": True, "masters": True, "momentum": True, "lr": True}
        assert result["rewinds"] == 1
        assert result["counters"]["nonfinite"]["rewind"] == 1
        assert result["applied"] == STEPS - len(NEVER_TRAINED)


@pytest.mark.parametrize(("stage", "gas", "precision"), REWOUND)
def test_deepspeed_s_counters_after_a_rewind_count_every_update_and_its_scheduler_goes_on_from_the_snapshot(
    runs: Callable[[str], list[dict[str, Any]]], stage: int, gas: int, precision: str
) -> None:
    """``global_steps`` counts every update the loop asked for (the loop's position in its data); ``skipped_steps`` the
    fault's and the window's at ZeRO 1-3 (DeepSpeed's own skip), none at ZeRO 0 (the client optimizer's step is not
    DeepSpeed's to skip); the LR scheduler stands as in the run that never trained the rewound batches."""
    for result in runs(f"recovery_{stage}_{gas}_{precision}"):
        counts = result["counts"]
        assert counts["global_steps"] == STEPS
        assert counts["skipped_steps"] == (0 if stage == 0 else FAULT + 2 - FAULT)
        assert counts["scheduler_steps"] == result["reference_scheduler_steps"] == STEPS - len(NEVER_TRAINED)


if __name__ == "__main__":
    main(scenario, sys.argv[1:])
