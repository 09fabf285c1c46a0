"""``zclip``'s kernel: per tensor, decided on the host from the norms the step reads anyway where it can.

Per tensor, zclip's verdict needs the tensor's 2-norm and its statistics (a running mean and variance, or the warm-up
buffer). Where the norms are the raw ones the non-finite watch reads in the step's one read, and the clip's change may
wait for that read (no later action of the step changes those gradients), the statistics are kept on the host as
Python numbers (``Series.host``) and the verdict is taken in the read's reader, in ``zclip_decide``'s float64
operations in its order (square roots correctly rounded, where torch's vectorised ones may differ in the last bit):
a clean step launches nothing for it, and a clip is one deferred multiply. Elsewhere (a group scope, norms taken
afresh, another action after it, FSDP2, a pipeline, a fused optimizer that reads after its update) the device path
decides.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from gradguard.enforce.actions.adaptive import (
    ZCLIP_EPS,
    finite_norms,
    followed_norms,
    report_reader,
    rescale,
    zclip_ceiling,
    zclip_decide,
    zclip_empty,
)
from gradguard.enforce.actions.base import ActionKernel
from gradguard.enforce.work.statistics import STATS_DTYPE, Series, StepStatistics
from gradguard.enforce.work.step_work import StepWork
from gradguard.enforce.work.tensors import EPS
from gradguard.enforce.work.writes import DeferredWrites
from gradguard.policy.matching import BoundRule
from gradguard.policy.schema import Action, ZClip

__all__ = ["ZClipKernel", "zclip_on_host"]

_CPU = torch.device("cpu")
_CEILING_FROM = ("buffer", "count", "ready")
"""The statistics ``zclip_ceiling`` is taken from: a ceiling is kept while these are the same objects."""


def zclip_on_host(work: StepWork, bound: BoundRule, action: ZClip, ids: list[int]) -> bool:
    """Decide ``action`` for ``ids`` in the step's read; False where the device must (the module's docstring)."""
    raw, statistics = work.raw, work.statistics
    if (
        action.scope != "tensor"
        or statistics is None
        or work.sharded
        or work.pipeline is not None
        or work.pending.quiet is not None
        or not work.after_read.issuperset(ids)
        or not work.touched.isdisjoint(ids)
        or not all(map(raw.__contains__, ids))
    ):
        return False
    warmup = action.warmup_steps
    series = statistics.series_for(bound, action, False, (warmup,), _CPU, zclip_empty(warmup))
    if series.host is None:
        if series.tensors["mean"].device.type != "cpu":
            return False  # made on the device by an earlier step: it decides there
        count = len(series.names)
        zeros = {name: [0.0] * count for name in ("mean", "var", "ready", "count")} | {
            "buffer": [[0.0] * warmup for _ in range(count)]
        }
        series.host = zeros if series.blank else {name: value.tolist() for name, value in series.tensors.items()}
    columns = [series.columns[i] for i in ids]
    grads = [work.grads[i] for i in ids]
    # Not the StepWork: a reader that held it would make a cycle through the step's pending read.
    report = report_reader(work, bound, action, ids, False, ["mean", "std", "z"])
    read = partial(_decide, work.writes, work.statistics_step, report, action, ids, grads, series, columns)
    work.pending.add(work.pending.stack([raw[i] for i in ids], raw[ids[0]].device), read)
    return True


def _decide(
    writes: DeferredWrites,
    proposals: StepStatistics,
    report: Callable[[list[float]], None],
    action: ZClip,
    ids: list[int],
    grads: list[torch.Tensor],
    series: Series,
    columns: list[int],
    g: list[float],
) -> None:
    """The read's reader: ``zclip_decide``'s maths per column, in Python floats (float64, the same operations)."""
    host = series.host
    assert host is not None
    mean_all, var_all, ready_all, count_all = (host[k] for k in ("mean", "var", "ready", "count"))
    # Correctly rounded square roots, in one map (``x ** 0.5`` is pow; torch's vectorised float64 sqrt on the CPU may
    # differ in the last bit: the std and z reported, and rarely a threshold, then differ there from the device's).
    std_all = list(map(math.sqrt, var_all))
    warming = not series.counters.get("ready")
    zt, alpha, ceiling, ratio = action.z_thresh, action.alpha, action.max_norm, action.max_norm_ratio
    floor = action.ratio_floor
    if ratio is not None and warming and floor is not None and all(norm <= floor for norm in g):
        # Every ceiling is at least the floor, which no norm passes: none can bind, so none is taken (in warm-up the
        # ceilings change every step, a tensor made from the host's lists each time; after it they are kept).
        ratio = None
    square = zt * zt
    ceilings: list[float] | None = None
    coefs, limits, means, stds, zs = [], [], [], [], []
    new_mean, new_var = list(mean_all), list(var_all)
    warm_columns: list[tuple[int, float]] = []
    moved = False
    for k, column in enumerate(columns):
        norm, mean, var, std = g[k], mean_all[column], var_all[column], std_all[column]
        ready = ready_all[column] > 0
        finite = norm - norm == 0.0
        z = (norm - mean) / (std + ZCLIP_EPS)
        adaptive = mean + square / z * std if ready and finite and z > zt and mean > 0 else norm
        limit = adaptive if ready else math.inf
        if ceiling is not None:
            limit = min(limit, ceiling)
        if ratio is not None:
            if ceilings is None:
                ceilings = _warm_ceilings(series, host, action)
            limit = min(limit, ceilings[column])
        coefs.append(limit / (norm + EPS) if finite and norm > limit else 1.0)
        limits.append(limit)
        means.append(mean)
        stds.append(std)
        zs.append(z)
        if ready and finite:
            moved = True
            new_mean[column] = updated = alpha * mean + (1 - alpha) * adaptive
            spread = adaptive - updated
            new_var[column] = alpha * var + (1 - alpha) * (spread * spread)
        elif warming and not ready and finite:
            warm_columns.append((column, norm))
    # Only what changed is proposed: each is a tensor made from a list, the step's only torch operations here.
    proposal: dict[str, Any] = {"mean": new_mean, "var": new_var} if moved else {}
    counters: dict[str, int] = {}
    if warming and warm_columns:
        proposal |= _warm_up(action, host["buffer"], warm_columns, new_mean, new_var, ready_all, count_all, counters)
    if proposal:
        proposals.propose_host(series, proposal, counters)
    if min(coefs) < 1.0:
        for index, grad, coef in zip(ids, grads, coefs, strict=True):
            if coef < 1.0:
                writes.scale(index, grad, coef, partial(torch.tensor, coef, dtype=torch.float32, device=grad.device))
    report([*coefs, *g, *limits, *means, *stds, *zs])


def _warm_ceilings(series: Series, host: dict[str, Any], action: ZClip) -> list[float]:
    """Each column's ``max_norm_ratio`` ceiling: ``zclip_ceiling`` itself, of the host's lists made tensors (so the
    two paths agree to the bit); taken again only for another buffer, count, readiness, ratio or floor, so once
    warm-up is done, never."""

    def take() -> list[float]:
        state = {key: torch.tensor(host[key], dtype=STATS_DTYPE) for key in _CEILING_FROM}
        ceilings: list[float] = zclip_ceiling(action, state).tolist()
        return ceilings

    sources = tuple(host[key] for key in _CEILING_FROM)
    result: list[float] = _kept(series, "warm_ceilings", sources, (action.max_norm_ratio, action.ratio_floor), take)
    return result


def _kept_ceiling(series: Series, action: ZClip, state: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """``zclip_ceiling`` of the series' own tensors, taken again only when its buffer, count or readiness is another
    tensor (a step of warm-up, a restore) or the action another: after warm-up, a step's ceiling launches nothing."""
    if action.max_norm_ratio is None:
        return None
    sources = tuple(state[key] for key in _CEILING_FROM)
    ceiling: torch.Tensor = _kept(
        series,
        "device_ceiling",
        sources,
        (action.max_norm_ratio, action.ratio_floor),
        partial(zclip_ceiling, action, state),
    )
    return ceiling


def _kept(
    series: Series, name: str, sources: tuple[object, ...], key: tuple[object, ...], take: Callable[[], Any]
) -> Any:
    """``series.derived[name]``, taken (``take``) again unless it was taken from these very ``sources`` (``is``: the
    statistics are replaced at a commit, never edited) with an equal ``key``."""
    kept = series.derived.get(name)
    if kept is None or kept[0][1] != key or any(a is not b for a, b in zip(kept[0][0], sources, strict=True)):
        kept = ((sources, key), take())
        series.derived[name] = kept
    return kept[1]


def _warm_up(
    action: ZClip,
    buffer: list[list[float]],
    warm: list[tuple[int, float]],
    mean: list[float],
    var: list[float],
    ready: list[float],
    count: list[float],
    counters: dict[str, int],
) -> dict[str, Any]:
    """The warm-up's buffer and counts after this step; a column whose buffer fills takes its first mean and variance
    from it, taken by torch as ``zclip_decide`` takes them (the same summation)."""
    warmup = action.warmup_steps
    rows = [list(row) for row in buffer]  # out of place: the proposal is committed only if the step is applied
    count = list(count)
    ready = list(ready)
    filled = []
    for column, norm in warm:
        rows[column][min(int(count[column]), warmup - 1)] = norm
        count[column] += 1.0
        if count[column] >= warmup:
            filled.append(column)
    if filled:  # once per column: its first mean and variance, by torch's own reduction (as zclip_decide takes them)
        # Over every column's row, as zclip_decide reduces them: torch's reduction order can follow the row count.
        full = torch.tensor(rows, dtype=STATS_DTYPE)
        first_mean = full.mean(dim=1)
        first_var = ((full - first_mean.unsqueeze(1)) ** 2).mean(dim=1)
        means, variances = first_mean.tolist(), first_var.tolist()
        for column in filled:
            mean[column], var[column], ready[column] = means[column], variances[column], 1.0
    if all(value > 0 for value in ready):
        counters["ready"] = 1
    changed: dict[str, Any] = {"buffer": rows, "count": count}
    return changed | ({"mean": mean, "var": var, "ready": ready} if filled else {})


class ZClipKernel(ActionKernel):
    """``zclip``: clip a norm whose z-score against its EMA exceeds ``z_thresh`` (arXiv 2504.02507)."""

    schemas = (ZClip,)
    alarms = True

    def wants_raw_norm(self, action: Action) -> bool:
        return True

    def apply(self, work: StepWork, bound: BoundRule, action: Action, ids: list[int]) -> bool:
        assert isinstance(action, ZClip)
        assert work.statistics is not None
        if zclip_on_host(work, bound, action, ids):
            return True
        group, gs, g = followed_norms(work, ids, action.scope)
        series = work.statistics.series_for(
            bound, action, group, (action.warmup_steps,), g.device, zclip_empty(action.warmup_steps)
        )
        if series.tensors["mean"].device != g.device:  # kept on the host by the host path's earlier steps
            series.tensors = {key: value.to(g.device) for key, value in series.tensors.items()}
        cols = None if group else series.select(ids)
        state = series.at(cols)
        ceiling = _kept_ceiling(series, action, state) if cols is None else None
        decision = zclip_decide(action, g, state, warming=not series.counters.get("ready"), ceiling=ceiling)
        rescale(gs, decision.coef, group)
        counters: dict[str, int] = {}
        if decision.all_ready is not None:
            counters["ready"] = 0

            def note_ready(values: list[float]) -> None:
                counters["ready"] = int(values[0] > 0 and cols is None)  # every column ready: skip warm-up work

            work.pending.add(decision.all_ready, note_ready)
        work.statistics_step.propose(series, cols, decision.proposal, counters)
        figures = torch.stack([decision.coef, g, decision.limit, state["mean"], state["var"].sqrt(), decision.z])
        work.pending.quiet_if(partial(finite_norms, g))  # its clip is made on the device; a non-finite norm is reported
        work.pending.add(figures, report_reader(work, bound, action, ids, group, ["mean", "std", "z"]))
        return True
