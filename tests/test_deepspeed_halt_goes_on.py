"""A loop that catches a halt inside DeepSpeed's ``engine.step()`` and goes on stays aligned (issue 58, item 4).

With ``gradient_accumulation_steps`` 2, a halt raised before DeepSpeed counted the micro-step left the engine one
micro-step short, and every later update mixed the micro-batches of two of the loop's steps. Now the halted update
takes DeepSpeed's own skipped-step path and the halt is raised once ``engine.step()`` has finished: the engine counts
it as a skipped step. Judged against two twins on the same 2 gloo ranks: the unguarded engine that never trained on
the halted step's batches (the weights, bitwise) and the engine whose guard skips that step (the engine's counters).
The file is also the ranks' script (``--torchrun NAMES OUTDIR``).
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

from gradguard import GradGuard, GradientHalt, Policy  # noqa: E402

SCRIPT = Path(__file__)
STAGES = [0, 2, 3]
SCENARIOS = [f"zero_{stage}" for stage in STAGES]
GAS = 2
STEPS = 4
HALTED = 1
POISONED = "2.weight"
CLIP = 1.0
"""DeepSpeed's own global clip, as its default config sets it: at ZeRO 0 the guard's step runs just before it."""


# --- the ranks ------------------------------------------------------------------------------------


def rule(action: str) -> Policy:
    return Policy.from_dict(
        {"version": 1, "rules": [{"name": "nonfinite", "match": "*", "actions": [{"action": action}]}]}
    )


def full_weights(engine: Any) -> list[torch.Tensor]:
    """Every parameter whole (gathered at ZeRO 3: a collective, on every rank)."""
    params = list(engine.module.parameters())
    if int(engine.zero_optimization_stage()) < 3:
        return [p.detach().clone() for p in params]
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def counts(engine: Any) -> dict[str, int]:
    return {name: int(getattr(engine, name)) for name in ("micro_steps", "global_steps", "skipped_steps")}


def guarded_run(stage: int, rank: int, action: str) -> tuple[Any, list[int]]:
    """``STEPS`` steps of ``GAS`` micro-batches with a NaN in rank 1's first micro-batch of step ``HALTED``; the loop
    catches each halt and goes on."""
    engine = make_engine(stage, GAS, clip=CLIP, momentum=0.9)
    param = dict(engine.module.named_parameters())[POISONED]
    steps = [0]
    handle = param.register_hook(lambda g: g * float("nan") if rank == 1 and steps[-1] == HALTED else g)
    halted = []
    with GradGuard(engine, rule(action), logger=None):
        for step in range(STEPS):
            steps.append(step)
            try:
                train_step(engine, step, GAS, rank)
            except GradientHalt as halt:
                halted.append(halt.step)
    handle.remove()
    return engine, halted


def go_on_scenario(stage: int, rank: int) -> dict[str, Any]:
    engine, halted = guarded_run(stage, rank, "halt_on_nonfinite")
    skipping, _ = guarded_run(stage, rank, "skip_step_on_nonfinite")
    unguarded = make_engine(stage, GAS, clip=CLIP, momentum=0.9)
    for step in range(STEPS):
        if step != HALTED:
            train_step(unguarded, step, GAS, rank)
    mine, twin = full_weights(engine), full_weights(unguarded)
    return {
        "halted": halted,
        "counts": counts(engine),
        "skipping_counts": counts(skipping),
        "same_weights_as_the_twin": all(torch.equal(a, b) for a, b in zip(mine, twin, strict=True)),
    }


def scenario(name: str, rank: int, world: int, outdir: Path) -> dict[str, Any]:
    return go_on_scenario(int(name.removeprefix("zero_")), rank)


# --- the tests ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[dict[str, Any]]]:
    return torchrun_scenarios(SCRIPT, SCENARIOS, tmp_path_factory.mktemp("deepspeed_halt_goes_on"), timeout=420)


@pytest.mark.parametrize("stage", STAGES)
def test_after_a_halt_caught_in_the_loop_the_engine_counts_a_skipped_step_and_trains_on_whole_steps(
    runs: Callable[[str], list[dict[str, Any]]], stage: int
) -> None:
    for result in runs(f"zero_{stage}"):
        assert result["halted"] == [HALTED]
        # At ZeRO 0 DeepSpeed counts no skipped step for a guard's skip either: its client optimizer has no overflow.
        skipped = 0 if stage == 0 else 1
        assert result["counts"] == {"micro_steps": STEPS * GAS, "global_steps": STEPS, "skipped_steps": skipped}
        assert result["counts"] == result["skipping_counts"]
        assert result["same_weights_as_the_twin"]


if __name__ == "__main__":
    main(scenario, sys.argv[1:])
