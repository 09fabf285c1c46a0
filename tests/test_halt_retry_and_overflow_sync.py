"""A retry after a halt treats nothing twice; a step whose float32 norm overflows costs one more sync, as documented."""

from __future__ import annotations

import pytest
import torch
from support.host_syncs import count_host_syncs

from gradguard import GradGuard, GradientHalt


def test_retrying_after_a_halt_does_not_apply_actions_twice(make_workload, make_policy):
    """After a halt, dropping the bad gradient and stepping again scales the others once, not twice."""
    policy = make_policy(
        {"name": "halt", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
        {"name": "half", "match": "*", "actions": [{"action": "scale", "factor": 0.5}]},
    )
    workload = make_workload("mlp")
    opt = torch.optim.SGD(workload.model.parameters(), lr=0.1)
    with GradGuard(workload.model, policy, logger=None):
        workload.backward(0)
        raw = workload.model.inp.weight.grad.clone()
        workload.model.out.bias.grad[0] = float("nan")
        with pytest.raises(GradientHalt):
            opt.step()
        workload.model.out.bias.grad = None  # drop the bad gradient, keep the others, retry
        opt.step()
        assert torch.equal(workload.model.inp.weight.grad, raw * 0.5)  # raw * 0.25 today


def test_a_step_whose_norm_overflows_costs_exactly_one_more_host_sync(make_workload, make_policy):
    """One more sync on a step where a norm comes out infinite, to tell an Inf element from an overflow (documented)."""
    policy = make_policy(
        {"name": "halt", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
        {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 1.0}]},
    )
    workload = make_workload("mlp")
    opt = torch.optim.SGD(workload.model.parameters(), lr=0.01)
    with GradGuard(workload.model, policy, logger=None):
        workload.backward(0)
        workload.model.out.weight.grad.fill_(1e20)
        syncs = count_host_syncs(opt.step)
    assert syncs == 2
