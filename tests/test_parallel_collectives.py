"""The guard's collectives per step under FSDP2, tensor parallel, FSDP2 over TP and a pipeline, counted.

``benchmarks/parallel_collectives.py`` counts every collective a training step dispatches on real gloo ranks; the
guard's own are what it adds to the unguarded step's. Counts, not times: held exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import parallel_collectives  # noqa: E402


@pytest.fixture(scope="module")
def table() -> dict[str, dict[str, dict[str, int]]]:
    return parallel_collectives.measure()


def added(table: dict[str, dict[str, dict[str, int]]], layout: str, policy: str) -> int:
    return sum(table[layout][policy].values()) - sum(table[layout]["none"].values())


def test_fsdp2_over_tensor_parallel_makes_as_many_guard_collectives_as_fsdp2_alone(table: dict) -> None:
    """One all-reduce a step under FSDP2 and under FSDP2 over TP, for the shipped default and a group clip alike."""
    for policy in ("default", "group clip"):
        assert added(table, "fsdp2", policy) == 1
        assert added(table, "fsdp2_tp", policy) == 1


def test_tensor_parallel_adds_the_step_s_all_reduce_and_one_for_each_partial_gradient(table: dict) -> None:
    """Each Partial gradient (a SequenceParallel norm's weight and bias) is reduced by an all-reduce of its own, as
    DTensor's redistribution would: one joined buffer sums an element's pieces in another order on three ranks or
    more, and a healthy run would not be the unguarded one to the last bit (``test_tensor_parallel``)."""
    from support.parallel_models import make_decoder

    partial = len([name for name, _ in make_decoder().named_parameters() if "norm" in name])
    for policy in ("default", "group clip"):
        assert added(table, "tp", policy) == 1 + partial
        assert table["tp"][policy]["allreduce"] == 1 + partial


def test_a_pipeline_adds_its_verdict_and_a_group_clip_s_norm_over_the_stages(table: dict) -> None:
    assert added(table, "pp", "default") == 1
    assert added(table, "pp", "group clip") == 2
    assert table["pp"]["none"] == {"send": 2, "recv": 2}
