"""halt_on_nonfinite: opt.step() raises GradientHalt before the update, and nothing the optimizer owns has moved.

Every test trains a guarded model next to an unguarded copy that never sees the bad batch: after the
halt, parameters and optimizer state (moments, step counts) must equal the copy's, bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.utils import clip_grad_norm_

from gradguard import GradGuard, GradientHalt

OPTIMIZERS = ("sgd", "adamw", "adamw_foreach", "adamw_fused")

RULES = (
    {"name": "no-nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
    {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 1.0}]},
)


def _kind(grads) -> str:
    """What the guard must report: per tensor 'nan' if it holds a NaN, else 'inf'; joined over tensors."""
    kinds = {"nan" if bool(torch.isnan(g).any()) else "inf" for g in grads}
    return "+".join(kind for kind in ("nan", "inf") if kind in kinds)  # documented: nan, inf or nan+inf


class _Pair:
    """A guarded workload and an unguarded twin that applies the same clip by hand and skips bad batches."""

    def __init__(self, make_workload, make_optimizer, make_policy, name, opt_name, tmp_path, **guard_kwargs):
        self.guarded = make_workload(name)
        self.reference = self.guarded.clone()
        self.opt = make_optimizer(opt_name, self.guarded.model.parameters())
        self.ref_opt = make_optimizer(opt_name, self.reference.model.parameters())
        self.log = tmp_path / "audit.jsonl"
        self.guard = GradGuard(self.guarded.model, make_policy(*RULES), audit_log=self.log, logger=None, **guard_kwargs)

    def good_step(self, step: int) -> None:
        for side, opt in ((self.guarded, self.opt), (self.reference, self.ref_opt)):
            opt.zero_grad()
            side.backward(step)
        for p in self.reference.model.parameters():
            clip_grad_norm_([p], 1.0)
        self.opt.step()
        self.ref_opt.step()

    def assert_in_step(self, same) -> None:
        same(dict(self.guarded.model.state_dict()), dict(self.reference.model.state_dict()))
        same(self.opt.state_dict(), self.ref_opt.state_dict())


@pytest.fixture
def pair(make_workload, make_optimizer, make_policy, tmp_path):
    made = []

    def make(name="mlp", opt_name="adamw", **guard_kwargs):
        made.append(_Pair(make_workload, make_optimizer, make_policy, name, opt_name, tmp_path, **guard_kwargs))
        return made[-1]

    yield make
    for one in made:
        one.guard.remove()


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_nonfinite_input_halts_before_the_step_leaving_parameters_and_state_as_after_the_last_good_step(
    pair, same, nonfinite_names, read_audit, opt_name, poison
):
    """NaN/Inf input: opt.step() raises GradientHalt; params and optimizer state are as after the last good step."""
    run = pair("mlp", opt_name)
    for step in range(3):
        run.good_step(step)
    params_before = copy.deepcopy(run.guarded.model.state_dict())
    state_before = copy.deepcopy(run.opt.state_dict())

    inputs, targets = run.guarded.batch(3)
    inputs[2, 5] = float(poison)
    run.opt.zero_grad()
    run.guarded.loss((inputs, targets)).backward()
    bad = nonfinite_names(run.guarded.model)
    assert bad  # the poison reached the gradients
    kind = _kind([p.grad for name, p in run.guarded.model.named_parameters() if name in bad])

    with pytest.raises(GradientHalt) as info:
        run.opt.step()
    halt = info.value
    assert isinstance(halt, RuntimeError)
    assert halt.step == 3
    assert halt.params == tuple(bad)
    assert halt.kind == kind
    assert halt.rule == "no-nonfinite"
    same(dict(run.guarded.model.state_dict()), params_before)
    same(run.opt.state_dict(), state_before)
    run.assert_in_step(same)  # and equal to a twin that never saw the bad batch

    run.good_step(4)  # after catching the halt, training goes on
    run.assert_in_step(same)
    assert run.guard.step_count == 5

    halts = [event for event in read_audit(run.log) if event["event"] == "halt"]
    assert len(halts) == 1
    assert halts[0]["params"] == list(bad)
    assert halts[0]["step"] == 3
    assert halts[0]["rule"] == "no-nonfinite"
    assert halts[0]["kind"] == kind
    assert set(halts[0]["kinds"]) == set(bad)


def test_inf_injected_into_one_gradient_halts_with_kind_inf(pair, same):
    """An Inf written into one p.grad halts with kind 'inf', naming that parameter alone."""
    run = pair("mlp", "adamw_foreach")
    run.good_step(0)
    state_before = copy.deepcopy(run.opt.state_dict())
    run.opt.zero_grad()
    run.guarded.backward(1)
    run.guarded.model.hidden.weight.grad[3, 4] = float("-inf")
    with pytest.raises(GradientHalt) as info:
        run.opt.step()
    assert info.value.params == ("hidden.weight",)
    assert info.value.kind == "inf"
    assert info.value.step == 1
    same(run.opt.state_dict(), state_before)
    run.assert_in_step(same)


def test_nan_and_inf_in_different_parameters_halt_with_kind_nan_plus_inf_in_model_order(pair, same, read_audit):
    """NaN in one gradient and Inf in others: kind 'nan+inf', every offender listed in model order with its kind."""
    run = pair("mlp", "adamw")
    run.good_step(0)
    run.opt.zero_grad()
    run.guarded.backward(1)
    model = run.guarded.model
    model.out.bias.grad[0] = float("inf")  # injected in reverse model order
    model.hidden.bias.grad[1] = float("nan")
    model.inp.weight.grad[0, 0] = float("inf")
    with pytest.raises(GradientHalt) as info:
        run.opt.step()
    assert info.value.params == ("inp.weight", "hidden.bias", "out.bias")
    assert info.value.kind == "nan+inf"
    run.assert_in_step(same)
    halt = next(event for event in read_audit(run.log) if event["event"] == "halt")
    assert halt["kinds"] == {"inp.weight": "inf", "hidden.bias": "nan", "out.bias": "inf"}
    assert halt["params"] == ["inp.weight", "hidden.bias", "out.bias"]


def test_halt_on_the_first_step_leaves_the_optimizer_without_state(pair, same):
    """A halt before any good step leaves AdamW with no state at all and the weights as initialised."""
    run = pair("mlp", "adamw")
    initial = copy.deepcopy(run.guarded.model.state_dict())
    run.guarded.backward(0)
    run.guarded.model.out.weight.grad.fill_(float("nan"))
    with pytest.raises(GradientHalt) as info:
        run.opt.step()
    assert info.value.step == 0
    assert run.opt.state_dict()["state"] == {}
    same(dict(run.guarded.model.state_dict()), initial)


def test_tied_parameter_is_reported_once_under_its_first_name(pair, same):
    """On a decoder whose head is tied to the embedding, a NaN in the shared gradient names it once."""
    run = pair("decoder", "adamw")
    run.good_step(0)
    run.opt.zero_grad()
    run.guarded.backward(1)
    run.guarded.model.head.weight.grad[0, 0] = float("nan")  # the same tensor as embed.weight
    with pytest.raises(GradientHalt) as info:
        run.opt.step()
    assert info.value.params == ("embed.weight",)
    assert info.value.kind == "nan"
    run.assert_in_step(same)


def test_halt_from_manual_guard_step(make_workload, make_policy):
    """guard.step() in a loop without a torch optimizer raises the same GradientHalt."""
    workload = make_workload("mlp")
    with GradGuard(workload.model, make_policy(*RULES), logger=None) as guard:
        workload.backward(0)
        workload.model.inp.bias.grad[0] = float("nan")
        with pytest.raises(GradientHalt) as info:
            guard.step()
    assert info.value.params == ("inp.bias",)
    assert info.value.rule == "no-nonfinite"


def test_finite_but_large_gradient_does_not_halt(make_workload, make_policy):
    """A gradient whose elements are all finite does not halt, even when its float32 2-norm overflows."""
    workload = make_workload("mlp")
    opt = torch.optim.SGD(workload.model.parameters(), lr=0.1)
    with GradGuard(workload.model, make_policy(*RULES), logger=None) as guard:
        workload.backward(0)
        workload.model.out.weight.grad.fill_(1e20)  # finite (float32 max is 3.4e38); its 2-norm is inf
        assert torch.isinf(torch.linalg.vector_norm(workload.model.out.weight.grad))
        opt.step()
        counts = guard.counters.snapshot().get("no-nonfinite", {})
        assert not {"nan", "inf", "halt_on_nonfinite"} & set(counts)
        assert guard.step_count == 1
