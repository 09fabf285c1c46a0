"""zclip, autoclip and skip_step_on_spike against references written from their papers' formulas.

The guard is driven with gradients whose norms follow chosen sequences (steady noise, spikes, a NaN
and an Inf), through ``guard.step()`` on real parameters, and every step's decision, threshold,
clipped gradient and the statistics left behind are compared with a plain-Python reference of the
formula: ZClip (arXiv 2504.02507, the authors' code), AutoClip (arXiv 2007.14469: ``np.percentile`` of
the history and the current norm, then ``clip_grad_norm_``), OLMo-core's spike rule (``norm - mean >
z * std`` with ``torch.std_mean``). The statistics are float64 on both sides; they agree to 1e-12 and
the decisions agree exactly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from gradguard import GradGuard, GradientHalt, Policy, PolicyError
from gradguard.audit.fields import per_parameter
from tests.support.host_syncs import count_host_syncs

EPS = 1e-6
DIRECTION = torch.tensor([3.0, -4.0, 12.0, 0.0]) / 13.0  # unit 2-norm


def norm_sequence(seed: int, steps: int = 70, bad: dict[int, float] | None = None) -> list[float]:
    """Norms around 1 with 10% noise, then the ``bad`` values (spikes, NaN, Inf) at their steps."""
    rng = np.random.default_rng(seed)
    norms = [float(1.0 + 0.1 * rng.standard_normal()) for _ in range(steps)]
    for step, value in (bad or {}).items():
        norms[step] = value
    return norms


SEQUENCES = {
    "a": norm_sequence(0, bad={30: 25.0, 31: 8.0, 45: 60.0, 38: math.nan, 50: math.inf}),
    "b": norm_sequence(1, bad={33: 40.0, 40: math.nan, 41: math.nan, 60: 0.01}),
}


class TwoParams(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(4))
        self.b = nn.Parameter(torch.zeros(4))


def policy_of(*actions: dict[str, Any], extra: list[dict[str, Any]] | None = None) -> Policy:
    rules = [{"name": "adaptive", "match": ["*"], "actions": list(actions)}, *(extra or [])]
    return Policy.from_dict({"version": 1, "rules": rules})


def drive(
    policy: Policy, steps: int, log: Path | None = None
) -> tuple[list[dict[str, tuple[torch.Tensor, torch.Tensor]]], list[bool], GradGuard]:
    """Each step, set ``a.grad`` and ``b.grad`` to DIRECTION times the sequences' norms, then ``guard.step()``.

    Returns per step {name: (gradient before, gradient after)}, whether each step was applied, the guard.
    """
    model = TwoParams()
    history: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    applied: list[bool] = []
    guard = GradGuard(model, policy, logger=None, audit_log=log)
    with guard:
        for step in range(steps):
            record = {}
            for name, param in model.named_parameters():
                param.grad = DIRECTION * SEQUENCES[name][step]
                record[name] = (param.grad.clone(), param.grad)
            applied.append(guard.step())
            if not applied[-1]:  # a skip leaves the optimizer nothing to apply
                assert all(param.grad is None for param in model.parameters())
            history.append({name: (before, after.clone()) for name, (before, after) in record.items()})
    return history, applied, guard


def float32_norm(grad: torch.Tensor) -> float:
    """The norm the guard sees (float32, as torch computes it), as the reference's input."""
    return float(torch.linalg.vector_norm(grad))


def float32_norm_t(grad: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(grad)


def statistics_of(guard: GradGuard, rule: str = "adaptive", position: int = 0) -> dict[str, Any]:
    return guard.state_dict()["statistics"][rule][str(position)]


# --- ZClip ----------------------------------------------------------------------------------------


class ZClipReference:
    """ZClip as its authors' code does it, with non-finite norms left out of the statistics."""

    def __init__(
        self,
        alpha: float,
        z_thresh: float,
        warmup: int,
        max_norm: float | None,
        max_norm_ratio: float | None = None,
        ratio_floor: float | None = None,
    ) -> None:
        self.alpha, self.z_thresh, self.warmup, self.max_norm = alpha, z_thresh, warmup, max_norm
        self.max_norm_ratio, self.ratio_floor = max_norm_ratio, ratio_floor
        self.buffer: list[float] = []
        self.mean: float | None = None
        self.var = 0.0

    def step(self, norm: float) -> tuple[float, float]:
        """Returns (coefficient, the limit the norm was held to)."""
        if not math.isfinite(norm):
            return 1.0, math.nan
        # The warm-up scale: the mean of the warm-up norms so far (none before the first), then of all of them.
        scale = self.buffer_mean if self.buffer else 0.0
        if self.mean is None:
            limit = self._ratio_ceiling(self.max_norm if self.max_norm is not None else math.inf, scale)
            self.buffer.append(norm)
            if len(self.buffer) >= self.warmup:
                self.mean = sum(self.buffer) / len(self.buffer)
                self.var = sum((x - self.mean) ** 2 for x in self.buffer) / len(self.buffer)
        else:
            std = self.var**0.5
            z = (norm - self.mean) / (std + EPS)
            adaptive = self.mean + self.z_thresh**2 / z * std if z > self.z_thresh else norm
            limit = self._ratio_ceiling(adaptive if self.max_norm is None else min(adaptive, self.max_norm), scale)
            self.mean = self.alpha * self.mean + (1 - self.alpha) * adaptive
            self.var = self.alpha * self.var + (1 - self.alpha) * (adaptive - self.mean) ** 2
        return (limit / (norm + EPS) if norm > limit else 1.0), limit

    def _ratio_ceiling(self, limit: float, scale: float) -> float:
        if self.max_norm_ratio is None or scale <= 0:
            return limit
        return min(limit, max(self.max_norm_ratio * scale, self.ratio_floor or 0.0))

    @property
    def buffer_mean(self) -> float:
        """The mean of the warm-up norms so far: after warm-up, the first mean."""
        return sum(self.buffer) / len(self.buffer)


@pytest.mark.parametrize(
    ("z_thresh", "max_norm", "max_norm_ratio", "ratio_floor", "ceiling_clips"),
    [
        (2.5, None, None, None, None),
        (2.5, 3.0, None, None, None),
        (1e6, None, 3.0, None, {"a": [30, 31, 45], "b": [33]}),
        (1e6, None, 3.0, 30.0, {"a": [45], "b": [33]}),
    ],
    ids=["adaptive", "and a ceiling", "a ceiling relative to the warm-up scale", "and its floor"],
)
def test_zclip_clips_each_tensor_as_the_zclip_formula_says_and_a_nan_never_enters_its_statistics(
    z_thresh: float,
    max_norm: float | None,
    max_norm_ratio: float | None,
    ratio_floor: float | None,
    ceiling_clips: dict[str, list[int]] | None,
    tmp_path: Path,
) -> None:
    """Per tensor: warm-up, then z-score clips at the spikes, EMA of the clipped norms; NaN/Inf left out. With
    ``max_norm_ratio`` and a z-score threshold too high ever to act, only the spikes above that multiple of the first
    mean (at least ``ratio_floor``: 25 and 8 are under 30) are clipped, to it."""
    action = {"action": "zclip", "alpha": 0.9, "z_thresh": z_thresh, "warmup_steps": 10, "max_norm": max_norm}
    if max_norm_ratio is not None:
        action |= {"max_norm_ratio": max_norm_ratio, "ratio_floor": ratio_floor}
    log = tmp_path / "run.jsonl"
    history, applied, guard = drive(policy_of(action), 70, log)
    assert all(applied)
    references = {name: ZClipReference(0.9, z_thresh, 10, max_norm, max_norm_ratio, ratio_floor) for name in "ab"}
    clipped_steps: dict[str, list[int]] = {"a": [], "b": []}
    for step, grads in enumerate(history):
        for name, (before, after) in grads.items():
            coef, _ = references[name].step(float32_norm(before))
            if coef < 1.0:
                clipped_steps[name].append(step)
            torch.testing.assert_close(after, before * coef, rtol=1e-6, atol=0, equal_nan=True)
    if ceiling_clips is not None:  # only the relative ceiling clipped, exactly at the spikes above it
        assert clipped_steps == ceiling_clips
    else:
        assert 30 in clipped_steps["a"]
        assert 45 in clipped_steps["a"]
        assert 33 in clipped_steps["b"]
    if max_norm is not None:
        assert {30, 31, 45} <= set(clipped_steps["a"])  # the fixed ceiling holds during warm-up and after
    stats = statistics_of(guard)
    assert stats["names"] == ["a", "b"]
    for column, name in enumerate(("a", "b")):
        reference = references[name]
        assert reference.mean is not None
        assert math.isfinite(stats["tensors"]["mean"][column])
        assert stats["tensors"]["mean"][column] == pytest.approx(reference.mean, rel=1e-12)
        assert stats["tensors"]["var"][column] == pytest.approx(reference.var, rel=1e-12)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    clips = [one for e in events if e["event"] == "adaptive_clip" for one in per_parameter(e)]
    assert sorted((e["param"], e["step"]) for e in clips) == sorted(
        (name, step) for name, steps in clipped_steps.items() for step in steps
    )
    spike = next(e for e in clips if e["param"] == "a" and e["step"] == 45)
    assert spike["action"] == "zclip"
    assert spike["z"] > 2.5
    if ceiling_clips is not None:
        assert spike["z"] < z_thresh
        assert spike["threshold"] == pytest.approx(max(3.0 * references["a"].buffer_mean, ratio_floor or 0.0))
    assert spike["after"] == pytest.approx(spike["threshold"])
    assert guard.counters.snapshot()["adaptive"]["zclip"] == len(clips)


def test_in_warm_up_the_relative_ceiling_holds_a_norm_to_its_multiple_of_the_norms_so_far(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A spike at step 5 of a 10-step warm-up is held to 3x the mean of the 5 norms before it (a NaN at step 2 does not
    enter it); the first step has no scale yet, so a spike there passes; none is clipped on ``b``."""
    monkeypatch.setitem(SEQUENCES, "a", norm_sequence(2, steps=12, bad={0: 7.0, 2: math.nan, 5: 40.0}))
    monkeypatch.setitem(SEQUENCES, "b", norm_sequence(3, steps=12))
    action = {"action": "zclip", "z_thresh": 1e6, "warmup_steps": 10, "max_norm_ratio": 3.0}
    history, applied, _ = drive(policy_of(action), 12)
    assert all(applied)
    reference = ZClipReference(0.97, 1e6, 10, None, 3.0)
    clipped = []
    for step, grads in enumerate(history):
        before, after = grads["a"]
        coef, limit = reference.step(float32_norm(before))
        torch.testing.assert_close(after, before * coef, rtol=1e-6, atol=0, equal_nan=True)
        if coef < 1.0:
            clipped.append(step)
            assert float32_norm(after) == pytest.approx(limit, rel=1e-6)
        assert torch.equal(grads["b"][0], grads["b"][1]) or math.isnan(float32_norm(grads["b"][0]))
    earlier = [float32_norm(history[step]["a"][0]) for step in (0, 1, 3, 4)]
    assert clipped == [5]
    assert float32_norm(history[5]["a"][1]) == pytest.approx(3.0 * sum(earlier) / 4, rel=1e-6)


def test_per_tensor_adaptive_clips_are_one_log_line_per_rule_and_step_listing_each_clipped_parameter(
    tmp_path: Path,
) -> None:
    """scope: tensor: one adaptive_clip event per step whose lists hold each clipped parameter's figures."""
    log = tmp_path / "run.jsonl"
    drive(policy_of({"action": "autoclip", "percentile": 10.0, "history": 8}), 20, log)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    clips = [e for e in events if e["event"] == "adaptive_clip"]
    assert len({e["step"] for e in clips}) == len(clips)  # one line per step
    both = next(e for e in clips if e["n_params"] == 2)
    assert both["param"] is None
    assert both["params"] == ["a", "b"]
    assert all(len(both[key]) == 2 for key in ("before", "after", "coef", "threshold", "samples"))
    expanded = per_parameter(both)
    assert [(one["param"], one["before"]) for one in expanded] == list(zip(both["params"], both["before"], strict=True))


def test_zclip_on_a_group_clips_the_joint_norm_with_one_set_of_statistics() -> None:
    """``scope: group``: the rule's joint 2-norm follows the formula; both tensors get one coefficient."""
    action = {"action": "zclip", "alpha": 0.97, "z_thresh": 2.5, "warmup_steps": 5, "scope": "group"}
    history, _, guard = drive(policy_of(action), 70)
    reference = ZClipReference(0.97, 2.5, 5, None)
    clips = 0
    for grads in history:
        joint = float(torch.linalg.vector_norm(torch.stack([float32_norm_t(b) for b, _ in grads.values()])))
        coef, _ = reference.step(joint)
        clips += coef < 1.0
        for before, after in grads.values():
            torch.testing.assert_close(after, before * coef, rtol=1e-6, atol=0, equal_nan=True)
    assert clips >= 2
    stats = statistics_of(guard)
    assert stats["names"] == ["adaptive"]
    assert stats["tensors"]["mean"][0] == pytest.approx(reference.mean, rel=1e-12)


# --- AutoClip -------------------------------------------------------------------------------------


class AutoClipReference:
    """AutoClip: clip to ``np.percentile`` of the recent norms and this one, as ``clip_grad_norm_`` would."""

    def __init__(self, percentile: float, history: int) -> None:
        self.percentile, self.history = percentile, history
        self.seen: list[float | None] = []  # one entry per applied step; None for a non-finite norm

    def step(self, norm: float, applied: bool = True) -> tuple[float, float]:
        recent = self.seen[max(0, len(self.seen) - (self.history - 1)) :] if self.history > 1 else []
        candidates = [x for x in [*recent, norm if math.isfinite(norm) else None] if x is not None]
        threshold = float(np.percentile(candidates, self.percentile)) if candidates else math.nan
        if applied:
            self.seen.append(norm if math.isfinite(norm) else None)
        if not math.isfinite(norm) or not math.isfinite(threshold):
            return 1.0, threshold
        return min(1.0, threshold / (norm + EPS)), threshold


@pytest.mark.parametrize(("percentile", "history"), [(10.0, 16), (50.0, 7), (90.0, 128)])
def test_autoclip_clips_to_the_percentile_of_the_recent_norms_as_numpy_computes_it(
    percentile: float, history: int, tmp_path: Path
) -> None:
    """The threshold is numpy's percentile to the last bit; the gradients are as clip_grad_norm_ leaves them."""
    log = tmp_path / "run.jsonl"
    action = {"action": "autoclip", "percentile": percentile, "history": history}
    steps, _, guard = drive(policy_of(action), 70, log)
    references = {name: AutoClipReference(percentile, history) for name in ("a", "b")}
    thresholds: dict[tuple[str, int], float] = {}
    for step, grads in enumerate(steps):
        for name, (before, after) in grads.items():
            coef, threshold = references[name].step(float32_norm(before))
            thresholds[(name, step)] = threshold
            torch.testing.assert_close(after, before * coef, rtol=1e-6, atol=0, equal_nan=True)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    clips = [one for e in events if e["event"] == "adaptive_clip" for one in per_parameter(e)]
    assert clips
    for event in clips:
        assert event["threshold"] == thresholds[(event["param"], event["step"])]  # bitwise: numpy's own order
    stats = statistics_of(guard)
    ring = np.array(stats["tensors"]["ring"])
    for column, name in enumerate(("a", "b")):
        kept = sorted(x for x in references[name].seen[-history:] if x is not None)
        assert sorted(ring[column][np.isfinite(ring[column])].tolist()) == kept


# --- skip_step_on_spike ---------------------------------------------------------------------------


class SpikeReference:
    """OLMo-core's rule: skip when norm - mean > z * std over the last ``window`` applied steps."""

    def __init__(self, z_thresh: float, window: int, min_samples: int) -> None:
        self.z_thresh, self.window, self.min_samples = z_thresh, window, min_samples
        self.seen: list[float | None] = []

    def spikes(self, norm: float) -> bool:
        values = [x for x in self.seen[-self.window :] if x is not None]
        if not math.isfinite(norm) or len(values) < self.min_samples:
            return False
        std, mean = torch.std_mean(torch.tensor(values, dtype=torch.float64))
        return norm - float(mean) > self.z_thresh * float(std)

    def applied(self, norm: float) -> None:
        self.seen.append(norm if math.isfinite(norm) else None)


def test_skip_step_on_spike_skips_exactly_the_steps_the_reference_rule_skips(tmp_path: Path) -> None:
    """Group scope (the rule's joint norm): the spikes are skipped, a NaN is not, neither enters the window."""
    log = tmp_path / "run.jsonl"
    action = {"action": "skip_step_on_spike", "z_thresh": 4.0, "window": 20, "min_samples": 10}
    steps, applied, guard = drive(policy_of(action), 70, log)
    reference = SpikeReference(4.0, 20, 10)
    expected = []
    for grads in steps:
        joint = float(torch.linalg.vector_norm(torch.stack([float32_norm_t(b) for b, _ in grads.values()])))
        spike = reference.spikes(joint)
        expected.append(not spike)
        if not spike:
            reference.applied(joint)
    assert applied == expected
    skipped = [step for step, ok in enumerate(applied) if not ok]
    assert skipped
    assert {30, 33, 45} <= set(skipped)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    spikes = [e for e in events if e["event"] == "spike_skip"]
    assert [e["step"] for e in spikes] == skipped
    assert all(e["z"] > 4.0 and e["samples"] >= 10 and e["params"] == ["a", "b"] for e in spikes)
    assert guard.counters.snapshot()["adaptive"]["skip_step_on_spike"] == len(skipped)
    ring = np.array(statistics_of(guard)["tensors"]["ring"][0])
    kept = sorted(x for x in reference.seen[-20:] if x is not None)
    assert sorted(ring[np.isfinite(ring)].tolist()) == pytest.approx(kept, rel=1e-12)


def test_a_spike_is_judged_on_the_gradient_as_it_arrived_before_an_earlier_clip() -> None:
    """A clip_norm placed before the spike watch in the policy cannot hide the spike from it."""
    clip = {"name": "clip", "match": ["*"], "actions": [{"action": "clip_norm", "max_norm": 0.5}]}
    policy = Policy.from_dict(
        {
            "version": 1,
            "rules": [
                clip,
                {
                    "name": "adaptive",
                    "match": ["*"],
                    "actions": [{"action": "skip_step_on_spike", "z_thresh": 4.0, "window": 20, "min_samples": 10}],
                },
            ],
        }
    )
    _, applied, _ = drive(policy, 50)
    assert not applied[30]
    assert not applied[33]
    assert not applied[45]


def test_spike_skips_escalate_to_a_halt_past_max_consecutive_skips() -> None:
    """Two spikes in a row with max_consecutive_skips 1: the second is a halt naming the spike."""
    action = {
        "action": "skip_step_on_spike",
        "z_thresh": 4.0,
        "window": 20,
        "min_samples": 10,
        "max_consecutive_skips": 1,
        "scope": "tensor",
    }
    with pytest.raises(GradientHalt, match="gradient norm spike at step 31") as caught:
        drive(policy_of(action), 70)
    assert caught.value.kind == "spike"
    assert caught.value.params == ("a",)
    assert "skip limit exceeded: 2 consecutive skipped steps" in str(caught.value)


def test_a_step_skipped_for_a_nan_leaves_every_adaptive_statistic_as_it_was() -> None:
    """Statistics are proposed on the device and kept only by applied steps: a skipped step changes none."""
    policy = policy_of(
        {"action": "skip_step_on_nonfinite"},
        {"action": "zclip", "warmup_steps": 5},
        {"action": "autoclip", "history": 8},
        {"action": "skip_step_on_spike", "window": 8, "min_samples": 4},
    )
    model = TwoParams()
    with GradGuard(model, policy, logger=None) as guard:
        for step in range(12):
            for name, param in model.named_parameters():
                param.grad = DIRECTION * SEQUENCES[name][step]
            assert guard.step()
        before = guard.state_dict()["statistics"]
        model.a.grad = DIRECTION * 1.0
        model.b.grad = DIRECTION * math.nan
        assert not guard.step()
        assert guard.state_dict()["statistics"] == before


def test_adaptive_actions_add_no_host_sync_to_the_step() -> None:
    """All three adaptive actions, per tensor and per group: still one host read per step."""
    policy = policy_of(
        {"action": "halt_on_nonfinite"},
        {"action": "zclip", "warmup_steps": 3},
        {"action": "autoclip", "history": 8, "scope": "group"},
        {"action": "skip_step_on_spike", "window": 8, "min_samples": 4, "scope": "tensor"},
    )
    model = TwoParams()
    with GradGuard(model, policy, logger=None) as guard:
        for step in range(10):
            for name, param in model.named_parameters():
                param.grad = DIRECTION * SEQUENCES[name][step]
            assert count_host_syncs(guard.step) == 1


# --- policy errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("action", "message"),
    [
        ({"action": "zclip", "alpha": 1.0}, "alpha"),
        ({"action": "zclip", "warmup_steps": 0}, "warmup_steps"),
        ({"action": "autoclip", "percentile": 101.0}, "percentile"),
        ({"action": "autoclip", "history": 0}, "history"),
        ({"action": "skip_step_on_spike", "window": 10, "min_samples": 20}, "min_samples (20) cannot exceed window"),
        ({"action": "skip_step_on_spike", "max_skips": 2}, "max_skips and window_steps go together"),
        ({"action": "zclip", "z_tresh": 2.0}, "did you mean 'z_thresh'"),
        ({"action": "zclip", "ratio_floor": 100.0}, "set max_norm_ratio too"),
        ({"action": "zclip", "max_norm_ratio": 1.0}, "max_norm_ratio"),
    ],
)
def test_bad_adaptive_settings_are_policy_errors_that_name_the_field(action: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyError, match=message.replace("(", r"\(").replace(")", r"\)")):
        policy_of(action)


# --- resume equals uninterrupted ------------------------------------------------------------------

RESUME_POLICY = {
    "version": 1,
    "rules": [
        {"name": "watch", "match": ["*"], "actions": [{"action": "skip_step_on_nonfinite"}]},
        {
            "name": "spikes",
            "match": ["*"],
            "actions": [{"action": "skip_step_on_spike", "window": 8, "min_samples": 4, "z_thresh": 3.0}],
        },
        {"name": "embed", "match": ["*embed*"], "actions": [{"action": "autoclip", "history": 6, "scope": "group"}]},
        {
            "name": "rest",
            "match": ["*"],
            "exclude": ["*embed*", "head.weight"],
            "actions": [{"action": "zclip", "warmup_steps": 4, "alpha": 0.9, "z_thresh": 2.0}],
        },
    ],
}
SPIKES_AT = {9: 200.0, 15: 80.0, 19: 300.0}
NAN_AT = 11


def _train(work: Any, opt: torch.optim.Optimizer, guard: GradGuard, steps: range) -> list[tuple[bool, dict]]:
    """AdamW steps with spikes and a NaN injected into the gradients; per step: applied?, weights."""
    out = []
    for step in steps:
        opt.zero_grad()
        work.backward(step)
        for param in work.model.parameters():
            if step in SPIKES_AT:
                param.grad.mul_(SPIKES_AT[step])
        if step == NAN_AT:
            next(work.model.parameters()).grad.view(-1)[0] = math.nan
        opt.step()
        out.append((guard.last_step_skipped, {k: v.clone() for k, v in work.model.state_dict().items()}))
    return out


@pytest.mark.parametrize("stop_at", [2, 6, 12, 17])
def test_a_run_resumed_from_the_guard_state_decides_and_trains_bitwise_as_the_uninterrupted_run(
    make_workload: Any, stop_at: int
) -> None:
    """Stopped at step k and resumed from model, optimizer and guard state (through JSON): same skips, same clips,
    same weights at every step, same statistics at the end."""
    policy = Policy.from_dict(RESUME_POLICY)
    steps = 24
    work = make_workload("decoder")
    opt = torch.optim.AdamW(work.model.parameters(), lr=1e-2)
    with GradGuard(work.model, policy, logger=None) as guard:
        whole = _train(work, opt, guard, range(steps))
        whole_state = guard.state_dict()
        whole_counters = guard.counters.snapshot()
    assert [step for step, (skipped, _) in enumerate(whole) if skipped] == [9, 11, 15, 19]  # spikes and the NaN
    assert whole_counters["rest"]["zclip"] > 0
    assert whole_counters["embed"]["autoclip"] > 0

    first = make_workload("decoder")
    opt = torch.optim.AdamW(first.model.parameters(), lr=1e-2)
    with GradGuard(first.model, policy, logger=None) as guard:
        head = _train(first, opt, guard, range(stop_at))
        saved = json.dumps(guard.state_dict())
        saved_model = {k: v.clone() for k, v in first.model.state_dict().items()}
        saved_opt = opt.state_dict()
        head_counters = guard.counters.snapshot()
    second = make_workload("decoder", seed=123)  # different initial weights: all must come from the checkpoint
    second.model.load_state_dict(saved_model)
    opt = torch.optim.AdamW(second.model.parameters(), lr=1e-2)
    opt.load_state_dict(saved_opt)
    with GradGuard(second.model, policy, logger=None) as guard:
        guard.load_state_dict(json.loads(saved))
        tail = _train(second, opt, guard, range(stop_at, steps))
        resumed_state = guard.state_dict()
        tail_counters = guard.counters.snapshot()
    for step, ((skipped, weights), (skipped_again, weights_again)) in enumerate(zip(whole, head + tail, strict=True)):
        assert skipped == skipped_again, step
        for name, value in weights.items():
            assert torch.equal(value, weights_again[name]), (step, name)
    assert resumed_state == whole_state
    for rule, counts in whole_counters.items():
        for action, count in counts.items():
            assert head_counters.get(rule, {}).get(action, 0) + tail_counters.get(rule, {}).get(action, 0) == count


def test_a_reload_keeps_the_statistics_of_an_action_that_keeps_its_kind_and_drops_the_others(tmp_path: Path) -> None:
    """A new z_thresh keeps the zclip EMA (no second warm-up); an action replaced by another kind starts empty."""

    def write(zclip: dict[str, Any], second: dict[str, Any]) -> Path:
        rules = [{"name": "adaptive", "match": ["*"], "actions": [zclip, second]}]
        path = tmp_path / "policy.json"
        path.write_text(json.dumps({"version": 1, "rules": rules}))
        return path

    path = write({"action": "zclip", "warmup_steps": 3}, {"action": "autoclip", "history": 4})
    model = TwoParams()
    with GradGuard(model, path, logger=None) as guard:
        for step in range(6):
            for name, param in model.named_parameters():
                param.grad = DIRECTION * SEQUENCES[name][step]
            guard.step()
        before = guard.state_dict()["statistics"]["adaptive"]
        write(
            {"action": "zclip", "warmup_steps": 3, "z_thresh": 9.0},
            {"action": "skip_step_on_spike", "window": 4, "min_samples": 2},
        )
        assert guard.reload()
        for name, param in model.named_parameters():
            param.grad = DIRECTION * SEQUENCES[name][6]
        guard.step()  # the reload takes over at this step boundary
        after = guard.state_dict()["statistics"]["adaptive"]
    assert after["0"]["tensors"]["ready"] == [1.0, 1.0]  # no second warm-up
    assert after["0"]["tensors"]["mean"] != before["0"]["tensors"]["mean"]  # and step 6 updated the EMA
    assert after["1"]["action"] == "skip_step_on_spike"
    assert sum(math.isfinite(x) for x in after["1"]["tensors"]["ring"][0]) == 1  # only step 6's norm


def test_with_per_micro_batch_the_adaptive_actions_still_act_once_per_step_on_the_accumulated_gradient(
    make_workload: Any,
) -> None:
    """per_micro_batch=True moves only the per-tensor fixed actions into the hooks: zclip and autoclip see the
    step's accumulated gradient, so two micro-batches give the same weights and statistics either way."""
    policy = policy_of({"action": "zclip", "warmup_steps": 2}, {"action": "autoclip", "history": 4, "scope": "group"})
    results = []
    for per_micro_batch in (False, True):
        work = make_workload("mlp")
        opt = torch.optim.SGD(work.model.parameters(), lr=0.1)
        with GradGuard(work.model, policy, logger=None, per_micro_batch=per_micro_batch) as guard:
            for step in range(6):
                opt.zero_grad()
                for micro in range(2):
                    (work.loss(work.batch(10 * step + micro)) / 2).backward()
                opt.step()
            results.append(
                (guard.state_dict()["statistics"], {k: v.clone() for k, v in work.model.state_dict().items()})
            )
    (stats_a, weights_a), (stats_b, weights_b) = results
    assert stats_a == stats_b
    assert stats_a["adaptive"]["1"]["counters"]["slot"] == 2  # 6 steps in a 4-slot ring: one norm per step
    for name, value in weights_a.items():
        assert torch.equal(value, weights_b[name]), name
