"""The guard's float32 clip formulas in numpy, for the replay (``gradguard.tuning.acting``, ``tuning.blocks``).

The guard computes its clip coefficients with torch on float32 tensors (``enforce.work.tensors.clip_coefficients``,
``enforce.actions.clipping``); the replay must decide as it does without importing torch (a second of a
``gradguard replay``'s start-up). numpy's float32 is the same IEEE float32, and each formula here is torch's, element
by element and operation by operation, so the results are bitwise equal (``tests/test_replay_float32.py`` checks each
against torch on edge cases: overflow to inf, NaN, subnormals, values on a threshold):

- a tensor's own norm of one recorded norm ``x`` (``vector_norm`` of a one-element row, as the guard's per-tensor
  clip takes it): ``|x|``, for the 2-norm as for the inf-norm (torch's 2-norm of one element neither overflows
  above 1.8e19 nor underflows below 1e-19, as ``sqrt(x * x)`` would);
- ``clip_coefficients``: ``max_norm / (total + 1e-6)`` as torch evaluates ``float / tensor`` (the reciprocal, then a
  product), at most 1, and 1 where the total is not finite.

One formula is a reduction whose rounding depends on the order torch adds in, which follows the CPU's vector width
(``vector_norm`` of a group's norms, summed in 8 or 16 float32 lanes): no portable numpy sum is bitwise torch's. A
group's 2-norm is taken in float64 instead, with a bound on how far any float32 summation order can lie from it; where
every float32 value within that bound gives the same verdict and nothing later reads the coefficient's exact bits,
that verdict is the guard's. Only the other steps (a total within a few ulps of ``max_norm``, a coefficient a later
action depends on, a sum near float32's overflow) are handed to torch's own ``vector_norm``, imported then.
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "EPS",
    "F32",
    "F32_MAX",
    "Bools",
    "Floats",
    "as_float32",
    "clip_coefficients",
    "group_coefficients",
    "tensor_norms",
]

F32: Final = np.float32
F32_MAX: Final = float(np.finfo(np.float32).max)
"""A recorded norm (a double) above this is infinite in float32, where the guard and the replay decide."""
EPS: Final = np.float32(1e-6)
"""``clip_grad_norm_``'s epsilon as torch adds it to a float32 tensor: cast to float32 first."""

Floats = NDArray[np.float32]
Bools = NDArray[np.bool_]

_U: Final = 2.0**-24
"""float32's unit roundoff: each rounding of a float32 operation moves a result by at most this, relatively."""
_TINY: Final = 2.0**-149
"""float32's smallest subnormal: a result that underflows moves by at most this, absolutely."""


def as_float32(values: NDArray[np.float64] | list[float]) -> Floats:
    """Doubles rounded to float32 as torch's ``.to(torch.float32)`` rounds them (to nearest; past the largest: inf)."""
    with np.errstate(over="ignore"):
        return np.asarray(values, dtype=np.float64).astype(np.float32)


def tensor_norms(norms: Floats, norm_type: float) -> Floats:
    """Each element's own ``norm_type``-norm, as ``torch.linalg.vector_norm(norms.unsqueeze(-1), norm_type, dim=-1)``:
    the guard's per-tensor clip takes its total so (``enforce.actions.clipping``)."""
    assert norm_type in (2.0, math.inf)
    magnitudes: Floats = np.abs(norms)
    return magnitudes


def clip_coefficients(totals: Floats, max_norm: float) -> Floats:
    """``enforce.work.tensors.clip_coefficients`` in numpy: ``clamp(max_norm / (totals + EPS), max=1)``, 1 where a
    total is not finite. torch's ``float / tensor`` is ``tensor.reciprocal() * float``, with the float cast to
    float32; both roundings are kept."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        coef = np.minimum((np.float32(1.0) / (totals + EPS)) * np.float32(max_norm), np.float32(1.0))
        kept: Floats = np.where(totals < math.inf, coef, np.float32(1.0)).astype(np.float32)
        return kept


def group_coefficients(rows: Floats, norm_type: float, max_norm: float, exact: bool) -> tuple[Floats, Bools]:
    """A group clip on each row (``[steps x members]`` float32 norms): each row's coefficient, and whether it clipped.

    ``exact``: a later action reads the norms this coefficient leaves, so a clipping row's coefficient must be
    torch's to the bit. Where it need not be (nothing later reads it), a clipping row's coefficient is close to it.
    """
    if norm_type == math.inf:
        totals = np.max(np.abs(rows), axis=1) if rows.shape[1] else np.zeros(rows.shape[0], np.float32)
        coef = clip_coefficients(totals, max_norm)
        return coef, coef < 1.0
    assert norm_type == 2.0
    width = rows.shape[1]
    wide = rows.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        squares = np.sum(wide * wide, axis=1)
    finite = np.isfinite(rows).all(axis=1)
    # Any order of float32 additions of ``width`` squares (each rounded, or fused) lies within gamma of the exact
    # sum (Higham's bound for a sum of non-negative terms), plus an absolute ulp of underflow per operation; the
    # float64 sum itself is within ``width`` double ulps; the square root halves the relative error and rounds once.
    # Doubled, so that a summation that scales its terms (as LAPACK's nrm2 does) lies inside it too.
    gamma = 2.0 * (width + 2) * _U / (1.0 - 2.0 * (width + 2) * _U) + 4.0 * width * 2.0**-53
    slack = 2.0 * width * _TINY
    with np.errstate(over="ignore", invalid="ignore"):
        low = np.sqrt(np.maximum(squares * (1.0 - gamma) - slack, 0.0)) * (1.0 - 2.0 * _U)
        high = np.sqrt(squares * (1.0 + gamma) + slack) * (1.0 + 2.0 * _U)
    # The float32 totals torch could have made, and the verdict at each end (monotone in the total in between).
    low32 = np.nextafter(as_float32(low), np.float32(0.0))
    high32 = np.nextafter(as_float32(high), np.float32(math.inf))
    clips_low = clip_coefficients(low32, max_norm) < 1.0
    clips_high = clip_coefficients(high32, max_norm) < 1.0
    # A squared sum near float32's largest value may overflow in some order (a total of inf does not clip).
    overflow = squares * (1.0 + gamma) + slack >= F32_MAX
    sure = ~finite | ((clips_low == clips_high) & ~overflow & ~(clips_low & exact))
    # A NaN or Inf norm makes torch's total NaN or inf: it does not clip (the non-finite watch reports it).
    acted = finite & clips_low
    coef = np.where(acted, clip_coefficients(as_float32(np.sqrt(squares)), max_norm), np.float32(1.0))
    if not sure.all():
        unsure = np.flatnonzero(~sure)
        torch_coef = clip_coefficients(_torch_group_norms(rows[unsure]), max_norm)
        coef[unsure] = torch_coef
        acted[unsure] = torch_coef < 1.0
    return coef.astype(np.float32), acted


def _torch_group_norms(rows: Floats) -> Floats:
    """torch's own float32 2-norm of each row, as the guard's group clip takes it (torch imported here only)."""
    import torch

    totals: Floats = torch.linalg.vector_norm(torch.from_numpy(np.ascontiguousarray(rows)), 2.0, dim=1).numpy()
    return totals
