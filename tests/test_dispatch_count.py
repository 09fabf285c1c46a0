"""The dispatch-count benchmark counts what it says, and its ``--quick`` run finishes and writes its rows.

The counting model is checked on ops whose cost is known (a foreach over mixed shapes, views, host
reads, torch's own global clip); the engine's counts themselves are the benchmark's business, not
this test's: the targets may fail while the engine is being worked on.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch


@pytest.fixture
def bench(dispatch_bench: ModuleType) -> ModuleType:
    return dispatch_bench


def mixed_grads(pairs: int) -> list[torch.Tensor]:
    """Weights and biases of ``Linear(16, 16)`` layers: two shapes, alternating."""
    return [t for _ in range(pairs) for t in (torch.randn(16, 16), torch.randn(16))]


def with_grads(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    return params


def test_the_dispatch_count_counts_a_foreach_over_mixed_shapes_with_zero_dim_scalars_as_one_launch_per_tensor(
    bench: ModuleType,
) -> None:
    grads = mixed_grads(3)
    coefs = list(torch.rand(len(grads)).unbind())
    tally = bench.count(lambda: torch._foreach_mul_(grads, coefs))
    assert tally.launches == len(grads)
    assert tally.kernels == len(grads)


def test_the_dispatch_count_counts_a_foreach_with_host_floats_or_one_tensor_scalar_as_one_launch(
    bench: ModuleType,
) -> None:
    grads = mixed_grads(3)
    assert bench.count(lambda: torch._foreach_mul_(grads, [0.5] * len(grads))).launches == 1
    assert bench.count(lambda: torch._foreach_mul_(grads, 0.5)).launches == 1
    coef = torch.tensor(0.5)
    assert bench.count(lambda: torch._foreach_mul_(grads, coef)).launches == 1


def test_the_dispatch_count_takes_the_fast_path_when_corresponding_tensors_share_their_shapes(
    bench: ModuleType,
) -> None:
    grads = mixed_grads(3)
    others = [torch.ones_like(g) for g in grads]
    assert bench.count(lambda: torch._foreach_add_(grads, others)).launches == 1
    scalars = list(torch.rand(4).unbind())
    zero_dim = list(torch.rand(4).unbind())
    assert bench.count(lambda: torch._foreach_mul_(zero_dim, scalars)).launches == 1


def test_the_dispatch_count_treats_views_as_free_and_counts_host_reads_and_python_data(bench: ModuleType) -> None:
    t = torch.randn(4, 4)
    views = bench.count(lambda: (t.view(-1), t.unsqueeze(0), t.detach(), t.t(), t.unbind(), t[0]))
    assert views.launches == 0
    assert views.read + views.written == 0
    reads = bench.count(lambda: (t.tolist(), t[0, 0].item(), bool(t[0, 0] > 0)))
    assert reads.host_reads == 3
    made = bench.count(lambda: (torch.tensor([1.0, 2.0]), torch.scalar_tensor(2.0)))
    assert made.from_python == 1
    assert made.fills == 1


def test_the_multi_tensor_apply_model_launches_a_kernel_per_full_metadata(bench: ModuleType) -> None:
    assert bench.mta_kernels([256] * 110, depth=1) == 1
    assert bench.mta_kernels([256] * 2000, depth=1) == 19  # ceil(2000 / 110)
    assert bench.mta_kernels([256] * 100, depth=2) == 2  # 64 tensors a launch at depth 2
    assert bench.mta_kernels([320 * 65536 + 1], depth=1) == 2  # 320 blocks a launch
    assert bench.mta_kernels([], depth=1) == 0


def test_torch_global_clip_moves_three_times_the_gradient_bytes_whether_it_clips_or_not(bench: ModuleType) -> None:
    """torch multiplies by the clamped coefficient even when it is 1: 1 G read for the norms, 2 G for the multiply;
    the norms alone read the gradients once."""
    for scale in (1e-4, 1e4):
        grads = [g * scale for g in mixed_grads(25)]
        params = with_grads(grads)
        g_bytes = sum(g.numel() * g.element_size() for g in grads)
        clip = bench.count(lambda params=params: torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True))
        assert 2.95 < (clip.read + clip.written) / g_bytes < 3.1
        assert clip.launches == 8
        assert clip.host_reads == 0
        norms = bench.count(lambda grads=grads: torch._foreach_norm(grads))
        assert 0.99 < (norms.read + norms.written) / g_bytes < 1.05


def test_the_quick_dispatch_count_run_writes_every_row_and_target(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "dispatch.json"
    assert bench.main(["--quick", "--steps", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "**targets**" in printed
    assert "| treatment | tensors | state | launches |" in printed
    result = json.loads(out.read_text())
    assert result["sizes"] == [50, 200]
    rows = result["rows"]
    names = {t.name for t in bench.TREATMENTS}
    assert {(r["treatment"], r["tensors"], r["state"]) for r in rows} == {
        (name, size, state) for name in names for size in (50, 200) for state in bench.STATES
    }
    for row in rows:
        assert row["changed"] == (0 if row["state"] == "nothing clipped" else row["tensors"]), row["treatment"]
        assert row["launches"] > 0
        assert row["bytes_g"] > 0.9
    assert result["targets"]
    assert all({"name", "value", "limit", "passed"} <= set(t) for t in result["targets"])
