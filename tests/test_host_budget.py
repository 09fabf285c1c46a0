"""The host's share of the guard's step (issue 51): the per-tensor clip's coefficients found on the host bitwise as the
device finds them, and the shipped default policy's work per step, counted (not timed), held to its budget.

The counts are deterministic: every torch op dispatched (a ``TorchDispatchMode``) and every Python function called
(``sys.setprofile``) during a step of nanoGPT's smallest shape with the loop's own clip, over the same loop unguarded,
averaged over 10 steps (the default policy's monitor samples every 10th). ``benchmarks/host_time.py`` prints them
with the time ratios.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from gradguard.enforce.work.tensors import clip_coefficients, host_clip_coefficient

MAX_NORMS = (1.0, 0.5, 3.0, 7.3, 0.1, 1.0000001, 1e-6, 1e-7, 1e30, 1e-30)


def norms_to_check(dtype: torch.dtype) -> torch.Tensor:
    """Norms over the whole range of ``dtype`` (log-uniform), its edges, and the 30 representable norms on either side
    of each place where a coefficient crosses 1 (``max_norm - 1e-6``, in float64 and rounded to ``dtype``)."""
    finfo = torch.finfo(dtype)
    span = math.log(finfo.max)
    spread = (torch.rand(20_000, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 2 - 1) * span
    values = spread.exp().to(dtype).tolist()
    values += [0.0, finfo.tiny, finfo.max, 2.0**64, 2.0**-63, 2.0**-75, math.inf, math.nan]
    up, down = torch.tensor(math.inf, dtype=dtype), torch.tensor(-math.inf, dtype=dtype)
    for max_norm in MAX_NORMS:
        rounded = torch.tensor(max_norm, dtype=dtype).item()
        for edge in torch.tensor([max_norm - 1e-6, rounded - 1e-6, max_norm, 1e-6], dtype=dtype):
            above = below = edge
            for _ in range(30):
                values += [above.item(), below.item()]
                above, below = torch.nextafter(above, up), torch.nextafter(below, down)
    return torch.tensor([value for value in values if not value < 0], dtype=dtype)  # a norm is never negative


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_host_clip_coefficient_is_bitwise_the_one_torch_computes_on_the_cpu_for_every_norm(
    dtype: torch.dtype,
) -> None:
    norms = norms_to_check(dtype)
    for max_norm in MAX_NORMS:
        # clip_grad_norm_([p]) on the CPU: the 2-norm of the one-element stack, then its coefficient.
        totals = torch.linalg.vector_norm(norms.unsqueeze(1), 2.0, dim=1)
        expected = list(zip(totals.tolist(), clip_coefficients(totals, max_norm).tolist(), strict=True))
        found = [host_clip_coefficient(norm, max_norm, dtype == torch.float32) for norm in norms.tolist()]
        wrong = [
            (norm, want, got)
            for norm, want, got in zip(norms.tolist(), expected, found, strict=True)
            if got[1] != want[1] or not (got[0] == want[0] or (math.isnan(got[0]) and math.isnan(want[0])))
        ]
        assert not wrong, (max_norm, wrong[:5])
        assert any(coef < 1.0 for _, coef in found)
        assert any(coef == 1.0 for _, coef in found)


@pytest.mark.parametrize(("dtype", "overflows"), [(torch.float32, 2.0**64), (torch.float64, 2.0**512)])
def test_the_one_element_norm_the_host_coefficient_assumes_is_the_element_itself_where_its_square_overflows(
    dtype: torch.dtype, overflows: float
) -> None:
    """What ``host_clip_coefficient`` rests on: torch's 2-norm of a one-element stack (``clip_grad_norm_([p])``'s
    total), and the row-wise one the guard takes on the device, is the norm itself, also from where its square
    overflows (an H200 with torch 2.11 gave the same: docs/performance.md)."""
    norms = norms_to_check(dtype)
    huge = norms[(norms >= overflows) & norms.isfinite()]
    assert len(huge) > 1000
    whole = torch.stack([torch.linalg.vector_norm(torch.stack([norm]), 2.0) for norm in huge.unbind()])
    assert torch.equal(whole, huge)
    assert torch.equal(torch.linalg.vector_norm(huge.unsqueeze(1), 2.0, dim=1), huge)
    for max_norm in MAX_NORMS:
        found = [host_clip_coefficient(norm, max_norm, dtype == torch.float32) for norm in huge.tolist()]
        assert [total for total, _ in found] == huge.tolist()
        assert [coef for _, coef in found] == clip_coefficients(whole, max_norm).tolist()


@pytest.fixture
def host_time() -> Iterator[ModuleType]:
    """``benchmarks/host_time.py`` as a module (its loops and its counting); torch's thread count put back after."""
    folder, threads = str(Path(__file__).resolve().parent.parent / "benchmarks"), torch.get_num_threads()
    sys.path.insert(0, folder)
    torch.set_num_threads(1)
    try:
        import host_time

        yield host_time
    finally:
        sys.path.remove(folder)
        torch.set_num_threads(threads)


@pytest.mark.parametrize("loop", ["gpt", "flat", "mlp"])
def test_the_default_provenance_adds_at_most_its_budget_of_torch_ops_and_python_calls_on_each_module_tree(
    host_time: ModuleType, loop: str
) -> None:
    """Issue 56's budget, on any module tree: at most +10 torch ops and +200 Python calls a step over the unguarded
    loop (with its own clip) on nanoGPT's GPT, on a GPT of the same shape with a flat tree (round 7's trace hooked
    15 modules there: +33.1 ops, +328 calls) and on the MLP with 4 micro-batches a step (+29.1, +530), at 2 layers
    and at 4x the layers, with the policy the budget was set on (0.2.0's default, shipped as per-tensor-clip) and
    the default provenance: it holds each forward and traces none (a faulting step is replayed)."""
    counted = {layers: host_time.budget_counts(layers, loop, host_time._per_tensor_clip) for layers in (2, 8)}
    assert host_time.within_budget(counted), counted


@pytest.mark.parametrize("loop", ["gpt", "flat", "mlp"])
def test_the_default_provenance_costs_no_torch_op_and_few_python_calls_on_a_clean_step(
    host_time: ModuleType, loop: str
) -> None:
    """With the shipped default policy, the default provenance against none: no torch op at all on a clean step, and
    a few Python calls (two hooks on the model per forward, its part of the step), not one per module or layer."""
    for layers in (2, 8):
        traced = host_time.budget_counts(layers, loop, host_time._default)
        untraced = host_time.budget_counts(layers, loop, host_time._untraced)
        assert traced[1] == untraced[1], (layers, traced, untraced)
        assert 0 < traced[0] - untraced[0] <= 30, (layers, traced, untraced)


@pytest.mark.parametrize("loop", ["gpt", "flat", "mlp"])
def test_the_shipped_default_adds_at_most_its_budget_on_every_tree(host_time: ModuleType, loop: str) -> None:
    """The shipped default policy (its per-tensor zclip decided on the host from the step's read: two small tensors
    of statistics a step) with the default provenance, within +10 ops and +200 calls, and no more at 4x the layers.
    On the MLP with 4 micro-batches it was +8.7 ops and +213 calls while each backward's loss was summed on the device
    at every step; its monitor samples the loss every 10th step, and now the other nine take no root (+182, -1.2)."""
    counted = {layers: host_time.budget_counts(layers, loop) for layers in (2, 8)}
    assert host_time.within_budget(counted), counted


def test_the_counts_are_deterministic_and_see_the_guard(host_time: ModuleType) -> None:
    """The same count twice is the same number; a guard's step counts more Python calls than none (the counting sees
    it; its torch ops may be fewer: the loop's clip reuses the guard's norms). The first count in a process is taken
    and dropped: it holds one-time work of the interpreter's and torch's (+10 calls a step on nanoGPT)."""
    host_time.budget_counts(2)
    first, second = host_time.budget_counts(2), host_time.budget_counts(2)
    assert first == second
    assert first[0] > 0
