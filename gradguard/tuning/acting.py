"""What one action of a policy does to one step's recorded norms, for ``gradguard.tuning.replay``.

Each action decides as the guard's kernel does, from the same formulas: the clips with
``clip_coefficients`` on float32 norms, ``zclip``, ``autoclip`` with ``zclip_decide``
and ``autoclip_decide`` on float64 norms (and ``skip_step_on_spike``, in the replay,
with ``spike_decide``). What no recorded figure can decide is named here too
(``never_decidable``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gradguard.enforce.actions.adaptive import autoclip_decide, autoclip_empty, zclip_decide, zclip_empty
from gradguard.enforce.actions.spikes import spike_empty
from gradguard.enforce.work.statistics import STATS_DTYPE, Init
from gradguard.enforce.work.tensors import clip_coefficients
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
from gradguard.tuning.records import RecordedStep

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

F32 = torch.float32


@dataclass
class Stats:
    """One adaptive action's statistics: tensors whose rows are its columns (members, or one for a group)."""

    tensors: dict[str, torch.Tensor]
    slot: int = 0


Proposal = tuple[tuple[int, int], torch.Tensor | None, dict[str, torch.Tensor], int]
"""``((rule, position), columns or None, tensors, next ring slot)``: statistics a step would leave behind."""


def act(
    key: tuple[int, int],
    action: Action,
    current: torch.Tensor,
    peaks: torch.Tensor | None,
    recorded: RecordedStep,
    names: list[str],
    index: torch.Tensor,
    ids: list[int],
    cols: torch.Tensor | None,
    proposals: list[Proposal],
    state_of: Callable[[int], Stats],
    columns: int,
) -> tuple[torch.Tensor | None, bool]:
    """One action on one step's norms: the float32 coefficient it multiplies its members' norms by, and whether
    it acted. ``current``: every recorded tensor's 2-norm as the earlier actions left it; ``peaks``: its max-abs
    (or ``None``); ``index``/``ids``: the members with a norm this step, ``cols`` their columns in the action's
    statistics (``None``: all, in order); ``state_of(columns)``: the action's statistics, made on first use with
    ``columns`` columns (all its members, or 1 for a group). Statistics go to ``proposals``: kept if the step is.
    """
    norms = current.index_select(0, index)
    if isinstance(action, ClipNorm | Scale | Zero):
        if isinstance(action, ClipNorm) and action.norm_type != 2.0:
            assert peaks is not None
            norms = peaks.index_select(0, index)
        coefs, changed = stateless_coefficients(action, norms.unsqueeze(0))
        return coefs[0], bool(changed[0])
    if isinstance(action, ZClip | AutoClip):
        group = action.scope == "group"
        g = followed(current, ids, group)
        stats = state_of(1 if group else columns)
        take = None if group else cols
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
        coef = coef64.to(F32)
        did = bool((coef64 < 1.0).any())
        return (coef.expand(len(ids)) if group else coef), did
    if isinstance(action, ClipValue):
        assert peaks is not None
        mine = peaks.index_select(0, index)
        did = bool(((mine > action.limit) & torch.isfinite(mine)).any())
        peaks[index] = torch.clamp(mine, max=action.limit)
        return None, did
    if isinstance(action, AdaptiveGradClip):
        weights = torch.tensor([recorded.norm[names[i]] / recorded.grad_to_weight[names[i]] for i in ids], dtype=F32)
        if action.scope == "group":
            total, weight = torch.linalg.vector_norm(norms), torch.linalg.vector_norm(weights)
        else:
            total, weight = norms, weights
        limit = action.clipping * torch.clamp(weight, min=action.eps)
        coef = torch.where(total > limit, limit / torch.clamp(total, min=1e-6), torch.ones_like(total))
        coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))
        return coef.expand(len(ids)) if action.scope == "group" else coef, bool((coef < 1.0).any())
    if isinstance(action, Drop):
        return None, True
    raise AssertionError(f"unexpected action {action.action!r}")


def stateless_coefficients(action: ClipNorm | Scale | Zero, norms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What an action that keeps no statistics does to ``[steps x members]`` float32 norms: the coefficients
    (same shape) it multiplies them by, and per step whether it changed a gradient.

    One step is a one-row matrix (``act``); a block of steps (``gradguard.tuning.blocks``) is many rows of the
    same formulas, element by element (a group's norm is reduced along its row alone), so both decide alike.
    """
    steps, width = norms.shape
    if isinstance(action, ClipNorm):
        assert action.norm_type in (2.0, math.inf)
        if action.scope == "tensor":
            totals = torch.linalg.vector_norm(norms.unsqueeze(2), action.norm_type, dim=2)
            coef = clip_coefficients(totals, action.max_norm)
            return coef, (coef < 1.0).any(dim=1)
        total = torch.linalg.vector_norm(norms, action.norm_type, dim=1)
        coef = clip_coefficients(total, action.max_norm)
        return coef.unsqueeze(1).expand(steps, width), coef < 1.0
    every = torch.ones(steps, dtype=torch.bool)
    if isinstance(action, Scale):
        return torch.full((steps, width), action.factor, dtype=F32), every
    return torch.zeros((steps, width), dtype=F32), every


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
    if isinstance(action, ZClip):
        return zclip_empty(action.warmup_steps)
    if isinstance(action, AutoClip):
        return autoclip_empty(action.history)
    assert isinstance(action, SkipStepOnSpike)
    return spike_empty(action.window)


def followed(norms: torch.Tensor, ids: list[int], group: bool) -> torch.Tensor:
    """The float64 norms an adaptive action follows: one per member, or their joint float32 norm (as the guard)."""
    mine = norms.index_select(0, torch.tensor(ids, dtype=torch.long))
    if group:
        joint: torch.Tensor = torch.linalg.vector_norm(mine, 2.0)
        return joint.reshape(1).to(STATS_DTYPE)
    return mine.to(STATS_DTYPE)
