"""gradguard in plain accelerate loops: guard_accelerator acts inside unscale_gradients, before accelerate's clip."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from support.training import make_policy, model_state
from torch import nn

from gradguard import GradientHalt

accelerate = pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from gradguard.integrations.accelerate import guard_accelerator  # noqa: E402

HALT_ALL = {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}
CLIP_FIRST = {"name": "first-layer", "match": "0.*", "actions": [{"action": "clip_norm", "max_norm": 0.01}]}


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """accelerate keeps process-wide singletons: a Trainer run earlier in the session leaves its gradient
    state (an unfinished dataloader makes every micro-batch a sync step). Each test starts afresh."""
    GradientState._reset_state()
    AcceleratorState._reset_state()
    yield
    GradientState._reset_state()
    AcceleratorState._reset_state()


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + i)
    return torch.randn(2, 4, generator=gen) * 3, torch.randn(2, 1, generator=gen) * 20


def loss_of(model: nn.Module, i: int) -> torch.Tensor:
    x, y = batch(i)
    return nn.functional.mse_loss(model(x), y)


def reference(model: nn.Module, micro_batches: int, steps: int) -> dict[str, torch.Tensor]:
    """Plain torch: loss / k per micro-batch, per-tensor clip 0.01 on layer 0, global clip 1.0, AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for step in range(steps):
        for micro in range(micro_batches):
            (loss_of(model, step * micro_batches + micro) / micro_batches).backward()
        for p in model[0].parameters():
            torch.nn.utils.clip_grad_norm_([p], 0.01)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model_state(model)


def test_nan_is_attributed_before_accelerators_clip_spreads_it(nonfinite_names, same):
    """accelerator.clip_grad_norm_ raises GradientHalt naming the one poisoned parameter; nothing clipped or applied."""
    accelerator = accelerate.Accelerator(cpu=True)
    model = make_model()
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    with guard_accelerator(accelerator, model, make_policy(HALT_ALL), logger=None) as guard:
        for step in range(3):
            opt.zero_grad()
            accelerator.backward(loss_of(model, step))
            if step == 2:
                before = model_state(model)
                model[2].weight.grad[0, 3] = float("nan")
                with pytest.raises(GradientHalt) as excinfo:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                break
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        assert excinfo.value.params == ("2.weight",)
        assert excinfo.value.step == 2
        assert nonfinite_names(model) == ["2.weight"], "accelerate's clip never ran: the NaN did not spread"
        same(model_state(model), before)
        assert guard.step_count == 3


def test_policy_clips_come_before_accelerators_clip_bit_for_bit():
    """Per-tensor clip then accelerate's global clip: weights equal a plain torch loop's, bit for bit, every step."""
    accelerator = accelerate.Accelerator(cpu=True)
    model = make_model()
    ref_model = copy.deepcopy(model)
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False))
    with guard_accelerator(accelerator, model, make_policy(CLIP_FIRST), logger=None) as guard:
        for step in range(3):
            accelerator.backward(loss_of(model, step))
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            assert norm > 1.0, "the global clip really clips"
            opt.step()
            opt.zero_grad()
    expected = reference(ref_model, micro_batches=1, steps=3)
    for name, value in model_state(model).items():
        assert torch.equal(value, expected[name]), name
    assert guard.counters.snapshot() == {"first-layer": {"clip_norm": 6}}


def test_accumulation_treats_each_steps_summed_gradient_once():
    """accumulate() over 2 micro-batches: the guard acts once per optimizer step, on the sum, before the clip."""
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = make_model()
    ref_model = copy.deepcopy(model)
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False))
    steps_seen = []
    with guard_accelerator(accelerator, model, make_policy(CLIP_FIRST), logger=None) as guard:
        for i in range(6):
            with accelerator.accumulate(model):
                accelerator.backward(loss_of(model, i))
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                else:
                    accelerator.unscale_gradients()  # mid-accumulation: not a step boundary, the guard waits
                steps_seen.append(guard.step_count)
                opt.step()
                opt.zero_grad()
    assert steps_seen == [0, 1, 1, 2, 2, 3]
    expected = reference(ref_model, micro_batches=2, steps=3)
    for name, value in model_state(model).items():
        assert torch.equal(value, expected[name]), name
    assert guard.counters.snapshot() == {"first-layer": {"clip_norm": 6}}


def test_clip_norm_then_clip_value_in_one_step_treats_the_gradients_once():
    """A second unscale_gradients in the same step (clip_grad_value_) does not count or treat a new step."""
    accelerator = accelerate.Accelerator(cpu=True)
    model = make_model()
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    with guard_accelerator(accelerator, model, make_policy(CLIP_FIRST), logger=None) as guard:
        for step in range(2):
            accelerator.backward(loss_of(model, step))
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            accelerator.clip_grad_value_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
            assert guard.step_count == step + 1
    assert guard.counters.snapshot() == {"first-layer": {"clip_norm": 4}}


def test_without_any_clip_the_guard_acts_at_the_optimizer_step():
    """A loop that never calls clip_grad_norm_ is still guarded: the halt comes from opt.step()."""
    accelerator = accelerate.Accelerator(cpu=True)
    model = make_model()
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    with guard_accelerator(accelerator, model, make_policy(HALT_ALL), logger=None):
        accelerator.backward(loss_of(model, 0))
        model[0].bias.grad[1] = float("inf")
        with pytest.raises(GradientHalt) as excinfo:
            opt.step()
    assert excinfo.value.params == ("0.bias",)


def test_removing_the_guard_puts_the_accelerator_back():
    """After the with-block (guard.remove()), unscale_gradients and backward are the accelerator's own again."""
    accelerator = accelerate.Accelerator(cpu=True)
    model = make_model()
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    with guard_accelerator(accelerator, model, make_policy(HALT_ALL), logger=None) as guard:
        assert "unscale_gradients" in vars(accelerator)
        assert "backward" in vars(accelerator)
    assert not guard.attached
    assert "unscale_gradients" not in vars(accelerator)
    assert "backward" not in vars(accelerator)
    accelerator.backward(loss_of(model, 0))
    model[0].bias.grad[1] = float("nan")
    accelerator.clip_grad_norm_(model.parameters(), 1.0)  # no guard any more: nothing halts
    assert not bool(torch.isfinite(model[2].weight.grad).all()), "accelerate's clip spread the NaN, as torch does"


def test_a_gradscaler_the_accelerator_uses_is_honoured(monkeypatch):
    """fp16-style GradScaler (simulated on the CPU): clips see true gradients; the scaler's own skip is not a halt."""
    accelerator = accelerate.Accelerator(cpu=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    accelerator.scaler = scaler  # what Accelerator(mixed_precision="fp16") builds on a GPU
    model = make_model()
    ref_model = copy.deepcopy(model)
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False))
    accelerator.native_amp = True  # after prepare: no fp16 autocast on the CPU, only the scaler's maths
    monkeypatch.setattr(type(accelerator), "mixed_precision", property(lambda self: "fp16"))
    with guard_accelerator(accelerator, model, make_policy(HALT_ALL, CLIP_FIRST), logger=None) as guard:
        for step in range(3):
            accelerator.backward(loss_of(model, step))
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        expected = reference(ref_model, micro_batches=1, steps=3)  # no scaler: the true gradients
        for name, value in model_state(model).items():
            assert torch.equal(value, expected[name]), name
        before = model_state(model)
        accelerator.backward(loss_of(model, 3))
        model[0].weight.grad[0, 0] = float("inf")  # a scaled gradient overflowed: the scaler's business
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        assert accelerator.optimizer_step_was_skipped
        for name, value in model_state(model).items():
            assert torch.equal(value, before[name]), name
        assert guard.counters.snapshot()["grad_scaler"] == {"skip": 1}
        assert "nonfinite" not in guard.counters.snapshot()
        assert scaler.get_scale() == 2.0**7
