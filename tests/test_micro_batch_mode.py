"""The opt-in per-micro-batch mode: each backward's contribution treated before it is accumulated."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from gradguard import GradGuard, GradientHalt, Policy

POLICY = Policy.from_dict(
    {
        "version": 1,
        "rules": [
            {"name": "halt", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
            {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.1}]},
        ],
    }
)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def micro_batches(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return [torch.randn(5, 4, generator=generator) * 3 for _ in range(3)]


def test_each_micro_batch_is_clipped_before_accumulation_exactly_as_by_hand(tmp_path: Path) -> None:
    """Three backward passes per step: the update equals clip_grad_norm_ on each contribution, then the sum."""
    model, ref = make_model(), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    log = tmp_path / "micro.jsonl"
    with GradGuard(model, POLICY, per_micro_batch=True, audit_log=log, logger=None) as guard:
        for step in range(3):
            opt.zero_grad()
            for x in micro_batches(step):
                model(x).pow(2).sum().backward()
            opt.step()
            total = {name: torch.zeros_like(p) for name, p in ref.named_parameters()}
            for x in micro_batches(step):
                ref.zero_grad()
                ref(x).pow(2).sum().backward()
                for name, p in ref.named_parameters():
                    torch.nn.utils.clip_grad_norm_([p], 0.1)
                    total[name] += p.grad
            for name, p in ref.named_parameters():
                p.grad = total[name]
            opt_r.step()
            for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert torch.equal(a, b), f"step {step}: {name}"
        counts = guard.counters.snapshot()
        guard.flush()
    events = [json.loads(line) for line in log.read_text().splitlines()]
    clips = [e for e in events if e["event"] == "intervention"]
    assert clips
    assert all(e["micro_batch"] is True for e in clips)
    assert counts["clip"]["clip_norm"] == len(clips)


def test_autograd_grad_is_left_untouched_in_per_micro_batch_mode() -> None:
    """torch.autograd.grad w.r.t. a parameter returns the raw gradient and counts nothing."""
    model, ref = make_model(), make_model()
    x = micro_batches(0)[0]
    with GradGuard(model, POLICY, per_micro_batch=True, logger=None) as guard:
        (got,) = torch.autograd.grad(model(x).pow(2).sum(), [model[0].weight])
        (want,) = torch.autograd.grad(ref(x).pow(2).sum(), [ref[0].weight])
        assert torch.equal(got, want)
        assert torch.linalg.vector_norm(got) > 0.1  # it would have been clipped
        model(x).pow(2).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.0).step()
        assert guard.counters.snapshot()["clip"]["clip_norm"] == 4  # the backward only, not the autograd.grad


def test_a_nan_in_one_micro_batch_still_halts_at_the_step() -> None:
    """Halts stay at the step boundary, on the accumulated gradient: a NaN micro-batch halts before the update."""
    model = make_model()
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradGuard(model, POLICY, per_micro_batch=True, logger=None):
        batches = micro_batches(0)
        batches[1][0, 0] = float("nan")
        for x in batches:
            model(x).pow(2).sum().backward()
        with pytest.raises(GradientHalt):
            opt.step()
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])


@pytest.mark.parametrize("watch", ["halt_on_nonfinite", "skip_step_on_nonfinite"])
def test_an_inf_a_micro_batch_s_value_clip_made_finite_is_still_halted_or_skipped_at_the_step(watch: str) -> None:
    """A ``clip_value`` in the hooks clamps an Inf to the limit before it accumulates, so the step's own watch sees a
    finite gradient: the peak the hook read before its clamp must reach the rule that watches the tensor."""
    policy = Policy.from_dict(
        {
            "version": 1,
            "rules": [
                {"name": "nonfinite", "match": "*", "actions": [{"action": watch}]},
                {"name": "value", "match": "*", "actions": [{"action": "clip_value", "limit": 0.05}]},
            ],
        }
    )
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradGuard(model, policy, per_micro_batch=True, logger=None) as guard:
        batches = micro_batches(0)
        batches[1][0, 0] = float("inf")  # the weight's gradient is the input's sum: an Inf there, no NaN anywhere
        for x in batches:
            model(x).sum().backward()
        assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
        if watch == "halt_on_nonfinite":
            with pytest.raises(GradientHalt) as caught:
                opt.step()
            assert caught.value.kind == "inf"
            assert caught.value.rule == "nonfinite"
            assert caught.value.params == ("weight",)
        else:
            opt.step()
            assert guard.last_step_skipped
            assert guard.counters.snapshot()["nonfinite"]["skip_step_on_nonfinite"] == 1
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])
