"""Tensor helpers shared by the step engine and its actions: batched norms, clip coefficients, clamps.

Norms follow ``torch.nn.utils.clip_grad_norm_`` operation for operation, so results are bitwise
equal to it, except in two deliberate ways: float16/bfloat16 gradients have their norms computed in
float32 (a finite gradient is never called infinite because a half-precision norm overflowed), and
a non-finite norm never rescales anything (torch would turn every gradient of the group into NaN).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from ctypes import c_float
from functools import lru_cache
from operator import attrgetter
from typing import Any, TypeVar, cast

import torch

__all__ = [
    "EPS",
    "LOW_PRECISION",
    "by_device",
    "by_device_and_dtype",
    "clamp_",
    "clip_coefficients",
    "device_constant",
    "host_clip_coefficient",
    "in_torch_order",
    "norms",
    "stack_on",
    "version_of",
    "without_grad",
]

LOW_PRECISION = (torch.float16, torch.bfloat16)
_DEVICE, _DTYPE = attrgetter("device"), attrgetter("dtype")  # for map(): the per-tensor checks below loop in C
_DEVICE_AND_DTYPE = attrgetter("device", "dtype")
version_of = attrgetter("_version")
"""A tensor's version counter, for ``map``: the per-tensor reads of it loop in C."""
EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s epsilon; the same value keeps results bitwise equal.
_grad_enabled, _set_grad_enabled = torch.is_grad_enabled, torch._C._set_grad_enabled

_F = TypeVar("_F", bound=Callable[..., Any])


def without_grad(function: _F) -> _F:
    """``@torch.no_grad()`` for the guard's per-step functions, in two C calls: torch's decorator makes and enters a
    new context object at every call (six Python calls), which a host-bound step of a small model notices."""

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        enabled = _grad_enabled()
        _set_grad_enabled(False)
        try:
            return function(*args, **kwargs)
        finally:
            _set_grad_enabled(enabled)

    return cast(_F, run)


def norms(grads: Sequence[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Per-tensor norms, in float32 for half-precision gradients, in one ``_foreach_norm`` per dtype."""
    if norm_type == math.inf and not all(map(torch.Tensor.numel, grads)):
        # An empty tensor (a rank that holds none of a DeepSpeed gradient) has no max-abs norm in torch (no identity
        # for max): 0, the identity of the max over the ranks' pieces, as its 2-norm is 0.
        full = [k for k, g in enumerate(grads) if g.numel()]
        found = dict(zip(full, norms([grads[k] for k in full], norm_type), strict=True)) if full else {}
        return [found[k] if k in found else g.new_zeros((), dtype=_norm_dtype(g)) for k, g in enumerate(grads)]
    if set(map(_DTYPE, grads)).isdisjoint(LOW_PRECISION):
        return list(torch._foreach_norm(list(grads), norm_type))
    out: list[torch.Tensor | None] = [None] * len(grads)
    low = [i for i, g in enumerate(grads) if g.dtype in LOW_PRECISION]
    high = [i for i, g in enumerate(grads) if g.dtype not in LOW_PRECISION]
    for indices, kwargs in ((low, {"dtype": torch.float32}), (high, {})):
        if indices:
            taken = torch._foreach_norm([grads[i] for i in indices], norm_type, **kwargs)
            for i, norm in zip(indices, taken, strict=True):
                out[i] = norm
    return [norm for norm in out if norm is not None]


@lru_cache(maxsize=256)
def device_constant(
    values: float | tuple[float, ...] | tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Host values as a device tensor (one value: a 0-dim tensor), made once per (values, dtype, device) and then
    reused: a tensor made from Python data at every step is a copy from pageable host memory, which on a GPU waits
    for the device (a host sync). Never written to: callers use it as an index or an operand only."""
    return torch.tensor(values, dtype=dtype, device=device)


def stack_on(norms: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    if _one_value(map(_DEVICE, norms), device):
        return torch.stack(list(norms))  # the common case: no per-tensor ``.to`` (a no-op, but a dispatch)
    return torch.stack([norm.to(device) for norm in norms])


def clamp_(grads: list[torch.Tensor], limit: float) -> None:
    """``clip_grad_value_``'s clamp, with the limit capped at each dtype's largest finite value.

    torch refuses a float16 clamp bound above 65504; no finite float16 exceeds it, so the cap changes
    nothing but the (reported) Inf, which becomes the largest finite value instead of staying Inf.
    """
    if all(limit <= torch.finfo(g.dtype).max for g in grads):
        torch._foreach_clamp_min_(grads, -limit)
        torch._foreach_clamp_max_(grads, limit)
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for dtype, group in by_dtype.items():
        bound = min(limit, torch.finfo(dtype).max)
        torch._foreach_clamp_min_(group, -bound)
        torch._foreach_clamp_max_(group, bound)


def in_torch_order(grads: Sequence[torch.Tensor], norms: list[torch.Tensor]) -> list[torch.Tensor]:
    """The per-tensor norms in the order ``clip_grad_norm_`` sums them: grouped by (device, dtype).

    The same order keeps a group clip over mixed dtypes bitwise equal to torch's.
    """
    first = grads[0]
    if all(g.dtype == first.dtype and g.device == first.device for g in grads):
        return norms
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

    groups = _group_tensors_by_device_and_dtype([list(grads)], with_indices=True)
    return [norms[i] for _, (_, indices) in groups.items() for i in indices]


def clip_coefficients(totals: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_``'s coefficient, left at 1 where the norm is not finite.

    A NaN or Inf gradient is left as it is and reported (torch would spread the NaN to every tensor
    of a group clip). A finite gradient whose float32 norm overflowed is clipped after the sync, with
    its norm taken in float64 (``gradguard.enforce.actions.overflow.clear_overflows``).
    """
    coef = torch.clamp(max_norm / (totals + EPS), max=1.0)
    # Norms are never negative, so ``< inf`` is ``isfinite`` (False for NaN and +Inf) in one kernel instead of
    # isfinite's four; and a kept 1 in place of ``ones_like`` (or of a host 1.0, filled on the device) is none.
    return torch.where(totals < math.inf, coef, device_constant(1.0, coef.dtype, coef.device))


_F32_EPS = c_float(EPS).value


def host_clip_coefficient(norm: float, max_norm: float, single: bool) -> tuple[float, float]:
    """``clip_coefficients`` of one read 2-norm, on the host: (the total ``clip_grad_norm_([p])`` takes, its
    coefficient), the coefficient bitwise the device's, so the step launches nothing to find it.

    The total is the norm itself: torch's 2-norm of a one-element stack is that element's absolute value, on the CPU
    and on CUDA alike, also where its square would overflow (seen on an H200, torch 2.11, from 2**64 on in float32
    and 2**512 in float64: ``benchmarks/cuda_clip_check.py``). ``single``: the norm is float32, and so is every step
    of torch's arithmetic (``total + 1e-6``, ``reciprocal``, ``* max_norm``, each rounded to float32; a scalar is
    cast to float32 first): each is taken in float64 here and rounded to float32, which for these operations is the
    float32 result itself (float64 has more than twice float32's precision).
    """
    if not norm < math.inf:  # NaN or Inf: left at 1, and reported (``clip_coefficients``' ``where``)
        return norm, 1.0
    if single:
        reciprocal = c_float(1.0 / c_float(norm + _F32_EPS).value).value
        return norm, min(c_float(reciprocal * c_float(max_norm).value).value, 1.0)
    return norm, min(1.0 / (norm + EPS) * max_norm, 1.0)


def by_device_and_dtype(ids: Sequence[int], tensors: Sequence[torch.Tensor]) -> list[tuple[list[int], list[int]]]:
    """``by_device``, with each dtype apart too: a float32 norm stacked with a float64 one would be promoted, and
    its clip coefficient would no longer be the one ``clip_grad_norm_([p])`` computes."""
    return _grouped(ids, tensors, _DEVICE_AND_DTYPE)


def by_device(ids: Sequence[int], tensors: Sequence[torch.Tensor]) -> list[tuple[list[int], list[int]]]:
    """Group positions of parallel lists by device, keeping order: ``[(ids, positions), ...]``.

    One group in the common single-device case, found without building anything per tensor.
    """
    return _grouped(ids, tensors, _DEVICE)


def _grouped(
    ids: Sequence[int], tensors: Sequence[torch.Tensor], key: Callable[[torch.Tensor], Hashable]
) -> list[tuple[list[int], list[int]]]:
    keys = list(map(key, tensors))  # in C
    if len(set(keys)) == 1:
        return [(list(ids), list(range(len(ids))))]
    groups: dict[Hashable, tuple[list[int], list[int]]] = {}
    for position, (index, group_key) in enumerate(zip(ids, keys, strict=False)):
        bucket = groups.setdefault(group_key, ([], []))
        bucket[0].append(index)
        bucket[1].append(position)
    return list(groups.values())


def _one_value(values: Iterator[object], value: object) -> bool:
    """Whether every one of ``values`` equals ``value`` (none: True), compared in C, not in a Python loop."""
    return set(values) <= {value}


def _norm_dtype(grad: torch.Tensor) -> torch.dtype:
    """The dtype ``norms`` gives ``grad``'s norm: float32 for half precision, else its own."""
    return torch.float32 if grad.dtype in LOW_PRECISION else grad.dtype
