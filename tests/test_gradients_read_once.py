"""The gradients read once: a step that clips nothing writes nothing, a step that clips writes only what it
clips, and the loop's own clip after the guard takes the guard's norms and returns torch's result bit for bit."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from gradguard import GradGuard, Policy

PER_TENSOR = [
    {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
    {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 1.0}]},
]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def backward(net: nn.Module, step: int, scale: float) -> None:
    gen = torch.Generator().manual_seed(step)
    net.zero_grad()
    (net(torch.randn(16, 8, generator=gen)).pow(2).mean() * scale).backward()


def versions(net: nn.Module) -> list[int]:
    return [p.grad._version for p in net.parameters() if p.grad is not None]


def test_a_step_that_clips_nothing_writes_no_gradient() -> None:
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    with GradGuard(net, Policy.from_dict({"version": 1, "rules": PER_TENSOR}), logger=None) as guard:
        backward(net, 0, 1e-3)
        before = versions(net)
        assert guard.step(opt)
        assert versions(net) == before
        assert "clip" not in guard.counters.snapshot()


def test_a_step_that_clips_some_tensors_writes_those_only_and_as_torch_would() -> None:
    net = model()
    reference = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    rules = [PER_TENSOR[0], {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.05}]}]
    with GradGuard(net, Policy.from_dict({"version": 1, "rules": rules}), logger=None) as guard:
        backward(net, 1, 1.0)
        before = versions(net)
        assert guard.step(opt)
        changed = [after != first for first, after in zip(before, versions(net), strict=True)]
    backward(reference, 1, 1.0)
    norms = [float(p.grad.norm()) for p in reference.parameters()]
    assert changed == [norm > 0.05 for norm in norms]
    assert 0 < sum(changed) < len(changed), "some tensors clipped, some not"
    for p, q in zip(net.parameters(), reference.parameters(), strict=True):
        torch.nn.utils.clip_grad_norm_([q], 0.05)
        assert torch.equal(p.grad, q.grad)
    assert guard.counters.snapshot()["clip"]["clip_norm"] == sum(changed)


@pytest.mark.parametrize("rules", [PER_TENSOR[:1], PER_TENSOR], ids=["halt", "halt-and-clip"])
@pytest.mark.parametrize(("scale", "max_norm"), [(1e-3, 1.0), (1.0, 1.0), (1e3, 1.0), (1.0, 1e-4)])
@pytest.mark.parametrize("call", ["clip_grad_norm_", "get_total_norm", "clip_grad_norm_foreach"])
def test_the_loops_clip_after_the_guard_returns_torchs_norm_and_gradients_bit_for_bit(
    rules: list[dict[str, Any]], scale: float, max_norm: float, call: str
) -> None:
    net = model()
    reference = copy.deepcopy(net)
    guard = GradGuard(net, Policy.from_dict({"version": 1, "rules": rules}), logger=None)
    try:
        backward(net, 2, scale)
        got = clip(call, net, max_norm)
        assert guard.step_count == 1, "the guard's step ran at the clip"
    finally:
        guard.remove()
    backward(reference, 2, scale)
    for p, bound in zip(reference.parameters(), rules_clip(rules), strict=True):
        if bound:
            torch.nn.utils.clip_grad_norm_([p], 1.0)
    want = clip(call, reference, max_norm)
    assert torch.equal(got, want)
    for p, q in zip(net.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def rules_clip(rules: list[dict[str, Any]]) -> list[bool]:
    return [len(rules) > 1] * 6


def clip(call: str, net: nn.Module, max_norm: float) -> torch.Tensor:
    if call == "get_total_norm":
        return torch.nn.utils.get_total_norm([p.grad for p in net.parameters()])
    foreach = True if call.endswith("foreach") else None
    return torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm, foreach=foreach)


def test_the_loops_clip_under_the_guard_writes_nothing_when_its_coefficient_is_1() -> None:
    net = model()
    with GradGuard(net, Policy.from_dict({"version": 1, "rules": PER_TENSOR[:1]}), logger=None):
        backward(net, 3, 1e-3)
        before = versions(net)
        total = torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        assert float(total) < 1.0
        assert versions(net) == before, "a multiply by 1 was left out"
        backward(net, 4, 1e3)
        before = versions(net)
        total = torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        assert float(total) > 1.0
        assert all(after == first + 1 for first, after in zip(before, versions(net), strict=True))


def test_only_the_first_clip_after_the_guards_step_takes_its_norms() -> None:
    """A change through ``.data`` shows in no version: a second clip of the step computes its own norms."""
    net = model()
    reference = copy.deepcopy(net)
    with GradGuard(net, Policy.from_dict({"version": 1, "rules": PER_TENSOR[:1]}), logger=None):
        backward(net, 5, 1.0)
        first = torch.nn.utils.clip_grad_norm_(net.parameters(), 1e6)
        for p in net.parameters():
            p.grad.data.mul_(2.0)
        second = torch.nn.utils.clip_grad_norm_(net.parameters(), 1e6)
    backward(reference, 5, 1.0)
    assert torch.equal(first, torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e6))
    for p in reference.parameters():
        p.grad.data.mul_(2.0)
    assert torch.equal(second, torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e6))


def test_a_clip_after_an_explicit_guard_step_computes_its_own_norms() -> None:
    """Code may run between ``guard.step()`` and the loop's clip (a change through ``.data`` shows in no version):
    only a clip that ran the guard's step itself takes its norms."""
    net = model()
    reference = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    with GradGuard(net, Policy.from_dict({"version": 1, "rules": PER_TENSOR[:1]}), logger=None) as guard:
        backward(net, 6, 1.0)
        assert guard.step(opt)
        for p in net.parameters():
            p.grad.data.mul_(100.0)
        got = torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0, foreach=True)
    backward(reference, 6, 1.0)
    for p in reference.parameters():
        p.grad.data.mul_(100.0)
    assert torch.equal(got, torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0, foreach=True))
    for p, q in zip(net.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_a_per_tensor_clip_over_float32_and_float64_tensors_is_torchs_for_each() -> None:
    """The norms of each dtype are stacked apart: a float32 tensor's coefficient is computed in float32, as
    ``clip_grad_norm_([p])`` computes it."""
    rules = [{"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.1}]}]
    for seed in range(40):
        torch.manual_seed(seed)
        net = nn.Module()
        net.a = nn.Parameter(torch.randn(7, 5))
        net.b = nn.Parameter(torch.randn(3, dtype=torch.float64))
        ga, gb = torch.randn(7, 5) * 3, torch.randn(3, dtype=torch.float64)
        net.a.grad, net.b.grad = ga.clone(), gb.clone()
        with GradGuard(net, Policy.from_dict({"version": 1, "rules": rules}), logger=None) as guard:
            guard.step()
        for param, grad in ((net.a, ga), (net.b, gb)):
            want = nn.Parameter(torch.zeros_like(grad))
            want.grad = grad.clone()
            torch.nn.utils.clip_grad_norm_([want], 0.1)
            assert torch.equal(param.grad, want.grad), seed
