"""Lightning integration: ``GradGuardCallback`` guards ``trainer.fit`` with a gradguard policy.

``pip install 'gradguard[lightning]'``. Add the callback to the ``Trainer``; it attaches a
[`GradGuard`][gradguard.GradGuard] to the ``LightningModule`` when fitting starts and removes it when
fitting ends or fails:

    from lightning.pytorch import Trainer
    from gradguard.integrations.lightning import GradGuardCallback

    trainer = Trainer(callbacks=[GradGuardCallback("my-policy.yaml")], gradient_clip_val=1.0)  # or a Policy
    trainer.fit(model)

Under ``strategy="ddp"`` the guard attaches to the strategy's ``DistributedDataParallel`` around the module
(``trainer.strategy.model``), where it reads each rank's own gradient before the all-reduce: a NaN made on one rank
is named with that rank and its host (``GradientHalt.ranks``) on every rank.

Where it acts: in ``on_before_optimizer_step``, after the step's backward passes (all micro-batches
of ``accumulate_grad_batches``) and after GradScaler's ``unscale_`` (``precision="16-mixed"``), and
before the module's own ``on_before_optimizer_step`` and Lightning's ``gradient_clip_val``: the policy
acts first, then Lightning's clip, exactly once per optimizer step. A halt ends ``trainer.fit`` with
[`GradientHalt`][gradguard.GradientHalt] before the optimizer step.

With a policy's ``recovery`` section a halt becomes a rewind instead: the trainer's LR schedulers
(``configure_optimizers``' ``lr_scheduler``) and the precision plugin's GradScaler are handed to the guard,
so they go back to the snapshot's step with the weights, Lightning's ``scheduler.step()`` on a skipped
batch is undone, and ``lr_factor`` holds through the schedulers' later steps. Skipped batches still run
their forward and backward (the update is what is skipped); Lightning's ``global_step`` counts them.

With a policy's ``rerun`` section, automatic optimization's closure is what the guard computes again; under
``accumulate_grad_batches`` the earlier batches' gradients and losses are put back first, so the second
computation is the whole step (``gradguard.enforce.triggers.rerun``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.core.optimizer import LightningOptimizer
except ImportError as exc:  # tested by hiding lightning from sys.modules
    raise ImportError(
        "gradguard.integrations.lightning needs Lightning 2.6 (the `lightning` package); install it with "
        "pip install 'gradguard[lightning]'"
    ) from exc

from gradguard import GradGuard, Policy
from gradguard.enforce.hooks.scaler import has_unscaled
from gradguard.enforce.recovery.schedulers import schedulers_with

__all__ = ["GradGuardCallback"]

_GUARD_STATE = "guard"


def _with_trainers(given: Any, trainer: pl.Trainer) -> list[Any]:
    """``lr_scheduler=`` given to the callback and the trainer's LR schedulers, for the guard's recovery (the
    precision plugin's GradScaler is its ``scaler``); given at attach, so the attach event counts them.

    A rewind takes them back to the snapshot's step with the weights and holds them through the skip
    window (Lightning's ``scheduler.step()`` at the end of a skipped batch is undone), and ``lr_factor``
    lowers what they recompute the LR from, so it holds through their later steps.
    """
    return schedulers_with(given, (config.scheduler for config in trainer.lr_scheduler_configs))


def _guarded_model(trainer: pl.Trainer, pl_module: pl.LightningModule) -> nn.Module:
    """The model the guard attaches to: the strategy's ``DistributedDataParallel`` around ``pl_module`` under
    ``strategy="ddp"`` (and its kin), else ``pl_module`` itself.

    The DDP wrapper is where each rank's own gradient can be read before the all-reduce averages one rank's NaN into
    every rank's: a guard on the bare ``LightningModule`` sees only the reduced gradients and can name no rank. The
    names are the same (the policy's patterns never see DDP's ``module.``). An FSDP2 strategy shards ``pl_module`` in
    place, where the guard finds its reduce-scatter by itself.
    """
    wrapped = getattr(trainer.strategy, "model", None)
    if isinstance(wrapped, DistributedDataParallel) and wrapped.module is pl_module:
        return wrapped
    return pl_module


class GradGuardCallback(Callback):
    """Enforce a gradguard policy on a ``LightningModule`` during ``trainer.fit``.

    Args:
        policy: a [`Policy`][gradguard.Policy] or the path of a policy file. Patterns match the names of
            ``pl_module.named_parameters()`` (a module that holds ``self.model`` has ``model.*`` names).
        log_counters: log the guard's counters through the module's loggers as
            ``gradguard/<rule>/<action>`` (cumulative counts) and ``gradguard/steps``, on the
            trainer's ``log_every_n_steps`` schedule.
        **guard_options: passed to [`GradGuard`][gradguard.GradGuard] (``audit_log``, ``logger``,
            ``per_micro_batch``, ``summary_every``, ``process_group``, ``replace``, ...). By default
            ``optimizer`` is the trainer's optimizers, ``scaler`` the precision plugin's GradScaler
            (``precision="16-mixed"``), ``lr_scheduler`` the trainer's schedulers (for ``recovery``;
            added to any given), and ``start_step`` the step saved in the checkpoint being resumed (else
            the resumed ``global_step``, else 0).

    After ``trainer.fit``, [`guard`][gradguard.integrations.lightning.GradGuardCallback.guard] is the (detached) guard
    of that fit, so its counters, step count and audit log stay readable.
    """

    def __init__(
        self,
        policy: Policy | str | os.PathLike[str],
        *,
        log_counters: bool = True,
        **guard_options: Any,
    ) -> None:
        super().__init__()
        self.policy: Policy = policy if isinstance(policy, Policy) else Policy.load(policy)
        self.log_counters = log_counters
        self.guard_options: dict[str, Any] = dict(guard_options)
        self.guard: GradGuard | None = None
        """The guard of the current (or last) fit; ``None`` before the first fit starts."""
        self._scaler: torch.amp.GradScaler | None = None
        self._saved_state: dict[str, Any] | None = None
        self._checkpoint_step: int | None = None

    # --- attach and detach ---------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Attach the guard: after the strategy set the model and optimizers up, before the first step.

        A checkpoint being resumed has already given its callback state by now (``load_state_dict``),
        except under strategies that restore after setup: those hand it over later, to the live guard.
        """
        self._detach()
        options = dict(self.guard_options)
        if "scaler" not in options:
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            options["scaler"] = scaler if isinstance(scaler, torch.amp.GradScaler) else None
        self._scaler = options["scaler"]
        if "optimizer" not in options:
            optimizers = [opt for opt in trainer.optimizers if isinstance(opt, Optimizer)]
            options["optimizer"] = optimizers or None
        state, self._saved_state = self._saved_state, None
        if state is not None:
            options["start_step"] = int(state["step"])
        elif "start_step" not in options:
            checkpoint_step = self._checkpoint_step
            options["start_step"] = checkpoint_step if checkpoint_step is not None else trainer.global_step
        self._checkpoint_step = None
        options["lr_scheduler"] = _with_trainers(options.get("lr_scheduler"), trainer)
        guard = GradGuard(_guarded_model(trainer, pl_module), self.policy, **options)
        self.guard = guard
        if state is not None:
            guard.load_state_dict(state)  # skip histories; logged as a state_loaded event

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._detach()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._detach()
        else:  # validate/test/predict from a checkpoint: its guard state is not for a later fit
            self._saved_state = None
            self._checkpoint_step = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """The fit failed (a ``GradientHalt`` among others): detach, keeping the guard readable."""
        self._detach()

    def _detach(self) -> None:
        if self.guard is not None and self.guard.attached:
            self.guard.remove()

    # --- the step ------------------------------------------------------------------------------

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        """Treat the gradients this optimizer is about to apply: before Lightning's gradient clipping.

        The gradients count as treated until the optimizer has stepped, so Lightning's clip changing
        them does not make the optimizer's own step treat them again. Where the explicit boundary
        cannot work (a GradScaler that has not unscaled this optimizer: a fused optimizer unscales in
        its kernel), the guard acts in the optimizer's ``step()`` instead, as without Lightning.
        """
        guard = self.guard
        if guard is None or not guard.attached:
            return
        opt: Any = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if not isinstance(opt, Optimizer):
            return
        if self._scaler is not None and not has_unscaled(self._scaler, opt):
            return
        guard.step(opt)

    # --- logging -------------------------------------------------------------------------------

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log the cumulative counters; Lightning passes them to the loggers every ``log_every_n_steps``."""
        guard = self.guard
        if not self.log_counters or guard is None or not trainer.loggers:
            return
        pl_module.log_dict(self.metrics(), on_step=True, on_epoch=False, logger=True, batch_size=1)

    def metrics(self) -> dict[str, float]:
        """``guard.metrics()`` of the current guard: ``gradguard/steps``, ``gradguard/<rule>/<action>``
        counts and the monitors' last figures, ``gradguard/<rule>/<stat>[/<name>]``."""
        guard = self.guard
        if guard is None:
            return {}
        return guard.metrics()

    # --- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Saved in Lightning checkpoints: the guard's step number and skip histories."""
        if self.guard is None:
            return {}
        return {_GUARD_STATE: self.guard.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the guard's steps: now if it is attached (restore after setup), else when it attaches."""
        state = state_dict.get(_GUARD_STATE)
        if state is None:
            return
        if self.guard is not None and self.guard.attached:
            self.guard.load_state_dict(state)
        else:
            self._saved_state = state

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Remember the checkpoint's global step: the guard's start step if it saved no guard state."""
        step = checkpoint.get("global_step")
        self._checkpoint_step = int(step) if isinstance(step, int) else None
