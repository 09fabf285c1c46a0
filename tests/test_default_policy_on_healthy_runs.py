"""The shipped default changes nothing in a healthy run and still bounds an exploding gradient (issue 58, item 1).

Each healthy run (``support/healthy_runs.py``) is compared bitwise with its unguarded twin (same seed, same data): a
small GPT with the loop's own clip (and under a learning-rate warm-up), Hugging Face's Trainer on a 2-layer GPT-2 built
from a config, a CNN with BatchNorm, a LoRA adapter whose B starts at 0, blocks behind gates that start at 0 (their
norms grow 5,000x past their warm-up scale: the default's floor leaves them), and an MLP learning a fixed teacher, whose
per-tensor norms pass 1.0 (where the previous default, now ``per-tensor-clip``, clipped), and two small regressions
whose norms are above 100 from the start (where the default's fixed ceiling of 100 clipped until round 8). An
explosion is made by scaling one tensor's gradient in its backward hook: a jump to 30x its recent scale (the median of
its last 20 steps' norms) reaches the optimizer at no more than 10x that scale and is counted; a sustained climb is
held under the default's ceiling, 1000 times the tensor's own warm-up scale but at least 100.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from support.healthy_runs import (
    STEPS,
    Gated,
    LoRA,
    cnn,
    cnn_loop,
    gated_loop,
    gpt_loop,
    large_norms_loop,
    late_layer_loop,
    lora_loop,
    regression,
    teacher_loop,
    teacher_student,
    tiny_gpt,
    two_layers,
)
from support.training import hf_training_args
from torch import nn
from torch.overrides import TorchFunctionMode

from gradguard import GradGuard, Policy

RATIO, FLOOR = 1000.0, 100.0
"""The default's ceiling on each tensor's norm: a multiple of its warm-up scale, at least the floor
(``policies/default.yaml``)."""
WARMUP = 25
"""The default's warm-up steps: their norms' mean is a tensor's warm-up scale."""
Loop = Callable[[nn.Module], None]


def _differing_tensors(guarded: nn.Module, unguarded: nn.Module) -> list[str]:
    """The names of the tensors whose values differ bitwise between the two models."""
    theirs = unguarded.state_dict()
    return [name for name, tensor in guarded.state_dict().items() if not torch.equal(tensor, theirs[name])]


def _guarded_and_twin(
    build: Callable[[], nn.Module], loop: Loop, policy: str | Policy
) -> tuple[nn.Module, nn.Module, Any]:
    unguarded = build()
    loop(unguarded)
    guarded = build()
    with GradGuard(guarded, policy, logger=None) as guard:
        loop(guarded)
    return guarded, unguarded, guard.counters.snapshot()


@pytest.mark.parametrize(
    ("build", "loop"),
    [
        (tiny_gpt, gpt_loop),
        (teacher_student, teacher_loop),
        (regression, partial(large_norms_loop, sum_reduced=False)),
        (regression, partial(large_norms_loop, sum_reduced=True)),
        (tiny_gpt, partial(gpt_loop, warm_up=100)),
        (cnn, cnn_loop),
        (LoRA, lora_loop),
    ],
    ids=[
        "small GPT",
        "MLP teacher",
        "norms above 100: unnormalised targets",
        "norms above 100: a sum-reduced loss",
        "small GPT under a learning-rate warm-up",
        "CNN with BatchNorm, one-cycle SGD",
        "LoRA adapter whose B starts at 0",
    ],
)
def test_the_default_leaves_a_healthy_run_bitwise_as_its_unguarded_twin(build: Callable[[], nn.Module], loop: Loop):
    guarded, unguarded, counters = _guarded_and_twin(build, loop, "default")
    assert _differing_tensors(guarded, unguarded) == []
    assert counters == {}


def test_the_runs_of_large_norms_are_what_a_fixed_ceiling_of_100_would_change():
    """The twin comparison sees the change a fixed ceiling makes (the default's ``max_norm: 100`` until round 8):
    the large-norm runs above are no trivial pass."""
    zclip = {"action": "zclip", "z_thresh": 10.0, "warmup_steps": WARMUP, "max_norm": 100.0}
    fixed = Policy.from_dict({"version": 1, "rules": [{"name": "explosions", "match": "*", "actions": [zclip]}]})
    for sum_reduced in (False, True):
        loop = partial(large_norms_loop, sum_reduced=sum_reduced)
        guarded, unguarded, counters = _guarded_and_twin(regression, loop, fixed)
        assert counters["explosions"]["zclip"] > 10
        assert _differing_tensors(guarded, unguarded) != []


def test_blocks_behind_gates_from_0_grow_thousands_of_times_past_their_warm_up_scale_and_the_floor_leaves_them():
    """Under a learning-rate warm-up the gates open slowly: a block's norm passes 5,000x its warm-up scale (healthy,
    under 3 in value). The default's floor (100) leaves the run bitwise its twin; without the floor it is clipped.
    The monitor warns that the 4 blocks' gradients vanish at the first step: true, they are 0 there."""
    guarded, unguarded, counters = _guarded_and_twin(Gated, gated_loop, "default")
    assert _differing_tensors(guarded, unguarded) == []
    assert counters == {"health": {"vanishing": 4}}
    unfloored = Policy.shipped("default").model_dump(mode="json", exclude_defaults=True)
    assert unfloored["rules"][1]["actions"][0].pop("ratio_floor") == FLOOR
    guarded, unguarded, counters = _guarded_and_twin(Gated, gated_loop, Policy.from_dict(unfloored))
    assert counters["explosions"]["zclip"] > 10
    assert _differing_tensors(guarded, unguarded) != []


def test_the_previous_default_kept_as_per_tensor_clip_still_changes_the_teacher_run():
    """The twin comparison sees a change where there is one: the old default clips this healthy run's tensors."""
    guarded, unguarded, counters = _guarded_and_twin(teacher_student, teacher_loop, "per-tensor-clip")
    assert counters["per-tensor-clip"]["clip_norm"] > 0
    assert _differing_tensors(guarded, unguarded) != []


def test_the_default_leaves_hugging_faces_trainer_on_gpt2_bitwise_as_its_unguarded_twin(tmp_path: Path):
    transformers = pytest.importorskip("transformers")
    from gradguard.integrations.transformers import guard_trainer

    generator = torch.Generator().manual_seed(1)
    data = []
    for _ in range(32):
        ids = torch.randint(0, 32, (8,), generator=generator)
        data.append({"input_ids": ids, "labels": ids.clone()})

    def trained(guarded: bool) -> tuple[nn.Module, dict[str, Any]]:
        transformers.set_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
        model = transformers.GPT2LMHeadModel(config)
        args = hf_training_args(
            tmp_path / str(guarded), max_steps=STEPS, per_device_train_batch_size=8, learning_rate=1e-3,
            max_grad_norm=1.0, logging_strategy="no",
        )  # fmt: skip
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        seen: dict[str, Any] = {}
        if guarded:
            callback = guard_trainer(trainer, "default", logger=None)

            class Counted(transformers.TrainerCallback):  # type: ignore[misc]
                def on_step_end(self, *args: Any, **kwargs: Any) -> None:
                    assert callback.guard is not None
                    seen.update(callback.guard.counters.snapshot(), steps=callback.guard.step_count)

            trainer.add_callback(Counted())
        trainer.train()
        return model, seen

    guarded, seen = trained(guarded=True)
    unguarded, _ = trained(guarded=False)
    assert seen == {"steps": STEPS}  # every step guarded, nothing counted
    assert _differing_tensors(guarded, unguarded) == []


class _Explosion:
    """Scales one tensor's gradient in its backward hook from ``start`` on (by what ``scale(step, raw, scale)``
    says), and records the norm it arrives at the optimizer with (an optimizer pre-hook, after the guard's)."""

    def __init__(self, model: nn.Module, name: str, scale: Callable[[int, float, float], float], start: int) -> None:
        self.param = dict(model.named_parameters())[name]
        self.scale, self.start = scale, start
        self.raw: list[float] = []
        self.made: dict[int, float] = {}
        self.arrived: dict[int, float] = {}
        self.step = 0
        self.param.register_hook(self._hook)

    def at(self, step: int) -> None:
        self.step = step

    def recent_scale(self, step: int) -> float:
        """The median of the tensor's raw norms over the 20 steps before ``step``."""
        return statistics.median(self.raw[step - 20 : step])

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        norm = float(grad.norm())
        if self.step < self.start:
            self.raw.append(norm)
            return grad
        factor = self.scale(self.step, norm, self.recent_scale(self.start))
        self.made[self.step] = norm * factor
        self.raw.append(norm * factor)
        return grad * factor

    def arrive(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.step >= self.start:
            assert self.param.grad is not None
            self.arrived[self.step] = float(self.param.grad.norm())


def _explode(
    scale: Callable[[int, float, float], float], steps: int, start: int = 60
) -> tuple[_Explosion, dict[str, Any]]:
    """The small GPT under the default, without the loop's clip (so what arrives is the guard's doing alone), one
    tensor scaled from step ``start`` on."""
    model = tiny_gpt()
    explosion = _Explosion(model, "blocks.1.mlp.0.weight", scale, start=start)
    vocab, length = 32, 16
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    with GradGuard(model, "default", logger=None) as guard:
        optimizer.register_step_pre_hook(explosion.arrive)
        for step in range(steps):
            explosion.at(step)
            start = torch.randint(0, vocab, (8, 1), generator=generator)
            tokens = (start + torch.arange(length + 1)) % vocab
            logits = model(tokens[:, :-1])
            nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return explosion, guard.counters.snapshot()


def test_a_tensor_whose_norm_jumps_to_30x_its_recent_scale_reaches_the_optimizer_at_under_10x_and_is_counted():
    def spike(step: int, raw: float, recent: float) -> float:
        return 30 * recent / raw if step == 60 else 1.0

    explosion, counters = _explode(spike, steps=61)
    recent = explosion.recent_scale(60)
    assert explosion.made[60] == pytest.approx(30 * recent)
    assert explosion.arrived[60] <= 10 * recent
    assert counters == {"explosions": {"zclip": 1}}


def test_an_explosion_in_warm_up_is_held_under_1000x_the_tensor_s_norms_so_far_or_100_and_counted():
    def spike(step: int, raw: float, recent: float) -> float:
        return 1e8 if step == 10 else 1.0  # at step 10 of the 25 warm-up steps: the z-score cannot act yet

    explosion, counters = _explode(spike, steps=12, start=10)
    ceiling = max(RATIO * statistics.fmean(explosion.raw[:10]), FLOOR)  # 1000x the mean of its norms so far
    assert explosion.made[10] > 1e3 * ceiling
    assert explosion.arrived[10] == pytest.approx(ceiling, rel=1e-5)
    assert explosion.arrived[11] == pytest.approx(explosion.made[11])  # the next step untouched
    assert counters["explosions"] == {"zclip": 1}


def test_a_sustained_climb_is_held_under_the_default_s_ceiling_and_counted_at_every_step_it_passes_it():
    def climb(step: int, raw: float, recent: float) -> float:
        return recent * 1.4 ** (step - 59) / raw  # 1.4x a step: 1000x within 25 steps, 4e8x by the end

    explosion, counters = _explode(climb, steps=120)
    ceiling = max(RATIO * statistics.fmean(explosion.raw[:WARMUP]), FLOOR)  # 1000x the mean of its warm-up norms
    assert max(explosion.made.values()) > 1e5 * ceiling
    assert max(explosion.arrived.values()) <= ceiling * (1 + 1e-6)
    above = [step for step, made in explosion.made.items() if made > ceiling]
    assert len(above) > 30
    assert counters["explosions"]["zclip"] >= len(above)


def test_a_tensor_whose_gradient_was_zero_through_the_warm_up_is_not_clipped_to_zero_when_it_is_used():
    guarded, unguarded, counters = _guarded_and_twin(two_layers, late_layer_loop, "default")
    assert not torch.equal(guarded[0].weight, two_layers()[0].weight)  # the late layer learned
    assert _differing_tensors(guarded, unguarded) == []
    assert "explosions" not in counters


class _TensorsFromPython(TorchFunctionMode):
    """Counts ``torch.tensor`` calls: a tensor made from the host's numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.made = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.made += func is torch.tensor
        return func(*args, **(kwargs or {}))


def test_in_a_healthy_warm_up_the_default_takes_no_ceiling_and_after_it_takes_them_once():
    """No norm of a healthy warm-up passes the floor, so no ceiling can bind and none is taken (the host's lists made
    into a tensor each step otherwise); after warm-up the ceilings are taken once (3 tensors) and kept."""
    model = tiny_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(1)
    made = []
    with GradGuard(model, "default", logger=None):
        for _ in range(WARMUP + 5):
            tokens = torch.randint(0, 32, (8, 17), generator=generator)
            logits = model(tokens[:, :-1])
            nn.functional.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1)).backward()
            with _TensorsFromPython() as counted:
                optimizer.step()
            made.append(counted.made)
            optimizer.zero_grad(set_to_none=True)
    assert made[1 : WARMUP - 1] == [0] * (WARMUP - 2)  # the first step makes the plan's constants
    assert made[WARMUP - 1 :] == [1, 3, 0, 0, 0, 0]  # the first mean and variance; the ceilings, once
