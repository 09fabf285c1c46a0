"""The guard acts before the loop's own clip: torch's clip functions run the guard's step first.

nanoGPT, timm, Lightning, accelerate and HF Trainer call ``torch.nn.utils.clip_grad_norm_`` over every
parameter between backward and ``step()``; one NaN gradient becomes NaN everywhere there. While a guard is
attached, that call runs the guard's step first, on the raw gradients, and the optimizer's step does not
treat them again.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.training import SmallMLP, assert_same, assert_same_training_state, clip_each, make_policy, model_state
from torch import nn

import gradguard.enforce.torch_hooks as torch_hooks
from gradguard import GradGuard, GradientHalt

HALT_ALL = {"match": ["*"], "actions": [{"action": "halt_on_nonfinite"}]}
SKIP_ALL = {"match": ["*"], "actions": [{"action": "skip_step_on_nonfinite"}]}


def poison_at(param: torch.Tensor, steps: set[int], counter: list[int]) -> None:
    """Make ``param``'s gradient NaN (and only its) in the backward of the given iterations."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad * math.nan if counter[0] in steps else grad

    param.register_hook(hook)


def nanogpt_iteration(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    generator: torch.Generator,
    clip: Callable[..., Any] | None = None,
    accumulation: int = 3,
) -> torch.Tensor | None:
    """One iteration of nanoGPT's train.py: micro-batches, ``unscale_``, a global clip, ``scaler.step``."""
    for _ in range(accumulation):
        x = torch.randn(6, 8, generator=generator)
        loss = model(x).pow(2).mean() / accumulation
        scaler.scale(loss).backward()
    norm = None
    if clip is not None:
        scaler.unscale_(opt)
        norm = clip(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return norm


def test_a_nanogpt_loop_halts_naming_the_poisoned_parameter_with_no_options():
    """Accumulation, unscale_, clip_grad_norm_ over every parameter, scaler.step: the halt names hidden.weight."""
    torch.manual_seed(0)
    model = SmallMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # nanoGPT's bfloat16 default: a disabled scaler
    counter = [0]
    poison_at(model.hidden.weight, {7}, counter)
    generator = torch.Generator().manual_seed(1)
    with GradGuard(model, make_policy(HALT_ALL), logger=None) as guard:
        for iteration in range(7):
            counter[0] = iteration
            nanogpt_iteration(model, opt, scaler, generator, torch.nn.utils.clip_grad_norm_)
        before = model_state(model)
        state_before = copy.deepcopy(opt.state_dict())
        counter[0] = 7
        with pytest.raises(GradientHalt) as caught:
            nanogpt_iteration(model, opt, scaler, generator, torch.nn.utils.clip_grad_norm_)
    assert caught.value.step == 7
    assert caught.value.params == ("hidden.weight",)
    assert "clip" not in str(caught.value)
    assert_same(model_state(model), before, "parameters after the halt")
    assert_same(opt.state_dict()["state"], state_before["state"], "optimizer state after the halt")
    assert guard.step_count == 8  # one step per iteration, not one at the clip and one at step()


def test_an_enabled_gradscaler_skips_a_nan_step_itself_and_the_guard_does_not_halt():
    """A NaN under an enabled GradScaler is in unscale_'s found_inf: the scaler's skip, counted, no halt."""
    torch.manual_seed(0)
    model = SmallMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    counter = [0]
    poison_at(model.hidden.weight, {3}, counter)
    generator = torch.Generator().manual_seed(1)
    with GradGuard(model, make_policy(HALT_ALL), logger=None) as guard:
        for iteration in range(6):
            counter[0] = iteration
            if iteration == 3:
                before = model_state(model)
            nanogpt_iteration(model, opt, scaler, generator, torch.nn.utils.clip_grad_norm_)
            if iteration == 3:
                assert_same(model_state(model), before, "parameters after the scaler's skip")
    assert guard.counters.snapshot() == {"grad_scaler": {"skip": 1}}
    assert guard.step_count == 6


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_a_per_tensor_rule_then_the_loops_global_clip_matches_torch_doing_both_bitwise(norm_type):
    """The policy's clip acts on the raw gradients, the loop's clip on the result: torch's two clips in a row."""
    torch.manual_seed(0)
    guarded = SmallMLP()
    reference = copy.deepcopy(guarded)
    opt_g = torch.optim.AdamW(guarded.parameters(), lr=1e-2)
    opt_r = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    policy = make_policy({"match": ["*"], "actions": [{"action": "clip_norm", "max_norm": 0.3}]})
    with GradGuard(guarded, policy, logger=None) as guard:
        for step in range(6):
            x = torch.randn(16, 8)
            guarded(x).pow(2).sum().backward()
            reference(x).pow(2).sum().backward()
            norm_g = torch.nn.utils.clip_grad_norm_(guarded.parameters(), 1.0, norm_type=norm_type)
            clip_each(reference, 0.3)
            norm_r = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0, norm_type=norm_type)
            assert torch.equal(norm_g, norm_r), f"step {step}: the clip returns the norm after the policy"
            opt_g.step()
            opt_r.step()
            opt_g.zero_grad()
            opt_r.zero_grad()
            assert_same_training_state(guarded, reference, opt_g, opt_r, f"step {step}")
    assert guard.counters.snapshot()["r0"]["clip_norm"] > 0
    assert guard.step_count == 6


def test_get_total_norm_and_clip_grads_with_norm_run_the_guards_step_first():
    """The two-call spelling (norm of the gradients, then clip with it) sees the policy's gradients."""
    torch.manual_seed(0)
    guarded = SmallMLP()
    reference = copy.deepcopy(guarded)
    policy = make_policy({"match": ["*"], "actions": [{"action": "clip_norm", "max_norm": 0.3}]})
    with GradGuard(guarded, policy, logger=None):
        x = torch.randn(16, 8)
        guarded(x).pow(2).sum().backward()
        reference(x).pow(2).sum().backward()
        grads = [p.grad for p in guarded.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads)
        torch.nn.utils.clip_grads_with_norm_(guarded.parameters(), 1.0, total)
        clip_each(reference, 0.3)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        grads = {n: p.grad for n, p in guarded.named_parameters()}
        assert_same(grads, {n: p.grad for n, p in reference.named_parameters()})


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("torch.nn.utils.clip_grad", "clip_grad_norm_"),
        ("torch.nn.utils.clip_grad", "clip_grad_value_"),
        ("torch.nn.utils", "clip_grad_value_"),
    ],
)
def test_every_public_spelling_of_the_clips_runs_the_guards_step_first(module, name):
    """torch.nn.utils.clip_grad.* and clip_grad_value_: the halt names the one poisoned gradient."""
    import importlib

    torch.manual_seed(0)
    model = SmallMLP()
    with GradGuard(model, make_policy(HALT_ALL), logger=None):
        clip = getattr(importlib.import_module(module), name)  # looked up at call time, as Lightning does
        model(torch.randn(4, 8)).sum().backward()
        model.out.weight.grad[0, 0] = math.nan
        with pytest.raises(GradientHalt) as caught:
            clip(model.parameters(), 1.0)
    assert caught.value.params == ("out.weight",)


def test_a_skip_decided_at_the_clip_leaves_parameters_and_optimizer_state_bitwise_untouched():
    """skip_step_on_nonfinite at the clip: the clip and step() that follow change nothing."""
    torch.manual_seed(0)
    model = SmallMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    counter = [0]
    poison_at(model.inp.weight, {2}, counter)
    generator = torch.Generator().manual_seed(3)
    with GradGuard(model, make_policy(SKIP_ALL), logger=None) as guard:
        for iteration in range(5):
            counter[0] = iteration
            before, state_before = model_state(model), copy.deepcopy(opt.state_dict())
            norm = nanogpt_iteration(model, opt, scaler, generator, torch.nn.utils.clip_grad_norm_)
            if iteration == 2:
                assert guard.last_step_skipped
                assert norm is not None
                assert norm.item() == 0.0
                assert_same(model_state(model), before, "parameters after the skip")
                assert_same(opt.state_dict(), state_before, "optimizer state after the skip")
    assert guard.counters.snapshot()["r0"] == {"nan": 1, "skip_step_on_nonfinite": 1}


def test_a_nan_batch_without_any_clip_in_the_loop_halts_without_a_word_about_clips():
    """Every gradient is NaN by itself (bad data): the halt never blames a clip."""
    torch.manual_seed(0)
    model = SmallMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradGuard(model, make_policy(HALT_ALL), logger=None, provenance="always"):
        x = torch.randn(4, 8)
        x[0, 0] = math.nan
        model(x).sum().backward()
        with pytest.raises(GradientHalt) as caught:
            opt.step()
    assert "out.bias" not in caught.value.params
    assert len(caught.value.params) == 5
    assert "clip" not in str(caught.value)
    assert caught.value.origin is not None
    assert not caught.value.origin["spread"]


def test_a_nan_batch_with_the_loops_clip_halts_at_the_clip_without_blaming_it():
    """The guard acted before the clip, so a NaN that reached every gradient by itself names no clip."""
    torch.manual_seed(0)
    model = SmallMLP()
    with GradGuard(model, make_policy(HALT_ALL), logger=None, provenance="always"):
        x = torch.randn(4, 8)
        x[0, 0] = math.nan
        model(x).sum().backward()
        with pytest.raises(GradientHalt) as caught:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert "clip" not in str(caught.value)
    assert caught.value.origin is not None
    assert caught.value.origin["phase"] == "forward"


def test_a_clip_the_guard_saw_run_before_its_step_is_named_plainly_in_the_halt():
    """before_clip=False: the clip spreads the NaN first; the halt says that clip ran before the guard's step."""
    torch.manual_seed(0)
    model = SmallMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradGuard(model, make_policy(HALT_ALL), logger=None, provenance="always", before_clip=False):
        model(torch.randn(4, 8)).sum().backward()
        model.out.weight.grad[0, 0] = math.nan
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with pytest.raises(GradientHalt) as caught:
            opt.step()
    assert len(caught.value.params) == 6
    assert caught.value.origin is not None
    assert caught.value.origin["spread"]
    assert "torch.nn.utils.clip_grad_norm_ ran over these gradients before the guard's step" in str(caught.value)


def test_the_clips_are_wrapped_once_at_the_first_attach_and_stay_wrapped_after_the_last_guard_goes():
    """Swapping back could race a thread that looked a clip up: wrapped once, for good; with no guard, as torch's."""
    GradGuard(SmallMLP(), make_policy(HALT_ALL), logger=None).remove()
    wrapped = torch.nn.utils.clip_grad_norm_
    original = wrapped.__gradguard_original__
    assert not hasattr(original, "__gradguard_original__")
    assert torch.nn.utils.clip_grad.clip_grad_norm_ is wrapped
    scale, unscale = torch.amp.GradScaler.scale, torch.amp.GradScaler.unscale_
    models = SmallMLP(), SmallMLP()  # held: a guard holds its model weakly
    first = GradGuard(models[0], make_policy(HALT_ALL), logger=None)
    second = GradGuard(models[1], make_policy(HALT_ALL), logger=None)
    first.remove()
    second.remove()
    assert torch.nn.utils.clip_grad_norm_ is wrapped
    assert (torch.amp.GradScaler.scale, torch.amp.GradScaler.unscale_) == (scale, unscale)
    assert unscale.__wrapped__.__qualname__ == "GradScaler.unscale_"  # wrapped once, not once per attach
    model, x = SmallMLP(), torch.randn(4, 8)
    twin = copy.deepcopy(model)
    for each in (model, twin):
        each(x).sum().backward()
    assert torch.equal(wrapped(model.parameters(), 0.1), original(twin.parameters(), 0.1))
    assert_same({n: p.grad for n, p in model.named_parameters()}, {n: p.grad for n, p in twin.named_parameters()})


def test_a_guard_on_another_model_leaves_a_clip_of_this_one_alone():
    """A clip over an unguarded model's parameters is not a step boundary for a guard on another model."""
    torch.manual_seed(0)
    guarded, other = SmallMLP(), SmallMLP()
    with GradGuard(guarded, make_policy(HALT_ALL), logger=None) as guard:
        other(torch.randn(4, 8)).sum().backward()
        other.out.weight.grad[0, 0] = math.nan
        torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)
        assert guard.step_count == 0


def test_an_optimizer_step_in_another_thread_never_sees_torchs_hook_table_change():
    """Attaching and removing guards does not register into torch's global hook tables after the first."""
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    GradGuard(SmallMLP(), make_policy(HALT_ALL), logger=None).remove()
    tables = (dict(_global_optimizer_pre_hooks), dict(_global_optimizer_post_hooks))
    errors: list[BaseException] = []

    def attach_and_remove() -> None:
        try:
            for _ in range(20):
                GradGuard(SmallMLP(), make_policy(HALT_ALL), logger=None).remove()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=attach_and_remove)
    thread.start()
    thread.join()
    assert not errors
    assert (dict(_global_optimizer_pre_hooks), dict(_global_optimizer_post_hooks)) == tables
    assert torch_hooks._guards == ()
