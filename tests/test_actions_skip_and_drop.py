"""The new actions: skip_step_on_nonfinite (with escalation), drop (versus zero), step windows on rules
and actions, and NaN told from Inf; each against an unguarded reference run.

A skipped step's reference is an unguarded run that simply does not call ``opt.step()`` on that step;
the guarded run calls it as usual and must end in the very same state: parameters, every optimizer
state tensor and every step count, compared with ``torch.equal``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.training import assert_same, clip_each, events_of, make_policy, mlp_pair
from torch import nn

from gradguard import GradGuard, GradientHalt, GuardWarning, Policy

NAMES = ["inp.weight", "inp.bias", "hidden.weight", "hidden.bias", "out.weight", "out.bias"]


def backward(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(3000 + step)
    x, y = torch.randn(16, 8, generator=gen) * 3, torch.randn(16, 4, generator=gen)
    (nn.functional.mse_loss(model(x), y) * 10).backward()  # type: ignore[no-untyped-call]


def poison(model: nn.Module, name: str, value: float) -> None:
    grad = dict(model.named_parameters())[name].grad
    assert grad is not None
    grad.view(-1)[3] = value


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "params": {name: p.detach().clone() for name, p in model.named_parameters()},
        "state": copy.deepcopy(opt.state_dict()["state"]),
    }


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
}

SKIP_AND_CLIP = make_policy(
    {"name": "skip", "match": "*", "actions": [{"action": "skip_step_on_nonfinite"}]},
    {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 1.0}]},
)


# --- skip_step_on_nonfinite --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_skipped_step_changes_no_parameter_and_no_optimizer_state(name: str, tmp_path: Path) -> None:
    """NaN at step 2, Inf at step 4: the guarded run equals a reference that did not call opt.step() there,
    moments and step counts included; each skip is logged with its parameters and kinds, and counted."""
    model, ref = mlp_pair()
    opt_g, opt_r = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](ref.parameters())
    bad = {2: ("hidden.weight", float("nan")), 4: ("out.bias", float("inf"))}
    log = tmp_path / "audit.jsonl"
    clipped = 0
    with GradGuard(model, SKIP_AND_CLIP, logger=None, audit_log=log) as guard:
        for step in range(6):
            for m, opt in ((model, opt_g), (ref, opt_r)):
                opt.zero_grad()
                backward(m, step)
                if step in bad:
                    poison(m, *bad[step])
            before = snapshot(model, opt_g)
            if step not in bad:
                clipped += clip_each(ref, 1.0)
                opt_r.step()
            opt_g.step()
            assert guard.last_step_skipped is (step in bad)
            if step in bad:
                assert all(p.grad is None for p in model.parameters()), "no gradient is left to apply"
                assert_same(snapshot(model, opt_g), before, f"skipped step {step}")
            assert_same(snapshot(model, opt_g), snapshot(ref, opt_r), f"step {step}")
        assert guard.step_count == 6
        counters = guard.counters.snapshot()
    assert opt_g.state_dict()["state"], "the optimizer did build state on the applied steps"
    assert counters == {"skip": {"skip_step_on_nonfinite": 2, "nan": 1, "inf": 1}, "clip": {"clip_norm": clipped}}
    skips = events_of(log, "skip")
    assert [(e["step"], e["params"], e["kinds"], e["kind"]) for e in skips] == [
        (2, ["hidden.weight"], {"hidden.weight": "nan"}, "nan"),
        (4, ["out.bias"], {"out.bias": "inf"}, "inf"),
    ]
    assert all(e["level"] == "warning" for e in skips)
    nonfinite = events_of(log, "nonfinite")
    assert [(e["step"], e["param"], e["kind"], e["skips"], e["halts"]) for e in nonfinite] == [
        (2, "hidden.weight", "nan", True, False),
        (4, "out.bias", "inf", True, False),
    ]
    # A skipped step's clips did not happen either: no intervention is logged for steps 2 and 4.
    assert not {e["step"] for e in events_of(log, "intervention")} & set(bad)
    assert events_of(log, "halt") == []


def test_an_lr_scheduler_around_a_skipping_optimizer_warns_once_and_stays_in_step_when_the_loop_asks() -> None:
    """A skipped step with StepLR: one GuardWarning that explains it; calling scheduler.step() only when
    guard.last_step_skipped is False keeps the schedule on applied steps, exactly as the reference."""
    model, ref = mlp_pair(1)
    opt_g = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
    sched_g = torch.optim.lr_scheduler.StepLR(opt_g, step_size=1, gamma=0.5)
    sched_r = torch.optim.lr_scheduler.StepLR(opt_r, step_size=1, gamma=0.5)
    with GradGuard(model, SKIP_AND_CLIP, logger=None) as guard:
        for step in range(5):
            for m, opt in ((model, opt_g), (ref, opt_r)):
                opt.zero_grad()
                backward(m, step)
                if step in (1, 3):
                    poison(m, "inp.weight", float("nan"))
            if step in (1, 3):
                if step == 1:
                    with pytest.warns(GuardWarning, match=r"LR scheduler.*scheduler\.step\(\).*last_step_skipped"):
                        opt_g.step()
                else:
                    opt_g.step()  # the warning is given once: under filterwarnings=error a second one would raise
                assert guard.last_step_skipped
            else:
                clip_each(ref, 1.0)
                opt_r.step()
                sched_r.step()
                opt_g.step()
                assert not guard.last_step_skipped
                sched_g.step()
            assert sched_g.get_last_lr() == sched_r.get_last_lr()
            assert_same(snapshot(model, opt_g), snapshot(ref, opt_r), f"step {step}")
    assert sched_g.get_last_lr() == [1e-2 * 0.5**3]


def test_a_skipped_step_without_a_scheduler_does_not_warn() -> None:
    """No LR scheduler, no warning (pytest turns a GuardWarning into an error here)."""
    model, _ = mlp_pair(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradGuard(model, SKIP_AND_CLIP, logger=None) as guard:
        backward(model, 0)
        poison(model, "out.weight", float("nan"))
        opt.step()
        assert guard.last_step_skipped


def test_guard_step_returns_false_on_a_skipped_step_and_clears_every_gradient() -> None:
    """In a loop without a torch optimizer, guard.step() says False and leaves no gradient to apply."""
    model, _ = mlp_pair(3)
    with GradGuard(model, SKIP_AND_CLIP, logger=None) as guard:
        backward(model, 0)
        assert guard.step() is True
        assert not guard.last_step_skipped
        model.zero_grad()
        backward(model, 1)
        poison(model, "inp.bias", float("-inf"))
        assert guard.step() is False
        assert guard.last_step_skipped
        assert all(p.grad is None for p in model.parameters())
        assert guard.counters.snapshot()["skip"] == {"skip_step_on_nonfinite": 1, "inf": 1}


def run_with_nonfinite_steps(
    policy: Policy, nonfinite_steps: set[int], steps: int
) -> tuple[list[int], GradientHalt | None, dict[str, Any], dict[str, Any], dict[str, dict[str, int]]]:
    """Train guarded and reference side by side; return the skipped steps, the halt, both final states."""
    model, ref = mlp_pair(4)
    opt_g = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
    skipped: list[int] = []
    halt: GradientHalt | None = None
    with GradGuard(model, policy, logger=None) as guard:
        for step in range(steps):
            for m, opt in ((model, opt_g), (ref, opt_r)):
                opt.zero_grad()
                backward(m, step)
                if step in nonfinite_steps:
                    poison(m, "hidden.bias", float("nan"))
            if step not in nonfinite_steps:
                opt_r.step()
            try:
                opt_g.step()
            except GradientHalt as exc:
                halt = exc
                break
            if guard.last_step_skipped:
                skipped.append(step)
        counters = guard.counters.snapshot()
    return skipped, halt, snapshot(model, opt_g), snapshot(ref, opt_r), counters


def test_max_consecutive_skips_escalates_to_a_halt_and_a_good_step_resets_the_count() -> None:
    """max_consecutive_skips 2: NaN at 1, 2 (skipped), good 3, NaN at 4, 5 (skipped), NaN at 6: GradientHalt."""
    policy = make_policy({"match": "*", "actions": [{"action": "skip_step_on_nonfinite", "max_consecutive_skips": 2}]})
    skipped, halt, guarded, reference, counters = run_with_nonfinite_steps(policy, {1, 2, 4, 5, 6}, 8)
    assert skipped == [1, 2, 4, 5]
    assert halt is not None
    assert halt.step == 6
    assert halt.params == ("hidden.bias",)
    assert halt.kind == "nan"
    assert halt.reason is not None
    assert "3 consecutive" in halt.reason
    assert "max_consecutive_skips: 2" in halt.reason
    assert "max_consecutive_skips" in str(halt)
    # The halt happened before the optimizer step: the state is the last good step's, as the reference's.
    assert_same(guarded, reference, "at the halt")
    assert counters["r0"]["skip_step_on_nonfinite"] == 4
    assert counters["r0"]["halt_on_nonfinite"] == 1


def test_max_consecutive_skips_counts_training_steps_when_two_optimizers_apply_one_and_skip_the_other() -> None:
    """Two optimizers, the head's gradient Inf at every step from 2 on: the body's clean update at each step must not
    end the run of skips the head's make (it did, and the run skipped for ever): skips at 2 and 3, a halt at 4."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizers = [torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[1].parameters(), lr=0.1)]
    policy = make_policy({"match": "*", "actions": [{"action": "skip_step_on_nonfinite", "max_consecutive_skips": 2}]})
    skipped: list[int] = []
    halt: GradientHalt | None = None
    with GradGuard(model, policy, logger=None) as guard:
        for step in range(10):
            for opt in optimizers:
                opt.zero_grad()
            model(torch.randn(3, 4)).pow(2).sum().backward()
            if step >= 2:
                model[1].weight.grad.view(-1)[0] = float("inf")
            try:
                for opt in optimizers:
                    opt.step()
            except GradientHalt as raised:
                halt = raised
                break
            if guard.last_step_skipped:
                skipped.append(step)
        restored = copy.deepcopy(guard.state_dict()["skips"])
    assert skipped == [2, 3]
    assert halt is not None
    assert halt.step == 4
    assert halt.reason is not None
    assert "3 consecutive" in halt.reason
    assert restored == {"r0": {"consecutive": 3, "recent": [2, 3, 4]}}


def test_skips_per_window_escalate_to_a_halt_only_when_the_window_holds_too_many() -> None:
    """max_skips 2 within window_steps 5: skips at 0, 3, 6, 9 never put 3 in one window of 5 steps; 10 does."""
    policy = make_policy(
        {"match": "*", "actions": [{"action": "skip_step_on_nonfinite", "max_skips": 2, "window_steps": 5}]}
    )
    skipped, halt, guarded, reference, _ = run_with_nonfinite_steps(policy, {0, 3, 6, 9, 10}, 13)
    assert skipped == [0, 3, 6, 9]
    assert halt is not None
    assert halt.step == 10
    assert halt.reason is not None
    assert "3 skipped steps within the last 5 steps" in halt.reason
    assert_same(guarded, reference, "at the halt")


def test_halt_wins_over_skip_when_both_cover_a_nonfinite_gradient() -> None:
    """A tensor covered by a halt rule and a skip rule halts: the stronger action is taken."""
    policy = make_policy(
        {"match": "*", "actions": [{"action": "skip_step_on_nonfinite"}]},
        {"match": "hidden.*", "actions": [{"action": "halt_on_nonfinite"}]},
    )
    skipped, halt, guarded, reference, _ = run_with_nonfinite_steps(policy, {2}, 4)
    assert skipped == []
    assert halt is not None
    assert halt.rule == "r1"
    assert halt.step == 2
    assert_same(guarded, reference, "at the halt")


# --- NaN versus Inf ----------------------------------------------------------------------------------


def test_nan_and_inf_are_told_apart_in_events_counters_and_the_halt(tmp_path: Path) -> None:
    """One NaN tensor and one Inf tensor: separate nan/inf counts, per-parameter kinds, kind 'nan+inf'."""
    model, _ = mlp_pair(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = make_policy({"name": "halt", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]})
    log = tmp_path / "audit.jsonl"
    with GradGuard(model, policy, logger=None, audit_log=log) as guard:
        backward(model, 0)
        poison(model, "inp.weight", float("inf"))
        poison(model, "out.weight", float("nan"))
        with pytest.raises(GradientHalt) as info:
            opt.step()
        assert guard.counters.snapshot() == {"halt": {"inf": 1, "nan": 1, "halt_on_nonfinite": 1}}
    assert info.value.kind == "nan+inf"
    assert info.value.params == ("inp.weight", "out.weight")
    (halt,) = events_of(log, "halt")
    assert halt["kinds"] == {"inp.weight": "inf", "out.weight": "nan"}
    assert {(e["param"], e["kind"]) for e in events_of(log, "nonfinite")} == {
        ("inp.weight", "inf"),
        ("out.weight", "nan"),
    }


# --- drop versus zero --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sgd-momentum", "adamw-foreach", "adamw-fused"])
def test_drop_leaves_the_parameter_exactly_as_it_was_while_zero_lets_the_optimizer_move_it(name: str) -> None:
    """drop from step 2 on: 'hidden' stops dead (its momentum/moments and step count frozen too); zero lets
    momentum and weight decay still move it. Both equal a reference that does the same by hand."""
    results = {}
    for action in ("drop", "zero"):
        model, ref = mlp_pair(6)
        opt_g, opt_r = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](ref.parameters())
        policy = make_policy({"match": "hidden.*", "from_step": 2, "actions": [{"action": action}]})
        with GradGuard(model, policy, logger=None) as guard:
            for step in range(5):
                for m, opt in ((model, opt_g), (ref, opt_r)):
                    opt.zero_grad()
                    backward(m, step)
                if step >= 2:
                    for p in ref.hidden.parameters():
                        if action == "drop":
                            p.grad = None
                        else:
                            p.grad.zero_()
                if step == 2:
                    at_two = snapshot(model, opt_g)
                opt_r.step()
                opt_g.step()
                assert_same(snapshot(model, opt_g), snapshot(ref, opt_r), f"{action}, step {step}")
            assert guard.counters.snapshot() == {"r0": {action: 2 * 3}}
        hidden_ids = [2, 3]  # optimizer state is keyed by parameter position
        state = snapshot(model, opt_g)
        moved = [not torch.equal(at_two["params"][n], state["params"][n]) for n in ("hidden.weight", "hidden.bias")]
        results[action] = (moved, [state["state"][i] for i in hidden_ids], [at_two["state"][i] for i in hidden_ids])
    drop_moved, drop_state, drop_state_before = results["drop"]
    assert drop_moved == [False, False]
    assert_same(dict(enumerate(drop_state)), dict(enumerate(drop_state_before)), "dropped parameters' state")
    zero_moved, zero_state, zero_state_before = results["zero"]
    assert zero_moved == [True, True]
    if name != "sgd-momentum":
        assert float(zero_state[0]["step"]) == float(zero_state_before[0]["step"]) + 3


def test_drop_runs_before_later_actions_and_counts_only_tensors_that_had_a_gradient() -> None:
    """drop on one tensor of a rule that also clips others: the clip acts on the rest; an absent gradient
    is not counted as dropped."""
    model, ref = mlp_pair(7)
    policy = make_policy(
        {"match": "out.*", "actions": [{"action": "drop"}]},
        {"match": "*", "exclude": "out.*", "actions": [{"action": "clip_norm", "max_norm": 0.5, "scope": "group"}]},
    )
    with GradGuard(model, policy, logger=None) as guard:
        for m in (model, ref):
            backward(m, 0)
        model.out.bias.grad = None
        guard.step()
        assert model.out.weight.grad is None
        assert model.out.bias.grad is None
        torch.nn.utils.clip_grad_norm_([p for n, p in ref.named_parameters() if not n.startswith("out.")], 0.5)
        for n, p in model.named_parameters():
            if not n.startswith("out."):
                assert torch.equal(p.grad, dict(ref.named_parameters())[n].grad), n
        assert guard.counters.snapshot() == {"r0": {"drop": 1}, "r1": {"clip_norm": 4}}


# --- step windows --------------------------------------------------------------------------------------


def test_step_windows_on_rules_and_on_actions_apply_exactly_on_their_steps() -> None:
    """Rule window [1, 3) and action windows (scale until 2, clip_value from 2, clip_norm [3, 4)): by hand."""
    model, ref = mlp_pair(8)
    opt_g = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    policy = make_policy(
        {"match": "inp.*", "from_step": 1, "until_step": 3, "actions": [{"action": "clip_norm", "max_norm": 0.5}]},
        {
            "match": "out.*",
            "actions": [
                {"action": "scale", "factor": 0.5, "until_step": 2},
                {"action": "clip_value", "limit": 0.05, "from_step": 2},
                {"action": "clip_norm", "max_norm": 0.1, "from_step": 3, "until_step": 4},
            ],
        },
    )
    with GradGuard(model, policy, logger=None) as guard:
        for step in range(6):
            for m, opt in ((model, opt_g), (ref, opt_r)):
                opt.zero_grad()
                backward(m, step)
            if 1 <= step < 3:
                clip_each(ref.inp, 0.5)
            if step < 2:
                for p in ref.out.parameters():
                    p.grad.mul_(0.5)
            if step >= 2:
                torch.nn.utils.clip_grad_value_(ref.out.parameters(), 0.05)
            if 3 <= step < 4:
                clip_each(ref.out, 0.1)
            opt_r.step()
            opt_g.step()
            assert_same(snapshot(model, opt_g), snapshot(ref, opt_r), f"step {step}")
        counters = guard.counters.snapshot()
    assert counters["r0"]["clip_norm"] == 2 * 2  # steps 1 and 2 only
    assert counters["r1"]["scale"] == 2 * 2  # steps 0 and 1 only
    assert counters["r1"]["clip_value"] > 0


def test_a_halt_window_halts_only_inside_it() -> None:
    """halt_on_nonfinite from_step 2: an Inf on step 0 is reported, not halted; the same Inf on step 2 halts."""
    model, _ = mlp_pair(9)
    policy = make_policy({"name": "halt", "match": "*", "actions": [{"action": "halt_on_nonfinite", "from_step": 2}]})
    with GradGuard(model, policy, logger=None) as guard:
        for step in range(3):
            model.zero_grad()
            backward(model, step)
            if step in (0, 2):
                poison(model, "hidden.weight", float("inf"))
            if step < 2:
                assert guard.step() is True  # a loop without an optimizer: nothing is applied
            else:
                with pytest.raises(GradientHalt) as info:
                    guard.step()
                assert info.value.step == 2
        assert guard.counters.snapshot() == {"halt": {"inf": 2, "halt_on_nonfinite": 1}}
