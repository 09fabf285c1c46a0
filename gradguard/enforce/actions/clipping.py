"""Clipping: ``clip_norm`` (per tensor or per group) and ``clip_value``, bitwise as torch's own.

Also the one clean-up clipping needs after the sync: a float32 2-norm that overflowed while every
element is finite is not a non-finite gradient; such a tensor gets its tensor-scope clips again with
a float64 norm (``clear_overflows``).
"""

from __future__ import annotations

import math
from functools import partial

import torch

from gradguard.enforce.actions.base import ActionKernel
from gradguard.enforce.work.step_work import StepOutcome, StepWork
from gradguard.enforce.work.tensors import (
    EPS,
    by_device,
    by_device_and_dtype,
    clamp_,
    clip_coefficients,
    host_clip_coefficient,
    in_torch_order,
    stack_on,
)
from gradguard.policy.matching import BoundRule
from gradguard.policy.schema import Action, ClipNorm, ClipValue

__all__ = ["ClipNormKernel", "ClipValueKernel", "pipeline_total"]


class ClipNormKernel(ActionKernel):
    """``clip_norm``: rescale by ``max_norm / (norm + 1e-6)`` where that is below 1, as ``clip_grad_norm_``."""

    alarms = True

    schemas = (ClipNorm,)

    def wants_raw_norm(self, action: Action) -> bool:
        assert isinstance(action, ClipNorm)
        return action.norm_type == 2.0

    def may_hold(self, action: Action) -> bool:
        assert isinstance(action, ClipNorm)
        return action.scope == "tensor"

    def apply(self, work: StepWork, bound: BoundRule, action: Action, ids: list[int]) -> bool:
        assert isinstance(action, ClipNorm)
        if not ids:  # a pipeline stage that holds none of the rule's tensors: its part of the group's norm is 0
            pipeline_total(work, action.norm_type, None)
            return True
        gs = list(map(work.grads.__getitem__, ids))  # map: a loop in C, over every tensor at every step
        raw, touched = work.raw, work.touched
        reuse = action.norm_type == 2.0 and all(map(raw.__contains__, ids)) and touched.isdisjoint(ids)
        norms = list(map(raw.__getitem__, ids)) if reuse else work.norms(gs, action.norm_type, ids)
        if action.scope == "tensor":
            _clip_tensors(work, bound, action, ids, gs, norms, fresh=not reuse)
        else:
            _clip_group(work, bound, action, ids, gs, norms, fresh=not reuse)
        return True


class ClipValueKernel(ActionKernel):
    """``clip_value``: clamp into ``[-limit, limit]``, as ``clip_grad_value_``."""

    alarms = True

    schemas = (ClipValue,)

    def may_erase_nonfinite(self, action: Action) -> bool:
        return True

    def may_hold(self, action: Action) -> bool:
        return True

    def apply(self, work: StepWork, bound: BoundRule, action: Action, ids: list[int]) -> bool:
        assert isinstance(action, ClipValue)
        gs = [work.grads[i] for i in ids]
        peaks = _peaks(work, ids, gs)
        final = work.after_read
        now = [g for index, g in zip(ids, gs, strict=True) if index not in final]
        if now:  # a later action of this step acts on these: the clamp must be on the device before it
            clamp_(now, action.limit)
        outcome, names, step, writes = work.outcome, work.names, work.step, work.writes
        for device_ids, positions in by_device(ids, peaks):

            def read(values: list[float], device_ids: list[int] = device_ids, positions: list[int] = positions) -> None:
                if max(values) <= action.limit and math.isfinite(sum(values)):
                    return  # nothing clamped, every peak finite
                for index, peak, position in zip(device_ids, values, positions, strict=True):
                    if index in final and not peak <= action.limit:  # above the limit, Inf or NaN: clamp it
                        writes.clamp(index, gs[position], action.limit)
                for index, peak in zip(device_ids, values, strict=False):
                    if peak != peak or abs(peak) == float("inf"):
                        outcome.nonfinite.setdefault(index, ("nan" if peak != peak else "inf", bound.index))
                    elif peak > action.limit:
                        outcome.value_clipped(step, bound.name, names[index], action.limit, peak)

            stacked = stack_on([peaks[k] for k in positions], peaks[positions[0]].device)
            work.pending.quiet_if(partial(_within, stacked, action.limit))
            work.pending.add(stacked, read)
        return True


def _peaks(work: StepWork, ids: list[int], gs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Max-abs norms of ``gs``: the non-finite watch's where it took them of these untouched gradients (one read)."""
    raw, touched = work.raw_peaks, work.touched
    if not work.sharded and all(index in raw and index not in touched for index in ids):
        return [raw[index] for index in ids]
    return work.norms(gs, float("inf"), ids)


def _clip_tensors(
    work: StepWork,
    bound: BoundRule,
    action: ClipNorm,
    ids: list[int],
    gs: list[torch.Tensor],
    norms: list[torch.Tensor],
    *,
    fresh: bool,
) -> None:
    outcome, names, step, pending, writes = work.outcome, work.names, work.step, work.pending, work.writes
    final = work.after_read  # a held change waits for the read as a final one
    for device_ids, positions in by_device_and_dtype(ids, norms):
        device = norms[positions[0]].device
        whole = len(positions) == len(ids)  # one group (the common case): positions are 0, 1, ... in order
        per_tensor = pending.stack(norms if whole else [norms[k] for k in positions], device)
        if not fresh and not work.sharded and final.issuperset(device_ids):
            # The common case: the raw norms, every change after the read. Their values are read anyway; the
            # coefficients are found from them on the host, bitwise, and nothing is launched for them.
            group = gs if whole else [gs[k] for k in positions]
            _clip_on_host(work, bound, action, device_ids, group, per_tensor)
            continue
        # clip_grad_norm_([p]) takes the norm of the one-element stack of norms; so do we, row-wise.
        totals = torch.linalg.vector_norm(per_tensor.unsqueeze(1), action.norm_type, dim=1)
        coefs = clip_coefficients(totals, action.max_norm)
        if final.issuperset(device_ids):  # every change waits for the read: no loop in Python
            now: list[int] = []
            group = gs if whole else [gs[k] for k in positions]
            deferred = list(zip(range(len(positions)), device_ids, group, strict=True))
        else:
            now = [row for row, k in enumerate(positions) if ids[k] not in final]
            deferred = [
                (row, device_ids[row], gs[positions[row]])
                for row in range(len(positions))
                if ids[positions[row]] in final
            ]
        if now:  # a later action of this step acts on these: the clip must be on the device before it
            rows = coefs.unbind()
            torch._foreach_mul_([gs[positions[row]] for row in now], [rows[row] for row in now])

        def read(
            values: list[float],
            device_ids: list[int] = device_ids,
            deferred: list[tuple[int, int, torch.Tensor]] = deferred,
            coefs: torch.Tensor = coefs,
        ) -> None:
            count = len(device_ids)
            if min(values[count:]) >= 1.0 and math.isfinite(sum(values[:count])):
                return  # nothing clipped, every norm finite (coefficients are never NaN)
            for row, index, grad in deferred:
                if values[count + row] < 1.0:  # the 0-dim coefficient is only taken for half precision
                    writes.scale(index, grad, values[count + row], partial(coefs.select, 0, row))
            _report_clips(outcome, step, names, bound, action, device_ids, values[:count], values[count:])

        pending.quiet_if(partial(_unclipped, totals, coefs, fresh))
        pending.add(totals, read, coefs)


def _clip_on_host(
    work: StepWork, bound: BoundRule, action: ClipNorm, ids: list[int], gs: list[torch.Tensor], norms: torch.Tensor
) -> None:
    """A per-tensor clip of raw 2-norms whose every change waits for the read: ``norms`` (their stack, which the
    non-finite watch reads already: read again in the same transfer, not launched again) are read and each
    coefficient is taken on the host (``host_clip_coefficient``: bitwise the device's)."""
    outcome, names, step, writes, max_norm = work.outcome, work.names, work.step, work.writes, action.max_norm
    single = norms.dtype == torch.float32
    # Below this, every coefficient is above 1 whatever the rounding (each of torch's roundings moves it 2**-24 at
    # most): the common step decides in two C calls.
    below = (max_norm - 2 * EPS) * (1 - 2**-20)

    def read(values: list[float]) -> None:
        if max(values) < below and math.isfinite(sum(values)):
            return  # nothing clipped, every norm finite
        found = [host_clip_coefficient(value, max_norm, single) for value in values]
        totals, coefs = [total for total, _ in found], [coef for _, coef in found]
        for row, (index, coef) in enumerate(zip(ids, coefs, strict=True)):
            if coef < 1.0:  # the 0-dim coefficient is only taken for half precision
                writes.scale(index, gs[row], coef, partial(_device_coefficient, norms, row, max_norm))
        _report_clips(outcome, step, names, bound, action, ids, totals, coefs)

    work.pending.quiet_if(partial(_host_unclipped, norms, max_norm))
    work.pending.add(norms, read)


def _device_coefficient(norms: torch.Tensor, row: int, max_norm: float) -> torch.Tensor:
    """One row's coefficient as the device takes it (for a half-precision gradient, multiplied by it as torch does)."""
    return clip_coefficients(torch.linalg.vector_norm(norms[row].reshape(1, 1), 2.0, dim=1), max_norm)[0]


def _host_unclipped(norms: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``_unclipped`` for ``_clip_on_host``, on the device (only where a fused update asks before the read)."""
    return clip_coefficients(torch.linalg.vector_norm(norms.unsqueeze(1), 2.0, dim=1), max_norm) >= 1.0


def _report_clips(
    outcome: StepOutcome,
    step: int,
    names: dict[int, str],
    bound: BoundRule,
    action: ClipNorm,
    ids: list[int],
    norms: list[float],
    coefs: list[float],
) -> None:
    """What a per-tensor clip's figures say: each non-finite norm (left as it is), each clip."""
    for index, norm, coef in zip(ids, norms, coefs, strict=False):
        if norm != norm or abs(norm) == float("inf"):
            outcome.nonfinite.setdefault(index, ("nan" if norm != norm else "inf", bound.index))
        elif coef < 1.0:
            outcome.norm_clipped(step, bound.name, names[index], action, norm, coef)


def _clip_group(
    work: StepWork,
    bound: BoundRule,
    action: ClipNorm,
    ids: list[int],
    gs: list[torch.Tensor],
    norms: list[torch.Tensor],
    *,
    fresh: bool,
) -> None:
    outcome = work.outcome
    deferred = all(index in work.final for index in ids)
    total, coef = _group_coefficient(action, ids, gs, norms, multiply=not deferred, pipeline=work)
    writes = work.writes

    def read(values: list[float]) -> None:
        norm, factor = values
        if deferred and not writes.written.isdisjoint(ids):
            # A change held for the read hit the group: these figures are of the gradients before it (which may
            # have held a NaN or Inf a clamp has since made finite).
            writes.after.append(partial(clip_group_after_read, work, bound, action, ids, gs, norms))
            return
        if deferred and factor < 1.0:
            for index, grad in zip(ids, gs, strict=True):
                writes.scale(index, grad, factor, partial(coef.to, grad.device))
        _group_read(outcome, work.step, work.names, bound, action, ids, norm, factor)

    work.pending.quiet_if(partial(_unclipped, total, coef, fresh))
    work.pending.add(total, read, coef)


def clip_group_after_read(
    work: StepWork,
    bound: BoundRule,
    action: ClipNorm,
    ids: list[int],
    gs: list[torch.Tensor],
    norms: list[torch.Tensor],
) -> None:
    """A group clip after changes held for the read (``StepWork.held``) that the read showed were made: clipped again,
    on the gradients those changes left, with the norms of the changed ones taken again and the others' reused.

    It is what the group clip would have done on the device before the read, op for op, so bitwise the same, with
    launches that do not grow with the number of tensors; only its figures wait, for the next step's read
    (``Carried``), since this step's is done.
    """
    written = work.writes.written
    stale = [k for k, index in enumerate(ids) if index in written]
    norms = list(norms)
    for k, norm in zip(
        stale, work.norms([gs[k] for k in stale], action.norm_type, [ids[k] for k in stale]), strict=True
    ):
        norms[k] = norm
    total, coef = _group_coefficient(action, ids, gs, norms, multiply=True)
    # Not the StepWork: the reader lives until the next read, and must not keep this step's gradients alive.
    report = partial(_group_read, work.carried.outcome, work.step, work.names, bound, action, ids)
    work.carried.parts.append((total, lambda values: report(*values), (coef,)))


def _group_coefficient(
    action: ClipNorm,
    ids: list[int],
    gs: list[torch.Tensor],
    norms: list[torch.Tensor],
    *,
    multiply: bool,
    pipeline: StepWork | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's total norm and clip coefficient, as ``clip_grad_norm_`` takes them; applied on the device too
    where ``multiply``. ``pipeline``: the step, whose stages' totals are combined where it has a pipeline's."""
    total = torch.linalg.vector_norm(stack_on(in_torch_order(gs, norms), norms[0].device), action.norm_type)
    if pipeline is not None and pipeline.pipeline is not None:
        total = pipeline_total(pipeline, action.norm_type, total)
    coef = clip_coefficients(total, action.max_norm)
    if multiply:
        for _, positions in by_device(ids, gs):
            torch._foreach_mul_([gs[k] for k in positions], coef.to(gs[positions[0]].device))
    return total, coef


def pipeline_total(work: StepWork, norm_type: float, total: torch.Tensor | None) -> torch.Tensor:
    """A group's norm over every pipeline stage, as torchtitan's clip takes it: the stages' totals to the p-th power
    summed over ``pp`` (their maximum for the inf-norm), one collective per group clip on every stage, in policy order
    (``total`` None: this stage holds none of the group's tensors)."""
    pipeline = work.pipeline
    if pipeline is None:
        assert total is not None
        return total
    if total is None:
        device = next(iter(work.grads.values())).device if work.grads else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float32, device=device)
    if math.isinf(norm_type):
        return pipeline.max_(total.reshape(1))[0]
    return pipeline.sum_(total.pow(norm_type).reshape(1))[0].pow(1.0 / norm_type)


def _group_read(
    outcome: StepOutcome,
    step: int,
    names: dict[int, str],
    bound: BoundRule,
    action: ClipNorm,
    ids: list[int],
    norm: float,
    factor: float,
) -> None:
    """What a group clip's figures say: a non-finite total (left as it is), or a clip."""
    if not math.isfinite(norm):
        kind = "nan" if norm != norm else "inf"
        fields = {"step": step, "rule": bound.name, "action": "clip_norm", "kind": kind, "n_params": len(ids)}
        outcome.events.append(("nonfinite_group_norm", fields))
    elif factor < 1.0:
        params = [names[i] for i in ids]
        outcome.norm_clipped(step, bound.name, None, action, norm, factor, params=params, n_params=len(ids))


def _unclipped(totals: torch.Tensor, coefs: torch.Tensor, fresh: bool) -> torch.Tensor:
    """A clip's reader is quiet where no coefficient is below 1 and no norm is non-finite (coefficients are 1 there;
    a non-finite raw norm is the non-finite watch's condition already, a norm taken afresh is this one's)."""
    unclipped = coefs >= 1.0
    return torch.cat([unclipped.reshape(-1), (totals < math.inf).reshape(-1)]) if fresh else unclipped


def _within(peaks: torch.Tensor, limit: float) -> torch.Tensor:
    """A clamp's reader is quiet where every peak is within the limit (not NaN)."""
    return peaks <= limit
