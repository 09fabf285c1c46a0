"""A per-tensor clip (or a clamp) followed in the same step by a group clip over the same tensors waits for the
step's read, and the group clip checks after it (``Plan.held_ids``, ``clipping.clip_group_after_read``).

The gradients must be bitwise those of torch's own functions applied in policy order (the per-tensor clip on the
device before the group clip reads it); the launches must not grow with the number of tensors; the group clip's
figures, when they could only be taken after the read, are reported with the next step's read or at close, under
their own step, and never for a step that was skipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_, clip_grad_value_

from gradguard import GradGuard, Policy
from gradguard.enforce.plans.plan import Plan

EMBED = "*embed*"
ATTENTION = r"re:blocks\.\d+\.attn\..*"
NORMS = "*norm*"
GROUP = "group"


def chained_policy(embed: float, attention: float, limit: float, group: float, group_match: Any = "*") -> Policy:
    return Policy.from_dict(
        {
            "version": 1,
            "rules": [
                {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
                {"name": "embeddings", "match": EMBED, "actions": [{"action": "clip_norm", "max_norm": embed}]},
                {"name": "attention", "match": ATTENTION, "actions": [{"action": "clip_norm", "max_norm": attention}]},
                {"name": "norms", "match": NORMS, "actions": [{"action": "clip_value", "limit": limit}]},
                {
                    "name": "global",
                    "match": group_match,
                    "actions": [{"action": "clip_norm", "max_norm": group, "scope": "group"}],
                },
            ],
        }
    )


def in_policy_order(embed: float, attention: float, limit: float, group: float, in_group=lambda name: True):
    """torch's own functions, rule by rule: what the chained policy says."""

    def reference(model: nn.Module, step: int) -> None:
        named = list(model.named_parameters())
        for name, p in named:
            if "embed" in name:
                clip_grad_norm_([p], embed)
        for name, p in named:
            if ".attn." in name and name.startswith("blocks."):
                clip_grad_norm_([p], attention)
        for name, p in named:
            if "norm" in name:
                clip_grad_value_([p], limit)
        return clip_grad_norm_([p for name, p in named if in_group(name)], group)

    return reference


def _attention_or_embedding(name: str) -> bool:
    return "embed" in name or (".attn." in name and name.startswith("blocks."))


# (embed max_norm, attention max_norm, clip_value limit, group max_norm): what fires on the decoder's gradients
# (global norms 2.0, 1.34, 1.07 over the steps; embeddings 0.5-1.5; attention 0.02-0.14; norms' peaks ~0.01).
CASES = {
    "nothing clipped": (100.0, 100.0, 10.0, 100.0),
    "the held clips and the group clip after them": (0.3, 0.05, 0.001, 0.5),
    "the held clips, and then the group is below its limit": (0.3, 0.05, 0.001, 1.5),
    "only the group clip": (100.0, 100.0, 10.0, 0.5),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("opt_name", ["sgd", "adamw_fused"])
def test_a_chain_of_clips_held_for_the_read_gives_torchs_gradients_bit_for_bit(run_pair, case, opt_name):
    thresholds = CASES[case]
    run = run_pair("decoder", opt_name, chained_policy(*thresholds), in_policy_order(*thresholds), steps=4)
    counted = run.guard.counters.snapshot()
    if case == "nothing clipped":
        assert counted == {}
    elif case == "only the group clip":
        assert set(counted) == {"global"}
    else:
        assert {"embeddings", "attention", "norms"} <= set(counted)
        assert ("global" in counted) == (case == "the held clips and the group clip after them")


def test_a_group_over_the_held_tensors_only_that_ends_below_its_limit_is_left_as_it_is(run_pair):
    """The read says the group is above 0.4 before the per-tensor clips; after them it is not: nothing more."""
    thresholds = (0.01, 0.01, 0.001, 0.4)
    policy = chained_policy(*thresholds, group_match=["*embed*", ATTENTION])
    run = run_pair("decoder", "sgd", policy, in_policy_order(*thresholds, in_group=_attention_or_embedding))
    assert "global" not in run.guard.counters.snapshot()


def _each_then_group(model: nn.Module) -> GradGuard:
    policy = Policy.from_dict(
        {
            "version": 1,
            "rules": [
                {"name": "each", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.5}]},
                {"name": "global", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 1.0, "scope": GROUP}]},
            ],
        }
    )
    return GradGuard(model, policy, logger=None)


def _layers(dtypes: tuple[torch.dtype, torch.dtype], grads: list[torch.Tensor] | None = None) -> nn.Module:
    torch.manual_seed(3)
    model = nn.ModuleDict({f"layer{i}": nn.Linear(8, 8).to(dtypes[i % 2]) for i in range(4)})
    for i, p in enumerate(model.parameters()):
        p.grad = torch.randn_like(p) * (1 + i) if grads is None else grads[i].clone()
    return model


def test_held_clips_over_two_float_dtypes_sum_the_groups_norms_in_torchs_order(same):
    model = _layers((torch.float32, torch.float64))
    raw = [p.grad.clone() for p in model.parameters()]
    with _each_then_group(model) as guard:
        guard.step()
    expected = [nn.Parameter(torch.zeros_like(g)) for g in raw]
    for p, g in zip(expected, raw, strict=True):
        p.grad = g.clone()
        clip_grad_norm_([p], 0.5)
    clip_grad_norm_(expected, 1.0)
    same([p.grad for p in model.parameters()], [p.grad for p in expected])
    assert guard.counters.snapshot() == {"each": {"clip_norm": len(raw)}, "global": {"clip_norm": len(raw)}}


def test_held_clips_on_bfloat16_gradients_are_what_the_clips_on_the_device_gave(same, monkeypatch):
    """Half-precision norms are the guard's own (in float32, docs/limits.md), so the reference is the guard with
    nothing held: every clip on the device before the read."""
    model = _layers((torch.bfloat16, torch.float32))
    raw = [p.grad.clone() for p in model.parameters()]
    with _each_then_group(model) as guard:
        guard.step()
    held = [p.grad.clone() for p in model.parameters()]
    monkeypatch.setattr(Plan, "held_ids", lambda *args: frozenset())
    again = _layers((torch.bfloat16, torch.float32), raw)
    with _each_then_group(again) as unheld:
        unheld.step()
    same(held, [p.grad for p in again.parameters()])
    assert guard.counters.snapshot() == unheld.counters.snapshot()


def _log_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_the_group_clip_after_held_clips_is_reported_with_the_next_read_under_its_own_step(
    make_workload, tmp_path: Path
):
    """Its figures come with the next step's read (no second read in the step), or at close, and say what torch's
    clip returned: the total norm of the gradients the per-tensor clips left."""
    thresholds = (0.3, 0.05, 0.001, 0.2)  # the group clips at every step, after the others
    work = make_workload("decoder")
    ref = work.clone()
    reference = in_policy_order(*thresholds)
    log = tmp_path / "guard.jsonl"
    totals: list[float] = []
    seen_after_step: list[list[int]] = []
    guard = GradGuard(work.model, chained_policy(*thresholds), audit_log=log, logger=None)
    opt = torch.optim.SGD(work.model.parameters(), lr=0.01)
    opt_ref = torch.optim.SGD(ref.model.parameters(), lr=0.01)
    for step in range(3):
        for side, optimizer in ((work, opt), (ref, opt_ref)):
            optimizer.zero_grad(set_to_none=True)
            side.backward(step)
        totals.append(float(reference(ref.model, step)))  # what torch's group clip returned
        opt.step()
        opt_ref.step()
        guard.flush()
        seen_after_step.append([e["step"] for e in _log_lines(log) if e.get("rule") == "global"])
    guard.remove()
    group = [e for e in _log_lines(log) if e.get("rule") == "global"]
    assert seen_after_step == [[], [0], [0, 1]]  # each step's comes with the next step's read
    assert [e["step"] for e in group] == [0, 1, 2]  # the last one at detach
    assert [e["before"] for e in group] == totals
    n_params = len(list(work.model.parameters()))
    assert all(e["coef"] < 1.0 and e["n_params"] == n_params for e in group)
    assert guard.counters.snapshot()["global"]["clip_norm"] == 3 * n_params


def test_a_skipped_steps_group_clip_after_held_clips_is_not_reported(make_workload, tmp_path: Path):
    """A NaN outside the group skips step 1: its interventions did not happen, the carried ones included."""
    policy = Policy.from_dict(
        {
            "version": 1,
            "rules": [
                {"name": "skip", "match": "*", "actions": [{"action": "skip_step_on_nonfinite"}]},
                {"name": "embeddings", "match": EMBED, "actions": [{"action": "clip_norm", "max_norm": 0.01}]},
                {
                    "name": "global",
                    "match": [EMBED, ATTENTION],
                    "actions": [{"action": "clip_norm", "max_norm": 0.001, "scope": "group"}],
                },
            ],
        }
    )
    work = make_workload("decoder")
    log = tmp_path / "guard.jsonl"
    with GradGuard(work.model, policy, audit_log=log, logger=None) as guard:
        opt = torch.optim.SGD(work.model.parameters(), lr=0.01)
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            work.backward(step)
            if step == 1:
                work.model.get_parameter("blocks.0.mlp.0.weight").grad[0, 0] = float("nan")
            opt.step()
    group = [e for e in _log_lines(log) if e.get("rule") == "global"]
    assert [e["step"] for e in group] == [0, 2]
    n_group = sum(1 for name, _ in work.model.named_parameters() if _attention_or_embedding(name))
    assert guard.counters.snapshot()["global"]["clip_norm"] == 2 * n_group
    assert guard.counters.snapshot()["skip"]["skip_step_on_nonfinite"] == 1


@pytest.mark.parametrize("state", ["nothing clipped", "every tensor clipped"])
def test_the_mixed_policys_launches_do_not_grow_with_the_number_of_tensors(
    dispatch_bench: ModuleType, state: str
) -> None:
    bench = dispatch_bench
    mixed = next(t for t in bench.TREATMENTS if t.name == "guard: mixed")
    small = bench.measure(bench.Gradients(20), mixed, state, steps=2)
    large = bench.measure(bench.Gradients(400), mixed, state, steps=2)
    assert large.launches == small.launches
    assert large.host_reads == small.host_reads == 1
    if state == "nothing clipped":
        assert large.bytes_g < 1.25  # the gradients read once, nothing written


def test_a_held_clamp_that_makes_an_inf_finite_leaves_the_group_clip_to_clip_as_torch_does(same):
    """The group's total as the gradients arrived is Inf; after the clamp it is finite, and the group clip clips."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()
    model[0].weight.grad[0, 0] = float("inf")
    raw = [p.grad.clone() for p in model.parameters()]
    policy = Policy.from_dict(
        {
            "version": 1,
            "rules": [
                {"name": "clamp", "match": "0.*", "actions": [{"action": "clip_value", "limit": 0.1}]},
                {"name": "global", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 1.0, "scope": GROUP}]},
            ],
        }
    )
    with GradGuard(model, policy, logger=None) as guard:
        guard.step()
    expected = [nn.Parameter(torch.zeros_like(g)) for g in raw]
    for p, g in zip(expected, raw, strict=True):
        p.grad = g.clone()
    clip_grad_value_(expected[:2], 0.1)
    clip_grad_norm_(expected, 1.0)
    same([p.grad for p in model.parameters()], [p.grad for p in expected])
    assert guard.counters.snapshot()["global"] == {"clip_norm": 4}
