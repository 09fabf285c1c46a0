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

import pytest
import torch
from support.training import SmallMLP, assert_same, assert_same_training_state, clip_each, make_policy, model_state
from torch.nn.utils import clip_grad_norm_

import gradguard.enforce.hooks.torch_hooks as torch_hooks
from gradguard import GradGuard, GradientHalt

HALT_ALL = {"match": ["*"], "actions": [{"action": "halt_on_nonfinite"}]}
CLIP_GRAD_NORM_BOUND_EARLY = getattr(clip_grad_norm_, "__gradguard_original__", clip_grad_norm_)
"""torch's own function, bound when this module is imported (as a script's ``from torch.nn.utils import ...``)."""
SKIP_ALL = {"match": ["*"], "actions": [{"action": "skip_step_on_nonfinite"}]}


def poison_at(param: torch.Tensor, steps: set[int], counter: list[int]) -> None:
    """Make ``param``'s gradient NaN (and only its) in the backward of the given iterations."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad * math.nan if counter[0] in steps else grad

    param.register_hook(hook)


class NanoGPTLoop:
    """nanoGPT's train.py in miniature: micro-batches, ``unscale_``, a global clip, ``scaler.step``; one
    parameter's gradient poisoned at the given iterations."""

    def __init__(self, poison: set[int], *, scaler: torch.amp.GradScaler, weight_decay: float = 0.01) -> None:
        torch.manual_seed(0)
        self.model = SmallMLP()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=weight_decay)
        self.scaler = scaler
        self.counter = [0]
        poison_at(self.model.hidden.weight, poison, self.counter)
        self.generator = torch.Generator().manual_seed(1)

    def iteration(self, index: int, accumulation: int = 3) -> torch.Tensor:
        """One iteration; returns what the loop's ``clip_grad_norm_`` returned."""
        self.counter[0] = index
        for _ in range(accumulation):
            x = torch.randn(6, 8, generator=self.generator)
            loss = self.model(x).pow(2).mean() / accumulation
            self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.opt)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        return norm


def test_a_nanogpt_loop_halts_naming_the_poisoned_parameter_with_no_options():
    """Accumulation, unscale_, clip_grad_norm_ over every parameter, scaler.step: the halt names hidden.weight."""
    loop = NanoGPTLoop({7}, scaler=torch.amp.GradScaler("cpu", enabled=False))  # nanoGPT's bfloat16: disabled
    model, opt = loop.model, loop.opt
    with GradGuard(model, make_policy(HALT_ALL), logger=None) as guard:
        for iteration in range(7):
            loop.iteration(iteration)
        before = model_state(model)
        state_before = copy.deepcopy(opt.state_dict())
        with pytest.raises(GradientHalt) as caught:
            loop.iteration(7)
    assert caught.value.step == 7
    assert caught.value.params == ("hidden.weight",)
    assert caught.value.origin is not None
    assert (caught.value.origin["phase"], caught.value.origin["module"]) == ("gradient", "hidden")
    assert "clip" not in str(caught.value)
    assert_same(model_state(model), before, "parameters after the halt")
    assert_same(opt.state_dict()["state"], state_before["state"], "optimizer state after the halt")
    assert guard.step_count == 8  # one step per iteration, not one at the clip and one at step()


def test_an_enabled_gradscaler_skips_a_nan_step_itself_and_the_guard_does_not_halt():
    """A NaN under an enabled GradScaler is in unscale_'s found_inf: the scaler's skip, counted, no halt."""
    loop = NanoGPTLoop({3}, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))
    with GradGuard(loop.model, make_policy(HALT_ALL), logger=None) as guard:
        for iteration in range(6):
            before = model_state(loop.model)
            loop.iteration(iteration)
            if iteration == 3:
                assert_same(model_state(loop.model), before, "parameters after the scaler's skip")
    assert guard.counters.snapshot() == {"grad_scaler": {"skip": 1}}
    assert guard.step_count == 6


@pytest.mark.parametrize("bound_by_name", [False, True])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_a_per_tensor_rule_then_the_loops_global_clip_matches_torch_doing_both_bitwise(norm_type, bound_by_name):
    """The policy's clip acts on the raw gradients, the loop's clip on the result: torch's two clips in a row. Also
    for a clip imported by name before the guard attached (``from torch.nn.utils import clip_grad_norm_``)."""
    clip = CLIP_GRAD_NORM_BOUND_EARLY if bound_by_name else torch.nn.utils.clip_grad_norm_
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
            norm_g = clip(guarded.parameters(), 1.0, norm_type=norm_type)
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
        assert_same(
            {n: p.grad for n, p in guarded.named_parameters()}, {n: p.grad for n, p in reference.named_parameters()}
        )


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
    loop = NanoGPTLoop({2}, scaler=torch.amp.GradScaler("cpu", enabled=False), weight_decay=0.1)
    with GradGuard(loop.model, make_policy(SKIP_ALL), logger=None) as guard:
        for iteration in range(5):
            before, state_before = model_state(loop.model), copy.deepcopy(loop.opt.state_dict())
            norm = loop.iteration(iteration)
            if iteration == 2:
                assert guard.last_step_skipped
                assert norm.item() == 0.0  # every gradient was dropped before the clip
                assert_same(model_state(loop.model), before, "parameters after the skip")
                assert_same(loop.opt.state_dict(), state_before, "optimizer state after the skip")
    assert guard.counters.snapshot()["r0"] == {"nan": 1, "skip_step_on_nonfinite": 1}


def test_a_skip_at_the_clip_also_holds_the_optimizers_parameters_outside_the_model():
    """An optimizer of the model and a learnable temperature outside it, the loop clipping the model's
    parameters only: a skip decided at the clip holds the temperature and its AdamW state too, and the run
    equals the same run without the clip's interception (the skip taken at step()) at every iteration."""

    def train(clip: bool) -> list[list[torch.Tensor]]:
        torch.manual_seed(0)
        model = SmallMLP()
        temperature = torch.nn.Parameter(torch.ones(()))
        opt = torch.optim.AdamW([*model.parameters(), temperature], lr=1e-2)
        states = []
        with GradGuard(model, make_policy(SKIP_ALL), logger=None):
            for iteration in range(5):
                opt.zero_grad()
                (model(torch.randn(6, 8)) * temperature).pow(2).mean().backward()
                if iteration == 2:
                    model.hidden.weight.grad[0, 0] = math.nan  # type: ignore[index]
                if clip:  # far above the gradients' norm: it changes nothing but where the guard acts
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
                before = temperature.detach().clone()
                opt.step()
                if iteration == 2:
                    assert torch.equal(temperature.detach(), before), "the temperature moved in a skipped step"
                states.append([temperature.detach().clone(), *(p.detach().clone() for p in model.parameters())])
        return states

    with_clip, without = train(clip=True), train(clip=False)
    for iteration, (a, b) in enumerate(zip(with_clip, without, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), iteration


def test_a_skip_at_one_optimizers_step_also_holds_the_next_optimizers_parameters_outside_the_model():
    """Two optimizers, the second also stepping a temperature outside the model: the first one's step skips
    (NaN in its part of the model) and clears the model's gradients; the second's step finds none of the
    model's left to treat and must still leave the temperature alone."""
    torch.manual_seed(0)
    model = SmallMLP()
    temperature = torch.nn.Parameter(torch.ones(()))
    first = torch.optim.SGD(model.inp.parameters(), lr=0.1)
    second = torch.optim.SGD([*model.hidden.parameters(), *model.out.parameters(), temperature], lr=0.1)
    with GradGuard(model, make_policy(SKIP_ALL), logger=None) as guard:
        (model(torch.randn(6, 8)) * temperature).pow(2).mean().backward()
        model.inp.weight.grad[0, 0] = math.nan  # type: ignore[index]
        before, held = model_state(model), temperature.detach().clone()
        first.step()
        second.step()
        assert guard.last_step_skipped
        assert_same(model_state(model), before, "parameters after the skip")
        assert torch.equal(temperature.detach(), held), "the temperature moved in a skipped step"


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


def test_the_clips_are_wrapped_while_a_guard_is_attached_and_restored_when_the_last_goes():
    """Two guards: the originals come back only after both are removed; an early-bound name is not wrapped."""
    original = torch.nn.utils.clip_grad_norm_
    assert not hasattr(original, "__gradguard_original__")
    models = SmallMLP(), SmallMLP()  # held: a guard holds its model weakly
    first = GradGuard(models[0], make_policy(HALT_ALL), logger=None)
    second = GradGuard(models[1], make_policy(HALT_ALL), logger=None)
    assert torch.nn.utils.clip_grad_norm_.__gradguard_original__ is original
    assert torch.nn.utils.clip_grad.clip_grad_norm_ is torch.nn.utils.clip_grad_norm_
    first.remove()
    assert torch.nn.utils.clip_grad_norm_ is not original
    second.remove()
    assert torch.nn.utils.clip_grad_norm_ is original
    assert torch.nn.utils.clip_grad.clip_grad_norm_ is original
    assert not hasattr(torch.amp.GradScaler.unscale_, "__wrapped__")


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


def test_another_models_gradscaler_in_flight_does_not_hold_back_a_model_without_one():
    """A scaler that has scaled a loss and only ever unscaled another optimizer: this model's clip is its boundary."""
    torch.manual_seed(0)
    scaled_model, plain = SmallMLP(), SmallMLP()
    scaled_opt = torch.optim.SGD(scaled_model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    with GradGuard(plain, make_policy(HALT_ALL), logger=None):
        for iteration in range(2):
            scaler.scale(scaled_model(torch.randn(4, 8)).sum()).backward()  # in flight: scaled, not yet updated
            plain(torch.randn(4, 8)).sum().backward()
            if iteration == 1:
                plain.inp.weight.grad[0, 0] = math.nan
                with pytest.raises(GradientHalt) as caught:
                    torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
                assert caught.value.params == ("inp.weight",)
            scaler.unscale_(scaled_opt)
            scaler.step(scaled_opt)
            scaler.update()
            scaled_opt.zero_grad()
            plain.zero_grad()


def test_a_clip_inside_a_compiled_function_still_runs_the_guards_step_first():
    """torch.compile (eager backend) around the clip: the guard runs eagerly at a graph break and names the NaN."""
    torch.manual_seed(0)
    model = SmallMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    clip = torch.compile(lambda params: torch.nn.utils.clip_grad_norm_(params, 1.0), backend="eager")
    with GradGuard(model, make_policy(HALT_ALL), logger=None) as guard:
        for step in range(3):
            model(torch.randn(4, 8)).sum().backward()
            if step == 2:
                model.out.weight.grad[0, 0] = math.nan
                with pytest.raises(GradientHalt) as caught:
                    clip(list(model.parameters()))
                break
            clip(list(model.parameters()))
            opt.step()
            opt.zero_grad()
    assert caught.value.params == ("out.weight",)
    assert guard.step_count == 3
