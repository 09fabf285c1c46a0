"""What the process's GradScalers say about some gradients: still scaled, unscaled (with their inf/NaN flags and
loss scales), or never scaled. Read from the tables ``torch_hooks``' GradScaler wrappers keep (which scaler scaled a
loss on which thread, which optimizers it unscaled)."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.amp.grad_scaler import OptState
from torch.optim import Optimizer

from gradguard.enforce.hooks.torch_hooks import _scaled, _scaler_lock, _unscaled

__all__ = ["Scaled", "scaler_view", "unscaled_by"]


@dataclass(frozen=True)
class Scaled:
    """What the process's GradScalers say about some gradients, at a clip."""

    still_scaled: bool
    """A scaler has scaled a loss and not unscaled these gradients' optimizer: they may still be scaled."""
    found_inf: tuple[torch.Tensor, ...] = ()
    """The inf/NaN flags of the scalers that unscaled them (the scaler skips the step if any is set)."""
    optimizers: tuple[Optimizer, ...] = ()
    """The optimizers whose gradients the scalers unscaled (those holding the given parameters)."""
    scales: tuple[torch.Tensor, ...] = ()
    """Those scalers' loss scales (``halt_on_nonfinite``'s ``min_loss_scale``), read with the step's one sync."""


_NEVER_SCALED = Scaled(still_scaled=False)


def scaler_view(params: Iterable[torch.Tensor]) -> Scaled:
    """Whether the gradients of ``params`` are unscaled, scaled, or never were (no scaler in flight).

    A scaler counts if it unscaled an optimizer that holds ``params``, or if it scaled a loss on this thread
    and has never unscaled any optimizer still alive (it may be this model's, not unscaled yet). A scaler
    another thread is using, or one that has only ever unscaled other optimizers, is another training's.
    """
    if not _scaled:
        return _NEVER_SCALED  # no GradScaler has scaled a loss (the common case): not even a lock taken
    here = threading.get_ident()
    with _scaler_lock:
        in_flight = []
        for scaler, (table, thread) in list(_scaled.items()):
            states = scaler._per_optimizer_states  # read once: update() replaces it (on its own thread)
            if states is table and scaler.is_enabled():
                in_flight.append((scaler, thread == here, dict(states)))  # a copy: its thread may add to it
        unscaled = {s: dict(records) for s, records in _unscaled.items()}
    if not in_flight:
        return Scaled(still_scaled=False)  # no scaler in flight (the common case): no set of the parameters' ids
    ids = {id(p) for p in params}
    flags: list[torch.Tensor] = []
    scales: list[torch.Tensor] = []
    optimizers: list[Optimizer] = []
    covered: set[int] = set()
    ours = False
    for scaler, on_this_thread, states in in_flight:
        records = unscaled.get(scaler, {})
        known = {key: opt for key, ref in records.items() if (opt := ref()) is not None}
        if records and not known:
            continue  # every optimizer it unscaled is gone: a finished (halted) training's scaler, not in flight
        ours |= on_this_thread and not known
        for key, optimizer in known.items():
            held = _param_ids(optimizer) & ids
            if not held:
                continue
            ours = True
            state = states.get(key)
            if state is not None and state["stage"] is OptState.UNSCALED:
                covered |= held
                optimizers.append(optimizer)
                flags.extend(state["found_inf_per_device"].values())
                if isinstance(scaler._scale, torch.Tensor):
                    scales.append(scaler._scale)
    if not ours:
        return Scaled(still_scaled=False)
    return Scaled(covered != ids, tuple(flags), tuple(optimizers), tuple(scales))


def unscaled_by(scaler: torch.amp.GradScaler) -> tuple[Optimizer, ...]:
    """The live optimizers ``scaler`` has unscaled in its current step (seen by the ``unscale_`` wrapper)."""
    states = scaler._per_optimizer_states
    with _scaler_lock:
        refs = dict(_unscaled.get(scaler, {}))
    out = []
    for key, ref in refs.items():
        optimizer = ref()
        state = states.get(key)
        if optimizer is not None and state is not None and state["stage"] is OptState.UNSCALED:
            out.append(optimizer)
    return tuple(out)


def _param_ids(optimizer: Optimizer) -> set[int]:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}
