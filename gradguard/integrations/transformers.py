"""gradguard for the Hugging Face ``Trainer``: [`guard_trainer`][gradguard.integrations.transformers.guard_trainer] (and
[`GradGuardCallback`][gradguard.integrations.transformers.GradGuardCallback]).

``Trainer`` clips the step's gradients with ``accelerator.clip_grad_norm_(model.parameters(),
max_grad_norm)`` right after the last backward (with ``max_grad_norm=0`` it still calls it, with an
infinite norm, to measure the norm), and no callback event runs in between. That clip turns one NaN
gradient into NaN everywhere, so a guard acting at the optimizer's ``step()`` would halt naming
every parameter. [`guard_trainer`][gradguard.integrations.transformers.guard_trainer] is the way to use gradguard with
``Trainer``: it places the guard before Trainer's clip (inside ``accelerator.unscale_gradients``, after GradScaler's
unscale), puts the guard's counters into Trainer's logs (``gradguard/<rule>/<action>``, in
``trainer.state.log_history`` and in what ``report_to`` integrations receive), saves the guard's
state beside each checkpoint, and removes the guard when ``trainer.train()`` ends, also by an
exception such as [`GradientHalt`][gradguard.GradientHalt].

Install with ``pip install 'gradguard[transformers]'``.
"""

from __future__ import annotations

import json
import os
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    import transformers
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

    from gradguard.integrations.accelerate import AcceleratorBoundary, InstancePatch, hand_schedulers
except ImportError as exc:  # pragma: no cover - exercised by a test that hides transformers
    raise ImportError(
        "gradguard.integrations.transformers needs transformers and accelerate: pip install 'gradguard[transformers]'"
    ) from exc

import torch
from torch import nn

from gradguard import GradGuard, GuardWarning, Policy

__all__ = ["STATE_FILE", "GradGuardCallback", "guard_trainer"]

STATE_FILE = "gradguard_state.json"
"""The guard's ``state_dict()``, written into each checkpoint folder the Trainer saves."""


class GradGuardCallback(transformers.TrainerCallback):
    """Attaches a [`GradGuard`][gradguard.GradGuard] to the Trainer's model for each ``trainer.train()``.

    On its own (``Trainer(..., callbacks=[GradGuardCallback(policy)])``, the Hugging Face convention) the
    guard acts before Trainer's ``max_grad_norm`` clip: accelerate's ``clip_grad_norm_`` unscales, then
    calls ``torch.nn.utils.clip_grad_norm_``, which runs the guard's step first while a guard is attached;
    a NaN halts naming the parameter it came from. ``on_log`` adds the guard's counters
    (``gradguard/<rule>/<action>``) to the entry Trainer has just put in ``state.log_history``.
    [`guard_trainer`][gradguard.integrations.transformers.guard_trainer] does the same and more: the counters also reach
    the ``report_to`` integrations (wandb, TensorBoard run before user callbacks), checkpoints resume with
    ``resume_from_checkpoint=True``, and a [`GradientHalt`][gradguard.GradientHalt] raised out of ``trainer.train()``
    removes the guard (with the callback alone ``on_train_end`` does not run then: call
    [`remove`][gradguard.integrations.transformers.GradGuardCallback.remove]).

    The guard is created at ``on_train_begin`` with ``start_step=state.global_step`` (a resumed run
    carries the step numbers on); for a policy's ``recovery`` it is told the Trainer's ``lr_scheduler`` and
    GradScaler (fp16): a rewind takes them back to the snapshot's step with the weights, and ``lr_factor``
    holds through the scheduler's later steps. It is removed at ``on_train_end``;
    [`guard`][gradguard.integrations.transformers.GradGuardCallback.guard] keeps the last run's guard, detached, so its
    counters can be read. At every checkpoint, ``guard.state_dict()`` (step number, skip histories, recovery's rewind
    count) is written to ``<checkpoint>/gradguard_state.json`` and read back when a run resumes from that
    checkpoint.

    Args:
        policy: a [`Policy`][gradguard.Policy] or the path of a policy file (loaded, and checked, now).
        **guard_options: passed to [`GradGuard`][gradguard.GradGuard] (``audit_log``, ``logger``,
            ``summary_every``, ``scaler``, ...); ``start_step`` comes from the Trainer.
    """

    def __init__(self, policy: Policy | str | os.PathLike[str], **guard_options: Any) -> None:
        if "start_step" in guard_options:
            raise TypeError(
                "GradGuardCallback sets start_step from the Trainer's state.global_step (a resumed run carries on "
                "from its checkpoint's step); do not pass it"
            )
        self.policy = policy if isinstance(policy, Policy) else Policy.load(policy)
        self.guard_options = guard_options
        self.guard: GradGuard | None = None
        """The guard of the current (or last) ``trainer.train()``; detached once that run ended."""
        self._trainer_ref: weakref.ReferenceType[transformers.Trainer] | None = None
        self._resume_from: str | None = None
        self._boundary: AcceleratorBoundary | None = None
        self._log_patch: InstancePatch | None = None

    # --- Trainer events ---------------------------------------------------------------------------

    def on_train_begin(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        **kwargs: Any,
    ) -> None:
        self.remove()  # a guard a previous, failed train() left attached
        model = kwargs.get("model")
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"GradGuardCallback needs the Trainer's model at on_train_begin, got {type(model).__name__}"
            )
        trainer = self._trainer_ref() if self._trainer_ref is not None else None
        options = dict(self.guard_options)
        if trainer is not None:
            options.setdefault("scaler", trainer.accelerator.scaler)
        guard = GradGuard(model, self.policy, start_step=state.global_step, **options)
        self.guard = guard
        # For recovery: the scheduler and the scale go back to the snapshot's step with the weights, held through
        # the skip window, and lr_factor holds through the scheduler's later steps.
        scheduler = kwargs.get("lr_scheduler")
        if scheduler is not None:
            hand_schedulers(guard, [scheduler])
        scaler = getattr(kwargs.get("optimizer"), "scaler", None)  # the prepared AcceleratedOptimizer's (fp16)
        if guard._enforcer.recovery.live.scaler is None and isinstance(scaler, torch.amp.GradScaler):
            guard._enforcer.recovery.set_scaler(scaler)
        self._load_saved_state(guard, args, state)
        if trainer is not None:
            self._boundary = AcceleratorBoundary(trainer.accelerator, self._current_guard, remove_with_guard=False)
            self._log_patch = InstancePatch(trainer, "log", self._wrap_log(trainer.log))

    def on_train_end(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        **kwargs: Any,
    ) -> None:
        self.remove()

    def on_save(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        **kwargs: Any,
    ) -> None:
        guard = self.guard
        if guard is None or not guard.attached or not args.should_save:
            return
        folder = Path(str(args.output_dir)) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if folder.is_dir():
            (folder / STATE_FILE).write_text(json.dumps(guard.state_dict()), encoding="utf-8")

    def on_log(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if self._log_patch is not None or self.guard is None:
            return  # guard_trainer's wrapper of Trainer.log put them in already, before the integrations
        entries = self.log_entries()
        if logs is not None:
            logs.update(entries)  # for the callbacks after this one
        if state.log_history:
            state.log_history[-1].update(entries)  # Trainer.log appended this entry just before on_log

    # --- public -----------------------------------------------------------------------------------

    def remove(self) -> None:
        """Detach the guard (kept in [`guard`][gradguard.integrations.transformers.GradGuardCallback.guard] for its
        counters) and undo every wrapper; idempotent."""
        if self._boundary is not None:
            self._boundary.remove()
            self._boundary = None
        if self._log_patch is not None:
            self._log_patch.remove()
            self._log_patch = None
        if self.guard is not None:
            self.guard.remove()

    def log_entries(self) -> dict[str, float]:
        """``guard.metrics()`` less ``gradguard/steps`` (Trainer logs its own step): the counters,
        ``{"gradguard/<rule>/<action>": count}``, and the monitors' last figures."""
        if self.guard is None:
            return {}
        entries = self.guard.metrics()
        del entries["gradguard/steps"]
        return entries

    # --- internals --------------------------------------------------------------------------------

    def _current_guard(self) -> GradGuard | None:
        return self.guard

    def _wrap_log(self, log: Callable[..., None]) -> Callable[..., None]:
        def log_with_counters(logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
            # Before Trainer.log appends to state.log_history and calls the reporting integrations.
            logs.update(self.log_entries())
            log(logs, *args, **kwargs)

        return log_with_counters

    def _load_saved_state(
        self, guard: GradGuard, args: transformers.TrainingArguments, state: transformers.TrainerState
    ) -> None:
        """A resumed run: take the skip histories saved beside the checkpoint; the step stays global_step."""
        folder = self._resume_from
        self._resume_from = None
        if folder is None:
            if state.global_step == 0:
                return
            folder = os.path.join(str(args.output_dir), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        path = Path(folder) / STATE_FILE
        if not path.is_file():
            return
        saved = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(saved, dict) and saved.get("step") != state.global_step:
            warnings.warn(
                f"{path} holds the guard's state at step {saved.get('step')}, but the Trainer resumes at global step "
                f"{state.global_step}; the guard carries on from the Trainer's step",
                GuardWarning,
                stacklevel=2,
            )
        if isinstance(saved, dict):
            saved = {**saved, "step": state.global_step}
        guard.load_state_dict(saved)


def guard_trainer(
    trainer: transformers.Trainer, policy: Policy | str | os.PathLike[str], **guard_options: Any
) -> GradGuardCallback:
    """Guard ``trainer``'s model with ``policy``, before Trainer's gradient clip: THE way with ``Trainer``.

    Adds a [`GradGuardCallback`][gradguard.integrations.transformers.GradGuardCallback] and, for each
    ``trainer.train()``:

    - treats every step's final gradients inside ``trainer.accelerator.unscale_gradients``, which
      Trainer's ``clip_grad_norm_`` calls first (after GradScaler's unscale under fp16): the policy
      acts before the global ``max_grad_norm`` clip, and a NaN halts naming the one parameter it
      came from, with the weights as after the last good step;
    - adds the guard's counters to every ``trainer.log`` call as ``gradguard/<rule>/<action>``
      (cumulative over this ``train()``), so they are in ``trainer.state.log_history`` and reach the
      ``report_to`` integrations;
    - starts the guard at ``state.global_step`` and, resuming from a checkpoint, reads back the guard
      state saved beside it;
    - removes the guard and every wrapper when ``train()`` returns or raises.

    Returns the callback; ``callback.guard`` is the (last) run's guard.

    Args:
        trainer: a ``transformers.Trainer`` (not yet training).
        policy: a [`Policy`][gradguard.Policy] or the path of a policy file.
        **guard_options: passed to [`GradGuard`][gradguard.GradGuard] (``audit_log``, ``logger``,
            ``summary_every``, ...). ``scaler`` defaults to the Trainer's GradScaler (fp16).
    """
    callback = GradGuardCallback(policy, **guard_options)
    callback._trainer_ref = weakref.ref(trainer)
    trainer.add_callback(callback)
    train = trainer.train

    def guarded_train(
        resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> transformers.trainer_utils.TrainOutput:
        if isinstance(resume_from_checkpoint, bool):
            found = get_last_checkpoint(str(trainer.args.output_dir)) if resume_from_checkpoint else None  # type: ignore[no-untyped-call]
            callback._resume_from = None if found is None else str(found)
        else:
            callback._resume_from = None if resume_from_checkpoint is None else os.fspath(resume_from_checkpoint)
        try:
            return train(resume_from_checkpoint, *args, **kwargs)
        finally:
            callback.remove()  # also when train() raised (a GradientHalt): on_train_end did not run

    trainer.train = guarded_train  # type: ignore[method-assign]
    return callback
