"""Mixed precision: a real ``torch.amp.GradScaler("cpu")`` under float16 autocast, fused and plain
optimizers, and float16/bfloat16 parameters, each against an unguarded reference run.

The scaler starts at 2**40, so the first steps overflow and the scaler runs a real loss-scale
search (it halves the scale and skips the step until the gradients fit in float16). Scales stay
powers of two, so unscaling is exact and every comparison is bitwise (``torch.equal``), including
the fused path where the guard, not the fused kernel, divides by the scale.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from support.training import SmallMLP, assert_same, assert_same_training_state, clip_each, events_of, make_policy
from torch import nn

from gradguard import GradGuard, GradientHalt

HALT_AND_CLIP = make_policy(
    {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
    {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 1.0}]},
)


def autocast_backward(model: nn.Module, scaler: torch.amp.GradScaler, step: int) -> None:
    gen = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(16, 8, generator=gen) * 3, torch.randn(16, 4, generator=gen)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    assert out.dtype == torch.float16, "autocast really ran the model in float16"
    loss = nn.functional.mse_loss(out.float(), y) * 10
    scaler.scale(loss).backward()  # type: ignore[no-untyped-call]


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if kind == "adamw-foreach":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    if kind == "adamw-fused":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    if kind == "adam-fused":
        return torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    raise AssertionError(kind)


@pytest.mark.parametrize("user_unscales", [False, True], ids=["scaler-unscales", "user-unscales"])
@pytest.mark.parametrize("kind", ["sgd", "adamw-foreach", "adamw-fused", "adam-fused"])
def test_a_gradscaler_loss_scale_search_gives_exactly_the_policys_result_on_unscaled_gradients(
    kind: str, user_unscales: bool, tmp_path: Path
) -> None:
    """GradScaler from 2**40 under float16 autocast: clip thresholds see unscaled gradients, and the overflowing
    steps of the scale search are skipped by the scaler alone: no halt, no clip, one scaler_skip event each."""
    torch.manual_seed(0)
    model = SmallMLP()
    ref = copy.deepcopy(model)
    opt_g, opt_r = make_optimizer(kind, model), make_optimizer(kind, ref)
    scaler_g = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    scaler_r = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    log = tmp_path / "audit.jsonl"
    skipped_steps: list[int] = []
    clipped = 0
    with GradGuard(model, HALT_AND_CLIP, logger=None, audit_log=log, scaler=scaler_g) as guard:
        for step in range(30):
            for m, opt, scaler in ((model, opt_g, scaler_g), (ref, opt_r, scaler_r)):
                opt.zero_grad()
                autocast_backward(m, scaler, step)
            # The reference: torch's documented recipe for clipping under GradScaler.
            scaler_r.unscale_(opt_r)
            finite = all(bool(torch.isfinite(p.grad).all()) for p in ref.parameters())
            if finite:
                clipped += clip_each(ref, 1.0)
            else:
                skipped_steps.append(step)
            if user_unscales:
                scaler_g.unscale_(opt_g)
            scaler_r.step(opt_r)
            scaler_g.step(opt_g)  # never raises GradientHalt: the infs are the scaler's business
            scaler_r.update()
            scaler_g.update()
            assert scaler_g.get_scale() == scaler_r.get_scale(), f"step {step}"
            assert_same_training_state(model, ref, opt_g, opt_r, f"step {step}")
        counters = guard.counters.snapshot()
        steps = guard.step_count
    # A real search: 2**40 overflows for many steps, then the run trains on unscaled, clipped gradients.
    assert skipped_steps[:10] == list(range(10))
    assert len(skipped_steps) <= 27
    assert clipped >= 6
    assert counters == {"grad_scaler": {"skip": len(skipped_steps)}, "clip": {"clip_norm": clipped}}
    scaler_events = events_of(log, "scaler_skip")
    assert [event["step"] for event in scaler_events] == skipped_steps
    assert all(event["fused"] is kind.endswith("fused") for event in scaler_events)
    assert events_of(log, "halt") == []
    assert events_of(log, "nonfinite") == []
    interventions = events_of(log, "intervention")
    assert len(interventions) == clipped
    assert not {event["step"] for event in interventions} & set(skipped_steps)
    # The guard's steps are the scaler's steps, skipped or not, so step windows count the same steps.
    assert steps == 30


def test_a_fused_optimizer_is_guarded_under_gradscaler_without_passing_the_scaler() -> None:
    """With fused=True the guard reads the scaler's grad_scale/found_inf itself: skips are counted without scaler=."""
    torch.manual_seed(1)
    model = SmallMLP()
    ref = copy.deepcopy(model)
    opt_g, opt_r = make_optimizer("adamw-fused", model), make_optimizer("adamw-fused", ref)
    scaler_g = torch.amp.GradScaler("cpu", init_scale=2.0**30)
    scaler_r = torch.amp.GradScaler("cpu", init_scale=2.0**30)
    skips = 0
    with GradGuard(model, HALT_AND_CLIP, logger=None) as guard:
        for step in range(16):
            for m, opt, scaler in ((model, opt_g, scaler_g), (ref, opt_r, scaler_r)):
                opt.zero_grad()
                autocast_backward(m, scaler, step)
            scaler_r.unscale_(opt_r)
            if all(bool(torch.isfinite(p.grad).all()) for p in ref.parameters()):
                clip_each(ref, 1.0)
            else:
                skips += 1
            scaler_r.step(opt_r)
            scaler_g.step(opt_g)
            assert getattr(opt_g, "grad_scale", None) is None, "the scaler's attributes do not outlive its step"
            scaler_r.update()
            scaler_g.update()
            assert_same_training_state(model, ref, opt_g, opt_r, f"step {step}")
        assert skips >= 3
        assert guard.counters.snapshot()["grad_scaler"] == {"skip": skips}


def test_a_genuine_nan_after_the_scale_search_is_still_the_scalers_skip_not_a_halt() -> None:
    """Under GradScaler a NaN gradient makes the scaler skip the step; the guard logs that skip and does not halt."""
    torch.manual_seed(2)
    model = SmallMLP()
    opt = make_optimizer("sgd", model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with GradGuard(model, HALT_AND_CLIP, logger=None, scaler=scaler) as guard:
        opt.zero_grad()
        autocast_backward(model, scaler, 0)
        scaler.step(opt)
        scaler.update()
        assert guard.counters.snapshot().get("grad_scaler") is None, "2**8 does not overflow"
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        opt.zero_grad()
        autocast_backward(model, scaler, 1)
        model.out.weight.grad[0, 0] = float("nan")
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 2.0**7
        assert all(torch.equal(before[name], p) for name, p in model.named_parameters())
        assert guard.counters.snapshot()["grad_scaler"] == {"skip": 1}


def reference_clip_in_float32(model: nn.Module, max_norm: float) -> int:
    """clip_grad_norm_'s recipe per tensor, with the norm taken in float32 (the guard's documented difference)."""
    changed = 0
    for p in model.parameters():
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad, dtype=torch.float32)]))
        torch.nn.utils.clip_grads_with_norm_([p], max_norm, norm)
        changed += bool(max_norm / (norm + 1e-6) < 1.0)
    return changed


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_parameters_are_clipped_by_their_norm_taken_in_float32(dtype: torch.dtype) -> None:
    """float16/bfloat16 parameters and gradients: the guard equals clip_grads_with_norm_ given the float32 norm."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).to(dtype)
    ref = copy.deepcopy(model)
    opt_g = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    opt_r = torch.optim.SGD(ref.parameters(), lr=1e-3, momentum=0.9)
    clipped = 0
    with GradGuard(model, HALT_AND_CLIP, logger=None) as guard:
        for step in range(3):
            x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step)).to(dtype)
            for m, opt in ((model, opt_g), (ref, opt_r)):
                opt.zero_grad()
                (m(x).float().sum() * 1000).backward()
            assert all(p.grad.dtype == dtype for p in model.parameters())
            clipped += reference_clip_in_float32(ref, 1.0)
            opt_r.step()
            opt_g.step()
            treated = {n: p.grad for n, p in model.named_parameters()}
            assert_same(treated, {n: p.grad for n, p in ref.named_parameters()}, "grads")
            assert_same_training_state(model, ref, opt_g, opt_r, f"step {step}")
        assert clipped == 12
        assert guard.counters.snapshot() == {"clip": {"clip_norm": clipped}}


def test_a_finite_float16_gradient_whose_float16_norm_overflows_is_not_called_nonfinite(tmp_path: Path) -> None:
    """Every element finite, the float16 norm inf: no halt, no nonfinite event, and a clip by the true float32 norm."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).half()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).half()
    for m in (model, ref):
        (m(x).float().sum() * 5000).backward()
    weight_grad = model[0].weight.grad
    assert bool(torch.isfinite(weight_grad).all())
    assert torch.isinf(torch.linalg.vector_norm(weight_grad)), "precondition: the float16 norm overflows"
    raw = weight_grad.clone()
    log = tmp_path / "audit.jsonl"
    with GradGuard(model, HALT_AND_CLIP, logger=None, audit_log=log) as guard:
        assert guard.step() is True
        assert guard.counters.snapshot() == {"clip": {"clip_norm": 4}}
    reference_clip_in_float32(ref, 1.0)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
        assert torch.linalg.vector_norm(p.grad, dtype=torch.float32) <= 1.001
    assert events_of(log, "nonfinite") == []
    assert events_of(log, "nonfinite_unhalted") == []
    # torch's own clip_grad_norm_ takes the float16 norm: inf, so it would have zeroed the gradient instead.
    naive = nn.Parameter(torch.zeros_like(raw))
    naive.grad = raw.clone()
    assert torch.isinf(torch.nn.utils.clip_grad_norm_([naive], 1.0))
    assert torch.count_nonzero(naive.grad) == 0


def test_a_nonfinite_half_precision_gradient_still_halts_and_tells_nan_from_inf() -> None:
    """float16 gradients with a real Inf, or a NaN, halt with that kind: the float32 norm hides neither."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).half()
    with GradGuard(model, HALT_AND_CLIP, logger=None) as guard:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        model[0].weight.grad[1, 1] = float("inf")
        model[1].bias.grad[0] = float("nan")
        with pytest.raises(GradientHalt) as info:
            guard.step()
        assert info.value.params == ("0.weight", "1.bias")
        assert info.value.kind == "nan+inf"
        assert guard.counters.snapshot()["nonfinite"] == {"inf": 1, "nan": 1, "halt_on_nonfinite": 1}


def test_a_finite_bfloat16_gradient_whose_norm_overflows_even_in_float32_is_not_called_nonfinite(
    tmp_path: Path,
) -> None:
    """bfloat16 has float32's range, so a float32 norm can overflow too: still no halt and no nonfinite event."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to(torch.bfloat16)
    log = tmp_path / "audit.jsonl"
    with GradGuard(model, HALT_AND_CLIP, logger=None, audit_log=log) as guard:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        model[0].weight.grad.fill_(1e20)
        assert bool(torch.isfinite(model[0].weight.grad).all())
        assert torch.isinf(torch.linalg.vector_norm(model[0].weight.grad, dtype=torch.float32))
        assert guard.step() is True
        counters = guard.counters.snapshot()
    assert "nan" not in counters["nonfinite"]
    assert "inf" not in counters["nonfinite"]
    assert "halt_on_nonfinite" not in counters["nonfinite"]
    assert events_of(log, "nonfinite") == []
    assert events_of(log, "halt") == []
    assert [event["param"] for event in events_of(log, "norm_overflow")] == ["0.weight"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_finite_gradient_whose_float32_norm_overflows_is_clipped_by_its_float64_norm(
    dtype: torch.dtype, tmp_path: Path
) -> None:
    """1e20s everywhere: the float32 norm is inf, the true norm 4e20. The clip keeps the direction and brings the
    norm to max_norm (torch's clip_grad_norm_ would zero it), and is counted and logged like any other clip."""
    model = nn.Linear(4, 4).to(dtype)
    log = tmp_path / "audit.jsonl"
    policy = make_policy({"name": "clip", "match": "weight", "actions": [{"action": "clip_norm", "max_norm": 1.0}]})
    with GradGuard(model, policy, logger=None, audit_log=log) as guard:
        model.weight.grad = torch.full((4, 4), 1e20, dtype=dtype)
        model.weight.grad[0, 0] = -1e20
        raw = model.weight.grad.clone()
        guard.step()
        counters = guard.counters.snapshot()
    treated = model.weight.grad.double()
    assert 0.99 <= torch.linalg.vector_norm(treated) <= 1.0
    assert torch.equal(torch.sign(treated), torch.sign(raw.double())), "the direction is kept"
    assert counters["clip"]["clip_norm"] == 1
    (event,) = events_of(log, "intervention")
    assert event["param"] == "weight"
    assert event["overflowed"] is True


@pytest.mark.parametrize("scale", [1e39, 1e100, 1e150])
def test_a_float64_gradient_whose_norm_is_beyond_float32s_range_is_clipped_once_bitwise_as_torch(
    scale: float, tmp_path: Path
) -> None:
    """A finite float64 norm above float32's largest value is not an overflow: one clip, bitwise
    ``clip_grad_norm_([p])``'s, no ``norm_overflow`` (the step once cast the norms to float32, read Inf there, and
    clipped the gradient a second time by the float64 norm of the clipped one, a factor 1 - 2e-6 too small)."""
    model = nn.Linear(4, 2, bias=False).double()
    grad = torch.tensor([[scale, -scale / 3, 0.0, 1.0], [2.0, scale / 7, 0.5, -scale]], dtype=torch.float64)
    reference = nn.Parameter(torch.zeros_like(grad))
    reference.grad = grad.clone()
    torch.nn.utils.clip_grad_norm_([reference], 0.5)
    log = tmp_path / "audit.jsonl"
    policy = make_policy(
        {"name": "watch", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
        {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.5}]},
    )
    with GradGuard(model, policy, logger=None, audit_log=log) as guard:
        model.weight.grad = grad.clone()
        guard.step()
        counters = guard.counters.snapshot()
    assert torch.equal(model.weight.grad, reference.grad)
    assert counters == {"clip": {"clip_norm": 1}}
    assert events_of(log, "norm_overflow") == []


ADAPTIVE = make_policy(
    {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
    {"name": "auto", "match": "*", "actions": [{"action": "autoclip", "history": 32}]},
    {"name": "z", "match": "*", "actions": [{"action": "zclip", "warmup_steps": 2, "scope": "group"}]},
    {"name": "spike", "match": "*", "actions": [{"action": "skip_step_on_spike", "window": 32, "min_samples": 2}]},
)


@pytest.mark.parametrize("boundary", ["optimizer", "explicit", "fused"])
def test_the_steps_gradscaler_skips_never_enter_the_adaptive_statistics(boundary: str) -> None:
    """The loss-scale search's overflowing steps are the scaler's to skip: no statistic takes them, whether the
    guard acts in the optimizer's step, at guard.step(opt) after unscale_, or beside a fused kernel."""
    torch.manual_seed(1)
    model = SmallMLP()
    opt = make_optimizer("adamw-fused" if boundary == "fused" else "sgd", model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**18)
    applied = 0
    with GradGuard(model, ADAPTIVE, logger=None, scaler=None if boundary == "fused" else scaler) as guard:
        for step in range(16):
            opt.zero_grad()
            autocast_backward(model, scaler, step)
            if boundary == "explicit":
                scaler.unscale_(opt)
                guard.step(opt)
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            applied += scaler.get_scale() >= before  # the scale only drops on a skipped step
        statistics = guard.state_dict()["statistics"]
        skips = guard.counters.snapshot()["grad_scaler"]["skip"]
    assert skips >= 2  # a real loss-scale search happened
    assert applied == 16 - skips
    assert statistics["auto"]["0"]["counters"]["slot"] == applied  # the 32-slot ring's next slot
    assert sum(x != math.inf for x in statistics["auto"]["0"]["tensors"]["ring"][0]) == applied
    assert all(math.isfinite(x) for row in statistics["auto"]["0"]["tensors"]["ring"] for x in row if x != math.inf)
    assert statistics["z"]["0"]["tensors"]["count"] == [2.0]  # warm-up filled by applied steps only
    assert math.isfinite(statistics["z"]["0"]["tensors"]["mean"][0])
    assert statistics["spike"]["0"]["counters"]["slot"] == applied
    assert sum(x == x for x in statistics["spike"]["0"]["tensors"]["ring"][0]) == applied  # NaN: empty
