"""torch.compile, torch.autograd.grad, gradient penalties and double backward, activation checkpointing,
unused and frozen parameters, and a backward pass that dies halfway: each against an unguarded reference.

For torch.compile one compiled model per backend is enough: its raw gradients are compared with an
eager copy's (bitwise for eager and aot_eager, which run the same aten kernels; to 1e-6 for inductor,
which fuses kernels and so rounds differently), and the guard's treated gradients with torch's
clip_grad_norm_ applied by hand to those raw gradients (bitwise, whatever the backend).
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.training import SmallMLP, assert_same, assert_same_training_state, clip_each, grads_of, make_policy
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradguard import GradGuard, GradientHalt


class Checkpointed(nn.Module):
    """Two blocks run under torch.utils.checkpoint, reentrant or not."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(2))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(x)  # type: ignore[no-any-return]


HALT_AND_CLIP = make_policy(
    {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
    {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 1.0}]},
)


def batch(step: int, width: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2000 + step)
    return torch.randn(16, width, generator=gen) * 3, torch.randn(16, 4, generator=gen)


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    x, y = batch(step)
    out = model(x)
    return nn.functional.mse_loss(out, y[:, : out.shape[1]]) * 10


# --- torch.compile ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_a_compiled_model_gets_the_same_gradients_and_the_same_treatment_as_eager(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """torch.compile (eager, aot_eager, inductor): eager's gradients, the policy matched through _orig_mod, and
    the guard's result is clip_grad_norm_ applied by hand to the compiled model's raw gradients."""
    import torch._inductor.config

    # Compile in this process: no pool of compile workers to start (and to wait for at exit) for two kernels.
    # torch's own config patch: pytest 9.2's monkeypatch deletes the attribute of torch's config module on undo.
    patch = torch._inductor.config.patch(compile_threads=1)
    patch.__enter__()
    request.addfinalizer(lambda: patch.__exit__(None, None, None))
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = SmallMLP()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-2, foreach=True)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2, foreach=True)
    with GradGuard(compiled, HALT_AND_CLIP, logger=None) as guard:
        # Names seen by the guard are the model's own, not "_orig_mod.inp.weight".
        assert list(guard.guarded) == [name for name, _ in eager.named_parameters()]
        assert all(not name.startswith("_orig_mod") for name in guard.guarded)
        for step in range(3):
            for m, opt in ((compiled, opt_c), (eager, opt_e)):
                opt.zero_grad()
                loss_of(m, step).backward()
            raw = grads_of(model)
            for name, p in eager.named_parameters():
                if backend == "inductor":
                    # inductor fuses the backward kernels, so float32 sums round differently.
                    torch.testing.assert_close(raw[name], p.grad, rtol=1e-5, atol=1e-6)
                else:
                    assert torch.equal(raw[name], p.grad), f"{backend}: {name} differs from eager"
            expected = copy.deepcopy(model)  # the compiled model's raw gradients, clipped by torch by hand
            for name, p in expected.named_parameters():
                p.grad = raw[name].clone()
            clip_each(expected, 1.0)
            clip_each(eager, 1.0)
            opt_e.step()
            opt_c.step()
            assert_same(grads_of(model), grads_of(expected), f"{backend}: treated gradients, step {step}")
        assert guard.step_count == 3
        assert guard.counters.total("clip_norm") > 0


def test_a_guard_attached_to_the_module_guards_the_compiled_wrapper_of_it_too() -> None:
    """Attach to the plain module, train through torch.compile(module): same parameters, so the guard still acts."""
    torch._dynamo.reset()
    torch.manual_seed(1)
    model = SmallMLP()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="eager")
    opt_g = torch.optim.SGD(compiled.parameters(), lr=0.05, momentum=0.9)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    with GradGuard(model, HALT_AND_CLIP, logger=None) as guard:
        for step in range(3):
            for m, opt in ((compiled, opt_g), (ref, opt_r)):
                opt.zero_grad()
                loss_of(m, step).backward()
            clip_each(ref, 1.0)
            opt_r.step()
            opt_g.step()
            assert_same_training_state(model, ref, opt_g, opt_r, f"step {step}")
        assert guard.step_count == 3


def test_a_compiled_optimizer_step_still_runs_the_guard_before_the_update() -> None:
    """torch.compile(opt.step) (backend eager): the guard's pre-hook runs inside it, so the result equals an
    eager step after clip_grad_norm_ by hand, and a NaN still halts before the update."""
    torch._dynamo.reset()
    torch.manual_seed(2)
    model = SmallMLP()
    ref = copy.deepcopy(model)
    opt_g = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    step_g = torch.compile(opt_g.step, backend="eager")
    with GradGuard(model, HALT_AND_CLIP, logger=None) as guard:
        for step in range(3):
            for m, opt in ((model, opt_g), (ref, opt_r)):
                opt.zero_grad()
                loss_of(m, step).backward()
            clipped = clip_each(ref, 1.0)
            opt_r.step()
            step_g()
            assert clipped > 0
            assert_same_training_state(model, ref, opt_g, opt_r, f"step {step}")
        assert guard.step_count == 3
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        opt_g.zero_grad()
        loss_of(model, 3).backward()
        model.hidden.bias.grad[0] = float("nan")
        with pytest.raises(GradientHalt):
            step_g()
        assert all(torch.equal(before[name], p) for name, p in model.named_parameters())


# --- autograd.grad, gradient penalties, double backward ----------------------------------------------


def test_autograd_grad_and_a_gradient_penalty_are_untouched_by_the_guard_and_not_counted() -> None:
    """torch.autograd.grad(create_graph=True) for a gradient penalty, then backward through it (double backward):
    the penalty's gradients equal the unguarded ones, only the optimizer step is treated, once."""
    torch.manual_seed(2)
    model = SmallMLP()
    ref = copy.deepcopy(model)
    opt_g = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt_r = torch.optim.Adam(ref.parameters(), lr=1e-2)
    policy = make_policy(
        {"match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
        {"match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.5}, {"action": "scale", "factor": 0.5}]},
    )
    with GradGuard(model, policy, logger=None) as guard:
        for step in range(3):
            penalties = []
            for m, opt in ((model, opt_g), (ref, opt_r)):
                opt.zero_grad()
                x, y = batch(step)
                x.requires_grad_(True)
                loss = nn.functional.mse_loss(m(x), y)
                (input_grad,) = torch.autograd.grad(loss, x, create_graph=True)
                param_grads = torch.autograd.grad(loss, list(m.parameters()), create_graph=True)
                penalty = (input_grad.norm() - 1) ** 2 + sum(g.pow(2).sum() for g in param_grads)
                penalties.append((input_grad.detach(), [g.detach() for g in param_grads]))
                (loss + penalty).backward()
            # autograd.grad returned the same values with and without the guard, and never counted as a step.
            assert torch.equal(penalties[0][0], penalties[1][0])
            assert all(torch.equal(a, b) for a, b in zip(penalties[0][1], penalties[1][1], strict=True))
            assert guard.step_count == step
            assert_same(grads_of(model), grads_of(ref), f"double-backward gradients, step {step}")
            clip_each(ref, 0.5)
            for p in ref.parameters():
                p.grad.mul_(0.5)
            opt_r.step()
            opt_g.step()
            assert_same_training_state(model, ref, opt_g, opt_r, f"step {step}")
        assert guard.step_count == 3
        assert guard.counters.snapshot()["r1"]["scale"] == 6 * 3


def test_autograd_grad_outside_any_step_does_not_trigger_the_guard_even_on_a_nan() -> None:
    """A NaN produced by torch.autograd.grad (e.g. for a diagnostic) is not the optimizer's gradient: no halt."""
    torch.manual_seed(3)
    model = SmallMLP()
    with GradGuard(model, HALT_AND_CLIP, logger=None) as guard:
        x, y = batch(0)
        x[0, 0] = float("nan")
        found = torch.autograd.grad(nn.functional.mse_loss(model(x), y), list(model.parameters()))
        assert all(torch.isnan(g).any() for g in found)
        assert all(p.grad is None for p in model.parameters())
        assert guard.step() is True  # nothing to treat
        assert guard.step_count == 0
        assert guard.counters.snapshot() == {}


# --- activation checkpointing --------------------------------------------------------------------------


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing_gives_the_policys_result(use_reentrant: bool) -> None:
    """torch.utils.checkpoint, reentrant and not: the guard treats the final gradients once, as by hand."""
    torch.manual_seed(4)
    model = Checkpointed(use_reentrant)
    ref = copy.deepcopy(model)
    opt_g = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    policy = make_policy(
        {"match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
        {"match": "blocks.*", "actions": [{"action": "clip_norm", "max_norm": 0.5, "scope": "group"}]},
        {"match": "head.*", "actions": [{"action": "clip_value", "limit": 0.1}]},
    )
    with GradGuard(model, policy, logger=None) as guard:
        for step in range(3):
            for m, opt in ((model, opt_g), (ref, opt_r)):
                opt.zero_grad()
                x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step)) * 3
                if use_reentrant:
                    x.requires_grad_(True)  # reentrant checkpoint needs an input that requires grad
                m(x).pow(2).sum().backward()
            torch.nn.utils.clip_grad_norm_(ref.blocks.parameters(), 0.5)
            torch.nn.utils.clip_grad_value_(ref.head.parameters(), 0.1)
            opt_r.step()
            opt_g.step()
            assert_same_training_state(model, ref, opt_g, opt_r, f"step {step}")
        counters = guard.counters.snapshot()
    assert counters["r1"] == {"clip_norm": 8 * 3}
    assert counters["r2"]["clip_value"] > 0


def test_the_checkpoint_wrapper_prefix_is_transparent_to_the_policy() -> None:
    """checkpoint_wrapper adds _checkpoint_wrapped_module. to every name; the policy's names still match."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(5)
    model = nn.Sequential(checkpoint_wrapper(nn.Linear(8, 8)), nn.Tanh(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    assert "0._checkpoint_wrapped_module.weight" in dict(model.named_parameters())
    policy = make_policy({"match": "0.weight", "actions": [{"action": "scale", "factor": 0.25}]})
    with GradGuard(model, policy, logger=None) as guard:
        assert guard.guarded == {"0.weight": ("r0",)}
        x = torch.randn(4, 8)
        for m in (model, ref):
            m(x).sum().backward()
        guard.step()
    ref[0].weight.grad.mul_(0.25)
    assert_same(grads_of(model), grads_of(ref), "gradients")


# --- unused, frozen and unfrozen parameters -------------------------------------------------------------


def test_unused_and_frozen_then_unfrozen_parameters_are_handled_like_the_unguarded_run() -> None:
    """A parameter never used (grad None), and a layer frozen on steps 2-3 then unfrozen: same run as by hand."""
    torch.manual_seed(6)
    model = SmallMLP(with_spare=True)
    ref = copy.deepcopy(model)
    opt_g = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    clipped = 0
    with GradGuard(model, HALT_AND_CLIP, logger=None) as guard:
        assert "spare.weight" in guard.guarded
        for step in range(6):
            frozen = step in (2, 3)
            for m, opt in ((model, opt_g), (ref, opt_r)):
                m.hidden.requires_grad_(not frozen)
                opt.zero_grad()
                loss_of(m, step).backward()
            assert model.spare.weight.grad is None
            assert (model.hidden.weight.grad is None) is frozen
            clipped += clip_each(ref, 1.0)
            opt_r.step()
            opt_g.step()
            assert_same_training_state(model, ref, opt_g, opt_r, f"step {step}")
        assert "spare.weight" not in str(opt_g.state_dict()["state"].keys())
        assert guard.counters.snapshot() == {"clip": {"clip_norm": clipped}}
    assert model.spare.weight.grad is None


def test_a_parameter_frozen_after_attach_with_a_stale_gradient_is_still_guarded() -> None:
    """Freezing a parameter does not unguard it: a NaN left in its .grad still halts the step that would apply it."""
    torch.manual_seed(7)
    model = SmallMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with GradGuard(model, HALT_AND_CLIP, logger=None):
        loss_of(model, 0).backward()
        model.out.requires_grad_(False)
        model.out.weight.grad[0, 0] = float("nan")
        with pytest.raises(GradientHalt) as info:
            opt.step()
        assert info.value.params == ("out.weight",)


# --- an exception halfway through backward ---------------------------------------------------------------


class Boom(RuntimeError):
    pass


def test_an_exception_halfway_through_backward_leaves_the_guard_consistent() -> None:
    """A user's hook raises mid-backward (some gradients written, some not); after zero_grad training resumes
    and matches an unguarded run that skipped the same step, and the failed backward was never a step."""
    torch.manual_seed(8)
    model = SmallMLP()
    ref = copy.deepcopy(model)
    opt_g = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def explode(grad: torch.Tensor) -> torch.Tensor:
        raise Boom("user code failed in backward")

    with GradGuard(model, HALT_AND_CLIP, logger=None) as guard:
        for step in range(4):
            for m, opt in ((model, opt_g), (ref, opt_r)):
                opt.zero_grad()
                x, y = batch(step)
                h = torch.tanh(m.hidden(torch.tanh(m.inp(x))))
                if step == 1:
                    h.register_hook(explode)
                loss = nn.functional.mse_loss(m.out(h), y) * 10
                if step == 1:
                    with pytest.raises(Boom):
                        loss.backward()
                else:
                    loss.backward()
            if step == 1:
                # Half written: the output layer got its gradient, the layers below did not.
                assert model.out.weight.grad is not None
                assert model.inp.weight.grad is None
                assert guard.step_count == 1
                continue
            clip_each(ref, 1.0)
            opt_r.step()
            opt_g.step()
            assert_same_training_state(model, ref, opt_g, opt_r, f"step {step}")
        assert guard.step_count == 3
