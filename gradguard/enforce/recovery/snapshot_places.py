"""Where one guard's snapshots live (``recovery.memory``): the placement and host mode's staging buffer.

Chosen at attach (``device`` refused there if it does not fit), for ``auto`` again at the first snapshot from the
run's measured peak (``snapshot_memory.place_from_peak``), again when a reload changes ``memory`` or ``keep``, and
moved to the host for good when a snapshot's allocation on the device fails. A choice made after attach is said in
a ``snapshot_placement`` event. It may import the snapshots' memory and layout modules (``snapshot_memory``,
``snapshots``), nothing of the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from gradguard.enforce.distributed.collective import local_tensor
from gradguard.enforce.recovery.snapshot_memory import (
    Placement,
    Stager,
    choose_placement,
    fallen_back,
    place_from_peak,
    state_to_come,
    tensor_nbytes,
)
from gradguard.enforce.recovery.snapshots import LiveState, Snapshot, TensorCopies, _params_of
from gradguard.policy.schema import Recovery as RecoveryConfig

if TYPE_CHECKING:
    from gradguard.events.log import EventLog

__all__ = ["Places", "snapshot_bytes"]


class Places:
    """The placement of one guard's snapshots, its staging buffer, and the decisions that change them."""

    def __init__(self, live: LiveState) -> None:
        self.live = live
        self.placement: Placement | None = None
        self.stager: Stager | None = None
        self.optimizers_given = False
        """The guard was given its optimizers (else their state to come is counted as Adam's)."""
        self.events: EventLog | None = None
        """Where a placement decided or changed after attach is said (``snapshot_placement``)."""
        self._chosen_for: tuple[str, int] | None = None
        self._measured = False
        """``auto``'s placement was decided from the run's measured peak (at the first snapshot)."""

    def place(self, config: RecoveryConfig, held_on_device: Callable[[], int]) -> Placement:
        """Where snapshots go, chosen once for the section's ``memory`` and ``keep`` (docs/recovery.md);
        ``held_on_device``: the bytes the snapshots held now take on the device, freed by a new choice."""
        if self.placement is None or self._chosen_for != (config.memory, config.keep):
            held = held_on_device() if self.placement is not None and self.placement.where == "device" else 0
            held += self.stager.nbytes if self.stager is not None else 0
            self.placement = _choose(config, self.live, self.optimizers_given, held)
            self.stager = Stager(self.placement.device) if self.placement.staged else None
            self._chosen_for = (config.memory, config.keep)
            self._measured = False
        return self.placement

    def take(
        self,
        snapshot: Snapshot,
        step: int,
        lr_scale: float,
        buffers: TensorCopies | None,
        config: RecoveryConfig,
        held_on_device: Callable[[], int],
    ) -> tuple[Snapshot, TensorCopies | None]:
        """Take ``snapshot`` where the placement says (for ``auto``, decided first from the run's measured peak); a
        device allocation that fails takes a fresh one on the host instead. The snapshot taken, and the buffers
        object it replaced."""
        placement = self.place(config, held_on_device)
        if config.memory == "auto" and not self._measured:
            self._measured = True
            placement = self._from_peak(step, config) or placement
        try:
            return snapshot, snapshot.take(step, lr_scale, self.live, buffers, placement, self.stager)
        except torch.OutOfMemoryError as error:
            if placement.where != "device":
                raise
            # Never the end of the run: this snapshot and the next go to the host. Its partial buffers are let go.
            self.placement = fallen_back(placement, error)
            self.release()
            self._said(step, self.placement, "snapshot_fallback")
            fresh = Snapshot()
            return fresh, fresh.take(step, lr_scale, self.live, buffers, self.placement, None)

    def _from_peak(self, step: int, config: RecoveryConfig) -> Placement | None:
        """``auto``'s decision at the first snapshot, from the peak the run's forward and backward were measured at."""
        model = self.live.model()
        params = list(model.parameters()) if model is not None else []
        if not params:
            return None
        device = local_tensor(params[0]).device
        held = self.stager.nbytes if self.stager is not None else 0
        coming = state_to_come(self.live.optimizers() if self.optimizers_given else None, params)
        chosen = place_from_peak(device, config.keep, snapshot_bytes(self.live), coming, held)
        if chosen is None:
            return None
        if not chosen.staged:
            self.release()
        elif self.stager is None:
            self.stager = Stager(device)
        self.placement = chosen
        self._said(step, chosen, "snapshot_placement")
        return chosen

    def _said(self, step: int, placement: Placement, event: str) -> None:
        if self.events is not None:
            level = "warning" if event == "snapshot_fallback" else "info"
            self.events.emit(level, event, step=step, **placement.fields())

    def release(self) -> None:
        """Give the staging buffers back (the guard is removed, or snapshots go where none are staged); the placement
        stays, to be read."""
        if self.stager is not None:
            self.stager.release()
            self.stager = None

    def forget(self) -> None:
        """Choose again at the next snapshot (a reload changed ``memory``, with nothing held)."""
        self.release()
        self.placement = None

    def pump(self) -> None:
        """The step's one read is done: host mode's copy in flight may queue its next chunk (``host_copy``)."""
        if self.stager is not None:
            self.stager.pump()

    @property
    def staging_bytes(self) -> int:
        return self.stager.nbytes if self.stager is not None else 0

    @property
    def on_device(self) -> bool:
        return self.placement is not None and self.placement.where == "device"


def _choose(config: RecoveryConfig, live: LiveState, optimizers_given: bool, held: int) -> Placement:
    """``choose_placement`` with the bytes of one snapshot (with the optimizer state still to come) and of what the
    run will still allocate on the device (gradients not made yet, that state)."""
    model = live.model()
    params = list(model.parameters()) if model is not None else []
    device = local_tensor(params[0]).device if params else torch.device("cpu")
    now = snapshot_bytes(live)
    coming = state_to_come(live.optimizers() if optimizers_given else None, params)
    grads = sum(tensor_nbytes(p) for p in params if p.requires_grad and p.grad is None)
    return choose_placement(config.memory, device, config.keep, now + coming, grads + coming, held)


def snapshot_bytes(live: LiveState) -> int:
    """Bytes one snapshot of ``live`` holds now: its tensors and the optimizers' state made so far (local shards).

    The state of the parameters each optimizer holds in its groups now, as a snapshot copies it: DeepSpeed's
    ZeRO 3 view (``Stage3Partitions``) shares the inner optimizer's state, whose own groups are empty outside its step,
    and is counted once, not twice."""
    state = [
        value
        for opt in live.optimizers()
        for param in _params_of(opt)  # the walk a snapshot copies the state by
        if (entry := opt.state.get(param)) is not None
        for value in entry.values()
    ]
    return sum(tensor_nbytes(t) for t in [*state, *live.tensors()] if isinstance(t, torch.Tensor))
