"""Every new gradient is treated, however Python reuses the ids of freed gradient tensors."""

from __future__ import annotations

import torch
from torch import nn

from gradguard import GradGuard, Policy


def test_every_step_of_a_long_run_is_clipped_even_when_gradient_ids_are_reused() -> None:
    """zero_grad(set_to_none=True) frees each gradient; a new one may get its id: it must still be treated."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    clip = {"action": "clip_norm", "max_norm": 1e-9}
    policy = Policy.from_dict({"version": 1, "rules": [{"name": "tiny", "match": "*", "actions": [clip]}]})
    ids: set[int] = set()
    steps = 200
    with GradGuard(model, policy, logger=None) as guard:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            model(torch.randn(4, 8)).pow(2).sum().backward()
            ids.update(id(p.grad) for p in model.parameters())
            opt.step()
            for param in model.parameters():
                assert param.grad is not None
                assert float(param.grad.norm()) <= 1e-9 * (1 + 1e-5)
        counts = guard.counters.snapshot()
    assert counts == {"tiny": {"clip_norm": steps * 4}}
    assert len(ids) < steps * 4  # ids were reused: the case this test is about happened


def test_a_second_step_on_the_same_unchanged_gradient_is_not_treated_twice() -> None:
    """scale 0.5 then opt.step() twice without a new backward: the gradient is halved once."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    policy = Policy.from_dict(
        {"version": 1, "rules": [{"name": "half", "match": "*", "actions": [{"action": "scale", "factor": 0.5}]}]}
    )
    with GradGuard(model, policy, logger=None):
        model(torch.ones(2, 3)).sum().backward()
        raw = model.weight.grad.clone()
        opt.step()
        opt.step()
        torch.testing.assert_close(model.weight.grad, raw * 0.5, rtol=0, atol=0)
