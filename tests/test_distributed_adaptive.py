"""Adaptive actions under DDP and FSDP2 (2 gloo ranks): every rank decides the same from the same figures.

A spike injected on rank 1 only reaches both ranks through the all-reduce: both skip that step, clip
the same steps, keep the same weights and end with the same statistics, equal to a single process run
on the ranks' gradients averaged by hand. Under FSDP2 the statistics are those of the full, unsharded
norms (they match the reference, not the shards).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import adaptive_scenarios
import distributed_scenarios
import pytest
import torch
from test_distributed import launch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")

WORLD = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    outdir = tmp_path_factory.mktemp("adaptive")
    launch(["adaptive_ddp", "adaptive_fsdp2"], WORLD, outdir)
    return outdir


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return adaptive_scenarios.reference(distributed_scenarios.make_model, distributed_scenarios.batch, WORLD)


def _ranks(outdir: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads((outdir / name / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def _close_statistics(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for rule, actions in want.items():
        for position, series in actions.items():
            mine = got[rule][position]
            assert mine["names"] == series["names"]
            assert mine["counters"] == series["counters"]
            for key, values in series["tensors"].items():
                torch.testing.assert_close(
                    torch.tensor(mine["tensors"][key]), torch.tensor(values), rtol=1e-5, atol=1e-7, equal_nan=True
                )


@pytest.mark.parametrize("name", ["adaptive_ddp", "adaptive_fsdp2"])
def test_every_rank_skips_and_clips_the_same_steps_and_keeps_the_same_statistics(runs: Path, name: str) -> None:
    rank0, rank1 = _ranks(runs, name)
    assert rank0["skipped"] == rank1["skipped"] == [adaptive_scenarios.SPIKE_STEP]
    assert rank0["weights"] == rank1["weights"]
    assert rank0["statistics"] == rank1["statistics"]
    assert rank0["counters"] == rank1["counters"]
    assert rank0["counters"]["rest"]["zclip"] > 0
    assert rank0["counters"]["embed"]["autoclip"] > 0


@pytest.mark.parametrize("name", ["adaptive_ddp", "adaptive_fsdp2"])
def test_the_ranks_statistics_are_those_of_the_averaged_full_gradient(
    runs: Path, reference: dict[str, Any], name: str
) -> None:
    """Equal (to float reduction order) to one process on the averaged gradients: full norms, not shards."""
    rank0, _ = _ranks(runs, name)
    assert reference["skipped"] == rank0["skipped"]
    _close_statistics(rank0["statistics"], reference["statistics"])
    for step, (mine, theirs) in enumerate(zip(rank0["weights"], reference["weights"], strict=True)):
        for param, values in theirs.items():
            torch.testing.assert_close(
                torch.tensor(mine[param]), torch.tensor(values), rtol=1e-5, atol=1e-6, msg=f"step {step} {param}"
            )
