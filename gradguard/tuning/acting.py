"""What one action of a policy does to one step's recorded norms, for ``gradguard.tuning.replay``.

Each action decides as the guard's kernel does, from the same formulas: the clips with ``clip_coefficients`` on
float32 norms, in numpy (``gradguard.tuning.float32``, bitwise torch's: the replay never imports torch for them);
``zclip``, ``autoclip`` with the guard's own ``zclip_decide`` and ``autoclip_decide`` on float64 norms (and
``skip_step_on_spike``, in the replay, with ``spike_decide``), and ``agc``, whose statistics and float32 sums are
torch's: torch is imported only for a policy that has one of these actions. What no recorded figure can decide is
named here too (``never_decidable``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from gradguard.policy.schema import (
    Action,
    AdaptiveGradClip,
    AutoClip,
    ClipNorm,
    ClipValue,
    Drop,
    Scale,
    SkipStepOnSpike,
    ZClip,
    Zero,
)
from gradguard.tuning.float32 import F32, Bools, Floats, clip_coefficients, group_coefficients, tensor_norms
from gradguard.tuning.records import RecordedStep

if TYPE_CHECKING:
    import torch

    from gradguard.enforce.work.statistics import Init

__all__ = [
    "NO_MAX_ABS",
    "NO_WEIGHTS",
    "Proposal",
    "Stats",
    "act",
    "followed",
    "init_for",
    "never_decidable",
    "scope_of",
    "stateless_coefficients",
]

Indices = NDArray[np.int64]


@dataclass
class Stats:
    """One adaptive action's statistics: torch tensors whose rows are its columns (members, or one for a group)."""

    tensors: dict[str, torch.Tensor]
    slot: int = 0


Proposal = tuple[tuple[int, int], "torch.Tensor | None", dict[str, "torch.Tensor"], int]
"""``((rule, position), columns or None, tensors, next ring slot)``: statistics a step would leave behind."""


def act(
    key: tuple[int, int],
    action: Action,
    current: Floats,
    peaks: Floats | None,
    recorded: RecordedStep,
    names: list[str],
    ids: list[int],
    cols: Indices | None,
    proposals: list[Proposal],
    state_of: Callable[[int], Stats],
    columns: int,
    exact: bool = True,
) -> tuple[Floats | None, bool]:
    """One action on one step's norms: the float32 coefficient it multiplies its members' norms by, and whether
    it acted. ``current``: every recorded tensor's 2-norm as the earlier actions left it; ``peaks``: its max-abs
    (or ``None``); ``ids``: the members with a norm this step, ``cols`` their columns in the action's statistics
    (``None``: all, in order); ``state_of(columns)``: the action's statistics, made on first use with ``columns``
    columns (all its members, or 1 for a group). Statistics go to ``proposals``: kept if the step is. ``exact``:
    a later action reads the norms this one leaves (a group clip's coefficient must then be torch's to the bit).
    """
    index = np.asarray(ids, dtype=np.int64)
    norms = current[index]
    if isinstance(action, ClipNorm | Scale | Zero):
        if isinstance(action, ClipNorm) and action.norm_type != 2.0:
            assert peaks is not None
            norms = peaks[index]
        coefs, changed = stateless_coefficients(action, norms[np.newaxis, :], exact)
        return np.array(coefs[0]), bool(changed[0])
    if isinstance(action, ZClip | AutoClip):
        return _adaptive(key, action, current, ids, cols, proposals, state_of, columns)
    if isinstance(action, ClipValue):
        assert peaks is not None
        mine = peaks[index]
        limit = F32(action.limit)
        did = bool(((mine > limit) & np.isfinite(mine)).any())
        peaks[index] = np.minimum(mine, limit)
        return None, did
    if isinstance(action, AdaptiveGradClip):
        return _agc(action, norms, recorded, names, ids)
    if isinstance(action, Drop):
        return None, True
    raise AssertionError(f"unexpected action {action.action!r}")


def _adaptive(
    key: tuple[int, int],
    action: ZClip | AutoClip,
    current: Floats,
    ids: list[int],
    cols: Indices | None,
    proposals: list[Proposal],
    state_of: Callable[[int], Stats],
    columns: int,
) -> tuple[Floats, bool]:
    """``zclip`` or ``autoclip`` with the guard's own functions, on torch tensors (torch imported here only)."""
    import torch

    from gradguard.enforce.actions.adaptive import autoclip_decide, zclip_decide

    group = action.scope == "group"
    g = followed(current, ids, group)
    stats = state_of(1 if group else columns)
    take = None if group or cols is None else torch.from_numpy(cols)
    state = stats.tensors if take is None else {k: v.index_select(0, take) for k, v in stats.tensors.items()}
    if isinstance(action, ZClip):
        decision = zclip_decide(action, g, state, warming=not bool(stats.tensors["ready"].all()))
        proposals.append((key, take, decision.proposal, stats.slot))
        coef64 = decision.coef
    else:
        slot = stats.slot % action.history
        auto = autoclip_decide(action, g, state, slot)
        proposals.append((key, take, auto.proposal, slot + 1))
        coef64 = auto.coef
    coef: Floats = coef64.to(torch.float32).numpy()
    did = bool((coef64 < 1.0).any())
    return (np.repeat(coef, len(ids)) if group else coef), did


def _agc(
    action: AdaptiveGradClip, norms: Floats, recorded: RecordedStep, names: list[str], ids: list[int]
) -> tuple[Floats, bool]:
    """``agc`` at ``scope: group`` on the recorded norms, with torch's float32 sums (torch imported here only)."""
    import torch

    f32 = torch.float32
    weights = torch.tensor([recorded.norm[names[i]] / recorded.grad_to_weight[names[i]] for i in ids], dtype=f32)
    mine = torch.from_numpy(np.ascontiguousarray(norms))
    if action.scope == "group":
        total, weight = torch.linalg.vector_norm(mine), torch.linalg.vector_norm(weights)
    else:
        total, weight = mine, weights
    limit = action.clipping * torch.clamp(weight, min=action.eps)
    coef = torch.where(total > limit, limit / torch.clamp(total, min=1e-6), torch.ones_like(total))
    coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))
    did = bool((coef < 1.0).any())
    out: Floats = (coef.expand(len(ids)) if action.scope == "group" else coef).numpy().copy()
    return out, did


def stateless_coefficients(action: ClipNorm | Scale | Zero, norms: Floats, exact: bool = True) -> tuple[Floats, Bools]:
    """What an action that keeps no statistics does to ``[steps x members]`` float32 norms: the coefficients
    (same shape) it multiplies them by, and per step whether it changed a gradient.

    One step is a one-row matrix (``act``); a block of steps (``gradguard.tuning.blocks``) is many rows of the
    same formulas, element by element (a group's norm is reduced along its row alone), so both decide alike.
    ``exact``: a later action reads the norms left (see ``float32.group_coefficients``).
    """
    steps, width = norms.shape
    if isinstance(action, ClipNorm):
        assert action.norm_type in (2.0, math.inf)
        if action.scope == "tensor":
            coef = clip_coefficients(tensor_norms(norms, action.norm_type), action.max_norm)
            changed: Bools = np.asarray((coef < 1.0).any(axis=1), dtype=np.bool_)
            return coef, changed
        total_coef, acted = group_coefficients(norms, action.norm_type, action.max_norm, exact)
        return np.broadcast_to(total_coef[:, np.newaxis], (steps, width)), acted
    every = np.ones(steps, dtype=np.bool_)
    if isinstance(action, Scale):
        return np.full((steps, width), action.factor, dtype=F32), every
    return np.zeros((steps, width), dtype=F32), every


# --- the result ---------------------------------------------------------------------------------


NO_MAX_ABS = (
    "clip_value (and clip_norm with norm_type .inf) compare the largest |element| with a limit: the log has no "
    "'max_abs' of every parameter on every step; "
    "record it with a monitor with stats: [norm, max_abs] at scope: tensor"
)
NO_WEIGHTS = (
    "agc compares gradient norms with weight norms: the log has no 'grad_to_weight' of every parameter; "
    "record it with a monitor with stats: [norm, grad_to_weight] at scope: tensor"
)


def never_decidable(action: Action) -> str | None:
    """Why no recorded norms can decide ``action``, or ``None``."""
    if isinstance(action, AdaptiveGradClip) and action.scope == "tensor":
        return (
            "agc at scope: tensor clips each output unit (row) by its own norms; the log records norms per "
            "tensor only (scope: group is decidable with grad_to_weight)"
        )
    if isinstance(action, ClipNorm) and action.norm_type not in (2.0, math.inf):
        return (
            f"clip_norm with norm_type {action.norm_type} needs that p-norm of each gradient; the log records "
            "2-norms (norm) and inf-norms (max_abs) only"
        )
    return None


def scope_of(action: Action) -> str:
    return str(getattr(action, "scope", "tensor"))


def init_for(action: Action) -> Init:
    """The action's empty statistics, as the guard makes them (torch imported here: only an adaptive action has any)."""
    from gradguard.enforce.actions.adaptive import autoclip_empty, zclip_empty
    from gradguard.enforce.actions.spikes import spike_empty

    if isinstance(action, ZClip):
        return zclip_empty(action.warmup_steps)
    if isinstance(action, AutoClip):
        return autoclip_empty(action.history)
    assert isinstance(action, SkipStepOnSpike)
    return spike_empty(action.window)


def followed(norms: Floats, ids: list[int], group: bool) -> torch.Tensor:
    """The float64 norms an adaptive action follows: one per member, or their joint float32 norm (as the guard), as
    a torch tensor for the guard's own decisions (torch imported here only)."""
    import torch

    from gradguard.enforce.work.statistics import STATS_DTYPE

    mine = torch.from_numpy(norms[np.asarray(ids, dtype=np.int64)])
    if group:
        joint: torch.Tensor = torch.linalg.vector_norm(mine, 2.0)
        return joint.reshape(1).to(STATS_DTYPE)
    return mine.to(STATS_DTYPE)
