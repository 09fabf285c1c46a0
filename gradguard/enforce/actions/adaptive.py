"""Adaptive clipping: ``zclip`` (z-score on an EMA of the norm) and ``autoclip`` (a percentile of recent norms).

Both decide from statistics of earlier norms (``gradguard.enforce.work.statistics``), per parameter
(``scope: tensor``) or for the rule's joint norm (``scope: group``). Everything runs on the device as
a few vector operations over all of a rule's parameters at once: no host sync, no Python loop per
tensor. The statistics the step would leave behind are proposed, not stored: the engine keeps them
only if the step is applied, so a non-finite norm, a skipped or a halted step never enters them.
Each clip is logged as an ``adaptive_clip`` event with the threshold and the statistics behind it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch

from gradguard.enforce.actions.base import ActionKernel
from gradguard.enforce.work.participant import Participant
from gradguard.enforce.work.statistics import STATS_DTYPE, Init, Statistics, pushed
from gradguard.enforce.work.step_work import StepContext, StepWork
from gradguard.enforce.work.tensors import EPS, by_device, in_torch_order, stack_on
from gradguard.policy.matching import BoundRule
from gradguard.policy.schema import Action, AutoClip, ZClip

__all__ = [
    "AutoClipDecision",
    "AutoClipKernel",
    "StatisticsTakingPart",
    "ZClipDecision",
    "autoclip_decide",
    "autoclip_empty",
    "finite_norms",
    "followed_norms",
    "norms_for_statistics",
    "report_reader",
    "rescale",
    "zclip_decide",
    "zclip_empty",
]

ZCLIP_EPS = 1e-6
"""ZClip's epsilon in ``z = (norm - mean) / (std + eps)`` (the reference implementation's)."""


def followed_norms(work: StepWork, ids: list[int], scope: str) -> tuple[bool, list[torch.Tensor], torch.Tensor]:
    """``(group scope?, the gradients of ids, the norms the statistics follow)``: see ``norms_for_statistics``."""
    group = scope == "group"
    gs = [work.grads[i] for i in ids]
    return group, gs, norms_for_statistics(work, ids, gs, group)


def norms_for_statistics(work: StepWork, ids: list[int], gs: list[torch.Tensor], group: bool) -> torch.Tensor:
    """The 2-norms the statistics follow, float64 on the first gradient's device: one per tensor, or the joint one.

    Reuses the raw norms where the step took them and no earlier action changed the gradients;
    under FSDP2 they are the norms of the full tensors.
    """
    raw, touched = work.raw, work.touched
    fresh = all(i in raw and i not in touched for i in ids)
    per_tensor = [raw[i] for i in ids] if fresh else work.norms(gs, 2.0, ids)
    device = gs[0].device
    if group:
        joint: torch.Tensor = torch.linalg.vector_norm(stack_on(in_torch_order(gs, per_tensor), device), 2.0)
        return joint.reshape(1).to(STATS_DTYPE)
    return work.pending.stack(per_tensor, device).to(STATS_DTYPE)


def rescale(gs: list[torch.Tensor], coef: torch.Tensor, group: bool) -> None:
    """Multiply each gradient by its coefficient (or all by the one group coefficient), per device."""
    for _, positions in by_device(range(len(gs)), gs):
        members = [gs[k] for k in positions]
        device = members[0].device
        if group:
            torch._foreach_mul_(members, coef[0].to(device, torch.float32))
            continue
        mine = coef if len(positions) == len(gs) else coef[positions]
        torch._foreach_mul_(members, list(mine.to(device, torch.float32).unbind()))


Report = Callable[[list[float]], None]


def report_reader(
    work: StepWork, bound: BoundRule, action: ZClip | AutoClip, ids: list[int], group: bool, figures: list[str]
) -> Report:
    """A reader for ``[coef, norm, threshold, *figures]`` per column: counts and logs the clips.

    One ``adaptive_clip`` event per rule and step, whatever the scope: for ``scope: tensor`` its fields
    are lists, one entry per clipped parameter (an adaptive clip typically changes most tensors every
    step: one line per step, not one per tensor, keeps the log and the training thread light).
    """
    outcome, names, step, rule = work.outcome, work.names, work.step, bound.name
    columns = 1 if group else len(ids)
    kind = action.action

    def read(values: list[float]) -> None:
        coefs, norms = values[:columns], values[columns : 2 * columns]
        if min(coefs) >= 1.0 and math.isfinite(sum(norms)):
            return  # nothing clipped, every norm finite: the common case, without a loop
        clipped = []
        for column, (coef, norm) in enumerate(zip(coefs, norms, strict=True)):
            if norm - norm != 0.0:  # NaN or Inf: left as it is, for the non-finite watch to report
                for index in ids if group else [ids[column]]:
                    outcome.nonfinite.setdefault(index, ("nan" if norm != norm else "inf", bound.index))
            elif coef < 1.0:
                clipped.append(column)
        if not clipped:
            return
        rows = {"threshold": values[2 * columns : 3 * columns]}
        rows |= {name: values[(3 + k) * columns : (4 + k) * columns] for k, name in enumerate(figures)}
        event: dict[str, object] = {"step": step, "rule": rule, "action": kind, "scope": action.scope}
        if group:
            norm, coef = norms[0], coefs[0]
            event |= {"param": None, "params": [names[i] for i in ids], "n_params": len(ids)}
            event |= {"before": norm, "after": norm * coef, "coef": coef}
            event |= {name: row[0] for name, row in rows.items()}
            outcome.counts.append((rule, kind, len(ids)))
        else:
            event |= {"param": None, "params": [names[ids[c]] for c in clipped], "n_params": len(clipped)}
            event |= {"before": [norms[c] for c in clipped], "after": [norms[c] * coefs[c] for c in clipped]}
            event["coef"] = [coefs[c] for c in clipped]
            event |= {name: [row[c] for c in clipped] for name, row in rows.items()}
            outcome.counts.append((rule, kind, len(clipped)))
        outcome.events.append(("adaptive_clip", event))

    return read


class ZClipDecision(NamedTuple):
    """One step of ``zclip`` on a vector of norms (one per column), before anything is committed."""

    coef: torch.Tensor
    """What each column's gradients are multiplied by (1 where nothing is clipped)."""
    limit: torch.Tensor
    """The norm each column may keep (+inf before warm-up ends, without ``max_norm``)."""
    z: torch.Tensor
    """Each norm's z-score against the statistics it was judged by."""
    proposal: dict[str, torch.Tensor]
    """The statistics the step leaves behind, if it is applied."""
    all_ready: torch.Tensor | None
    """During warm-up: 1 when every column's statistics are ready after this step (else ``None``)."""


def zclip_empty(warmup: int) -> Init:
    """``zclip``'s empty statistics: a warm-up buffer, and the mean and variance once it is full."""

    def empty(columns: int, device: torch.device) -> dict[str, torch.Tensor]:
        buffer = torch.zeros(columns, warmup, dtype=STATS_DTYPE, device=device)
        fresh = {key: torch.zeros(columns, dtype=STATS_DTYPE, device=device) for key in ("ready", "count", "mean")}
        return fresh | {"var": torch.zeros(columns, dtype=STATS_DTYPE, device=device), "buffer": buffer}

    return empty


def zclip_ceiling(action: ZClip, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """``max_norm_ratio``'s ceiling per column: that multiple of the column's warm-up scale, at least ``ratio_floor``;
    infinite where that scale is 0. The scale is the mean of the column's warm-up norms: of those so far while it warms
    up (none before its first: no ceiling), then of all of them (the first mean, taken again from the warm-up buffer,
    which stops changing once its column is ready): the ceiling needs no state of its own."""
    assert action.max_norm_ratio is not None
    buffer = state["buffer"]
    # A slot not yet written holds 0: the row's sum is the sum of the norms so far.
    scale = torch.where(state["ready"] > 0, buffer.mean(dim=1), buffer.sum(dim=1) / state["count"].clamp(min=1))
    ceiling = action.max_norm_ratio * scale
    if action.ratio_floor is not None:
        ceiling = ceiling.clamp(min=action.ratio_floor)
    return torch.where(scale > 0, ceiling, math.inf)


def zclip_decide(
    action: ZClip,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    *,
    warming: bool,
    ceiling: torch.Tensor | None = None,
) -> ZClipDecision:
    """``zclip`` on the float64 norms ``g`` against ``state`` (``zclip_empty``): the guard's maths, and replay's.

    ``warming``: some column may still be in warm-up (once every column is ready, its work is skipped).
    ``ceiling``: ``zclip_ceiling`` of ``state``, where the caller kept it (else it is taken here).
    """
    warmup = action.warmup_steps
    finite = torch.isfinite(g)
    ready = state["ready"] > 0
    mean, var = state["mean"], state["var"]
    std = var.sqrt()
    z = (g - mean) / (std + ZCLIP_EPS)
    # A column whose mean is 0 has no scale yet (its warm-up norms were all 0: a gradient zeroed, not None, while its
    # parameter was unused): every norm would be a spike clipped to 0, for ever. It is judged once its mean is positive.
    spike = ready & finite & (z > action.z_thresh) & (mean > 0)
    threshold = mean + (action.z_thresh * action.z_thresh) / z * std
    adaptive = torch.where(spike, threshold, g)
    # Before the statistics are ready only the ceilings apply (if any).
    limit = torch.where(ready, adaptive, torch.full_like(g, math.inf))
    if action.max_norm is not None:
        limit = limit.clamp(max=action.max_norm)
    if action.max_norm_ratio is not None:
        limit = torch.minimum(limit, ceiling if ceiling is not None else zclip_ceiling(action, state))
    coef = torch.where(finite & (g > limit), limit / (g + EPS), torch.ones_like(g))

    updated = ready & finite
    alpha = action.alpha
    new_mean = alpha * mean + (1 - alpha) * adaptive
    new_var = alpha * var + (1 - alpha) * (adaptive - new_mean) ** 2
    proposal = {
        "mean": torch.where(updated, new_mean, mean),
        "var": torch.where(updated, new_var, var),
    }
    all_ready = None
    if warming:
        # Warm-up: the first ``warmup_steps`` finite norms of a column set its mean and variance.
        warm = ~ready & finite
        slot = state["count"].long().clamp(max=warmup - 1).unsqueeze(1)
        kept = state["buffer"].gather(1, slot).squeeze(1)
        buffer = state["buffer"].scatter(1, slot, torch.where(warm, g, kept).unsqueeze(1))
        count = state["count"] + warm.to(STATS_DTYPE)
        becomes_ready = warm & (count >= warmup)
        first_mean = buffer.mean(dim=1)
        first_var = ((buffer - first_mean.unsqueeze(1)) ** 2).mean(dim=1)
        proposal["mean"] = torch.where(becomes_ready, first_mean, proposal["mean"])
        proposal["var"] = torch.where(becomes_ready, first_var, proposal["var"])
        now_ready = ready | becomes_ready
        proposal |= {"ready": now_ready.to(STATS_DTYPE), "count": count, "buffer": buffer}
        all_ready = now_ready.all().reshape(1).to(STATS_DTYPE)
    return ZClipDecision(coef, limit, z, proposal, all_ready)


class AutoClipDecision(NamedTuple):
    """One step of ``autoclip`` on a vector of norms (one per column), before anything is committed."""

    coef: torch.Tensor
    threshold: torch.Tensor
    """The percentile of the recent norms and the current one (NaN with no finite norm yet)."""
    proposal: dict[str, torch.Tensor]
    """The ring and its count of finite norms after the step, if it is applied."""


def autoclip_empty(history: int) -> Init:
    """``autoclip``'s empty statistics: a ring of ``history`` norms per column, and how many are finite."""

    def empty(columns: int, device: torch.device) -> dict[str, torch.Tensor]:
        # +inf marks an empty slot: it sorts after every norm, so the smallest values are the real ones.
        ring = torch.full((columns, history), math.inf, dtype=STATS_DTYPE, device=device)
        return {"ring": ring, "count": torch.zeros(columns, dtype=STATS_DTYPE, device=device)}

    return empty


def autoclip_decide(action: AutoClip, g: torch.Tensor, state: dict[str, torch.Tensor], slot: int) -> AutoClipDecision:
    """``autoclip`` on the float64 norms ``g``, the ring's next slot ``slot``: the guard's maths, and replay's."""
    finite = torch.isfinite(g)
    ring, evicted = pushed(state["ring"], slot, g, math.inf)
    count = state["count"] - (evicted < math.inf).to(STATS_DTYPE) + finite.to(STATS_DTYPE)
    threshold = _percentile(ring, count, action.percentile)
    usable = finite & torch.isfinite(threshold)
    # As clip_grad_norm_(params, threshold): the coefficient is applied whenever it is below 1.
    coef = torch.where(usable, torch.clamp(threshold / (g + EPS), max=1.0), torch.ones_like(g))
    return AutoClipDecision(coef, threshold, {"ring": ring, "count": count})


class AutoClipKernel(ActionKernel):
    """``autoclip``: clip to the ``percentile`` of the recent norms, the current one included (arXiv 2007.14469)."""

    schemas = (AutoClip,)
    alarms = True

    def wants_raw_norm(self, action: Action) -> bool:
        return True

    def apply(self, work: StepWork, bound: BoundRule, action: Action, ids: list[int]) -> bool:
        assert isinstance(action, AutoClip)
        assert work.statistics is not None
        group, gs, g = followed_norms(work, ids, action.scope)
        history = action.history
        series = work.statistics.series_for(bound, action, group, (history,), g.device, autoclip_empty(history))
        cols = None if group else series.select(ids)
        slot = series.ring_slot(history)
        decision = autoclip_decide(action, g, series.at(cols), slot)
        rescale(gs, decision.coef, group)
        work.statistics_step.propose(series, cols, decision.proposal, {"slot": slot + 1})
        figures = torch.stack([decision.coef, g, decision.threshold, decision.proposal["count"]])
        work.pending.quiet_if(partial(finite_norms, g))
        work.pending.add(figures, report_reader(work, bound, action, ids, group, ["samples"]))
        return True


def finite_norms(norms: torch.Tensor) -> torch.Tensor:
    """Norms (never negative) are finite: ``< inf`` is False for NaN and +Inf, in one kernel."""
    return norms < math.inf


def _percentile(ring: torch.Tensor, count: torch.Tensor, percentile: float) -> torch.Tensor:
    """Per row, the ``percentile`` of its ``count`` finite values, interpolated as ``numpy.percentile``.

    A partial selection (``topk``) instead of a sort: only the lowest ``percentile`` of the ring is
    ordered. A row with no value gives NaN.
    """
    history = ring.shape[1]
    fraction = percentile / 100.0
    needed = min(history, math.floor(fraction * (history - 1)) + 2)
    lowest = torch.topk(ring, needed, dim=1, largest=False, sorted=True).values
    position = (count - 1).clamp(min=0) * fraction  # numpy's virtual index for "linear", (n - 1) * q
    lo = position.floor()
    hi = torch.minimum(lo + 1, (count - 1).clamp(min=0))
    t = position - lo
    a = lowest.gather(1, lo.long().unsqueeze(1)).squeeze(1)
    b = lowest.gather(1, hi.long().unsqueeze(1)).squeeze(1)
    diff = b - a
    # numpy's _lerp: from the nearer end, so t = 1 gives b exactly.
    value = torch.where(t >= 0.5, b - diff * (1 - t), a + diff * t)
    return torch.where(count > 0, value, torch.full_like(value, math.nan))


class StatisticsTakingPart(Participant):
    """The adaptive actions' statistics across steps as a participant: the step's kernels read them, and only an
    applied step's norms enter them (``StepStatistics.commit``)."""

    def __init__(self, statistics: Statistics) -> None:
        self.statistics = statistics

    def before_figures(self, work: StepWork, context: StepContext) -> None:
        work.statistics = self.statistics

    def applied(self, work: StepWork) -> None:
        work.statistics_step.commit()

    def release(self) -> None:
        self.statistics.release()
