"""What a rewind's window holds still: the state a skipped step must not move, put back at each boundary of the
window (``Recovery``'s ``_held``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gradguard.enforce.recovery.snapshots import LiveState, Snapshot, detached_copy, restore_groups, scheduler_optimizer

__all__ = ["HeldState"]


class HeldState:
    """What a skipped step must not move, as it was right after a rewind, put back at each boundary of the window.

    The GradScaler's scale and the known schedulers' state with their optimizers' hyper-parameters (LRs,
    momentum, betas: ``OneCycleLR`` cycles them) and the averages (an EMA the loop updates after each step) until
    the first step applied again, included; the model's buffers until the last skipped step, so the first applied
    step's forward starts from the snapshot's.
    """

    def __init__(self, live: LiveState) -> None:
        self.snapshot = Snapshot()
        self.snapshot.scaler = {key: detached_copy(value) for key, value in live.scaler_tensors().items()}
        self.snapshot.schedulers = [detached_copy(scheduler.state_dict()) for scheduler in live.schedulers]
        self.snapshot.buffers.take(live.buffers())
        self.snapshot.averages.take(live.average_tensors())
        self.groups = [_hyper_parameters(scheduler) for scheduler in live.schedulers]

    def put_back(self, live: LiveState, *, buffers: bool) -> None:
        self.snapshot.restore_scaler(live)
        self.snapshot.restore_schedulers(live)
        for scheduler, saved in zip(live.schedulers, self.groups, strict=False):
            optimizer = scheduler_optimizer(scheduler)
            if optimizer is not None:
                restore_groups(optimizer.param_groups, saved)
        if buffers:
            self.snapshot.buffers.restore(live.buffers())
        self.snapshot.averages.restore(live.average_tensors())  # after the buffers: an EMA in the model holds its own

    def state_dict(self) -> dict[str, Any]:
        """Plain values (the buffers are not carried: a resumed run's window forwards may move BatchNorm's)."""
        scaler = {k: None if v is None else v.tolist() for k, v in self.snapshot.scaler.items()}
        groups = [[{k: _plain(v) for k, v in group.items()} for group in groups] for groups in self.groups]
        return {"scaler": scaler, "schedulers": detached_copy(self.snapshot.schedulers), "groups": groups}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], live: LiveState) -> HeldState:
        held = cls.__new__(cls)
        held.snapshot = Snapshot()
        scaler = dict(state.get("scaler", {}))
        held.snapshot.scaler = {k: None if v is None else torch.tensor(v) for k, v in scaler.items()}
        held.snapshot.schedulers = detached_copy(list(state.get("schedulers", [])))
        held.groups = detached_copy(list(state.get("groups", [])))
        held.snapshot.buffers.take(live.buffers())
        held.snapshot.averages.take(live.average_tensors())
        return held


def _hyper_parameters(scheduler: Any) -> list[dict[str, Any]]:
    optimizer = scheduler_optimizer(scheduler)
    groups = optimizer.param_groups if optimizer is not None else []
    return [{k: detached_copy(v) for k, v in group.items() if k != "params"} for group in groups]


def _plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, torch.Tensor) else detached_copy(value)
