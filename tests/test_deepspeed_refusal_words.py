"""The refusal of DeepSpeed's optimizer offload names the place the guard reads at the engine's stage (issue 58, item
9: at ZeRO 3 it spoke of ``averaged_gradients``, ZeRO 1 and 2's). Judged on stand-ins of DeepSpeed's classes, by
their names, as the refusal recognises them; the real engines' refusals run in tests/test_deepspeed_partitions.py."""

from __future__ import annotations

from typing import Any

import pytest

from gradguard.enforce.distributed.deepspeed import refusal


def offloading_engine(stage: int) -> Any:
    """An engine of ``stage`` with optimizer offload on, as DeepSpeed's classes are named."""
    optimizer_class = "DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer"
    optimizer = type(optimizer_class, (), {"cpu_offload": True})()
    engine_class = type(
        "DeepSpeedEngine",
        (),
        {
            "__module__": "deepspeed.runtime.engine",
            "optimizer": optimizer,
            "zero_optimization_stage": lambda self: stage,
            "zero_cpu_offload": lambda self: True,
        },
    )
    return engine_class()


@pytest.mark.parametrize(
    ("stage", "read_point", "not_said"),
    [
        (3, "each parameter's gradient partition (grad_partitions_flat_buffer) the guard reads at ZeRO 3", "averaged"),
        (2, "the averaged_gradients the guard reads at ZeRO 1 and 2", "grad_partitions_flat_buffer"),
    ],
)
def test_the_offload_refusal_names_where_the_guard_reads_at_the_engine_s_stage(
    stage: int, read_point: str, not_said: str
) -> None:
    said = refusal(offloading_engine(stage))
    assert said is not None
    assert said.startswith("optimizer offload (CPU/NVMe) writes gradients straight into the fp32 partition")
    assert f"not into {read_point}." in said
    assert not_said not in said
    assert said.endswith("What works: ZeRO stage 0 (fp32), 1, 2 or 3 on a plain DeepSpeedEngine, without offload.")
