"""``averages=`` through the integrations' callbacks (issue 36): an EMA updated after each optimizer step by a
Lightning module or a Hugging Face ``TrainerCallback`` ends bitwise equal to the twin fit's after a rewind.

The scenario is tests/test_recovery_frameworks.py's: a NaN at step 23 rewinds to step 20's snapshot and skips steps
24-27; the twin trains on the batches of steps 0-19 and 28-39 only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.training import assert_same, hf_training_args, model_state
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

pytest.importorskip("lightning.pytorch")
pytest.importorskip("transformers")

import test_recovery_frameworks as frameworks
import transformers
from support.training import hf_poison_at
from test_recovery_frameworks import (
    FAULT,
    KEPT,
    RECOVERY,
    STEPS,
    JumpGuard,
    JumpTrainerGuard,
    assert_rewound_once,
    lightning_fit,
    policy,
)

from gradguard.integrations.lightning import GradGuardCallback
from gradguard.integrations.transformers import GradGuardCallback as TrainerCallback

pytestmark = frameworks.pytestmark
_fresh_accelerate_state = frameworks._fresh_accelerate_state


class EmaNet(frameworks.Net):
    """The frameworks' Lightning module with an EMA of its network inside it, updated after each optimizer step."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.ema = AveragedModel(self.net, multi_avg_fn=get_ema_multi_avg_fn(0.9))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ema.update_parameters(self.net)


def test_a_lightning_modules_ema_given_in_averages_ends_bitwise_equal_to_the_twin_fits(tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    module = EmaNet(nan_at=FAULT)
    callback = GradGuardCallback(policy(recovery=RECOVERY), logger=None, audit_log=audit, averages=[module.ema])
    lightning_fit(module, list(range(STEPS)), callback, gradient_clip_val=1.0)

    reference = EmaNet()
    guarded = GradGuardCallback(policy(), logger=None)
    lightning_fit(reference, KEPT, guarded, JumpGuard(guarded), gradient_clip_val=1.0)

    assert callback.guard is not None
    assert_rewound_once(callback.guard, audit)
    assert_same(model_state(module), model_state(reference), "parameters and the EMA")
    assert int(module.ema.n_averaged) == int(reference.ema.n_averaged) == len(KEPT)


class UpdateEma(transformers.TrainerCallback):
    """The loop's EMA, updated at the end of every optimizer step of the Trainer."""

    def __init__(self, ema: AveragedModel, model: nn.Module) -> None:
        self.ema, self.model = ema, model

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ema.update_parameters(self.model)


def hf_train_with_ema(tmp_path: Path, steps: list[int], guard: TrainerCallback | None, *extra: Any) -> Any:
    model = frameworks.TinyRegressor()
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    callbacks: list[Any] = [UpdateEma(ema, model), *extra]
    if guard is None:  # the rewinding run: its callback is made here, where the EMA exists
        audit = tmp_path / "audit.jsonl"
        guard = TrainerCallback(policy(recovery=RECOVERY), logger=None, audit_log=audit, averages=[ema])
        callbacks += [hf_poison_at(FAULT)]
    trainer = transformers.Trainer(
        model=model,
        args=hf_training_args(
            tmp_path,
            per_device_train_batch_size=frameworks.HF_BATCH,
            max_steps=len(steps),
            logging_steps=10,
            learning_rate=1e-2,
            train_sampling_strategy="sequential",
            lr_scheduler_type="constant",
        ),
        train_dataset=frameworks.regression_examples(steps),
        callbacks=[guard, *callbacks],
    )
    trainer.train()
    return trainer, ema, guard


def test_a_trainer_callbacks_ema_given_in_averages_ends_bitwise_equal_to_the_twin_fits(tmp_path: Path) -> None:
    trainer, ema, callback = hf_train_with_ema(tmp_path / "a", list(range(STEPS)), None)
    guarded = TrainerCallback(policy(), logger=None)
    reference, reference_ema, _ = hf_train_with_ema(tmp_path / "b", KEPT, guarded, JumpTrainerGuard(guarded))

    assert callback.guard is not None
    assert_rewound_once(callback.guard, tmp_path / "a" / "audit.jsonl")
    assert_same(model_state(trainer.model), model_state(reference.model), "parameters")
    assert_same(ema.state_dict(), reference_ema.state_dict(), "EMA")
    assert int(ema.n_averaged) == len(KEPT)
    assert torch.is_tensor(ema.n_averaged)
