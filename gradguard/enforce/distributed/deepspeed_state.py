"""A DeepSpeed engine's own training state, cloned and put back: the fp32 master partitions, the inner optimizer's
state and groups, and the loss scaler's fields (``capture``/``restore``).

The guard's recovery snapshots a DeepSpeed engine through its usual snapshots instead (the inner optimizer, whose
parameters are the master partitions, joins them as an optimizer stepping tensors outside the model); these two are
the adapter's own record of what an exact rewind needs, shown bitwise by ``tests/test_deepspeed_adapter.py``.

At ZeRO 3 the inner optimizer holds its masters in its groups only while its step runs, so the snapshots would see
none: ``stage3_partitions`` shows them this rank's partitions as one more optimizer's (``Stage3Partitions``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from gradguard.enforce.distributed.deepspeed import inner_optimizer, layout
from gradguard.errors import GuardStateError

__all__ = ["DeepSpeedState", "Stage3Partitions", "capture", "restore", "stage3_partitions"]


class Stage3Partitions(Optimizer):
    """This rank's ZeRO 3 partitions as recovery's snapshots read an optimizer: its ``params`` are the fp32 master
    partitions (``fp32_partitioned_groups_flat``, one per sub group) and each trained parameter's own partition of the
    weights (``ds_tensor``, in the model's dtype), its ``state`` is the inner optimizer's (keyed by those masters).

    The snapshots copy an optimizer's parameters outside the model and their state, and put them back in place: so a
    rewind restores exactly what DeepSpeed's step moves on this rank, with no collective (every rank snapshots and
    rewinds at the same steps). The inner optimizer is seen besides (its groups' LRs). It steps nothing: the optimizer
    base's ``__init__`` is not run, as it would copy the groups.
    """

    def __init__(self, engine: Any) -> None:
        zero = engine.optimizer
        partitions = [param.ds_tensor for group in zero.fp16_groups for param in group]
        self.defaults: dict[str, Any] = {}
        self.param_groups: list[dict[str, Any]] = [{"params": [*zero.fp32_partitioned_groups_flat, *partitions]}]
        self.state = inner_optimizer(engine).state


_PARTITIONS: weakref.WeakKeyDictionary[Any, Stage3Partitions] = weakref.WeakKeyDictionary()
"""One view per ZeRO 3 optimizer, alive as long as it is (recovery holds optimizers by weak reference only)."""


def stage3_partitions(engine: Any) -> Stage3Partitions:
    """The view of ``engine``'s ZeRO 3 partitions for the snapshots (the same one at every call)."""
    zero = engine.optimizer
    view = _PARTITIONS.get(zero)
    if view is None:
        view = _PARTITIONS[zero] = Stage3Partitions(engine)
    return view


@dataclass(frozen=True)
class DeepSpeedState:
    """What an exact rewind needs: the fp32 masters, the inner optimizer's state and groups, the loss scaler."""

    masters: list[torch.Tensor]
    optimizer_state: list[dict[str, Any] | None]
    param_groups: list[dict[str, Any]]
    scaler: dict[str, Any]


def _masters(engine: Any) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """The tensors the inner optimizer updates (its state is keyed by them), and that optimizer.

    Refused at ZeRO 3, whose inner optimizer holds its masters in its groups only while its step runs: the record
    would hold nothing, and a restore would put nothing back."""
    if layout(engine) == "stage3":
        raise GuardStateError(
            "deepspeed_state.capture/restore cannot record a ZeRO 3 engine: its inner optimizer holds the fp32 "
            "masters in its groups only inside its step. Use the policy's recovery section instead: its snapshots "
            "hold this rank's ZeRO 3 partitions and their optimizer state (stage3_partitions)."
        )
    inner = inner_optimizer(engine)
    return [param for group in inner.param_groups for param in group["params"]], inner


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _copy(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copy(item) for item in value)
    return value


def capture(engine: Any) -> DeepSpeedState:
    """Clone this rank's state of ``engine`` (its fp32 master partitions, not the bit16 weights: they follow)."""
    masters, inner = _masters(engine)
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    fields = {key: _copy(value) for key, value in vars(scaler).items()} if scaler is not None else {}
    return DeepSpeedState(
        masters=[master.detach().clone() for master in masters],
        optimizer_state=[_copy(inner.state[m]) if m in inner.state else None for m in masters],
        param_groups=[{k: _copy(v) for k, v in group.items() if k != "params"} for group in inner.param_groups],
        scaler={k: v for k, v in fields.items() if isinstance(v, int | float | bool | torch.Tensor)},
    )


@torch.no_grad()
def restore(engine: Any, captured: DeepSpeedState) -> None:
    """Put ``captured`` back in place, then rebuild the bit16 weights from the masters.

    A collective at ZeRO 1/2 and under BF16_Optimizer (the weights are all-gathered): call it on every rank.
    The engine's counters and the LR scheduler are the caller's.
    """
    masters, inner = _masters(engine)
    if len(masters) != len(captured.masters):
        raise GuardStateError("the captured DeepSpeed state belongs to another engine (different partitions).")
    for master, saved in zip(masters, captured.masters, strict=True):
        master.copy_(saved)
    for master, state in zip(masters, captured.optimizer_state, strict=True):
        if state is None:
            inner.state.pop(master, None)
            continue
        current = inner.state.get(master)
        fresh = _copy(state)
        if current is not None:
            for key, value in fresh.items():
                held = current.get(key)
                if isinstance(value, torch.Tensor) and isinstance(held, torch.Tensor) and held.shape == value.shape:
                    held.copy_(value)
                    fresh[key] = held
        inner.state[master] = fresh
    for group, saved_group in zip(inner.param_groups, captured.param_groups, strict=True):
        group.update(_copy(saved_group))
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    for key, value in captured.scaler.items():
        setattr(scaler, key, _copy(value))
    if layout(engine) != "plain":
        engine.optimizer.update_lp_params()
