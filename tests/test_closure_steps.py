"""``optimizer.step(closure)`` and the explicit boundary ``guard.step()``: treated like backward(); step()."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils import clip_grad_norm_

from gradguard import GradGuard, GradientHalt, UnsupportedOptimizerError


def _closure_for(workload, opt, step, calls=None):
    def closure():
        if calls is not None:
            calls.append(step)
        opt.zero_grad(set_to_none=True)
        return workload.backward(step)

    return closure


@pytest.mark.parametrize("optimizer", ["sgd_plain", "sgd", "adamw", "adamw_foreach"])
@pytest.mark.parametrize("scope", ["group", "tensor"])
def test_step_with_a_closure_clips_the_gradients_the_closure_produced(
    make_workload, make_optimizer, make_policy, same, optimizer, scope
):
    """opt.step(closure) is clipped exactly as torch clips the closure's gradients, bit for bit, every step."""
    policy = make_policy({"match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.001, "scope": scope}]})
    guarded = make_workload("mlp")
    ref = guarded.clone()
    opt_g = make_optimizer(optimizer, guarded.model.parameters())
    opt_r = make_optimizer(optimizer, ref.model.parameters())
    with GradGuard(guarded.model, policy, logger=None) as guard:
        for step in range(3):

            def reference_closure(step=step):
                opt_r.zero_grad(set_to_none=True)
                loss = ref.backward(step)
                if scope == "group":
                    clip_grad_norm_(ref.model.parameters(), 0.001)
                else:
                    for p in ref.model.parameters():
                        clip_grad_norm_([p], 0.001)
                return loss

            calls: list[int] = []
            loss_g = opt_g.step(_closure_for(guarded, opt_g, step, calls))
            loss_r = opt_r.step(reference_closure)
            assert calls == [step], "the closure runs exactly once per step"
            same(loss_g, loss_r)
            same(dict(guarded.model.named_parameters()), dict(ref.model.named_parameters()))
            same(opt_g.state_dict(), opt_r.state_dict())
        assert guard.step_count == 3
        # clip_norm counts the tensors it rescaled, for a group clip as for per-tensor clips
        assert guard.counters.snapshot()["r0"]["clip_norm"] == 3 * len(list(guarded.model.parameters()))


def test_closure_passed_positionally_is_treated_too(make_workload, make_policy, same):
    """opt.step(closure) and opt.step(closure=closure) are the same to the guard, and both are the step of the
    gradients halved by hand (the policy's scale of 0.5, exact in floating point) with no guard."""
    policy = make_policy({"match": "*", "actions": [{"action": "scale", "factor": 0.5}]})
    a = make_workload("mlp")
    b = a.clone()
    ref = a.clone()
    opt_a = torch.optim.SGD(a.model.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.model.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(ref.model.parameters(), lr=0.1)
    with GradGuard(a.model, policy, logger=None):
        opt_a.step(_closure_for(a, opt_a, 0))
    with GradGuard(b.model, policy, logger=None):
        opt_b.step(closure=_closure_for(b, opt_b, 0))
    opt_r.zero_grad(set_to_none=True)
    ref.backward(0)
    for param in ref.model.parameters():
        assert param.grad is not None
        param.grad.mul_(0.5)
    opt_r.step()
    same(dict(a.model.named_parameters()), dict(b.model.named_parameters()))
    same(dict(a.model.named_parameters()), dict(ref.model.named_parameters()))


def test_nan_made_inside_a_closure_halts_before_the_update(make_workload, make_policy, same):
    """A NaN the closure's backward produces halts inside step(): weights and AdamW state stay as they were."""
    policy = make_policy({"match": "*", "actions": [{"action": "halt_on_nonfinite"}]})
    work = make_workload("mlp")
    opt = torch.optim.AdamW(work.model.parameters(), lr=1e-2)
    with GradGuard(work.model, policy, logger=None) as guard:
        opt.step(_closure_for(work, opt, 0))
        before = {k: v.detach().clone() for k, v in work.model.state_dict().items()}
        state_before = {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()}

        def poisoned():
            opt.zero_grad(set_to_none=True)
            loss = work.backward(1)
            work.model.hidden.weight.grad[0, 0] = float("nan")
            return loss

        with pytest.raises(GradientHalt) as excinfo:
            opt.step(poisoned)
        assert excinfo.value.params == ("hidden.weight",)
        assert excinfo.value.step == 1
        same(dict(work.model.state_dict()), before)
        same(opt.state_dict()["state"], state_before)
        assert guard.step_count == 2


def test_skip_inside_a_closure_leaves_parameters_and_optimizer_state_untouched(make_workload, make_policy, same):
    """A skip rule firing on the closure's gradients skips the whole step; the next good step proceeds."""
    policy = make_policy({"match": "*", "actions": [{"action": "skip_step_on_nonfinite"}]})
    work = make_workload("mlp")
    opt = torch.optim.AdamW(work.model.parameters(), lr=1e-2)
    with GradGuard(work.model, policy, logger=None) as guard:
        opt.step(_closure_for(work, opt, 0))
        before = {k: v.detach().clone() for k, v in work.model.state_dict().items()}
        steps_before = [s["step"].clone() for s in opt.state.values()]

        def poisoned():
            opt.zero_grad(set_to_none=True)
            loss = work.backward(1)
            work.model.out.bias.grad[0] = float("inf")
            return loss

        opt.step(poisoned)
        assert guard.last_step_skipped
        same(dict(work.model.state_dict()), before)
        same([s["step"] for s in opt.state.values()], steps_before)
        opt.step(_closure_for(work, opt, 2))
        assert not guard.last_step_skipped
        assert guard.counters.snapshot()["r0"] == {"inf": 1, "skip_step_on_nonfinite": 1}


def test_lbfgs_that_evaluates_its_closure_several_times_is_refused(make_workload, make_policy):
    """LBFGS(max_iter=20) is refused at attach with optimizer=, and at its first step without it."""
    policy = make_policy({"match": "*", "actions": [{"action": "clip_norm", "max_norm": 1.0}]})
    work = make_workload("mlp")
    opt = torch.optim.LBFGS(work.model.parameters(), lr=0.1)
    with pytest.raises(UnsupportedOptimizerError, match=r"LBFGS\(max_iter=20.*max_iter=1"):
        GradGuard(work.model, policy, optimizer=opt, logger=None)
    before = {k: v.detach().clone() for k, v in work.model.state_dict().items()}
    calls: list[int] = []
    with GradGuard(work.model, policy, logger=None), pytest.raises(UnsupportedOptimizerError, match="LBFGS"):
        opt.step(_closure_for(work, opt, 0, calls))
    assert calls == [], "refused before the closure ran"
    for name, value in work.model.state_dict().items():
        assert torch.equal(value, before[name])


def test_lbfgs_with_one_evaluation_per_step_is_treated_like_any_step(make_workload, make_policy, same):
    """LBFGS(max_iter=1) evaluates once per step: the guard clips that gradient, as torch's clip would."""
    policy = make_policy({"match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.01, "scope": "group"}]})
    guarded = make_workload("mlp")
    ref = guarded.clone()
    opt_g = torch.optim.LBFGS(guarded.model.parameters(), lr=0.1, max_iter=1)
    opt_r = torch.optim.LBFGS(ref.model.parameters(), lr=0.1, max_iter=1)
    with GradGuard(guarded.model, policy, optimizer=opt_g, logger=None) as guard:
        for step in range(3):

            def reference_closure(step=step):
                opt_r.zero_grad(set_to_none=True)
                loss = ref.backward(step)
                clip_grad_norm_(ref.model.parameters(), 0.01)
                return loss

            opt_g.step(_closure_for(guarded, opt_g, step))
            opt_r.step(reference_closure)
            same(dict(guarded.model.named_parameters()), dict(ref.model.named_parameters()))
        assert guard.step_count == 3


def test_an_optimizer_calling_its_closure_twice_is_stopped_at_the_second_call(make_workload, make_policy):
    """An unknown optimizer that re-evaluates the closure within one step gets UnsupportedOptimizerError."""

    class TwiceSGD(torch.optim.SGD):
        def step(self, closure=None):  # type: ignore[override]
            closure()
            super().step()
            return closure()

    policy = make_policy({"match": "*", "actions": [{"action": "clip_norm", "max_norm": 1.0}]})
    work = make_workload("mlp")
    opt = TwiceSGD(work.model.parameters(), lr=0.1)
    with GradGuard(work.model, policy, logger=None), pytest.raises(UnsupportedOptimizerError, match="TwiceSGD"):
        opt.step(_closure_for(work, opt, 0))


def test_per_micro_batch_hooks_inside_a_closure_are_reported_in_their_own_step(make_workload, make_policy, tmp_path):
    """per_micro_batch=True with step(closure): each step's hook clips are logged with that step's number."""
    import json

    policy = make_policy({"match": "*", "actions": [{"action": "clip_norm", "max_norm": 1e-4}]})
    work = make_workload("mlp")
    opt = torch.optim.SGD(work.model.parameters(), lr=0.1)
    log = tmp_path / "log.jsonl"
    with GradGuard(work.model, policy, audit_log=log, per_micro_batch=True) as guard:
        for step in range(3):
            opt.step(_closure_for(work, opt, step))
        assert guard.step_count == 3
    events = [json.loads(line) for line in log.read_text().splitlines()]
    clips = [e["step"] for e in events if e.get("event") == "intervention"]
    per_step = len(list(work.model.parameters()))
    assert clips == [0] * per_step + [1] * per_step + [2] * per_step


def test_guard_step_before_a_global_clip_names_the_parameter_that_went_bad(make_workload, make_policy):
    """guard.step() placed before clip_grad_norm_ halts on the one NaN gradient, before torch spreads it."""
    policy = make_policy({"match": "*", "actions": [{"action": "halt_on_nonfinite"}]})
    work = make_workload("mlp")
    opt = torch.optim.SGD(work.model.parameters(), lr=0.1)
    with GradGuard(work.model, policy, logger=None) as guard:
        opt.zero_grad()
        work.backward(0)
        work.model.inp.bias.grad[1] = float("nan")
        with pytest.raises(GradientHalt) as excinfo:
            guard.step(opt)
        assert excinfo.value.params == ("inp.bias",)
        # The global clip, imported by name before the guard attached, runs the guard's step first too (#58 item 5):
        # it halts on the same one gradient rather than spreading it to every gradient.
        with pytest.raises(GradientHalt) as again:
            clip_grad_norm_(work.model.parameters(), 1.0)
        assert again.value.params == ("inp.bias",)


def test_gradients_treated_by_guard_step_are_not_treated_again_after_a_global_clip(make_workload, make_policy, same):
    """guard.step(opt); clip_grad_norm_(...); opt.step(): the policy acts once, then torch's clip, exactly."""
    policy = make_policy({"match": "*", "actions": [{"action": "scale", "factor": 0.5}]})
    guarded = make_workload("mlp")
    ref = guarded.clone()
    opt_g = torch.optim.AdamW(guarded.model.parameters(), lr=1e-2)
    opt_r = torch.optim.AdamW(ref.model.parameters(), lr=1e-2)
    with GradGuard(guarded.model, policy, logger=None) as guard:
        for step in range(3):
            for opt, side in ((opt_g, guarded), (opt_r, ref)):
                opt.zero_grad(set_to_none=(step != 1))  # step 1 keeps the gradient tensors: held marks expire
                side.backward(step)
            assert guard.step(opt_g)
            clip_grad_norm_(guarded.model.parameters(), 0.1)
            opt_g.step()
            for p in ref.model.parameters():
                p.grad.mul_(0.5)
            clip_grad_norm_(ref.model.parameters(), 0.1)
            opt_r.step()
            same(dict(guarded.model.named_parameters()), dict(ref.model.named_parameters()))
        assert guard.step_count == 3
        assert guard.counters.snapshot()["r0"]["scale"] == 3 * len(list(guarded.model.parameters()))


def test_state_dict_carries_the_step_and_skip_history_into_a_new_guard(make_workload, make_policy):
    """A guard loaded from another's state_dict continues its step count and its skip limits."""
    policy = make_policy({"match": "*", "actions": [{"action": "skip_step_on_nonfinite", "max_consecutive_skips": 1}]})
    work = make_workload("mlp")
    opt = torch.optim.SGD(work.model.parameters(), lr=0.1)

    def poisoned_step(step):
        opt.zero_grad()
        work.backward(step)
        work.model.out.bias.grad[0] = float("nan")
        opt.step()

    with GradGuard(work.model, policy, logger=None) as first:
        poisoned_step(0)
        assert first.last_step_skipped
        state = first.state_dict()
    assert state == {
        "format": 1,
        "step": 1,
        "skips": {"r0": {"consecutive": 1, "recent": [0]}},
        "scaler_skips": 0,
        "statistics": {},
        "health": [],
        "recovery": {"rewinds": 0, "skip_until": None, "lr_scale": 1.0, "applied": 0},
    }
    with GradGuard(work.model, policy, logger=None) as second:
        second.load_state_dict(state)
        assert second.step_count == 1
        with pytest.raises(GradientHalt, match="2 consecutive skipped steps") as excinfo:
            poisoned_step(1)
        assert excinfo.value.step == 1


def _inject_once(work, policy, accumulate, bad_step, bad_name, value):
    """Train 4 closure steps with ``value`` written into ``bad_name``'s gradient at ``bad_step``; check the halt."""
    opt = torch.optim.AdamW(work.model.parameters(), lr=1e-2)
    params = dict(work.model.named_parameters())

    def closure_at(step):
        def closure():
            opt.zero_grad(set_to_none=True)
            for micro in range(accumulate):
                loss = work.backward(10 * step + micro)
            if step == bad_step:
                params[bad_name].grad.view(-1)[0] = value
            return loss

        return closure

    with GradGuard(work.model, policy, logger=None):
        for step in range(bad_step):
            opt.step(closure_at(step))
        before = {k: v.detach().clone() for k, v in params.items()}
        moments = {k: [t.clone() for t in s.values()] for k, s in opt.state.items()}
        with pytest.raises(GradientHalt) as excinfo:
            opt.step(closure_at(bad_step))
    assert excinfo.value.params == (bad_name,)
    assert excinfo.value.step == bad_step
    for name, p in params.items():
        assert torch.equal(p, before[name]), name
        assert torch.isfinite(p).all(), name
    for key, saved in moments.items():
        for now, old in zip(opt.state[key].values(), saved, strict=True):
            assert torch.equal(now, old)


@pytest.mark.parametrize("accumulate", [1, 3])
def test_random_nan_and_inf_injected_in_closure_loops_never_reach_the_weights(make_workload, make_policy, accumulate):
    """30 random injections (step, parameter, NaN or +-Inf) per mode in AdamW closure loops: each halts, untouched."""
    import random

    rng = random.Random(1234 + accumulate)
    policy = make_policy({"match": "*", "actions": [{"action": "halt_on_nonfinite"}]})
    for case in range(30):
        work = make_workload("mlp", seed=case)
        names = [name for name, _ in work.model.named_parameters()]
        value = rng.choice([float("nan"), float("inf"), float("-inf")])
        _inject_once(work, policy, accumulate, rng.randrange(4), rng.choice(names), value)
