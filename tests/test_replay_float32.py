"""The replay's float32 formulas in numpy (``gradguard.tuning.float32``) are the guard's torch formulas, bit for bit.

``gradguard replay`` and ``gradguard suggest`` decide without importing torch (#51 item 3), so each formula the guard
computes with torch is computed again in numpy; these tests hold every one to torch's result on many values, the
edges included: overflow to inf, NaN, subnormals, zeros, and totals on a clip's threshold.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradguard.enforce.triggers import loss_reference
from gradguard.enforce.work.tensors import clip_coefficients as torch_clip_coefficients
from gradguard.tuning import float32
from gradguard.tuning.float32 import as_float32, clip_coefficients, group_coefficients, tensor_norms

_F32_MAX = float(np.finfo(np.float32).max)


def _edge_values(count: int = 20_000, seed: int = 0) -> np.ndarray:
    """Float32 values a recorded norm can take: log-uniform over float32's whole range, subnormals, zeros, the
    largest finite values, inf and NaN, and the squares' overflow and underflow edges."""
    rng = np.random.default_rng(seed)
    spread = as_float32(np.exp(rng.uniform(-104.0, 89.0, count)))
    edges = [0.0, 1e-45, 1.4e-45, 1e-40, 1.1754944e-38, 1e-20, 1e-19, 1.0842022e-19, 1.0, 1.8446743e19, 1.8446744e19]
    edges += [3.4028235e38, math.inf, math.nan, 1e-6, 2e-6, 0.5, 1.0000001, 0.99999994]
    return np.concatenate([spread, np.array(edges, dtype=np.float32)])


def _same_bits(ours: np.ndarray, theirs: np.ndarray) -> bool:
    """Equal bit for bit, NaN included (NaN payloads aside: any NaN equals any NaN)."""
    both_nan = np.isnan(ours) & np.isnan(theirs)
    return bool(np.all(both_nan | (ours.view(np.uint32) == theirs.view(np.uint32))))


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_a_tensor_s_own_norm_is_torch_s_vector_norm_of_one_element_bit_for_bit(norm_type: float) -> None:
    values = _edge_values()
    theirs = torch.linalg.vector_norm(torch.from_numpy(values).unsqueeze(1), norm_type, dim=1).numpy()
    assert _same_bits(tensor_norms(values, norm_type), theirs)


def test_the_own_norm_check_can_fail() -> None:
    """The check above can fail: ``sqrt(x * x)`` in float32 overflows and underflows where torch's norm does not."""
    ends = np.array([1e20, 1e-30], dtype=np.float32)
    with np.errstate(over="ignore", under="ignore"):
        naive = np.sqrt(ends * ends)
    assert not _same_bits(naive, torch.linalg.vector_norm(torch.from_numpy(ends).unsqueeze(1), 2, dim=1).numpy())
    assert _same_bits(tensor_norms(ends, 2.0), ends)


@pytest.mark.parametrize("max_norm", [1.0, 0.5, 1e-3, 7.25, 1e-30, 3e38, 1e-6])
def test_clip_coefficients_are_the_guard_s_bit_for_bit(max_norm: float) -> None:
    totals = _edge_values(seed=1)
    # Totals on the threshold and one ulp either side of it, where the verdict turns.
    at = np.float32(max_norm)
    near = np.array([at, np.nextafter(at, np.float32(0)), np.nextafter(at, np.float32(math.inf))], dtype=np.float32)
    totals = np.concatenate([totals, near, near - np.float32(1e-6)])
    theirs = torch_clip_coefficients(torch.from_numpy(totals), max_norm).numpy()
    assert _same_bits(clip_coefficients(totals, max_norm), theirs)


def test_doubles_round_to_float32_as_torch_rounds_them() -> None:
    rng = np.random.default_rng(2)
    doubles = np.concatenate([np.exp(rng.uniform(-110.0, 90.0, 20_000)), [3.4028235e38, 3.40282357e38, 3.5e38, 1e-46]])
    doubles = np.concatenate([doubles, [math.inf, math.nan, 0.0, _F32_MAX * (1 + 2**-25), _F32_MAX * (1 + 2**-24)]])
    theirs = torch.tensor(doubles.tolist(), dtype=torch.float32).numpy()
    assert _same_bits(as_float32(doubles), theirs)


def _torch_group(rows: np.ndarray, max_norm: float) -> tuple[np.ndarray, np.ndarray]:
    totals = torch.linalg.vector_norm(torch.from_numpy(rows), 2.0, dim=1)
    coef = torch_clip_coefficients(totals, max_norm).numpy()
    return coef, coef < 1.0


@pytest.mark.parametrize("width", [1, 2, 7, 8, 9, 16, 17, 33, 300])
def test_a_group_clip_s_verdict_is_torch_s_on_every_row(width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of every scale, some with a total on the threshold (torch's own total as ``max_norm``): the verdict is
    torch's, and torch is asked only about the rows within the bound of the threshold."""
    rng = np.random.default_rng(width)
    rows = np.exp(rng.normal(0.0, 3.0, (400, width))).astype(np.float32)
    rows[:5] = np.float32(0.0)
    rows[5, 0], rows[6, -1], rows[7, 0] = np.nan, np.inf, np.float32(1e19)
    asked: list[int] = []
    original = float32._torch_group_norms

    def counted(unsure: np.ndarray) -> np.ndarray:
        asked.append(len(unsure))
        return original(unsure)

    monkeypatch.setattr(float32, "_torch_group_norms", counted)
    for max_norm in (1.0, 50.0, float(torch.linalg.vector_norm(torch.from_numpy(rows[10]), 2.0))):
        coef, acted = group_coefficients(rows, 2.0, max_norm, exact=False)
        theirs, torch_acted = _torch_group(rows, max_norm)
        assert acted.tolist() == torch_acted.tolist()
        assert _same_bits(coef[~acted], theirs[~acted])
        exact_coef, exact_acted = group_coefficients(rows, 2.0, max_norm, exact=True)
        assert exact_acted.tolist() == torch_acted.tolist()
        assert _same_bits(exact_coef, theirs)
    assert sum(asked) < 3 * len(rows)  # the rows that clipped under exact=True, and the ones on the threshold


def test_a_group_total_on_the_threshold_is_asked_of_torch_and_one_far_from_it_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bound is not a formality: a row whose torch total is ``max_norm`` itself cannot be decided in float64."""
    rows = np.exp(np.random.default_rng(9).normal(0.0, 1.0, (2, 37))).astype(np.float32)
    rows[1] *= np.float32(1000.0)
    on = float(torch.linalg.vector_norm(torch.from_numpy(rows[0]), 2.0))
    asked: list[int] = []
    original = float32._torch_group_norms
    monkeypatch.setattr(float32, "_torch_group_norms", lambda unsure: (asked.append(len(unsure)), original(unsure))[1])
    _, acted = group_coefficients(rows, 2.0, on, exact=False)
    assert asked == [1]
    assert (
        acted.tolist() == _torch_group(rows, on)[1].tolist() == [True, True]
    )  # the epsilon: a total at max_norm clips


def test_a_group_clip_by_the_inf_norm_is_torch_s_bit_for_bit() -> None:
    rows = _edge_values(seed=3)[: 37 * 500].reshape(500, 37)
    for max_norm in (1.0, 1e-20, 1e30):
        totals = torch.linalg.vector_norm(torch.from_numpy(rows), math.inf, dim=1)
        theirs = torch_clip_coefficients(totals, max_norm).numpy()
        coef, acted = group_coefficients(rows, math.inf, max_norm, exact=True)
        assert _same_bits(coef, theirs)
        assert acted.tolist() == (theirs < 1.0).tolist()


def test_the_loss_reference_s_float32_ceiling_is_torch_s() -> None:
    assert loss_reference._FLOAT32_MAX == float(torch.finfo(torch.float32).max) == float32.F32_MAX
