"""``agc``: adaptive gradient clipping (NFNets; timm's ``adaptive_clip_grad``), batched on the device.

Each unit's gradient norm is kept at most ``max = clipping * max(||W||, eps)``, ``W`` the unit's weights:

- ``scope: tensor``: a unit is an output unit of one parameter, its slice along the first dimension
  (norm over every other dimension); a parameter of at most one dimension is one unit. Bitwise as
  timm's ``adaptive_clip_grad([p], clipping, eps)`` on finite gradients: the same norms, the same
  ``max / max(norm, 1e-6)`` factor, a unit left exactly as it is where ``norm < max``;
- ``scope: group``: one unit, all of the rule's parameters jointly: ``max = clipping * max(||W_group||,
  eps)`` against the joint gradient norm (the norms of the per-tensor norms, as ``clip_grad_norm_``).

As everywhere in gradguard, a unit whose gradient norm is NaN or Inf is left as it is and reported
(timm would multiply it by NaN or 0), and float16/bfloat16 norms are taken in float32. Nothing is
read on the host here: per tensor (or group), the units clipped, the largest ``norm / max`` and the
gradient norm before and after ride in the step's one host read.

Under FSDP2 (dim-0 shards) a unit of a tensor of two or more dimensions lies on one rank, so its
norms are local; the norms of tensors of at most one dimension, and of a group, are combined across
ranks first (one collective), and the per-tensor figures after (two). Under DeepSpeed ZeRO each rank
holds a flat piece of each gradient, which may begin or end inside a unit: each unit's squared norms
are summed over its pieces (one collective), and the weights are read at the pieces' places.
"""

from __future__ import annotations

import math
from functools import lru_cache, partial

import torch

from gradguard.enforce.actions.base import ActionKernel
from gradguard.enforce.distributed.collective import combine_shard_norms
from gradguard.enforce.work.step_work import StepWork
from gradguard.enforce.work.tensors import LOW_PRECISION, by_device, norms
from gradguard.policy.matching import BoundRule
from gradguard.policy.schema import Action, AdaptiveGradClip

__all__ = ["AgcKernel"]

_DENOMINATOR_FLOOR = 1e-6
"""timm's ``grad_norm.clamp(min=1e-6)``: the same value keeps results bitwise equal."""


class AgcKernel(ActionKernel):
    """``agc``: per output unit (``tensor``) or per rule (``group``), ``max = clipping * max(||W||, eps)``."""

    schemas = (AdaptiveGradClip,)
    alarms = True

    def wants_raw_norm(self, action: Action) -> bool:
        assert isinstance(action, AdaptiveGradClip)
        return action.scope == "group"  # the tensor scope needs unit norms, not whole-tensor ones

    def apply(self, work: StepWork, bound: BoundRule, action: Action, ids: list[int]) -> bool:
        assert isinstance(action, AdaptiveGradClip)
        gs = [work.grads[i] for i in ids]
        if action.scope == "group":
            _clip_group(work, bound, action, ids, gs)
            return True
        for device_ids, positions in by_device(ids, gs):
            if work.places and all(i in work.places for i in device_ids):
                layout = [_piece_layout(work.places[i].shape, work.places[i].start) for i in device_ids]
                _clip_unit_pieces(work, bound, action, device_ids, [gs[k] for k in positions], layout)
            elif work.shares is not None and work.wrapped:  # tensor parallel: a row may be split over ranks
                layout = [_placed_layout(work, i) for i in device_ids]
                _clip_unit_pieces(work, bound, action, device_ids, [gs[k] for k in positions], layout)
            else:
                _clip_units(work, bound, action, device_ids, [gs[k] for k in positions])
        return True


def _unit_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """2-norm of each slice along the first dimension of each tensor (timm's ``unitwise_norm``, without
    the kept dims), in float32 for half precision."""
    vector_norm, low = torch.linalg.vector_norm, LOW_PRECISION
    return [
        vector_norm(t, 2.0, dim=_DIMS[t.ndim] if t.ndim < 6 else tuple(range(1, t.ndim)))
        if t.dtype not in low
        else vector_norm(t, 2.0, dim=tuple(range(1, t.ndim)), dtype=torch.float32)
        for t in tensors
    ]


_DIMS = {ndim: tuple(range(1, ndim)) for ndim in range(2, 6)}


@lru_cache(maxsize=64)
def _lengths(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The segment lengths as a device tensor, made once per layout (a fresh one each step would be an
    upload, a sync on a GPU)."""
    return torch.tensor(sizes, dtype=torch.int64, device=device)


def _coefficients(
    grad_norms: torch.Tensor, weight_norms: torch.Tensor, action: AdaptiveGradClip
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(factor, clipped, max) per unit: timm's ``where(norm < max, 1, max / norm.clamp(min=1e-6))``, and 1
    where the gradient norm is not finite (or ``max`` is NaN)."""
    limits = weight_norms.clamp(min=action.eps).mul_(action.clipping)
    clipped = (grad_norms >= limits) & torch.isfinite(grad_norms)
    factor = torch.where(clipped, limits / grad_norms.clamp(min=_DENOMINATOR_FLOOR), 1.0)
    return factor, clipped, limits


def _clip_units(
    work: StepWork, bound: BoundRule, action: AdaptiveGradClip, ids: list[int], gs: list[torch.Tensor]
) -> None:
    """Tensor scope, on one device: every tensor's units in one flat vector, decided and figured at once."""
    ws = work.weights(ids)
    # Tensors of two or more dimensions (a unit per row) first, then the others (one unit each).
    rows = [k for k, g in enumerate(gs) if g.ndim >= 2]
    flat = [k for k, g in enumerate(gs) if g.ndim < 2] if len(rows) < len(gs) else []
    order = rows + flat
    device = gs[0].device
    grad_parts = _unit_norms([gs[k] for k in rows])
    weight_parts = _unit_norms([ws[k] for k in rows])
    if flat:
        raw, touched = work.raw, work.touched
        flat_gs = [gs[k] for k in flat]
        reuse = not work.sharded and all(ids[k] in raw and ids[k] not in touched for k in flat)
        g_flat = [raw[ids[k]] for k in flat] if reuse else norms(flat_gs, 2.0)
        w_flat = norms([ws[k] for k in flat], 2.0)
        if work.sharded and work.collective is not None:
            shares = work.share_weights([ids[k] for k in flat], device, repeat=2)
            joined = combine_shard_norms(work.collective, [*g_flat, *w_flat], 2.0, shares)
            g_flat, w_flat = joined[: len(flat)], joined[len(flat) :]
        grad_parts.append(torch.stack(g_flat).to(device))
        weight_parts.append(torch.stack(w_flat).to(device))
    grad_norms = torch.cat(grad_parts) if len(grad_parts) > 1 else grad_parts[0]
    weight_norms = torch.cat(weight_parts) if len(weight_parts) > 1 else weight_parts[0]
    factor, clipped, limits = _coefficients(grad_norms, weight_norms, action)

    sizes = [gs[k].shape[0] for k in rows] + [1] * len(flat)
    n_rows_units = sum(sizes[: len(rows)])
    views = torch.split(factor[:n_rows_units], sizes[: len(rows)]) if rows else ()
    factors = [v.view((-1,) + (1,) * (gs[k].ndim - 1)) for v, k in zip(views, rows, strict=True)]
    if flat:
        factors.extend(factor[n_rows_units:].unbind())
    torch._foreach_mul_([gs[k] for k in order], factors)

    # Per tensor: squared norms before and after, units clipped; and the largest norm / max. (unsafe: the
    # lengths are ours and right; checking them would read them on the host, a sync each.)
    before = grad_norms.double()
    lengths = _lengths(tuple(sizes), device)
    sums = torch.segment_reduce(
        torch.stack([before.square(), (before * factor).square(), clipped.double()], dim=1),
        "sum",
        lengths=lengths,
        unsafe=True,
    )
    peaks = torch.segment_reduce(before / limits, "max", lengths=lengths, unsafe=True)
    if work.sharded and work.collective is not None and rows:
        # A row lies on one rank: the figures of the row tensors add up (max) across ranks; the others
        # were taken from full norms, the same on every rank.
        count = len(rows)
        row_sums = sums[:count].contiguous()
        shares = work.share_weights([ids[k] for k in rows], device)
        if shares is not None:  # a replicated row tensor's figures counted once (``StepWork.shares``)
            row_sums = row_sums * shares.double().unsqueeze(1)
        sums = torch.cat([work.collective.sum_(row_sums), sums[count:]])
        peaks = torch.cat([work.collective.max_(peaks[:count].contiguous()), peaks[count:]])

    _report_units(work, bound, action, [ids[k] for k in order], sums, peaks)


def _piece_layout(shape: tuple[int, ...], start: int) -> tuple[int, int, int]:
    """``(units, start, width)`` of a flat piece of a parameter of ``shape`` that starts at element ``start``."""
    return _units_of(shape), start, _width(shape)


def _placed_layout(work: StepWork, index: int) -> tuple[int, int, int]:
    """``(units, start, width)`` of this rank's local piece of a DTensor or replicated gradient, as a flat piece of the
    whole parameter's units: the piece's rows are units ``offset .. offset + rows`` (a piece split along another
    dimension holds part of each of its rows), numbered by the whole parameter's first dimension."""
    grad, dtensor = work.grads[index], work.wrapped.get(index)
    if grad.ndim < 2:
        return 1, 0, max(grad.numel(), 1)
    width = max(math.prod(grad.shape[1:]), 1)
    if dtensor is None:
        return int(grad.shape[0]), 0, width
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(dtensor.shape, dtensor.device_mesh, dtensor.placements)  # type: ignore[attr-defined]
    return int(dtensor.shape[0]), int(offset[0]) * width, width


def _clip_unit_pieces(
    work: StepWork,
    bound: BoundRule,
    action: AdaptiveGradClip,
    ids: list[int],
    gs: list[torch.Tensor],
    layout: list[tuple[int, int, int]],
) -> None:
    """Tensor scope where each rank holds a flat piece of each gradient (DeepSpeed ZeRO, ``work.places``): a piece may
    begin or end inside a unit, so each unit's squared gradient and weight norms are this rank's elements' sums,
    summed over the ranks in one collective (in float64); every rank then holds every unit's whole norms, decides the
    same factors, and scales its own elements by their unit's."""
    weights = work.weights(ids)
    device = gs[0].device
    units = [count for count, _, _ in layout]
    which = [_unit_index(start, g.numel(), width, device) for (_, start, width), g in zip(layout, gs, strict=True)]
    local = [
        torch.zeros(2, count, dtype=torch.float64, device=device).index_add_(
            1, index, torch.stack([g.double().reshape(-1).square(), w.double().reshape(-1).square()])
        )
        for g, w, count, index in zip(gs, weights, units, which, strict=True)
    ]
    if work.shares is not None:  # a replica's squares counted once (``StepWork.shares``)
        local = [part * work.shares[i] for part, i in zip(local, ids, strict=True)]
    joined = torch.cat(local, dim=1)
    if work.sharded and work.collective is not None:  # not where every rank holds the whole (BF16_Optimizer)
        joined = work.collective.sum_(joined)
    grad_norms, weight_norms = joined.sqrt().unbind(0)
    factor, clipped, limits = _coefficients(grad_norms, weight_norms, action)
    spans = list(torch.split(factor, units))
    torch._foreach_mul_(
        gs, [span[index].to(g.dtype).view(g.shape) for span, index, g in zip(spans, which, gs, strict=True)]
    )
    lengths = _lengths(tuple(units), device)
    sums = torch.segment_reduce(
        torch.stack([grad_norms.square(), (grad_norms * factor).square(), clipped.double()], dim=1),
        "sum",
        lengths=lengths,
        unsafe=True,
    )
    peaks = torch.segment_reduce(grad_norms / limits, "max", lengths=lengths, unsafe=True)
    _report_units(work, bound, action, ids, sums, peaks, units)


def _units_of(shape: tuple[int, ...]) -> int:
    return int(shape[0]) if len(shape) >= 2 else 1


def _width(shape: tuple[int, ...]) -> int:
    """Elements per unit: a row's (every dimension but the first), or the whole tensor's."""
    return max(math.prod(shape[1:]) if len(shape) >= 2 else math.prod(shape), 1)


@lru_cache(maxsize=256)
def _unit_index(start: int, length: int, width: int, device: torch.device) -> torch.Tensor:
    """The unit of each element of a piece that starts at flat element ``start``: made once per layout."""
    return torch.arange(start, start + length, device=device).floor_divide_(width)


def _report_units(
    work: StepWork,
    bound: BoundRule,
    action: AdaptiveGradClip,
    ordered_ids: list[int],
    sums: torch.Tensor,
    peaks: torch.Tensor,
    unit_counts: list[int] | None = None,
) -> None:
    """Queue the tensor scope's figures (per tensor: squared norms before and after, units clipped; the largest
    ``norm / max``) for the step's read, with the reader that reports them."""
    outcome, names, step, params = work.outcome, work.names, work.step, work.binding.params
    rule, clipping, eps, append = bound.name, action.clipping, action.eps, outcome.events.append

    def read(values: list[float]) -> None:
        n = len(ordered_ids)
        squares, counts = values[0 : 3 * n : 3], values[2 : 3 * n : 3]
        if not any(counts) and math.isfinite(sum(squares)):
            return  # nothing clipped, every norm finite: the common case, without a loop in Python
        clipped = []
        for k, index in enumerate(ordered_ids):
            square = squares[k]
            if square - square != 0.0:  # NaN or Inf
                outcome.nonfinite.setdefault(index, ("nan" if square != square else "inf", bound.index))
            elif counts[k] > 0:
                clipped.append(k)
        if not clipped:
            return
        # One event per rule and step, one list entry per clipped parameter (most are, every step).
        event = {
            "step": step,
            "rule": rule,
            "action": "agc",
            "scope": "tensor",
            "clipping": clipping,
            "eps": eps,
            "param": None,
            "params": [names[ordered_ids[k]] for k in clipped],
            "n_params": len(clipped),
            "units": [
                unit_counts[k] if unit_counts is not None else _units(params[ordered_ids[k]].ref()) for k in clipped
            ],
            "units_clipped": [int(counts[k]) for k in clipped],
            "max_ratio": [values[3 * n + k] for k in clipped],
            "before": [math.sqrt(squares[k]) for k in clipped],
            "after": [math.sqrt(values[3 * k + 1]) for k in clipped],
        }
        append(("adaptive_clip", event))
        outcome.counts.append((rule, "agc", len(clipped)))

    work.pending.quiet_if(partial(_finite_squares, sums))  # the clip is made on the device; a NaN is reported
    work.pending.add(torch.cat([sums.reshape(-1), peaks.to(sums.dtype)]), read)


def _finite_squares(sums: torch.Tensor) -> torch.Tensor:
    """Every tensor's squared gradient norm (the first of its three figures) is finite."""
    return sums.reshape(-1)[0::3] < math.inf


def _units(param: torch.Tensor | None) -> int:
    """A parameter's units: its first dimension (under FSDP2, of the whole parameter, not the shard)."""
    return int(param.shape[0]) if param is not None and param.ndim >= 2 else 1


def _clip_group(
    work: StepWork, bound: BoundRule, action: AdaptiveGradClip, ids: list[int], gs: list[torch.Tensor]
) -> None:
    """Group scope: the rule's parameters as one unit, their joint weight norm against their joint gradient norm."""
    ws = work.weights(ids)
    raw, touched = work.raw, work.touched
    device = gs[0].device
    if all(i in raw and i not in touched for i in ids):
        grad_norms = [raw[i] for i in ids]  # full norms already under FSDP2 (the watch combined them)
        weight_norms = work.norms(ws, 2.0, ids)
    else:
        grad_norms, weight_norms = norms(gs, 2.0), norms(ws, 2.0)
        if work.sharded and work.collective is not None:
            shares = work.share_weights(ids, device, repeat=2)
            joined = combine_shard_norms(work.collective, [*grad_norms, *weight_norms], 2.0, shares)
            grad_norms, weight_norms = joined[: len(ids)], joined[len(ids) :]
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in grad_norms]), 2.0)
    weight = torch.linalg.vector_norm(torch.stack([n.to(device) for n in weight_norms]), 2.0)
    factor, clipped, limit = _coefficients(total, weight, action)
    for _, positions in by_device(ids, gs):
        torch._foreach_mul_([gs[k] for k in positions], factor.to(gs[positions[0]].device))
    outcome, names, step, rule = work.outcome, work.names, work.step, bound.name

    def read(values: list[float]) -> None:
        norm, after, was_clipped, ratio = values
        if not math.isfinite(norm):
            kind = "nan" if norm != norm else "inf"
            event = {"step": step, "rule": rule, "action": "agc", "kind": kind, "n_params": len(ids)}
            outcome.events.append(("nonfinite_group_norm", event))
        elif was_clipped:
            outcome.counts.append((rule, "agc", len(ids)))
            event = {"step": step, "rule": rule, "action": "agc", "param": None, "params": [names[i] for i in ids]}
            event |= {"n_params": len(ids), "scope": "group", "clipping": action.clipping, "eps": action.eps}
            event |= {"units": 1, "units_clipped": 1, "max_ratio": ratio, "before": norm, "after": after}
            outcome.events.append(("adaptive_clip", event))

    figures = torch.stack([total, total * factor, clipped.to(total.dtype), total / limit])
    work.pending.add(figures, read)
