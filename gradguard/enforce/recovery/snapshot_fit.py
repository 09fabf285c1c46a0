"""Whether a snapshot can be restored: a rewind is all or nothing (docs/recovery.md).

Every tensor a snapshot holds is copied back *into* its live counterpart, so each must still have the shape,
dtype and device it had when the snapshot was taken: the model's parameters and buffers, the known optimizers'
state and parameters outside the model, the averages'. A buffer re-registered with another shape since (older
rotary-embedding code grows its cache for a longer sequence) would otherwise stop a restore half-way, with some
tensors put back and others not. ``misfits`` lists what does not fit, before anything is restored; recovery then
lets the halt go through with the state of the last good step, and says why.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gradguard.enforce.distributed.collective import local_tensor
from gradguard.enforce.recovery.snapshots import LiveState, Snapshot, _outside, _params_of, _Slot

__all__ = ["misfit_reason", "misfits"]

_SHOWN = 4
"""Misfits named in a halt's reason; the others are counted."""

Layout = tuple[torch.Size, torch.dtype, torch.device]


def misfits(snapshot: Snapshot, live: LiveState) -> list[str]:
    """One line per tensor of ``snapshot`` that no longer fits its live target (empty: it can be restored)."""
    model = live.model()
    found = _compare("parameter", _names(model, buffers=False), snapshot.model.layout, live.params())
    found += _compare("buffer", _names(model, buffers=True), snapshot.buffers.layout, live.buffers())
    names = {id(p): name for name, p in model.named_parameters()} if model is not None else {}
    model_ids = live.model_ids()
    for entry in snapshot.optimizers:
        optimizer = entry.ref()
        if optimizer is None:
            continue
        kind = type(optimizer).__name__
        outside = _outside(optimizer, model_ids)
        found += _compare(f"{kind}'s parameter outside the model", [], entry.outside.layout, outside)
        layout = entry.tensors.layout
        for position, param in enumerate(_params_of(optimizer)):
            saved = entry.state[position] if position < len(entry.state) else None
            state = optimizer.state.get(param)
            if saved is None or state is None:
                continue  # state made after the snapshot is dropped by the restore, whatever its shape
            for key, value in saved.items():
                current = state.get(key)
                if isinstance(value, _Slot) and isinstance(current, torch.Tensor):
                    what = f"{kind} state {key!r} of {names.get(id(param), f'parameter #{position}')!r}"
                    found += _differs(what, layout[value.index], local_tensor(current))
    averages = [average for ref in live.averages if (average := ref()) is not None]
    named = [f"averages[{i}].{n}" for i, a in enumerate(averages) for n in (*_names(a, False), *_names(a, True))]
    found += _compare("average's tensor", named, snapshot.averages.layout, live.average_tensors())
    return found


def misfit_reason(snapshot: Snapshot, found: list[str]) -> str:
    """The halt's reason when ``snapshot`` does not fit: what changed, and what to do."""
    shown = "; ".join(found[:_SHOWN]) + (f"; and {len(found) - _SHOWN} more" if len(found) > _SHOWN else "")
    return (
        f"recovery: the snapshot of step {snapshot.step} cannot be restored, so nothing of it was: {shown}. A tensor "
        "re-registered with another shape, dtype or device since the snapshot (a cache grown for a longer sequence) "
        "cannot take its old value back: allocate it at its final size before training, or keep it out of the "
        "module's buffers"
    )


def _names(module: nn.Module | None, buffers: bool) -> list[str]:
    if module is None:
        return []
    named = module.named_buffers() if buffers else module.named_parameters()
    return [name for name, tensor in named if tensor is not None]


def _compare(what: str, names: Sequence[str], layout: Sequence[Layout], tensors: Sequence[torch.Tensor]) -> list[str]:
    if len(layout) != len(tensors):
        return [f"{len(tensors)} {what}s now, {len(layout)} in the snapshot"]
    found: list[str] = []
    for index, (saved, tensor) in enumerate(zip(layout, tensors, strict=True)):
        name = names[index] if index < len(names) else f"#{index}"
        found += _differs(f"{what} {name!r}", saved, tensor)
    return found


def _differs(what: str, saved: Layout, tensor: torch.Tensor) -> list[str]:
    now = (tensor.shape, tensor.dtype, tensor.device)
    if now == saved:
        return []
    return [f"{what} is {_shown(now)}, {_shown(saved)} in the snapshot"]


def _shown(layout: Layout) -> str:
    shape, dtype, device = layout
    return f"{list(shape)} {str(dtype).removeprefix('torch.')} on {device}"
