"""Recovery under the Hugging Face Trainer across a checkpoint: the callback alone, resumed from anywhere.

A NaN at step 23 with ``recovery: {snapshot_every: 5, keep: 2, min_age: 3, skip_steps: 4}`` rewinds to step 20 and
skips steps 24-27. A checkpoint saved at step 25, inside that window, copied to another folder and resumed from
there by a new Trainer with another ``output_dir``, ends bitwise equal to the run that was never stopped: the guard's
state (the rewind count, the skip window and the scheduler it holds) travels in the Trainer's own
``trainer_state.json`` (``stateful_callbacks``), not beside ``output_dir``.
"""

from __future__ import annotations

import copy
import gc
import json
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.training import TinyRegressor, assert_same, events_of, hf_poison_at, hf_training_args, model_state

from gradguard import GuardWarning, Policy

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from gradguard.integrations.transformers import STATE_FILE, GradGuardCallback  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers:UserWarning",
    "ignore:.*is smaller than the logging interval.*",
)

STEPS = 40
FAULT = 23
SAVED = 25
"""The checkpoint's step: inside the skip window (24-27)."""
BATCH = 2
RECOVERY = {"snapshot_every": 5, "keep": 2, "min_age": 3, "skip_steps": 4}


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """accelerate's process-wide singletons: each test starts (and leaves) them fresh."""
    GradientState._reset_state()
    AcceleratorState._reset_state()
    yield
    GradientState._reset_state()
    AcceleratorState._reset_state()


def recovering_policy() -> Policy:
    """Halt on NaN (a rewind, with recovery) and a zclip whose statistics a rewind restores."""
    return Policy.from_dict(
        {
            "version": 1,
            "rules": [
                {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
                {"name": "z", "match": "*", "actions": [{"action": "zclip", "max_norm": 5.0}]},
            ],
            "recovery": copy.deepcopy(RECOVERY),
        }
    )


def examples() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        {"x": torch.randn(4, generator=gen) * 3, "y": torch.randn(1, generator=gen) * 20} for _ in range(STEPS * BATCH)
    ]


class StopAt(transformers.TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


def trainer_of(folder: Path, callbacks: list[Any], **overrides: Any) -> Any:
    options: dict[str, Any] = {
        "per_device_train_batch_size": BATCH,
        "max_steps": STEPS,
        "logging_steps": 10,
        "learning_rate": 1e-2,
        "lr_scheduler_type": "linear",  # the LR changes at every step: a scheduler a step ahead would show
        "train_sampling_strategy": "sequential",
        **overrides,
    }
    return transformers.Trainer(
        model=TinyRegressor(), args=hf_training_args(folder, **options), train_dataset=examples(), callbacks=callbacks
    )


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    state = copy.deepcopy(optimizer.state_dict())
    groups = [{k: v for k, v in group.items() if k != "params"} for group in state["param_groups"]]
    return {"state": state["state"], "groups": groups}


def stopped_inside_the_window(folder: Path, **overrides: Any) -> Path:
    """Train with the guard and a NaN at step 23, stop at step 25 after a checkpoint: that checkpoint's folder."""
    callback = GradGuardCallback(recovering_policy(), logger=None)
    trainer = trainer_of(
        folder, [callback, hf_poison_at(FAULT), StopAt(SAVED)], save_strategy="steps", save_steps=SAVED, **overrides
    )
    trainer.train()
    assert callback.guard is not None
    assert callback.guard.state_dict()["recovery"]["skip_until"] == FAULT + RECOVERY["skip_steps"] + 1
    return Path(trainer.args.output_dir) / f"checkpoint-{SAVED}"


def test_a_trainer_resumed_from_a_copy_of_a_checkpoint_saved_in_the_skip_window_ends_as_the_run_never_stopped(
    tmp_path,
):
    """Callback alone, the checkpoint copied elsewhere and resumed with another output_dir: bitwise equal."""
    whole_callback = GradGuardCallback(recovering_policy(), logger=None)
    whole = trainer_of(tmp_path / "whole", [whole_callback, hf_poison_at(FAULT)])
    whole.train()

    saved = stopped_inside_the_window(tmp_path / "stopped")
    elsewhere = tmp_path / "elsewhere" / saved.name
    shutil.copytree(saved, elsewhere)
    shutil.rmtree(saved.parent)  # nothing left where the first run wrote
    audit = tmp_path / "resumed.jsonl"
    callback = GradGuardCallback(recovering_policy(), logger=None, audit_log=audit)
    resumed = trainer_of(tmp_path / "another", [callback])
    resumed.train(resume_from_checkpoint=str(elsewhere))

    assert callback.guard is not None
    assert whole_callback.guard is not None
    assert resumed.state.global_step == STEPS
    assert [event["step"] for event in events_of(audit, "state_loaded")] == [SAVED]
    assert callback.guard.state_dict()["recovery"] == whole_callback.guard.state_dict()["recovery"]
    assert callback.guard.counters.snapshot()["recovery"] == {"skip": 3}  # steps 25-27: the rest of the window
    assert_same(model_state(resumed.model), model_state(whole.model), "parameters")
    assert_same(optimizer_tensors(resumed.optimizer), optimizer_tensors(whole.optimizer), "optimizer")
    assert resumed.lr_scheduler.state_dict() == whole.lr_scheduler.state_dict()
    assert_same(callback.guard.state_dict()["statistics"], whole_callback.guard.state_dict()["statistics"], "zclip")


def test_the_guard_state_is_in_the_checkpoints_trainer_state_json(tmp_path):
    """trainer_state.json's stateful_callbacks holds the guard's state_dict at the checkpoint's step."""
    saved = stopped_inside_the_window(tmp_path)
    trainer_state = json.loads((saved / "trainer_state.json").read_text())
    guard_state = trainer_state["stateful_callbacks"]["GradGuardCallback"]["attributes"]["guard_state"]
    assert guard_state["step"] == SAVED
    assert guard_state["recovery"]["skip_until"] == 28
    assert guard_state["recovery"]["rewinds"] == 1


def test_resume_true_restores_the_guard_state_from_trainer_state_json(tmp_path):
    """resume_from_checkpoint=True with the callback alone: the last checkpoint's guard state is read."""
    saved = stopped_inside_the_window(tmp_path)
    (saved / STATE_FILE).unlink()  # only trainer_state.json holds it now
    audit = tmp_path / "resumed.jsonl"
    callback = GradGuardCallback(recovering_policy(), logger=None, audit_log=audit)
    resumed = trainer_of(tmp_path, [callback], save_strategy="steps", save_steps=SAVED)
    resumed.train(resume_from_checkpoint=True)
    assert [event["step"] for event in events_of(audit, "state_loaded")] == [SAVED]
    assert callback.guard is not None
    assert callback.guard.state_dict()["recovery"]["rewinds"] == 1


def test_a_resume_from_a_checkpoint_without_guard_state_warns_and_logs_state_missing(tmp_path):
    """A checkpoint of an unguarded run: a GuardWarning and a state_missing event, and later saves still work."""
    plain = trainer_of(tmp_path / "plain", [StopAt(10)], save_strategy="steps", save_steps=10)
    plain.train()
    checkpoint = Path(plain.args.output_dir) / "checkpoint-10"
    audit = tmp_path / "resumed.jsonl"
    callback = GradGuardCallback(recovering_policy(), logger=None, audit_log=audit)
    resumed = trainer_of(tmp_path / "resumed", [callback, StopAt(20)], save_strategy="steps", save_steps=10)
    with pytest.warns(GuardWarning, match="no guard state"):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    (missing,) = events_of(audit, "state_missing")
    assert missing["step"] == 10
    assert events_of(audit, "state_loaded") == []
    later = json.loads((Path(resumed.args.output_dir) / "checkpoint-20" / "trainer_state.json").read_text())
    assert later["stateful_callbacks"]["GradGuardCallback"]["attributes"]["guard_state"]["step"] == 20


def test_a_fresh_run_does_not_warn_about_missing_guard_state(tmp_path):
    """No resume, no warning."""
    callback = GradGuardCallback(recovering_policy(), logger=None)
    trainer = trainer_of(tmp_path, [callback], max_steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GuardWarning)
        trainer.train()


def test_restore_callback_states_from_checkpoint_keeps_the_callback_the_trainer_was_given(tmp_path):
    """With the Trainer's own restoring of callbacks, the callback it holds is still the one given, with its guard."""
    saved = stopped_inside_the_window(tmp_path / "stopped")
    gc.collect()  # the first run's callback is gone: the one below is the only one alive
    callback = GradGuardCallback(recovering_policy(), logger=None)
    resumed = trainer_of(tmp_path / "another", [callback], restore_callback_states_from_checkpoint=True)
    resumed.train(resume_from_checkpoint=str(saved))
    assert [cb for cb in resumed.callback_handler.callbacks if isinstance(cb, GradGuardCallback)] == [callback]
    assert callback.guard is not None
    assert callback.guard.state_dict()["recovery"]["rewinds"] == 1


def test_the_trainers_attach_event_counts_the_scheduler_the_callback_hands_over(tmp_path):
    """The attach event's recovery says "schedulers": 1: the Trainer's scheduler is given to the guard at attach."""
    audit = tmp_path / "run.jsonl"
    callback = GradGuardCallback(recovering_policy(), logger=None, audit_log=audit)
    trainer = trainer_of(tmp_path, [callback], max_steps=2)
    trainer.train()
    (attach,) = events_of(audit, "attach")
    assert attach["recovery"]["schedulers"] == 1
    assert callback.guard is not None
    assert callback.guard._enforcer.recovery.live.schedulers == [trainer.lr_scheduler]


def test_the_trainers_logs_show_no_nan_health_figures_in_the_steps_after_a_rewind(tmp_path):
    """The fault step's NaN norms are in its stats event only: the log entries of the window show finite ones."""
    rules = [
        {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
        {"name": "health", "match": "*", "actions": [{"action": "monitor", "stats": ["norm"]}]},
    ]
    spec = {"version": 1, "rules": rules, "recovery": copy.deepcopy(RECOVERY)}
    callback = GradGuardCallback(Policy.from_dict(spec), logger=None)
    trainer = trainer_of(tmp_path, [callback, hf_poison_at(FAULT)], max_steps=30, logging_steps=1)
    trainer.train()
    entries = [entry for entry in trainer.state.log_history if "loss" in entry]
    norms = [
        {key: value for key, value in entry.items() if key.startswith("gradguard/health/norm/")} for entry in entries
    ]
    assert len(norms) == 30
    assert all(figures and all(value == value for value in figures.values()) for figures in norms)
