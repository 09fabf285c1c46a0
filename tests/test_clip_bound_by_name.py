"""A clip imported by name before the guard attached runs the guard's step first too (issue 58, item 5).

``from torch.nn.utils import clip_grad_norm_`` at the top of a script binds torch's own function before any guard
swaps the module attribute; that function reaches its work through ``torch.nn.utils.clip_grad``'s
``_get_total_norm`` and ``_clip_grads_with_norm_``, looked up at call time, which the guard wraps. The names below are
bound when this module is imported, before any test attaches a guard; the references are torch doing the same things
by hand on an unguarded twin. (A per-tensor rule then such a clip, bitwise torch doing both:
``tests/test_clip_interception.py``.)
"""

from __future__ import annotations

import copy
import math
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from support.training import SmallMLP, assert_same, make_policy
from torch.nn.utils import clip_grad_norm_ as from_utils
from torch.nn.utils.clip_grad import clip_grad_norm_ as from_clip_grad

from gradguard import GradGuard, GradientHalt


def torch_s_own(clip: Callable[..., Any]) -> Callable[..., Any]:
    """torch's function, even if a guard from another test was attached when this module was imported."""
    return getattr(clip, "__gradguard_original__", clip)


BOUND_EARLY = {
    "from torch.nn.utils": torch_s_own(from_utils),
    "from torch.nn.utils.clip_grad": torch_s_own(from_clip_grad),
}
HALT_ALL = {"match": ["*"], "actions": [{"action": "halt_on_nonfinite"}]}


@pytest.mark.parametrize("spelling", BOUND_EARLY)
def test_a_nan_halts_at_a_clip_imported_by_name_naming_the_one_parameter_it_came_from(spelling: str) -> None:
    clip = BOUND_EARLY[spelling]
    torch.manual_seed(0)
    model = SmallMLP()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with GradGuard(model, make_policy(HALT_ALL), logger=None):
        model(torch.randn(4, 8)).pow(2).sum().backward()
        model.hidden.weight.grad[0, 0] = math.nan
        with pytest.raises(GradientHalt) as caught:
            clip(model.parameters(), 1.0)  # raises before the clip spreads the NaN, and before the optimizer's step
    assert caught.value.params == ("hidden.weight",)
    assert not (caught.value.origin or {}).get("spread")
    assert_same({name: p.detach() for name, p in model.named_parameters()}, before, "the weights after the halt")


@pytest.mark.parametrize("spelling", BOUND_EARLY)
def test_a_skip_at_a_clip_imported_by_name_returns_zero_and_the_step_changes_nothing(spelling: str) -> None:
    clip = BOUND_EARLY[spelling]
    torch.manual_seed(0)
    model = SmallMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    skip = make_policy({"match": ["*"], "actions": [{"action": "skip_step_on_nonfinite"}]})
    with GradGuard(model, skip, logger=None) as guard:
        model(torch.randn(4, 8)).pow(2).sum().backward()
        model.hidden.weight.grad[0, 0] = math.nan
        norm = clip(model.parameters(), 1.0)  # torch listed the NaN gradient before the guard's step dropped it
        opt.step()
        assert guard.last_step_skipped
    assert norm.item() == 0.0  # as the intercepted clip: no gradient is left to clip
    assert_same({name: p.detach() for name, p in model.named_parameters()}, before, "the weights after the skip")
    assert opt.state_dict()["state"] == {}


@pytest.mark.parametrize("spelling", BOUND_EARLY)
def test_a_gradient_dropped_at_a_clip_imported_by_name_is_left_out_of_its_norm(spelling: str) -> None:
    clip = BOUND_EARLY[spelling]
    torch.manual_seed(0)
    guarded = SmallMLP()
    reference = copy.deepcopy(guarded)
    drop = make_policy({"match": ["out.weight"], "actions": [{"action": "drop"}]})
    x = torch.randn(16, 8)
    with GradGuard(guarded, drop, logger=None):
        guarded(x).pow(2).sum().backward()
        norm_g = clip(guarded.parameters(), 0.1)
    reference(x).pow(2).sum().backward()
    reference.out.weight.grad = None
    norm_r = torch_s_own(torch.nn.utils.clip_grad_norm_)(reference.parameters(), 0.1)
    assert torch.equal(norm_g, norm_r)
    assert_same(
        {n: p.grad for n, p in guarded.named_parameters()}, {n: p.grad for n, p in reference.named_parameters()}
    )


def test_the_functions_torch_s_clip_calls_inside_are_wrapped_while_a_guard_is_attached_and_restored_after() -> None:
    from torch.nn.utils import clip_grad

    inner = clip_grad._get_total_norm, clip_grad._clip_grads_with_norm_
    with GradGuard(SmallMLP(), make_policy(HALT_ALL), logger=None):
        assert clip_grad._get_total_norm.__gradguard_original__ is inner[0]  # type: ignore[attr-defined]
        assert clip_grad._clip_grads_with_norm_.__gradguard_original__ is inner[1]  # type: ignore[attr-defined]
        assert clip_grad._get_total_norm is torch.nn.utils.get_total_norm  # one wrapper for both names
    assert (clip_grad._get_total_norm, clip_grad._clip_grads_with_norm_) == inner


# A script that imported torch's clips by name at its top, before any guard attached (``__main__`` is a module too).
USER_LOOP = """
from torch.nn.utils import clip_grad_value_, clip_grads_with_norm_, get_total_norm


def value_clipped_step(model, opt):
    clip_grad_value_(model.parameters(), 0.05)
    opt.step()


def two_call_clipped_step(model, opt):
    total = get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    clip_grads_with_norm_(model.parameters(), 0.1, total)
    opt.step()
"""
BY_NAME = ("clip_grad_value_", "clip_grads_with_norm_", "get_total_norm")


@pytest.fixture
def user_loop() -> Iterator[types.ModuleType]:
    module = types.ModuleType("a_user_training_script")
    exec(compile(USER_LOOP, "a_user_training_script.py", "exec"), vars(module))  # no guard attached yet
    assert not any(hasattr(getattr(module, name), "__gradguard_original__") for name in BY_NAME)
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def test_an_inf_gradient_halts_at_a_value_clip_imported_by_name_before_the_guard_attached(
    user_loop: types.ModuleType,
) -> None:
    # torch's clip_grad_value_ clamps an Inf to the clip value: run before the guard's step, the Inf would be gone
    torch.manual_seed(0)
    model = SmallMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with GradGuard(model, "default", logger=None):
        model(torch.randn(4, 8)).pow(2).sum().backward()
        model.hidden.weight.grad[0, 0] = math.inf
        with pytest.raises(GradientHalt) as caught:
            user_loop.value_clipped_step(model, opt)
    assert caught.value.params == ("hidden.weight",)
    assert caught.value.kind == "inf"
    assert_same({name: p.detach() for name, p in model.named_parameters()}, before, "the weights after the halt")


@pytest.mark.parametrize("loop_step", ["value_clipped_step", "two_call_clipped_step"])
def test_a_healthy_run_with_clips_imported_by_name_is_bitwise_an_unguarded_one(
    user_loop: types.ModuleType, loop_step: str
) -> None:
    step = getattr(user_loop, loop_step)
    torch.manual_seed(0)
    guarded = SmallMLP()
    reference = copy.deepcopy(guarded)
    pairs = [(model, torch.optim.AdamW(model.parameters(), lr=1e-2)) for model in (guarded, reference)]
    batches = [torch.randn(16, 8) for _ in range(6)]
    for (model, opt), attached in zip(pairs, (True, False), strict=True):
        guard = GradGuard(model, "default", logger=None) if attached else None
        for x in batches:
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            step(model, opt)
        if guard is not None:
            assert guard.step_count == len(batches)  # the guard's step ran at each clip, once a step
            guard.remove()
    assert_same(
        {n: p.detach() for n, p in guarded.named_parameters()},
        {n: p.detach() for n, p in reference.named_parameters()},
        "the weights after six steps",
    )


def test_names_bound_by_name_are_the_guard_s_while_one_is_attached_and_torch_s_own_after(
    user_loop: types.ModuleType,
) -> None:
    originals = {name: getattr(user_loop, name) for name in BY_NAME}
    with GradGuard(SmallMLP(), make_policy(HALT_ALL), logger=None):
        for name, original in originals.items():
            assert getattr(user_loop, name).__gradguard_original__ is original
        assert user_loop.clip_grad_value_ is torch.nn.utils.clip_grad_value_  # the very wrapper of the module's name
        assert torch.nn.utils.clip_grad.clip_grad_value_.__gradguard_original__ is originals["clip_grad_value_"]
    assert {name: getattr(user_loop, name) for name in BY_NAME} == originals
