"""The step boundary in real loops: every torch optimizer flavour, LR schedulers, explicit optimizers,
``guard.step()`` and gradient accumulation, each against an unguarded reference run that applies
torch's own clip functions by hand at the point the guard claims to act.

Every comparison is bitwise (``torch.equal``): the guard promises results identical to
``clip_grad_norm_`` and the optimizers are deterministic on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from support.training import (
    SmallMLP,
    assert_same,
    assert_same_training_state,
    clip_each,
    grads_of,
    make_policy,
    mlp_pair,
)
from torch import nn

from gradguard import GradGuard, GradientHalt, GuardWarning


def batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + 31 * step + micro)
    return torch.randn(16, 8, generator=gen) * 3, torch.randn(16, 4, generator=gen)


def backward(model: nn.Module, step: int, micro: int = 0, scale: float = 1.0) -> None:
    x, y = batch(step, micro)
    loss = nn.functional.mse_loss(model(x), y) * 10 * scale
    loss.backward()  # type: ignore[no-untyped-call]


OPTIMIZERS: dict[str, Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01),
    "sgd-foreach": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
}

CLIP_AND_HALT = make_policy(
    {"match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
    {"match": "*", "actions": [{"action": "clip_norm", "max_norm": 1.0}]},
)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_guard_finds_the_step_boundary_of_every_torch_optimizer_by_itself(name: str) -> None:
    """Without optimizer=, every SGD/Adam/AdamW flavour gets exactly clip_grad_norm_ per tensor, once per step."""
    model, ref = mlp_pair()
    opt_g, opt_r = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](ref.parameters())
    clipped = 0
    with GradGuard(model, CLIP_AND_HALT, logger=None) as guard:
        for step in range(4):
            for m, opt in ((model, opt_g), (ref, opt_r)):
                opt.zero_grad()
                backward(m, step)
            assert_same(grads_of(model), grads_of(ref), f"raw gradients, step {step}")
            clipped += clip_each(ref, 1.0)
            opt_r.step()
            opt_g.step()
            assert_same(grads_of(model), grads_of(ref), f"treated gradients, step {step}")
            assert_same_training_state(model, ref, opt_g, opt_r, f"step {step}", param_groups=True)
        assert guard.step_count == 4
        counters = guard.counters.snapshot()
    # Each (tensor, step) the clip changed is counted once; most of these gradients are far above 1.0.
    assert clipped > 12
    assert counters == {"r1": {"clip_norm": clipped}}


@pytest.mark.parametrize(
    "make_scheduler",
    [
        lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
    ],
    ids=["StepLR", "LambdaLR"],
)
def test_an_lr_scheduler_around_the_optimizer_does_not_hide_the_step_boundary(make_scheduler: Callable) -> None:
    """StepLR/LambdaLR wrap opt.step; the guard still acts at every step and the schedule is unchanged."""
    model, ref = mlp_pair()
    opt_g = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
    sched_g, sched_r = make_scheduler(opt_g), make_scheduler(opt_r)
    with GradGuard(model, CLIP_AND_HALT, logger=None) as guard:
        for step in range(5):
            for m, opt in ((model, opt_g), (ref, opt_r)):
                opt.zero_grad()
                backward(m, step)
            clip_each(ref, 1.0)
            opt_r.step()
            opt_g.step()
            sched_r.step()
            sched_g.step()
            assert sched_g.get_last_lr() == sched_r.get_last_lr()
            assert_same_training_state(model, ref, opt_g, opt_r, f"step {step}", param_groups=True)
        assert guard.step_count == 5
    assert opt_g.param_groups[0]["lr"] < 1e-2, "the schedule really moved the learning rate"


def test_an_unlisted_optimizer_stepping_the_model_is_guarded_too_and_warned_about() -> None:
    """optimizer=opt names the expected boundary; another optimizer stepping the model first is treated too."""
    model, ref = mlp_pair()
    opt_g = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    other = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: stepping it changes no parameter
    with GradGuard(model, CLIP_AND_HALT, optimizer=opt_g, logger=None) as guard:
        for step in range(3):
            for m, opt in ((model, opt_g), (ref, opt_r)):
                opt.zero_grad()
                backward(m, step)
            clip_each(ref, 1.0)
            if step == 0:
                with pytest.warns(GuardWarning, match="not given as optimizer="):
                    other.step()
            else:
                other.step()  # warned once
            assert_same(grads_of(model), grads_of(ref), "the unlisted optimizer's step treated the gradients")
            assert guard.step_count == step + 1
            opt_r.step()
            opt_g.step()  # the same gradients, already treated: not treated twice
            assert_same_training_state(model, ref, opt_g, opt_r, f"step {step}", param_groups=True)
        assert guard.step_count == 3


def test_a_group_rule_spanning_two_optimizers_clips_each_share_and_counts_one_step() -> None:
    """One optimizer per sub-module and a group clip over '*': each optimizer's share is clipped by its own norm at
    its own step (under GradScaler the other's gradients are still scaled then), with a warning; one step counted."""
    model, ref = mlp_pair(3)
    policy = make_policy(
        {"match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
        {"match": "*", "actions": [{"action": "clip_norm", "max_norm": 1.0, "scope": "group"}]},
    )

    def shares(m: SmallMLP) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        return [*m.inp.parameters(), *m.hidden.parameters()], list(m.out.parameters())

    def optimizers(m: SmallMLP) -> list[torch.optim.Optimizer]:
        body, head = shares(m)
        return [torch.optim.SGD(body, lr=0.05, momentum=0.9), torch.optim.AdamW(head, lr=1e-2)]

    opts_g, opts_r = optimizers(model), optimizers(ref)
    with GradGuard(model, policy, logger=None) as guard:
        for step in range(3):
            for m, opts in ((model, opts_g), (ref, opts_r)):
                for opt in opts:
                    opt.zero_grad()
                backward(m, step)
            for share in shares(ref):
                assert torch.nn.utils.clip_grad_norm_(share, 1.0) > 1.0
            for opt in opts_r:
                opt.step()
            if step == 0:
                with pytest.warns(GuardWarning, match="more than one optimizer"):
                    opts_g[0].step()
            else:
                opts_g[0].step()
            opts_g[1].step()
            assert_same(grads_of(model), grads_of(ref), f"treated gradients, step {step}")
            for opt_g, opt_r in zip(opts_g, opts_r, strict=True):
                assert_same_training_state(model, ref, opt_g, opt_r, f"step {step}", param_groups=True)
            assert guard.step_count == step + 1, "two optimizers, one step"
        assert guard.counters.snapshot() == {"r1": {"clip_norm": 6 * 3}}


def test_guard_step_serves_a_loop_without_a_torch_optimizer() -> None:
    """A hand-written update after guard.step() sees exactly the clipped gradients; a second step() is a no-op."""
    model, ref = mlp_pair()
    clipped = 0
    with GradGuard(model, CLIP_AND_HALT, logger=None) as guard:
        for step in range(3):
            for m in (model, ref):
                m.zero_grad()
                backward(m, step)
            clipped += clip_each(ref, 1.0)
            assert guard.step() is True
            treated = grads_of(model)
            assert guard.step() is True  # same, unchanged gradient: treated at most once
            assert_same(grads_of(model), treated, "a second step() on the same gradient changed it")
            assert_same(treated, grads_of(ref), f"treated gradients, step {step}")
            with torch.no_grad():
                for m in (model, ref):
                    for p in m.parameters():
                        p -= 0.05 * p.grad
            assert_same(dict(model.named_parameters()), dict(ref.named_parameters()), f"step {step}")
        assert guard.step_count == 3
        assert guard.counters.snapshot() == {"r1": {"clip_norm": clipped}}


@pytest.mark.parametrize("name", ["sgd-momentum", "adamw-foreach", "adamw-fused"])
@pytest.mark.parametrize("scope", ["tensor", "group"])
def test_gradient_accumulation_is_clipped_once_on_the_sum_of_the_micro_batches(name: str, scope: str) -> None:
    """k=3 backward passes then one step: clip_norm acts on g1 + g2 + g3, once, as clip_grad_norm_ would."""
    k = 3
    model, ref = mlp_pair()
    opt_g, opt_r = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](ref.parameters())
    policy = make_policy({"match": "*", "actions": [{"action": "clip_norm", "max_norm": 1.0, "scope": scope}]})
    clipped = 0
    with GradGuard(model, policy, logger=None) as guard:
        for step in range(3):
            for m, opt in ((model, opt_g), (ref, opt_r)):
                opt.zero_grad()
                for micro in range(k):
                    backward(m, step, micro, scale=1.0 / k)
            assert guard.step_count == step, "backward passes are not steps"
            assert_same(grads_of(model), grads_of(ref), f"accumulated gradients, step {step}")
            if scope == "tensor":
                clipped += clip_each(ref, 1.0)
            else:
                total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
                clipped += 6 * bool(1.0 / (total + 1e-6) < 1.0)
            opt_r.step()
            opt_g.step()
            assert_same(grads_of(model), grads_of(ref), f"treated gradients, step {step}")
            assert_same_training_state(model, ref, opt_g, opt_r, f"step {step}", param_groups=True)
        assert guard.step_count == 3
        # One count per (tensor, step) the clip changed (a group clip counts its 6 members), never one per
        # micro-batch: with a count per backward pass this would be up to three times as large.
        assert clipped >= 6
        assert guard.counters.snapshot() == {"r0": {"clip_norm": clipped}}


def test_clipping_each_micro_batch_would_have_given_a_different_result() -> None:
    """The accumulation test is meaningful: clipping g1, g2, g3 separately does not give clip(g1 + g2 + g3)."""
    model, per_micro = mlp_pair()
    policy = make_policy({"match": "*", "actions": [{"action": "clip_norm", "max_norm": 1.0}]})
    with GradGuard(model, policy, logger=None) as guard:
        for micro in range(3):
            backward(model, 0, micro)
        guard.step()
    total = {name: torch.zeros_like(p) for name, p in per_micro.named_parameters()}
    for micro in range(3):
        per_micro.zero_grad()
        backward(per_micro, 0, micro)
        clip_each(per_micro, 1.0)
        for name, p in per_micro.named_parameters():
            total[name] += p.grad
    assert all(torch.linalg.vector_norm(p.grad) <= 1.0 + 1e-5 for p in model.parameters())
    assert any(torch.linalg.vector_norm(t) > 1.1 for t in total.values())


def test_accumulation_into_a_nan_halts_once_before_the_step_and_leaves_the_optimizer_untouched() -> None:
    """A NaN in the second micro-batch halts at the step, not in backward, with the last step's optimizer state."""
    model, ref = mlp_pair()
    opt_g = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
    with GradGuard(model, CLIP_AND_HALT, logger=None) as guard:
        for step in range(2):
            for m, opt in ((model, opt_g), (ref, opt_r)):
                opt.zero_grad()
                backward(m, step)
            clip_each(ref, 1.0)
            opt_r.step()
            opt_g.step()
        opt_g.zero_grad()
        backward(model, 2, 0)
        x, y = batch(2, 1)
        x[0, 0] = float("nan")
        nn.functional.mse_loss(model(x), y).backward()
        backward(model, 2, 2)
        assert guard.step_count == 2
        with pytest.raises(GradientHalt) as info:
            opt_g.step()
        assert info.value.step == 2
        assert info.value.kind == "nan"
        assert info.value.params == tuple(name for name, _ in model.named_parameters())
        assert_same_training_state(model, ref, opt_g, opt_r, "after the halt", param_groups=True)
        assert guard.counters.snapshot()["r0"] == {"nan": 6, "halt_on_nonfinite": 1}
