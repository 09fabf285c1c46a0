"""The LR schedulers recovery holds: what ``lr_factor`` scales in them, and which of them it can copy.

``lr_factor`` must hold through a scheduler's later steps, so every learning rate it computes the LR from is
scaled with the param groups' (``snapshots.LR_KEYS``): torch's ``base_lrs``, ``eta_min``, ``max_lrs``,
``min_lrs``; timm's ``base_values`` (with its ``lr_min``, ``warmup_lr_init`` and warmup slopes, so warm-up and
cosine give exactly ``lr_factor`` times the LR). A composite (``SequentialLR``, ``ChainedScheduler``) and its parts
are each scaled once, whether the parts were handed over too or not.

A snapshot copies a scheduler's ``state_dict()`` with ``copy.deepcopy``: one that cannot be copied (a
``LambdaLR`` whose lambda object holds a lock) is refused when handed over, naming it, not at the first snapshot.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from gradguard.errors import GuardStateError

__all__ = ["check_copyable", "each_once", "holdable", "scale_scheduler_lrs", "schedulers_with"]

SCHEDULER_LRS = ("base_lrs", "_last_lr", "max_lrs", "min_lrs", "eta_min")
"""A torch scheduler's learning rates (``LambdaLR`` and HF's schedules recompute the LR from ``base_lrs``)."""
TIMM_LRS = ("base_values", "lr_min", "warmup_lr_init")
"""A timm scheduler's (``timm.scheduler.Scheduler``, ``param_group_field == "lr"``): its LR is computed from them."""


def each_once(schedulers: Iterable[Any]) -> list[Any]:
    """The schedulers and the parts of every composite (``_schedulers``), each once, in the order met."""
    found: list[Any] = []

    def visit(scheduler: Any) -> None:
        if any(known is scheduler for known in found):
            return
        found.append(scheduler)
        for part in getattr(scheduler, "_schedulers", None) or ():
            visit(part)

    for scheduler in schedulers:
        visit(scheduler)
    return found


def scale_scheduler_lrs(schedulers: Iterable[Any], factor: float) -> None:
    """Multiply every learning rate the schedulers (and their parts) compute the LR from by ``factor``, once each."""
    for scheduler in each_once(schedulers):
        keys: tuple[str, ...] = SCHEDULER_LRS
        if getattr(scheduler, "param_group_field", None) == "lr" and hasattr(scheduler, "base_values"):
            keys += TIMM_LRS
            if getattr(scheduler, "warmup_t", 0):
                keys += ("warmup_steps",)  # timm's per-group warm-up slopes: (base value - warmup_lr_init) / warmup_t
        for key in keys:
            value = getattr(scheduler, key, None)
            if isinstance(value, list | tuple):
                setattr(scheduler, key, [_scaled(v, factor) for v in value])
            elif value is not None and _number(value):
                setattr(scheduler, key, value * factor)


def check_copyable(scheduler: Any) -> None:
    """Refuse, naming it, a scheduler whose ``state_dict()`` a snapshot could not copy."""
    try:
        copy.deepcopy(scheduler.state_dict())
    except Exception as error:  # deepcopy raises TypeError, PicklingError, or anything a __deepcopy__ does
        name = type(scheduler).__name__
        raise GuardStateError(
            f"recovery cannot hold the LR scheduler {name}: its state_dict() cannot be copied "
            f"({type(error).__name__}: {error}), and every snapshot copies it. Keep what cannot be copied (a lock, "
            f"a file, a process) out of the scheduler and its lambdas, or leave {name} out of lr_scheduler (a rewind "
            "then leaves its schedule where it is)."
        ) from error


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _scaled(value: Any, factor: float) -> Any:
    return value * factor if _number(value) else value


def holdable(scheduler: Any) -> bool:
    """Whether recovery can hold ``scheduler``: it has ``state_dict`` and ``load_state_dict``."""
    return all(callable(getattr(scheduler, name, None)) for name in ("state_dict", "load_state_dict"))


def schedulers_with(given: Any, found: Iterable[Any]) -> list[Any]:
    """``lr_scheduler=`` as given to a framework's callback (one, several, or None; ``GradGuard`` checks them), and
    each of a trainer's schedulers ``found`` that can be held and is not among them already."""
    schedulers = [] if given is None else list(given) if isinstance(given, list | tuple) else [given]
    for scheduler in found:
        if scheduler is not None and holdable(scheduler) and not any(known is scheduler for known in schedulers):
            schedulers.append(scheduler)
    return schedulers
