"""The shipped default changes nothing in a healthy run and still bounds an exploding gradient (issue 58, item 1).

Each healthy run is compared bitwise with its unguarded twin (same seed, same data): a small GPT with the loop's own
clip, Hugging Face's Trainer on a 2-layer GPT-2 built from a config, and an MLP learning a fixed teacher, whose
per-tensor norms pass 1.0 (where the previous default, now ``per-tensor-clip``, clipped). An explosion is made by
scaling one tensor's gradient in its backward hook: a jump to 30x its recent scale (the median of its last 20 steps'
norms) reaches the optimizer at no more than 10x that scale and is counted; a sustained climb is held under the
default's ceiling.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.training import hf_training_args
from torch import nn

from gradguard import GradGuard
from gradguard.cli.demo import TinyDecoder

STEPS = 200
CEILING = 100.0
"""The default's fixed ceiling on any tensor's norm (``policies/default.yaml``)."""
Loop = Callable[[nn.Module], None]


def _differing_tensors(guarded: nn.Module, unguarded: nn.Module) -> list[str]:
    """The names of the tensors whose values differ bitwise between the two models."""
    theirs = unguarded.state_dict()
    return [name for name, tensor in guarded.state_dict().items() if not torch.equal(tensor, theirs[name])]


def _gpt_loop(model: nn.Module, steps: int = STEPS, explode: Callable[[int], None] | None = None) -> None:
    """nanoGPT's shape of loop: AdamW with weight decay, the loop's own global clip at 1.0, one batch a step."""
    vocab, length = 32, 16
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    for step in range(steps):
        start = torch.randint(0, vocab, (8, 1), generator=generator)
        tokens = (start + torch.arange(length + 1) * torch.randint(1, 3, (8, 1), generator=generator)) % vocab
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        if explode is not None:
            explode(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _teacher_loop(model: nn.Module) -> None:
    """A small MLP learning a fixed random teacher's classes: AdamW, the loop's clip at 1.0; its logits sharpen, and
    per-tensor norms pass 1.0 in many steps."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(STEPS):
        inputs = torch.randn(64, 32, generator=generator)
        with torch.no_grad():
            labels = (3 * teacher(inputs)).argmax(1)
        nn.functional.cross_entropy(model(inputs), labels).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _tiny_gpt() -> nn.Module:
    torch.manual_seed(0)
    return TinyDecoder(vocab=32, width=32, depth=2, heads=2, context=16)


def _teacher_student() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def _guarded_and_twin(build: Callable[[], nn.Module], loop: Loop, policy: str) -> tuple[nn.Module, nn.Module, Any]:
    unguarded = build()
    loop(unguarded)
    guarded = build()
    with GradGuard(guarded, policy, logger=None) as guard:
        loop(guarded)
    return guarded, unguarded, guard.counters.snapshot()


@pytest.mark.parametrize(
    ("build", "loop"), [(_tiny_gpt, _gpt_loop), (_teacher_student, _teacher_loop)], ids=["small GPT", "MLP teacher"]
)
def test_the_default_leaves_a_healthy_run_bitwise_as_its_unguarded_twin(build: Callable[[], nn.Module], loop: Loop):
    guarded, unguarded, counters = _guarded_and_twin(build, loop, "default")
    assert _differing_tensors(guarded, unguarded) == []
    assert counters == {}


def test_the_previous_default_kept_as_per_tensor_clip_still_changes_the_teacher_run():
    """The twin comparison sees a change where there is one: the old default clips this healthy run's tensors."""
    guarded, unguarded, counters = _guarded_and_twin(_teacher_student, _teacher_loop, "per-tensor-clip")
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


def _explode(scale: Callable[[int, float, float], float], steps: int) -> tuple[_Explosion, dict[str, Any]]:
    """The small GPT under the default, without the loop's clip (so what arrives is the guard's doing alone), one
    tensor scaled from step 60 on."""
    model = _tiny_gpt()
    explosion = _Explosion(model, "blocks.1.mlp.0.weight", scale, start=60)
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


def test_a_sustained_climb_is_held_under_the_ceiling_and_counted_at_every_step_it_passes_it():
    def climb(step: int, raw: float, recent: float) -> float:
        return recent * 1.4 ** (step - 59) / raw  # 1.4x a step: past 100 within 25 steps, 1e9 by the end

    explosion, counters = _explode(climb, steps=120)
    assert max(explosion.made.values()) > 1e6
    assert max(explosion.arrived.values()) <= CEILING * (1 + 1e-6)
    above = [step for step, made in explosion.made.items() if made > CEILING]
    assert len(above) > 30
    assert counters["explosions"]["zclip"] >= len(above)


def _late_layer_loop(model: nn.Module) -> None:
    """A layer left out of the forward for 30 steps (its gradient zeroed, not None: ``set_to_none=False``), then used:
    its first norms after zeros are not an explosion."""
    first, second = model[0], model[1]
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    for step in range(60):
        inputs = torch.randn(8, 4, generator=generator)
        out = second(first(inputs)) if step >= 30 else second(inputs)
        (out - 3.0 - inputs.sum(1, keepdim=True)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)


def test_a_tensor_whose_gradient_was_zero_through_the_warm_up_is_not_clipped_to_zero_when_it_is_used():
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))

    guarded, unguarded, counters = _guarded_and_twin(build, _late_layer_loop, "default")
    assert not torch.equal(guarded[0].weight, build()[0].weight)  # the late layer learned
    assert _differing_tensors(guarded, unguarded) == []
    assert "explosions" not in counters
