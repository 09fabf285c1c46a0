"""The guard's actions are torch's own functions, bit for bit, on real models and real optimizers.

Each test trains a guarded model and an unguarded copy side by side; the copy gets torch's functions
(``clip_grad_norm_``, ``clip_grad_value_``, ``mul_``, ``zero_``) applied by hand. After every step,
gradients, parameters and optimizer states must be ``torch.equal``.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
from support.host_syncs import count_host_syncs, count_python_data_tensors
from torch.nn.utils import clip_grad_norm_, clip_grad_value_

from gradguard import GradGuard, GradientHalt, GuardWarning

OPTIMIZERS = ("sgd", "adamw", "adamw_foreach", "adamw_fused")
WORKLOADS = ("mlp", "decoder")

# Thresholds chosen so that, on these models, some parameters are clipped and some are not.
TENSOR_MAX_NORM = {"mlp": 2.0, "decoder": 0.05}
GROUP = {"mlp": ("hidden.", "out."), "decoder": ("blocks.",)}
GROUP_MAX_NORM = {"mlp": 3.0, "decoder": 0.2}


def _in_group(workload: str):
    return lambda name: name.startswith(GROUP[workload])


# --- clip_norm ------------------------------------------------------------------------------------


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("workload", WORKLOADS)
def test_tensor_scope_clip_equals_clip_grad_norm_per_parameter(run_pair, make_policy, workload, opt_name):
    """clip_norm with scope tensor is bitwise clip_grad_norm_([p], max_norm) for every parameter."""
    max_norm = TENSOR_MAX_NORM[workload]
    policy = make_policy({"match": "*", "actions": [{"action": "clip_norm", "max_norm": max_norm}]})

    def reference(model, step):
        for p in model.parameters():
            clip_grad_norm_([p], max_norm)

    run = run_pair(workload, opt_name, policy, reference)
    n_params = len(list(run.guarded.model.parameters()))
    assert 0 < run.counters["r0"]["clip_norm"] < 4 * n_params  # some parameters clipped, some not


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("workload", WORKLOADS)
def test_group_scope_clip_equals_clip_grad_norm_over_the_group(run_pair, make_policy, select, workload, opt_name):
    """clip_norm with scope group is bitwise clip_grad_norm_(the rule's parameters, max_norm)."""
    max_norm = GROUP_MAX_NORM[workload]
    patterns = [prefix + "*" for prefix in GROUP[workload]]
    policy = make_policy(
        {"match": patterns, "actions": [{"action": "clip_norm", "max_norm": max_norm, "scope": "group"}]}
    )

    def reference(model, step):
        clip_grad_norm_(select(model, _in_group(workload)), max_norm)

    run = run_pair(workload, opt_name, policy, reference)
    group_size = len(select(run.guarded.model, _in_group(workload)))
    count = run.counters["r0"]["clip_norm"]
    assert count > 0
    assert count % group_size == 0  # a group clip counts every parameter of the group


@pytest.mark.parametrize("scope", ["tensor", "group"])
@pytest.mark.parametrize("norm_type", [1.0, math.inf])
def test_norm_types_one_and_inf_equal_clip_grad_norm(run_pair, make_policy, norm_type, scope):
    """norm_type 1.0 and inf clip exactly as clip_grad_norm_ with that norm_type, per tensor and per group."""
    max_norm = 1.0 if norm_type == math.inf else 4.0
    policy = make_policy(
        {
            "match": "*",
            "actions": [{"action": "clip_norm", "max_norm": max_norm, "norm_type": norm_type, "scope": scope}],
        }
    )

    def reference(model, step):
        if scope == "tensor":
            for p in model.parameters():
                clip_grad_norm_([p], max_norm, norm_type=norm_type)
        else:
            clip_grad_norm_(list(model.parameters()), max_norm, norm_type=norm_type)

    run = run_pair("mlp", "adamw", policy, reference)
    assert run.counters["r0"]["clip_norm"] > 0


@pytest.mark.parametrize("workload", WORKLOADS)
def test_clip_value_equals_clip_grad_value(run_pair, make_policy, workload):
    """clip_value is bitwise clip_grad_value_(params, limit)."""
    limit = 0.2 if workload == "mlp" else 0.01
    policy = make_policy({"match": "*", "actions": [{"action": "clip_value", "limit": limit}]})

    def reference(model, step):
        clip_grad_value_(model.parameters(), limit)

    run = run_pair(workload, "adamw", policy, reference)
    n_params = len(list(run.guarded.model.parameters()))
    assert 0 < run.counters["r0"]["clip_value"] < 4 * n_params


@pytest.mark.parametrize("opt_name", ["sgd", "adamw_foreach"])
def test_scale_and_zero_equal_multiplying_and_zeroing_the_gradient(run_pair, make_policy, select, opt_name):
    """scale multiplies the gradient (as grad.mul_(factor)) and zero zeroes it (as grad.zero_()), counted every step."""
    policy = make_policy(
        {"name": "slow", "match": ["blocks.0.*", "embed.*"], "actions": [{"action": "scale", "factor": 0.3}]},
        {"name": "frozen", "match": "blocks.1.mlp.*", "actions": [{"action": "zero"}]},
    )

    def reference(model, step):
        for p in select(model, lambda n: n.startswith(("blocks.0.", "embed."))):
            p.grad.mul_(0.3)
        for p in select(model, lambda n: n.startswith("blocks.1.mlp.")):
            p.grad.zero_()

    run = run_pair("decoder", opt_name, policy, reference, steps=3)
    model = run.guarded.model
    n_slow = len(select(model, lambda n: n.startswith(("blocks.0.", "embed."))))
    n_frozen = len(select(model, lambda n: n.startswith("blocks.1.mlp.")))
    assert run.counters == {"slow": {"scale": 3 * n_slow}, "frozen": {"zero": 3 * n_frozen}}


def test_several_rules_on_one_parameter_apply_in_file_order(run_pair, make_policy, select):
    """A parameter matched by several rules gets every action of every rule, rule by rule in file order."""
    policy = make_policy(
        {"name": "boost", "match": "*", "actions": [{"action": "scale", "factor": 4.0}]},
        {"name": "clip-hidden", "match": "hidden.*", "actions": [{"action": "clip_norm", "max_norm": 2.0}]},
        {
            "name": "weights",
            "match": "*.weight",
            "actions": [{"action": "clip_value", "limit": 0.5}, {"action": "scale", "factor": 0.5}],
        },
    )

    def file_order(model):
        for p in model.parameters():
            p.grad.mul_(4.0)
        for p in select(model, lambda n: n.startswith("hidden.")):
            clip_grad_norm_([p], 2.0)
        for p in select(model, lambda n: n.endswith(".weight")):
            clip_grad_value_([p], 0.5)
            p.grad.mul_(0.5)

    def reversed_order(model):
        for p in select(model, lambda n: n.endswith(".weight")):
            p.grad.mul_(0.5)
            clip_grad_value_([p], 0.5)
        for p in select(model, lambda n: n.startswith("hidden.")):
            clip_grad_norm_([p], 2.0)
        for p in model.parameters():
            p.grad.mul_(4.0)

    def reference(model, step):
        if step == 0:  # on this data the order matters: the reverse order gives other gradients
            one, other = _with_grads(model), _with_grads(model)
            file_order(one)
            reversed_order(other)
            assert not torch.equal(one.hidden.weight.grad, other.hidden.weight.grad)
        file_order(model)

    run = run_pair("mlp", "sgd", policy, reference)
    assert set(run.counters) == {"boost", "clip-hidden", "weights"}
    assert all(run.counters[rule] for rule in run.counters)


def _with_grads(model):
    clone = copy.deepcopy(model)
    for mine, theirs in zip(clone.parameters(), model.parameters(), strict=True):
        mine.grad = None if theirs.grad is None else theirs.grad.clone()
    return clone


def test_step_windows_on_rules_and_actions_follow_from_step_and_until_step(run_pair, make_policy):
    """Rules and actions apply exactly on steps from_step <= step < until_step (0-based)."""
    policy = make_policy(
        {
            "name": "ramp",
            "match": "*",
            "from_step": 1,
            "until_step": 3,
            "actions": [{"action": "scale", "factor": 0.5}],
        },
        {
            "name": "staged",
            "match": "*",
            "actions": [
                {"action": "scale", "factor": 2.0, "until_step": 1},
                {"action": "clip_value", "limit": 0.3, "from_step": 1, "until_step": 2},
                {"action": "clip_norm", "max_norm": 1.0, "from_step": 3},
            ],
        },
    )

    def reference(model, step):
        params = list(model.parameters())
        if 1 <= step < 3:
            for p in params:
                p.grad.mul_(0.5)
        if step < 1:
            for p in params:
                p.grad.mul_(2.0)
        if 1 <= step < 2:
            clip_grad_value_(params, 0.3)
        if step >= 3:
            for p in params:
                clip_grad_norm_([p], 1.0)

    run = run_pair("mlp", "adamw", policy, reference, steps=5)
    n_params = len(list(run.guarded.model.parameters()))
    assert run.counters["ramp"] == {"scale": 2 * n_params}
    assert run.counters["staged"]["scale"] == n_params
    assert run.counters["staged"]["clip_value"] > 0
    assert run.counters["staged"]["clip_norm"] > 0


def test_parameters_without_gradient_are_skipped(run_pair, make_policy, make_workload):
    """A parameter whose grad is None is skipped by every action (as torch's functions skip it) and left untouched."""
    policy = make_policy(
        {"match": "*", "actions": [{"action": "scale", "factor": 3.0}, {"action": "clip_norm", "max_norm": 2.0}]},
        {"match": "*", "actions": [{"action": "clip_norm", "max_norm": 5.0, "scope": "group"}]},
    )

    def drop_hidden_bias(model, step):
        if step == 1:
            model.hidden.bias.grad = None

    def reference(model, step):
        with_grad = [p for p in model.parameters() if p.grad is not None]
        for p in with_grad:
            p.grad.mul_(3.0)
            clip_grad_norm_([p], 2.0)
        clip_grad_norm_(model.parameters(), 5.0)  # torch skips grad None itself

    initial = make_workload("mlp", with_spare=True)  # the same seed: the guarded model's starting point
    spare_before = [p.detach().clone() for p in initial.model.spare.parameters()]
    run = run_pair("mlp", "adamw", policy, reference, tamper=drop_hidden_bias, model_kwargs={"with_spare": True})
    spare = run.guarded.model.spare
    assert all(p.grad is None for p in spare.parameters())
    assert all(torch.equal(a, b) for a, b in zip(spare_before, spare.parameters(), strict=True))
    used = len(list(run.guarded.model.parameters())) - 2
    assert run.counters["r0"]["scale"] == 4 * used - 1  # hidden.bias had no gradient at step 1


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_second_optimizer_step_on_unchanged_gradient_does_not_reapply_actions(
    make_workload, make_optimizer, make_policy, same, opt_name
):
    """Calling opt.step() twice on one unchanged gradient applies the actions once; a new backward is treated again."""
    policy = make_policy({"match": "*", "actions": [{"action": "scale", "factor": 0.5}]})
    guarded = make_workload("mlp")
    ref = guarded.clone()
    opt_g = make_optimizer(opt_name, guarded.model.parameters())
    opt_r = make_optimizer(opt_name, ref.model.parameters())
    with GradGuard(guarded.model, policy, logger=None) as guard:
        for step in range(2):
            for side, opt in ((guarded, opt_g), (ref, opt_r)):
                opt.zero_grad()
                side.backward(step)
            for p in ref.model.parameters():
                p.grad.mul_(0.5)
            for _ in range(2):
                opt_g.step()
                opt_r.step()
            same(dict(guarded.model.named_parameters()), dict(ref.model.named_parameters()))
            same(opt_g.state_dict(), opt_r.state_dict())
            assert guard.step_count == step + 1
        assert guard.counters.snapshot() == {"r0": {"scale": 2 * 6}}


def test_accumulated_gradient_is_clipped_once_as_the_sum(make_workload, make_optimizer, make_policy, same):
    """With gradient accumulation over three micro-batches, the guard clips g1+g2+g3 once, at the step."""
    policy = make_policy({"match": "*", "actions": [{"action": "clip_norm", "max_norm": 2.0}]})
    guarded = make_workload("mlp")
    ref = guarded.clone()
    opt_g = make_optimizer("adamw", guarded.model.parameters())
    opt_r = make_optimizer("adamw", ref.model.parameters())
    with GradGuard(guarded.model, policy, logger=None) as guard:
        for step in range(2):
            for side, opt in ((guarded, opt_g), (ref, opt_r)):
                opt.zero_grad()
                for micro in range(3):
                    side.backward(10 * step + micro)
            for p in ref.model.parameters():
                clip_grad_norm_([p], 2.0)
            opt_g.step()
            opt_r.step()
            same(dict(guarded.model.named_parameters()), dict(ref.model.named_parameters()))
        assert guard.step_count == 2
        assert guard.counters.snapshot()["r0"]["clip_norm"] > 0


def test_manual_step_without_torch_optimizer_equals_reference(make_workload, make_policy, same):
    """guard.step() in a hand-written SGD loop treats the gradient exactly like the reference, once per step."""
    policy = make_policy(
        {"match": "*", "actions": [{"action": "clip_norm", "max_norm": 2.0}, {"action": "clip_value", "limit": 0.4}]}
    )
    guarded = make_workload("mlp")
    ref = guarded.clone()
    lr = 0.05
    with GradGuard(guarded.model, policy, logger=None) as guard:
        for step in range(3):
            for side in (guarded, ref):
                side.model.zero_grad(set_to_none=True)
                side.backward(step)
            guard.step()
            guard.step()  # the same, unchanged gradient: not treated twice
            assert guard.step_count == step + 1
            for p in ref.model.parameters():
                clip_grad_norm_([p], 2.0)
            clip_grad_value_(ref.model.parameters(), 0.4)
            for side in (guarded, ref):
                with torch.no_grad():
                    for p in side.model.parameters():
                        p.sub_(lr * p.grad)
            same(dict(guarded.model.named_parameters()), dict(ref.model.named_parameters()))
        assert guard.step_count == 3
        assert guard.counters.snapshot()["r0"]["clip_norm"] > 0


def test_optimizer_argument_names_the_boundary_and_an_unlisted_optimizer_is_still_guarded(
    make_workload, make_optimizer, make_policy, same
):
    """GradGuard(optimizer=opt): each optimizer treats what it steps; the unlisted one is guarded too, and warned of."""
    policy = make_policy({"match": "*", "actions": [{"action": "scale", "factor": 0.5}]})
    guarded = make_workload("mlp")
    ref = guarded.clone()

    def split(model):
        first = list(model.inp.parameters())
        rest = [p for p in model.parameters() if all(p is not q for q in first)]
        return first, rest

    g_first, g_rest = split(guarded.model)
    r_first, r_rest = split(ref.model)
    opts_g = [make_optimizer("adamw", g_first), make_optimizer("adamw", g_rest)]
    opts_r = [make_optimizer("adamw", r_first), make_optimizer("adamw", r_rest)]
    with GradGuard(guarded.model, policy, optimizer=opts_g[0], logger=None) as guard:
        for step in range(3):
            for side, opts in ((guarded, opts_g), (ref, opts_r)):
                for opt in opts:
                    opt.zero_grad()
                side.backward(step)
            for p in ref.model.parameters():
                p.grad.mul_(0.5)
            for opt in (*opts_r, opts_g[0]):
                opt.step()
            if step == 0:
                with pytest.warns(GuardWarning, match="not given as optimizer="):
                    opts_g[1].step()
            else:
                opts_g[1].step()
            same(dict(guarded.model.named_parameters()), dict(ref.model.named_parameters()))
        assert guard.counters.snapshot() == {"r0": {"scale": 3 * (len(g_first) + len(g_rest))}}
        assert guard.step_count == 3


def test_nan_in_one_gradient_does_not_spread_under_group_clip(
    make_workload, make_optimizer, make_policy, read_audit, tmp_path
):
    """A NaN in one gradient leaves the group's other gradients as they were (torch makes them NaN); it is reported."""
    policy = make_policy(
        {"name": "all", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.05, "scope": "group"}]}
    )
    workload = make_workload("mlp")
    opt = make_optimizer("sgd_plain", workload.model.parameters())
    log = tmp_path / "audit.jsonl"
    with GradGuard(workload.model, policy, audit_log=log, logger=None) as guard:
        workload.backward(0)
        workload.model.inp.weight.grad[0, 0] = float("nan")
        raw = {name: p.grad.clone() for name, p in workload.model.named_parameters()}

        torch_copy = [g.clone() for g in raw.values()]  # what torch would do to the same gradients
        holders = [torch.nn.Parameter(torch.zeros_like(g)) for g in torch_copy]
        for holder, g in zip(holders, torch_copy, strict=True):
            holder.grad = g
        clip_grad_norm_(holders, 0.05)
        assert all(bool(torch.isnan(h.grad).all()) for h in holders)

        opt.step()
        others = [name for name in raw if name != "inp.weight"]
        for name in others:
            grad = dict(workload.model.named_parameters())[name].grad
            assert torch.equal(grad, raw[name]), name
            assert bool(torch.isfinite(grad).all()), name
        nan_grad = workload.model.inp.weight.grad
        assert int(torch.isnan(nan_grad).sum()) == 1
        assert torch.equal(nan_grad.nan_to_num(0.0), raw["inp.weight"].nan_to_num(0.0))
        assert guard.counters.snapshot()["all"].get("nan") == 1
    events = read_audit(log)
    by_name = {e["event"]: e for e in events}
    assert by_name["nonfinite"]["param"] == "inp.weight"
    assert by_name["nonfinite"]["kind"] == "nan"
    assert by_name["nonfinite"]["halts"] is False
    assert by_name["nonfinite_group_norm"]["rule"] == "all"
    assert by_name["nonfinite_group_norm"]["kind"] == "nan"
    assert by_name["nonfinite_unhalted"]["params"] == ["inp.weight"]
    assert not [e for e in events if e["event"] == "intervention"]


# --- what a step costs: host syncs, hooks ---------------------------------------------------------


def test_one_host_sync_per_guarded_step_and_none_during_backward(make_workload, make_optimizer, make_policy):
    """A guarded optimizer step (per-tensor clip + halt on every param) costs one host sync; backward costs none."""
    policy = make_policy(
        {"name": "halt", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
        {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.05}]},
    )
    workload = make_workload("decoder")
    opt = make_optimizer("sgd", workload.model.parameters())
    batch = workload.batch(0)

    opt.zero_grad()
    workload.loss(batch).backward()
    unguarded = count_host_syncs(opt.step)  # what the optimizer itself costs

    with GradGuard(workload.model, policy, logger=None) as guard:
        for step in range(2):
            opt.zero_grad()
            loss = workload.loss(batch)
            assert count_host_syncs(loss.backward) == 0
            assert count_host_syncs(opt.step) - unguarded == 1
            assert guard.step_count == step + 1
        assert guard.counters.total("clip_norm") > 0


SYNC_POLICIES = {
    "halt-and-tensor-clip": (
        {"name": "halt", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
        {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.05}]},
    ),
    "group-clip-value-scale": (
        {
            "name": "all",
            "match": "*",
            "actions": [
                {"action": "clip_norm", "max_norm": 0.05, "scope": "group"},
                {"action": "clip_value", "limit": 0.001},
                {"action": "scale", "factor": 0.5},
            ],
        },
    ),
}


@pytest.mark.parametrize("poison", [False, True])
@pytest.mark.parametrize("policy_name", list(SYNC_POLICIES))
def test_one_host_sync_also_for_group_clips_and_for_a_step_with_nan(make_workload, make_policy, policy_name, poison):
    """Group clip, clip_value and scale together, and a step whose gradient holds NaN (halted or not): one sync (the
    default provenance's replay of a faulting step reads once more: the test below)."""
    workload = make_workload("mlp")
    opt = torch.optim.SGD(workload.model.parameters(), lr=0.01)
    policy = make_policy(*SYNC_POLICIES[policy_name])
    with GradGuard(workload.model, policy, logger=None, provenance=None) as guard:
        workload.backward(0)
        if poison:
            workload.model.hidden.weight.grad[0, 0] = float("nan")

        def step():
            try:
                opt.step()
            except GradientHalt:
                assert poison

        assert count_host_syncs(step) == 1
        assert guard.step_count == 1


@pytest.mark.parametrize("policy_name", list(SYNC_POLICIES))
def test_the_default_provenance_reads_once_more_only_at_a_faulting_step_it_replays(
    make_workload, make_policy, policy_name
):
    """A clean step: one sync. A step whose gradient holds NaN: the step's read, and one for the replay's figures."""
    workload = make_workload("mlp")
    opt = torch.optim.SGD(workload.model.parameters(), lr=0.01)
    with GradGuard(workload.model, make_policy(*SYNC_POLICIES[policy_name]), logger=None):
        for poison, expected in ((False, 1), (True, 2)):
            opt.zero_grad()
            workload.backward(0)
            if poison:
                workload.model.hidden.weight.grad[0, 0] = float("nan")

            def step() -> None:
                with contextlib.suppress(GradientHalt):
                    opt.step()

            assert count_host_syncs(step) == expected, poison


def test_sync_counter_sees_item_and_tolist(make_workload):
    """The sync counter used above is not blind: .item() and .tolist() each count once. A tensor made on the host from
    Python numbers, and what is computed from it alone, is read without a sync (on a GPU it never left the host); it
    counts as a tensor sent from Python data once it meets another tensor."""
    t = torch.ones(3)
    assert count_host_syncs(lambda: t.sum().item()) == 1
    assert count_host_syncs(lambda: t.tolist()) == 1
    assert count_host_syncs(lambda: t * 2) == 0
    assert count_host_syncs(lambda: torch.tensor([[1.0, 2.0]]).mean(dim=1).tolist()) == 0
    assert count_host_syncs(lambda: torch.tensor([1.0, 2.0]).sum().item()) == 0
    assert count_host_syncs(lambda: (t * torch.tensor(2.0)).sum().item()) == 1
    assert count_host_syncs(lambda: torch.where(torch.tensor([1.0]) > 0, torch.tensor([2.0]), math.inf).tolist()) == 0
    assert count_host_syncs(lambda: torch.where(t > 0, t, math.inf).tolist()) == 1
    assert count_python_data_tensors(lambda: torch.tensor([1.0, 2.0]).mean()) == 0
    assert count_python_data_tensors(lambda: t * torch.tensor([1.0, 2.0, 3.0])) == 1
    assert count_python_data_tensors(lambda: torch.tensor([1.0, 2.0], device=t.device)) == 1  # a copy on a GPU

    def five_made_one_after_another() -> None:  # each freed before the next: their ids may repeat
        for _ in range(5):
            t.mul_(torch.tensor([1.0, 1.0, 1.0]))

    assert count_python_data_tensors(five_made_one_after_another) == 5

    def written_from_another_tensor() -> list[float]:
        host = torch.tensor([1.0, 2.0, 3.0])
        host.copy_(t * 2)  # now holds the other tensor's data: a read of it waits for that
        return host.tolist()

    assert count_host_syncs(written_from_another_tensor) == 1


def test_no_hooks_are_registered_on_parameters(make_workload, make_policy):
    """By default the guard registers no hook on any parameter: it acts only at the optimizer step; its
    provenance (``first_fault``) observes module outputs only; ``provenance="always"`` adds observing hooks only."""
    workload = make_workload("decoder")
    policy = make_policy(
        {"match": "*", "actions": [{"action": "halt_on_nonfinite"}, {"action": "clip_norm", "max_norm": 1.0}]}
    )
    with GradGuard(workload.model, policy, logger=None):
        for p in workload.model.parameters():
            assert not p._backward_hooks
            assert not getattr(p, "_post_accumulate_grad_hooks", None)
        assert not workload.model._backward_hooks
        assert len(workload.model._forward_hooks) == 1  # first_fault's light trace: it reads outputs only
    with GradGuard(workload.model, policy, logger=None, provenance=None):
        assert not workload.model._forward_hooks
        assert not workload.model._forward_pre_hooks
    with GradGuard(workload.model, policy, logger=None, provenance="always"):
        for p in workload.model.parameters():
            assert not p._backward_hooks
            assert len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) == 1  # the gradient flags
        assert len(workload.model._forward_hooks) == 1
    for p in workload.model.parameters():
        assert not getattr(p, "_post_accumulate_grad_hooks", None)  # remove() took every hook away
    assert not workload.model._forward_hooks
