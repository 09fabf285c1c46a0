"""clip_value with a limit beyond float16's range works on float16 gradients, as a no-op on finite values."""

from __future__ import annotations

import torch
from torch import nn

from gradguard import GradGuard, Policy


def test_a_clip_value_limit_above_65504_leaves_finite_float16_gradients_alone_and_counts_nothing() -> None:
    """limit 1e6 on float16: torch would refuse the bound; every finite float16 is within it, so nothing changes."""
    model = nn.Linear(4, 2).half()
    policy = Policy.from_dict(
        {"version": 1, "rules": [{"name": "v", "match": "*", "actions": [{"action": "clip_value", "limit": 1e6}]}]}
    )
    grads = {"weight": torch.full((2, 4), 60000.0, dtype=torch.half), "bias": torch.ones(2, dtype=torch.half)}
    with GradGuard(model, policy, logger=None) as guard:
        model.weight.grad = grads["weight"].clone()
        model.bias.grad = grads["bias"].clone()
        guard.step()
        assert torch.equal(model.weight.grad, grads["weight"])
        assert torch.equal(model.bias.grad, grads["bias"])
        assert guard.counters.snapshot() == {}


def test_a_clip_value_limit_applies_per_dtype_in_a_mixed_precision_model() -> None:
    """limit 1e6 with a float32 and a float16 parameter: the float32 one is clamped at 1e6, as clip_grad_value_."""
    model = nn.Module()
    model.big = nn.Parameter(torch.zeros(3))
    model.small = nn.Parameter(torch.zeros(3, dtype=torch.half))
    policy = Policy.from_dict(
        {"version": 1, "rules": [{"name": "v", "match": "*", "actions": [{"action": "clip_value", "limit": 1e6}]}]}
    )
    with GradGuard(model, policy, logger=None) as guard:
        model.big.grad = torch.tensor([3e6, -2e6, 5.0])
        model.small.grad = torch.tensor([1.0, -2.0, 3.0], dtype=torch.half)
        guard.step()
        assert torch.equal(model.big.grad, torch.tensor([1e6, -1e6, 5.0]))
        assert torch.equal(model.small.grad, torch.tensor([1.0, -2.0, 3.0], dtype=torch.half))
        assert guard.counters.snapshot() == {"v": {"clip_value": 1}}
