"""Several optimizers under one GradScaler, and rebinding a parameter that reused a freed one's id.

Each optimizer's step treats the gradients it is about to apply, which its own ``scaler.step()`` has
just unscaled; the others' are still scaled then, so they are neither clipped nor halted on there.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from support.training import SmallMLP, make_policy
from torch import nn

from gradguard import GradGuard, GradientHalt

# 1 -------------------------------------------------------------------------------------------------


def test_the_rebind_event_names_a_replaced_parameter_that_got_the_old_ones_id(tmp_path: Path) -> None:
    """A new Parameter that got the freed one's id is re-bound, and the rebind event names it."""
    torch.manual_seed(7)
    model = nn.Linear(4, 2)
    log = tmp_path / "audit.jsonl"
    policy = make_policy({"match": "weight", "actions": [{"action": "scale", "factor": 0.0}]})
    with GradGuard(model, policy, logger=None, audit_log=log):
        old_id = id(model.weight)
        new_value = torch.randn(2, 4)
        del model.weight
        model.weight = nn.Parameter(new_value)
        if id(model.weight) != old_id:
            pytest.skip("the allocator did not reuse the id this time")
        model(torch.randn(3, 4)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=1.0).step()
    rebinds = [json.loads(line) for line in log.read_text().splitlines() if '"rebind"' in line]
    assert [event["replaced"] for event in rebinds] == [["weight"]]


# 2 -------------------------------------------------------------------------------------------------


def amp_backward(model: SmallMLP, scaler: torch.amp.GradScaler, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 8, generator=gen) * 3, torch.randn(16, 4, generator=gen)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    scaler.scale(nn.functional.mse_loss(out.float(), y) * 10).backward()


def two_optimizers(model: SmallMLP, fused: bool) -> list[torch.optim.Optimizer]:
    if fused:
        return [
            torch.optim.AdamW(model.inp.parameters(), lr=1e-2, fused=True),
            torch.optim.AdamW(model.out.parameters(), lr=1e-2, fused=True),
        ]
    return [torch.optim.SGD(model.inp.parameters(), lr=0.05), torch.optim.SGD(model.out.parameters(), lr=0.05)]


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_two_optimizers_under_one_gradscaler_get_the_policy_on_unscaled_gradients(fused: bool) -> None:
    """One GradScaler, two optimizers (torch's recipe): each share is clipped on its unscaled gradient, as by hand."""
    torch.manual_seed(0)
    model = SmallMLP(hidden=False)
    ref = copy.deepcopy(model)
    opts_g, opts_r = two_optimizers(model, fused), two_optimizers(ref, fused)
    scaler_g = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    scaler_r = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    policy = make_policy({"match": "*", "actions": [{"action": "clip_norm", "max_norm": 1.0}]})
    with GradGuard(model, policy, logger=None, scaler=scaler_g):
        for step in range(30):
            for m, opts, scaler in ((model, opts_g, scaler_g), (ref, opts_r, scaler_r)):
                for opt in opts:
                    opt.zero_grad()
                amp_backward(m, scaler, step)
            for opt in opts_r:
                scaler_r.unscale_(opt)
            for p in ref.parameters():
                if bool(torch.isfinite(p.grad).all()):
                    torch.nn.utils.clip_grad_norm_([p], 1.0)
            for opt in opts_r:
                scaler_r.step(opt)
            for opt in opts_g:
                scaler_g.step(opt)
            scaler_r.update()
            scaler_g.update()
            for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert torch.equal(p, q), f"step {step}: {name} differs"


def test_an_overflow_in_the_second_optimizers_scaled_gradients_is_not_a_halt() -> None:
    """opt_b's overflowed scaled gradients are the scaler's business: no halt at opt_a's step."""
    torch.manual_seed(0)
    model = SmallMLP(hidden=False)
    opts = two_optimizers(model, fused=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    policy = make_policy({"match": "*", "actions": [{"action": "halt_on_nonfinite"}]})
    with GradGuard(model, policy, logger=None, scaler=scaler):
        for step in range(30):
            for opt in opts:
                opt.zero_grad()
            amp_backward(model, scaler, step)
            try:
                for opt in opts:
                    scaler.step(opt)
            except GradientHalt as exc:
                pytest.fail(f"training step {step}: {exc}")
            scaler.update()


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_a_step_the_scaler_skipped_counts_once_however_many_optimizers_it_skipped(fused: bool) -> None:
    """A training step the scaler skipped counts one skip and one step, however many optimizers it skipped."""
    torch.manual_seed(0)
    model = SmallMLP(hidden=False)
    opts = two_optimizers(model, fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    policy = make_policy({"match": "*", "actions": [{"action": "clip_norm", "max_norm": 1e6}]})
    skipped = 0
    with GradGuard(model, policy, logger=None, scaler=scaler) as guard:
        for step in range(30):
            for opt in opts:
                opt.zero_grad()
            amp_backward(model, scaler, step)
            before = scaler.get_scale()
            for opt in opts:
                scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before
        assert skipped >= 20
        assert guard.counters.snapshot()["grad_scaler"] == {"skip": skipped}
        assert guard.step_count == 30


def test_a_param_group_added_to_the_optimizer_is_treated_from_its_next_step() -> None:
    """The optimizer's plan is kept between steps (the last one asked, in a slot) and taken again when its tensors
    change: after ``add_param_group``, the new group's gradients are clipped as torch's ``clip_grad_norm_([p])``
    clips them, from the next step on; before it, they are left alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.0)  # lr 0: the gradients alone are compared
    policy = make_policy({"match": "*", "actions": [{"action": "clip_norm", "max_norm": 1e-3}]})
    with GradGuard(model, policy, logger=None) as guard:
        for step in range(4):
            if step == 2:
                opt.add_param_group({"params": list(model[2].parameters())})
            opt.zero_grad()
            model.zero_grad()
            model(torch.randn(16, 4, generator=torch.Generator().manual_seed(step))).pow(2).sum().backward()
            raw = {name: p.grad.clone() for name, p in model.named_parameters()}
            opt.step()
            for name, p in model.named_parameters():
                stepped = name.startswith("0.") or step >= 2
                expected = nn.Parameter(torch.zeros_like(raw[name]))
                expected.grad = raw[name].clone()
                if stepped:
                    torch.nn.utils.clip_grad_norm_([expected], 1e-3)
                assert torch.equal(p.grad, expected.grad), (step, name)
        assert guard.counters.snapshot()["r0"]["clip_norm"] == 2 * 2 + 4 * 2
