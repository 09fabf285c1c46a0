"""Fused and foreach optimizers under a GradScaler: one guard step per loop step, every skip counted once.

A GradScaler still calls a fused optimizer's ``step()`` on a step it skips (it hands the optimizer
``found_inf``, and the kernel skips the update). That call is the skipped step itself: the guard must not
count it as a new one, in any order a loop calls the scaler, the clip and the guard in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from gradguard import GradGuard, GradientHalt, Policy

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam-fused": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    # Without momentum: torch 2.13's fused SGD with momentum on the CPU, under a GradScaler that skips its first
    # steps, applies a scaled update at its first unskipped step and then NaN, guarded or not (a torch defect).
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=1e-2, fused=True),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
    "adamw-for-loop": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False),
}
ORDERS = ["step", "unscale-clip-step", "unscale-guard-step", "unscale-guard-clip-step"]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def train_step(
    order: str,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    guard: GradGuard,
    step: int,
    poison: bool,
) -> bool:
    """One fp16 step in ``order``; returns whether the scaler skipped it (its scale went down)."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(4, 8, generator=gen)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    if poison:
        loss = loss * float("nan")
    opt.zero_grad()
    scaler.scale(loss).backward()
    if order != "step":
        scaler.unscale_(opt)
    if order in ("unscale-guard-step", "unscale-guard-clip-step"):
        guard.step(opt if order == "unscale-guard-step" else None)
    if order in ("unscale-clip-step", "unscale-guard-clip-step"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    before = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    return scaler.get_scale() < before


def _seen_without_scaler(kind: str, order: str) -> bool:
    """Whether the guard can see the scaler's skips without ``scaler=``: not through ``guard.step()`` (it learns the
    scaler's verdict from its ``scaler=``: docs/where-the-guard-acts.md), nor through a plain optimizer's
    ``step()``, which never runs on a skip; a fused one's does (it takes the scaler's flags)."""
    return "guard" not in order and (order != "step" or "fused" in kind)


SCALER_CASES = [
    pytest.param(kind, order, given, id=f"{kind}-{order}-{'scaler-given' if given else 'scaler-not-given'}")
    for given in (True, False)
    for order in ORDERS
    for kind in OPTIMIZERS
    if given or _seen_without_scaler(kind, order)
]
"""Every optimizer and order with ``scaler=``; without it, only those where the guard can see the skips."""


@pytest.mark.parametrize(("kind", "order", "given"), SCALER_CASES)
def test_a_skipping_scaler_leaves_the_guards_step_count_equal_to_the_loops_steps(
    kind: str, order: str, given: bool
) -> None:
    """A scale far too large at first and growing back every 2 steps: the scaler skips at the start and now and
    then later; the guard counts 30 steps and exactly the scaler's skips."""
    model = make_model()
    opt = OPTIMIZERS[kind](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=2)
    rules = [{"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}]
    policy = Policy.from_dict({"version": 1, "rules": rules})
    with GradGuard(model, policy, logger=None, **({"scaler": scaler} if given else {})) as guard:
        skips = sum(train_step(order, model, opt, scaler, guard, step, False) for step in range(30))
    assert skips >= 5, "the scaler really skipped"
    assert guard.step_count == 30
    assert guard.counters.snapshot()["grad_scaler"]["skip"] == skips


@pytest.mark.parametrize("order", ["step", "unscale-clip-step"])
@pytest.mark.parametrize("kind", ["adamw-fused", "sgd-fused", "adamw-for-loop"])
def test_a_nan_from_step_6_halts_at_step_22_saying_17_skips_whatever_the_optimizer(kind: str, order: str) -> None:
    """The default scale (65536) halves at each of the skips from step 6; the 17th, at scale 1, halts."""
    model = make_model()
    opt = OPTIMIZERS[kind](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    guard = GradGuard(model, Policy.shipped("default"), logger=None, scaler=scaler)
    halted_at = None
    try:
        for step in range(40):
            train_step(order, model, opt, scaler, guard, step, step >= 6)
    except GradientHalt as halt:
        halted_at, message = halt.step, str(halt)
    finally:
        guard.remove()
    assert (step, halted_at) == (22, 22)
    assert "at step 22 " in message
    assert "skipped 17 steps in a row" in message
    assert guard.step_count == 23
    assert guard.counters.snapshot()["grad_scaler"]["skip"] == 17


@pytest.mark.parametrize("order", ["step", "unscale-clip-step"])
def test_a_run_that_halted_under_a_scaler_does_not_stop_the_next_runs_clip_from_being_its_boundary(order: str) -> None:
    """A halt between ``scale()`` and ``update()`` leaves that scaler scaled; a notebook's next run (a new guard, no
    scaler) still has its loop's clip run the guard's step first."""
    model = make_model()
    opt = OPTIMIZERS["adamw-fused"](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    guard = GradGuard(model, Policy.shipped("default"), logger=None, scaler=scaler)

    def run() -> None:
        for step in range(40):
            train_step(order, model, opt, scaler, guard, step, step >= 6)

    with pytest.raises(GradientHalt):
        run()
    guard.remove()
    fresh = make_model()
    with GradGuard(fresh, Policy.shipped("default"), logger=None) as second:
        fresh(torch.randn(4, 8)).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(fresh.parameters(), 1.0)
        assert second.step_count == 1, "the clip ran the new guard's step"
