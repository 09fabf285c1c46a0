"""Recovery: a halt becomes a rewind to an in-memory snapshot, and the run goes on (docs/recovery.md).

With a policy's ``recovery`` section, the guard takes a ``Snapshot`` at the first boundary of every
step that is a multiple of ``snapshot_every`` (before the policy treats that step's gradients, so
before its update) and keeps the newest ``keep``. A step whose verdict is a halt restores, in place,
the newest snapshot at least ``min_age`` steps older than the fault, drops the newer ones, takes no
update at the fault step and skips the updates of the next ``skip_steps`` steps: the batches from the
snapshot's step to the end of that window are never learned from, and the run ends exactly as one that
never trained on them.

Skipped steps change nothing the guard restored. The GradScaler's scale and the LR schedulers the guard
knows are held: the loop's ``scaler.update()`` and ``scheduler.step()`` on a skipped step are undone at
the next boundary, up to and including the first step applied again, so the schedule goes on from the
snapshot's step, as a restart from a checkpoint taken there would (PaLM's recipe, in the run).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from gradguard.enforce.actions.nonfinite import SkipLimits
from gradguard.enforce.recovery.averages import averages_given
from gradguard.enforce.recovery.decisions import Decision
from gradguard.enforce.recovery.held_state import HeldState
from gradguard.enforce.recovery.schedulers import check_copyable
from gradguard.enforce.recovery.snapshot_fit import misfit_reason, misfits
from gradguard.enforce.recovery.snapshot_memory import HOST, Placement
from gradguard.enforce.recovery.snapshot_places import Places, snapshot_bytes
from gradguard.enforce.recovery.snapshots import (
    LiveState,
    Snapshot,
    TensorCopies,
    scale_lrs,
    scheduler_optimizer,
)
from gradguard.enforce.work.statistics import Statistics
from gradguard.errors import GuardStateError, GuardWarning
from gradguard.events.counters import RECOVERY_RULE, Counters
from gradguard.policy.schema import Recovery as RecoveryConfig

__all__ = ["Recovery"]


class Recovery:
    """Snapshots, rewinds and skip windows for one guard; inactive while the policy has no ``recovery``."""

    def __init__(self, statistics: Statistics, skip_limits: SkipLimits, counters: Counters | None = None) -> None:
        self.counters = counters if counters is not None else Counters()
        """The guard's counters: each step of a rewind's window counts as ``RECOVERY_RULE``/``skip``."""
        self._counted_step: int | None = None
        self.config: RecoveryConfig | None = None
        """The policy's ``recovery`` section (set by the engine at every step: a reload may change it)."""
        self.live = LiveState(weakref.ref(nn.Module()), statistics, skip_limits)
        self.snapshots: list[Snapshot] = []
        """Held snapshots, oldest first."""
        self._spare: list[Snapshot] = []
        """Snapshots no longer held, whose buffers the next ones reuse."""
        self.rewinds = 0
        self.skip_until: int | None = None
        """The first step applied again after a rewind; steps before it (and after the fault) are skipped."""
        self.lr_scale = 1.0
        """The product of every rewind's ``lr_factor`` so far."""
        self.applied = 0
        """Updates applied (not skipped, not undone by a rewind): ``guard.applied_steps``, a scheduler's step number."""
        self._applied_at: int | None = None
        self._held: HeldState | None = None
        self._checked: weakref.WeakSet[Optimizer] = weakref.WeakSet()
        self._buffers_at: tuple[int, TensorCopies] | None = None
        """The model's buffers at the start of a step a snapshot is due at (and the step), or a spare copy."""
        self.places = Places(self.live)
        """Where snapshots live (``recovery.memory``), and host mode's staging buffer."""

    # --- what the guard tells it ------------------------------------------------------------------

    def track(
        self,
        model: nn.Module,
        optimizers: list[Optimizer] | None,
        scaler: torch.amp.GradScaler | None,
        schedulers: list[Any],
        config: RecoveryConfig | None,
        start_step: int,
        averages: Any = None,
    ) -> None:
        """What the guard attaches to; nothing of ``start_step`` has run yet (its buffers are a snapshot's)."""
        self.config = config
        self.live.model = weakref.ref(model)
        self.live.averages = averages_given(averages, model)
        self.live.known_optimizers = [weakref.ref(opt) for opt in optimizers or ()]
        self.live.scaler = scaler
        for scheduler in schedulers:
            self.add_scheduler(scheduler)
        self.places.optimizers_given = optimizers is not None
        self.applied = start_step  # a resumed run's loop counted the first run's steps (a state_dict says better)
        if config is not None:
            self.place(config)  # device memory asked for and not fitting: an error now, not an OOM mid-run
        self.at_step_start(start_step)

    def place(self, config: RecoveryConfig) -> Placement:
        """Where snapshots go, chosen once for the section's ``memory`` and ``keep`` (docs/recovery.md)."""
        return self.places.place(config, lambda: self.nbytes)

    @property
    def placement(self) -> Placement | None:
        """Where snapshots live: chosen at attach, for ``auto`` again at the first snapshot, and after a reload."""
        return self.places.placement

    def add_scheduler(self, scheduler: Any) -> None:
        """A scheduler of the loop (an integration finds it after attach): rewound with the snapshots from now on.

        Snapshots taken before it was known hold none of its state; a rewind to one leaves it as it is.
        """
        if any(known is scheduler for known in self.live.schedulers):
            return
        if self.config is not None:
            check_copyable(scheduler)  # refused now, naming it, not at the first snapshot
        self.live.schedulers.append(scheduler)
        optimizer = scheduler_optimizer(scheduler)
        if optimizer is not None:
            self.saw_optimizer(optimizer)

    def set_scaler(self, scaler: torch.amp.GradScaler) -> None:
        """The loop's GradScaler (an integration finds it after attach): its scale is rewound and held."""
        self.live.scaler = scaler

    def saw_optimizer(self, optimizer: Optimizer) -> None:
        """An optimizer steps the model, before its update: the snapshots hold its state from now on.

        Every step of an optimizer holding the model's parameters reaches the guard, so one seen for the
        first time has not stepped them since the guard attached: its state now is its state at every
        snapshot held, which it joins.
        """
        live = self.live
        while isinstance(inner := getattr(optimizer, "optimizer", None), Optimizer):
            optimizer = inner  # accelerate's AcceleratedOptimizer wraps the one that holds the state
        for ref in live.known_optimizers:  # seen before (at every step after the first): a loop without a call
            if ref() is optimizer:
                return
        known = [opt for ref in live.known_optimizers if (opt := ref()) is not None]
        if any(opt is optimizer or opt.param_groups is optimizer.param_groups for opt in known):
            return  # a wrapper sharing its groups and state would be copied, and its LRs scaled, twice
        live.known_optimizers.append(weakref.ref(optimizer))
        model_ids = live.model_ids()
        for snapshot in self.snapshots:
            if not snapshot.holds(optimizer):
                snapshot.add_optimizer(optimizer, model_ids)

    def unchecked(self, optimizer: Optimizer) -> bool:
        """Whether an optimizer that steps no guarded parameter is met for the first time (checked once)."""
        if optimizer in self._checked:
            return False
        self._checked.add(optimizer)
        return True

    def met_unguarded(self, optimizer: Optimizer) -> None:
        """An optimizer stepping none of the guarded parameters, met for the first time: if it steps others of the
        model, its state is snapshotted and rewound with the rest, but its updates in a window are not held back."""
        model = self.live.model()
        names = {id(p): name for name, p in model.named_parameters()} if model is not None else {}
        held = [names[id(p)] for group in optimizer.param_groups for p in group["params"] if id(p) in names]
        if not held:
            return
        self.saw_optimizer(optimizer)
        shown = ", ".join(held[:3]) + (" ..." if len(held) > 3 else "")
        warnings.warn(
            f"recovery: {type(optimizer).__name__} steps parameters of the model no rule covers ({shown}): a rewind "
            "restores them and its state, but its updates in the skipped steps after a rewind are not held back. "
            "Cover them with a rule (e.g. match '*' with halt_on_nonfinite).",
            GuardWarning,
            stacklevel=5,
        )

    # --- at each step -----------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.config is not None

    def skipping(self, step: int) -> bool:
        """Whether ``step``'s update is skipped: it lies in a rewind's window."""
        return self.skip_until is not None and step < self.skip_until

    def pass_step(self, step: int) -> bool:
        """``guard.pass_step()``: whether ``step`` lies in a rewind's window, counted as skipped if it does."""
        if not self.skipping(step):
            return False
        self._count_skip(step)
        return True

    def applied_step(self, step: int) -> None:
        """``step``'s update goes through (counted once, however many optimizers step in it)."""
        if step != self._applied_at:
            self._applied_at, self.applied = step, self.applied + 1

    def _count_skip(self, step: int) -> None:
        """Count a step of the window once, however many optimizers (or ``pass_step`` calls) meet it."""
        if step != self._counted_step:
            self._counted_step = step
            self.counters.add(RECOVERY_RULE, "skip")

    def begin_step(self, step: int) -> bool:
        """The first boundary of ``step``: hold what the window must not move, snapshot if due.

        Returns True when the step's update is skipped (the caller clears its gradients).
        """
        if self._held is not None and self.skip_until is not None:
            # Undo the loop's scaler.update(), scheduler.step() and skipped forwards of the window.
            self._held.put_back(self.live, buffers=step < self.skip_until)
            if step >= self.skip_until:
                self._held = None
        if self.skipping(step):
            self._count_skip(step)
            return True
        config = self.config
        if config is not None and step % config.snapshot_every == 0 and not self._holds_step(step):
            self._take(step, config.keep)
        return False

    def after_read(self) -> None:
        """The step's one read is done: host mode's copy in flight may queue its next chunk (``host_copy``)."""
        self.places.pump()

    def _holds_step(self, step: int) -> bool:
        return bool(self.snapshots) and self.snapshots[-1].step == step

    def _take(self, step: int, keep: int) -> None:
        while len(self.snapshots) >= keep:
            self._spare.append(self.snapshots.pop(0))
        snapshot = self._spare.pop() if self._spare else Snapshot()
        buffers = None
        if self._buffers_at is not None and self._buffers_at[0] == step:
            buffers = self._buffers_at[1]
        config = self.config
        assert config is not None
        snapshot, replaced = self.places.take(snapshot, step, self.lr_scale, buffers, config, lambda: self.nbytes)
        snapshot.applied = self.applied
        self._buffers_at = None if replaced is None else (-1, replaced)
        self.snapshots.append(snapshot)

    def at_step_start(self, step: int) -> None:
        """Nothing of ``step`` has run yet (the guard attached, or the previous step's update is done): if a
        snapshot is due at ``step``, keep the model's buffers as they are now, before its forward moves them."""
        config = self.config
        if config is None or step % config.snapshot_every or self.skipping(step):
            return
        kept = self._buffers_at[1] if self._buffers_at is not None else TensorCopies()
        kept.take(self.live.buffers(), self.placement or HOST)
        self._buffers_at = (step, kept)

    def drop_snapshots(self) -> None:
        """The model's parameters were replaced: snapshots of the old ones are not restored into the new."""
        self._spare.extend(self.snapshots)
        self.snapshots = []

    def release(self) -> None:
        """Give back every tensor recovery holds (the guard is removed): snapshots, their spare buffers, the buffers
        kept for a coming snapshot and the staging buffers. The counts (``state_dict``, ``metrics``) stay readable."""
        self.places.release()
        self.snapshots, self._spare, self._buffers_at = [], [], None

    def reconfigure(self, config: RecoveryConfig | None) -> None:
        """A reload put ``config`` in force: give back at once what it no longer asks for. No section: everything;
        another ``memory``: the snapshots held (in the old place; the next one is taken in the new); a smaller
        ``keep``: the oldest snapshots beyond it, and every spare buffer."""
        old, self.config = self.config, config
        if config is None or (old is not None and config.memory != old.memory):
            self.release()
            self.places.forget()  # chosen again, with nothing held
        elif old is not None and config.keep < old.keep:
            self.snapshots, self._spare = self.snapshots[-config.keep :], []

    # --- a halt -----------------------------------------------------------------------------------

    def decide(self, step: int) -> Decision:
        """Whether a halt at ``step`` becomes a rewind, and to which snapshot."""
        config = self.config
        assert config is not None, "decide() is asked only with a recovery section"
        old_enough = [s for s in self.snapshots if step - s.step >= config.min_age]
        if not old_enough:
            held = [s.step for s in self.snapshots]
            why = f"recovery: no snapshot at least {config.min_age} steps older than step {step} (held: {held})"
            return Decision(False, None, why)
        target = old_enough[-1]
        if found := misfits(target, self.live):  # all or nothing: the halt goes through with the last good step's
            return Decision(False, None, misfit_reason(target, found))
        if self.rewinds >= config.max_rewinds:
            why = f"recovery: max_rewinds ({config.max_rewinds}) reached; restored to step {target.step}'s snapshot"
            return Decision(False, target, why)
        return Decision(True, target, None)

    def rewind(self, fault_step: int, snapshot: Snapshot) -> None:
        """Restore ``snapshot`` in place, lower the LRs by ``lr_factor``, skip the next ``skip_steps`` updates."""
        config = self.config
        assert config is not None
        self.restore(snapshot, self.lr_scale * config.lr_factor)
        self.rewinds += 1  # only once restored: a restore that refuses (GuardStateError) is no rewind
        self.skip_until = fault_step + config.skip_steps + 1
        self._held = HeldState(self.live)

    def restore(self, snapshot: Snapshot, lr_scale: float) -> None:
        """Put ``snapshot`` back, drop the newer ones, and leave every LR at ``lr_scale`` times its own."""
        if found := misfits(snapshot, self.live):  # checked before any tensor is restored (``decide`` says it first)
            raise GuardStateError(misfit_reason(snapshot, found))
        snapshot.restore(self.live)
        self.applied, self._applied_at = snapshot.applied, None  # the updates it undid were not applied
        factor = lr_scale / snapshot.lr_scale
        if factor != 1.0:
            scale_lrs(self.live.optimizers(), self.live.schedulers, factor)
        self.lr_scale = lr_scale
        newer = [s for s in self.snapshots if s.step > snapshot.step]
        self.snapshots = [s for s in self.snapshots if s.step <= snapshot.step]
        self._spare.extend(newer)

    # --- reading and saving -----------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Host bytes the held snapshots hold."""
        return sum(snapshot.nbytes for snapshot in self.snapshots)

    def metrics(self) -> dict[str, float]:
        """``guard.metrics()``'s part: the snapshots' bytes and count, the rewinds so far."""
        if not self.active:
            return {}
        held, on_device, staging = self.nbytes, self.places.on_device, self.places.staging_bytes
        return {
            "gradguard/recovery/snapshot_bytes": float(held),
            "gradguard/recovery/snapshots": float(len(self.snapshots)),
            "gradguard/recovery/rewinds": float(self.rewinds),
            "gradguard/recovery/device_bytes": float(held if on_device else staging),
            "gradguard/recovery/host_bytes": float(0 if on_device else held),
        }

    def estimated_bytes(self) -> int:
        """What ``keep`` snapshots will hold, from the model and the optimizers' state known now."""
        if self.config is None:
            return 0
        return snapshot_bytes(self.live) * self.config.keep

    def state_dict(self) -> dict[str, Any]:
        """The rewinds so far and any skip window in progress (not the snapshots: a checkpoint holds its own state)."""
        state: dict[str, Any] = {"rewinds": self.rewinds, "skip_until": self.skip_until, "lr_scale": self.lr_scale}
        state["applied"] = self.applied
        held = self._held.state_dict() if self._held is not None else {}
        if held.get("scaler") or held.get("schedulers"):
            state["held"] = held  # the scaler and schedulers a window in progress holds
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rewinds = int(state.get("rewinds", 0))
        skip_until = state.get("skip_until")
        self.skip_until = None if skip_until is None else int(skip_until)
        self.lr_scale = float(state.get("lr_scale", 1.0))
        self.applied = int(state.get("applied", self.applied))  # without it (an older state): the caller's step
        self._applied_at = None
        held = state.get("held")
        self._held = None if held is None or self.skip_until is None else HeldState.from_state_dict(held, self.live)
