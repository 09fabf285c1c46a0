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

DeepSpeed works too (``TrainingArguments(deepspeed=...)``, ZeRO stage 1, 2 or 3): the Trainer's update then happens
inside DeepSpeed's engine, which ``accelerator.backward`` steps, and
[`guard_trainer`][gradguard.integrations.transformers.guard_trainer] guards that engine (``trainer.model_wrapped``), as
``GradGuard(engine, policy)`` does: the policy acts on the reduced gradients inside DeepSpeed's update, before its
``gradient_clipping`` (Trainer's ``max_grad_norm``), a NaN halts every rank at the same step naming the parameter,
and a skip takes DeepSpeed's overflow path, so the Trainer does not step its scheduler either. What the guard refuses
under DeepSpeed (optimizer and parameter offload, a ``recovery`` section under fp16; docs/distributed.md) is refused at
``on_train_begin``. Tested through the Trainer at ZeRO 2; ZeRO 3 ran through it in issue 58's trial, not in the tests.

A policy's ``rerun`` section cannot compute a step again here: ``Trainer`` steps without a closure the guard could
run a second time. The first suspect step says so (``rerun_unavailable``, with why), its verdict stands, and a halt
says the step was not computed again.

Install with ``pip install 'gradguard[transformers]'``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    import transformers
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

    from gradguard.integrations.accelerate import AcceleratorBoundary, InstancePatch, unwrap_scheduler
except ImportError as exc:  # pragma: no cover - exercised by a test that hides transformers
    raise ImportError(
        "gradguard.integrations.transformers needs transformers and accelerate: pip install 'gradguard[transformers]'"
    ) from exc

import torch
from torch import nn

from gradguard import GradGuard, GuardStateError, GuardWarning, Policy
from gradguard.enforce.distributed.deepspeed import deepspeed_engine
from gradguard.enforce.recovery.schedulers import schedulers_with

__all__ = ["STATE_FILE", "GradGuardCallback", "guard_trainer"]

STATE_FILE = "gradguard_state.json"
"""The guard's ``state_dict()``, written into each checkpoint folder the Trainer saves (also in its
``trainer_state.json``, which a resume reads first)."""

_GIVEN = "gradguard: the callback given to the Trainer"
"""``state()``'s ``args``: with ``restore_callback_states_from_checkpoint`` the Trainer rebuilds each stateful callback
from them; this one is rebuilt as the live callback itself (its policy and options are not in the checkpoint)."""
_ALIVE: weakref.WeakSet[GradGuardCallback] = weakref.WeakSet()


class GradGuardCallback(transformers.TrainerCallback, ExportableState):
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
    count, a skip window in progress) goes into the checkpoint's ``trainer_state.json`` (the Trainer's own
    ``stateful_callbacks``, through [`state`][gradguard.integrations.transformers.GradGuardCallback.state]) and
    into ``<checkpoint>/gradguard_state.json``; a run resumed from that checkpoint, wherever it was copied to
    (``resume_from_checkpoint="elsewhere/checkpoint-65"`` or ``True``), reads it back. A resume whose checkpoint holds
    none (a run saved without the guard) warns and logs a ``state_missing`` event: the guard starts afresh.

    Under DDP (torchrun) the guard is attached to the Trainer's ``DistributedDataParallel`` (``trainer.model_wrapped``),
    where it reads each rank's own gradient before the all-reduce: a NaN made on one rank is named with that rank and
    its host (``GradientHalt.ranks``) on every rank, with the callback alone too.

    Under DeepSpeed the guard is attached to the Trainer's DeepSpeed engine (``trainer.model_wrapped``) and acts inside
    its update; the callback's own arguments name only the plain model, so this needs the callback from
    [`guard_trainer`][gradguard.integrations.transformers.guard_trainer]: the callback alone raises
    [`GuardStateError`][gradguard.GuardStateError] at ``on_train_begin`` saying so.

    Args:
        policy: a [`Policy`][gradguard.Policy] or the path of a policy file (loaded, and checked, now).
        **guard_options: passed to [`GradGuard`][gradguard.GradGuard] (``audit_log``, ``logger``,
            ``summary_every``, ``scaler``, ...); ``start_step`` comes from the Trainer.
    """

    def __new__(cls, policy: Policy | str | os.PathLike[str], **guard_options: Any) -> GradGuardCallback:
        if not (isinstance(policy, str) and policy == _GIVEN):
            return super().__new__(cls)
        # The Trainer rebuilds its stateful callbacks from state()'s args (restore_callback_states_from_checkpoint):
        # the one it holds is the only one alive, and keeps its policy, options and identity.
        alive = [callback for callback in list(_ALIVE) if type(callback) is cls]
        if len(alive) != 1:
            raise TypeError(
                f"restore_callback_states_from_checkpoint=True rebuilds {cls.__name__} from the checkpoint, which "
                f"cannot say which of the {len(alive)} {cls.__name__}s alive it was; leave it False: the callback "
                "restores its guard's state from trainer_state.json by itself"
            )
        return alive[0]

    def __init__(self, policy: Policy | str | os.PathLike[str], **guard_options: Any) -> None:
        if isinstance(policy, str) and policy == _GIVEN:
            return  # the live callback, given back by __new__: unchanged
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
        _ALIVE.add(self)

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
        engine = _deepspeed_engine_of(trainer, args, kwargs)
        options = dict(self.guard_options)
        if trainer is not None and engine is None:
            options.setdefault("scaler", trainer.accelerator.scaler)  # DeepSpeed keeps its own loss scale
        # For recovery: the scheduler and the scale go back to the snapshot's step with the weights, held through
        # the skip window, and lr_factor holds through the scheduler's later steps. Given at attach, so the attach
        # event counts it.
        options["lr_scheduler"] = _with_trainers(options.get("lr_scheduler"), kwargs.get("lr_scheduler"))
        # Under DeepSpeed the engine's update is the boundary (it reduces the gradients into its partitions and
        # clips and applies them inside engine.step, which accelerator.backward calls): the guard hooks it there.
        # Under DDP the wrapper is what the guard attaches to: there it reads each rank's own gradient before the
        # all-reduce, and names the rank a NaN came from.
        guarded = engine if engine is not None else _data_parallel_of(model, trainer or _trainer_running(model))
        guard = GradGuard(guarded, self.policy, start_step=state.global_step, **options)
        self.guard = guard
        scaler = getattr(kwargs.get("optimizer"), "scaler", None)  # the prepared AcceleratedOptimizer's (fp16)
        if engine is None and guard._enforcer.recovery.live.scaler is None and isinstance(scaler, torch.amp.GradScaler):
            guard._enforcer.recovery.set_scaler(scaler)
        self._load_saved_state(guard, args, state)
        if trainer is not None:
            if engine is None:  # under DeepSpeed, accelerate's clip_grad_norm_ never unscales: nothing to wrap
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

    def state(self) -> dict[str, Any]:
        """What the Trainer saves of this callback in each checkpoint's ``trainer_state.json``
        (``transformers.trainer_callback.ExportableState``): the guard's ``state_dict()`` as ``attributes``."""
        guard = self.guard
        saved = guard.state_dict() if guard is not None and guard.attached else None
        return {"args": {"policy": _GIVEN}, "attributes": {"guard_state": saved}}

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
        """A resumed run: take the guard state its checkpoint holds (``trainer_state.json`` first, else the
        ``gradguard_state.json`` beside it); the step stays global_step."""
        folder = self._resume_from
        self._resume_from = None
        name = type(self).__name__
        stateful: Any = state.stateful_callbacks  # a dict once the TrainerState exists (its __post_init__)
        saved = _saved_in(stateful.get(name))
        stateful.setdefault(name, self.state())  # the Trainer's next save updates this entry, and never adds it
        path: Path | str = "trainer_state.json"
        if saved is None and (folder is not None or state.global_step > 0):
            if folder is None:
                folder = os.path.join(str(args.output_dir), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            path = Path(folder) / STATE_FILE
            saved = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
        if saved is None:
            if state.global_step > 0:
                _warn_missing(guard, state.global_step)
            return
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


def _deepspeed_engine_of(
    trainer: transformers.Trainer | None, args: transformers.TrainingArguments, kwargs: dict[str, Any]
) -> Any | None:
    """The DeepSpeed engine that updates the model, or None when the Trainer does not run DeepSpeed.

    The Trainer wraps its model into the engine before ``on_train_begin`` (``trainer.model_wrapped``), but the
    callbacks' ``model`` stays the plain model: without the trainer (a callback not added by ``guard_trainer``) the
    engine cannot be found, and the guard would watch ``p.grad``, which ZeRO 1/2 leaves empty. That is refused."""
    candidates = [kwargs.get("model")]
    if trainer is not None:
        wrapper = getattr(trainer.accelerator, "deepspeed_engine_wrapped", None)
        candidates += [trainer.model_wrapped, getattr(trainer, "deepspeed", None), getattr(wrapper, "engine", None)]
    for candidate in candidates:
        engine = deepspeed_engine(candidate)
        if engine is not None:
            return engine
    optimizer = kwargs.get("optimizer")
    wrapped = any(klass.__name__ == "DeepSpeedOptimizerWrapper" for klass in type(optimizer).__mro__)
    deepspeed_on = bool(getattr(trainer, "is_deepspeed_enabled", False)) or wrapped or bool(args.deepspeed)
    if not deepspeed_on:
        return None
    if trainer is None:
        raise GuardStateError(
            "this Trainer runs DeepSpeed, whose engine reduces the gradients into its own partitions and applies them "
            "inside its update; a GradGuardCallback given to the Trainer on its own cannot reach that engine (the "
            "callbacks are handed the plain model). Use guard_trainer(trainer, policy) instead of "
            "callbacks=[GradGuardCallback(policy)]: it guards the engine (trainer.model_wrapped)."
        )
    raise GuardStateError(
        f"this Trainer runs DeepSpeed, but its model_wrapped is a {type(trainer.model_wrapped).__name__}, not a "
        "DeepSpeedEngine, at on_train_begin: gradguard cannot find the engine whose update it must guard"
    )


def _trainer_running(model: nn.Module) -> transformers.Trainer | None:
    """The Trainer whose event is being handled, for a callback given to it on its own: the events are handed the
    plain ``model``, never the Trainer, whose ``model_wrapped`` is the DDP wrapper; it is the ``self`` of a method
    below on the stack (``_inner_training_loop`` calls ``on_train_begin``)."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, transformers.Trainer) and candidate.model is model:
            return candidate
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _data_parallel_of(model: nn.Module, trainer: transformers.Trainer | None) -> nn.Module:
    """The Trainer's ``DistributedDataParallel`` around ``model`` (``trainer.model_wrapped`` under torchrun), where
    the guard reads each rank's own gradient before the all-reduce; else ``model`` (one process, or FSDP2, which
    shards ``model`` in place and whose reduce-scatter the guard finds by itself). The names are the same."""
    wrapped = getattr(trainer, "model_wrapped", None)
    if isinstance(wrapped, nn.parallel.DistributedDataParallel) and wrapped.module is model:
        return wrapped
    return model


def _with_trainers(given: Any, scheduler: Any) -> list[Any]:
    """``lr_scheduler=`` given to the callback, and the Trainer's (unwrapped), where it can be held (DeepSpeed's
    ``DummyScheduler`` cannot)."""
    return schedulers_with(given, [unwrap_scheduler(scheduler)])


def _saved_in(entry: Any) -> dict[str, Any] | None:
    """The guard state in ``trainer_state.json``'s entry for the callback (a list where several were saved)."""
    entries = entry if isinstance(entry, list) else [entry]
    for one in entries:
        saved = one.get("attributes", {}).get("guard_state") if isinstance(one, dict) else None
        if isinstance(saved, dict):
            return saved
    return None


def _warn_missing(guard: GradGuard, step: int) -> None:
    why = (
        f"the Trainer resumes at global step {step} from a checkpoint that holds no guard state (none in its "
        f"trainer_state.json, no {STATE_FILE}): the guard starts afresh, with no rewind count, skip window or "
        "statistics carried over"
    )
    guard._events.emit("warning", "state_missing", step=step, why=why)
    warnings.warn(why, GuardWarning, stacklevel=4)


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

    With a DeepSpeed config (ZeRO stage 1, 2 or 3) it guards the Trainer's DeepSpeed engine instead: the policy acts
    on the reduced gradients inside DeepSpeed's update (before its ``gradient_clipping``), every rank reaches the same
    verdict, and the counters reach the logs as above.

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
