"""The per-tensor clip's coefficients taken on the host, checked against torch's on a CUDA device (issue 51).

    python benchmarks/cuda_clip_check.py              # a CUDA device: a few seconds; exit 1 on any difference
    python benchmarks/cuda_clip_check.py --device cpu # the same checks on the CPU (tests/test_host_budget.py too)

1. ``coefficients``: for every norm of ``tests/test_host_budget.norms_to_check`` (float32 and float64: the whole
   range, its edges, and the 30 representable norms either side of each place a coefficient crosses 1) and each
   max_norm there, ``host_clip_coefficient`` against what ``clip_grad_norm_([p])`` takes on the device: the 2-norm
   of the one-element stack of the norm (``vector_norm(stack([norm]))``, one call per norm, as torch makes it),
   then ``max_norm / (total + 1e-6)`` clamped at 1, on the device. A NaN or Inf norm is left out: there the guard
   leaves the coefficient at 1 and reports the gradient (torch would multiply by 0 or NaN).
2. ``guard``: a guard's per-tensor ``clip_norm`` on a model on the device (float32 and bfloat16 parameters,
   gradients drawn at scales from 1e-3 to 1e3 so some clip and some do not), against ``clip_grad_norm_([p],
   max_norm)`` on each parameter of a copy: every gradient ``torch.equal``. For bfloat16 the reference takes the
   norm in float32 (``_foreach_norm(..., dtype=float32)``, then ``clip_grads_with_norm_``): the guard's documented
   difference (a finite half-precision gradient is never called infinite because its norm overflowed).
3. ``edges`` (recorded, not judged): what the device's reductions give for norms whose square overflows (the
   one-element stack torch's ``clip_grad_norm_([p])`` takes, a row-wise reduction over a size-1 dimension, and
   ``_foreach_norm``), and a guard's clip of gradients there (float32 elements of 1e20, float64 of 1e300) beside
   ``clip_grad_norm_([p])``'s.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from test_host_budget import MAX_NORMS, norms_to_check  # noqa: E402

from gradguard import GradGuard, Policy  # noqa: E402
from gradguard.enforce.work.tensors import host_clip_coefficient  # noqa: E402


def device_coefficients(norms: torch.Tensor, max_norm: float) -> tuple[list[float], list[float]]:
    """torch's total and coefficient for ``clip_grad_norm_([p])`` of each norm, on the norms' device."""
    totals = torch.stack([torch.linalg.vector_norm(torch.stack([norm]), 2.0) for norm in norms.unbind()])
    coefs = torch.clamp(max_norm / (totals + 1e-6), max=1.0)  # torch.nn.utils.clip_grads_with_norm_'s arithmetic
    return totals.tolist(), coefs.tolist()


def check_coefficients(device: torch.device) -> dict[str, object]:
    found: dict[str, object] = {}
    for dtype in (torch.float32, torch.float64):
        norms = norms_to_check(dtype)
        norms = norms[norms.isfinite()].to(device)
        values, wrong, clipped = norms.tolist(), [], 0
        for max_norm in MAX_NORMS:
            totals, coefs = device_coefficients(norms, max_norm)
            for norm, total, coef in zip(values, totals, coefs, strict=True):
                got_total, got_coef = host_clip_coefficient(norm, max_norm, dtype == torch.float32)
                same_total = got_total == total or (math.isnan(got_total) and math.isnan(total))
                if got_coef != coef or not same_total:
                    wrong.append([norm, max_norm, total, coef, got_total, got_coef])
                clipped += coef < 1.0
        found[str(dtype)] = {"norms": len(values), "max_norms": len(MAX_NORMS), "clipped": clipped, "wrong": wrong[:10]}
        found[f"{dtype}_wrong_count"] = len(wrong)
    return found


def check_guard(device: torch.device) -> dict[str, object]:
    found: dict[str, object] = {}
    policy = Policy.from_dict(
        {
            "version": 1,
            "rules": [
                {"name": "all", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
                {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.5}]},
            ],
        }
    )
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(50, 32), nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 50))
        model = model.to(device=device, dtype=dtype)
        ref = copy.deepcopy(model)
        cases, differing, clipped = 50, [], 0
        generator = torch.Generator().manual_seed(1)
        with GradGuard(model, policy, logger=None) as guard:
            for case in range(cases):
                for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                    scale = 10 ** (torch.rand((), generator=generator).item() * 6 - 3)
                    grad = (torch.randn(p.shape, generator=generator) * scale).to(device=device, dtype=dtype)
                    p.grad, q.grad = grad.clone(), grad.clone()
                guard.step()
                for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                    before = q.grad.clone()
                    if dtype == torch.float32:
                        torch.nn.utils.clip_grad_norm_([q], 0.5)
                    else:
                        norm = torch._foreach_norm([q.grad], 2, dtype=torch.float32)[0]
                        torch.nn.utils.clip_grads_with_norm_([q], 0.5, torch.linalg.vector_norm(torch.stack([norm])))
                    clipped += not torch.equal(before, q.grad)
                    if not torch.equal(p.grad, q.grad):
                        differing.append([case, name, (p.grad - q.grad).abs().max().item()])
        found[str(dtype)] = {"cases": cases, "tensors_clipped": clipped, "differing": differing[:10]}
        found[f"{dtype}_differing_count"] = len(differing)
    return found


def record_edges(device: torch.device) -> dict[str, object]:
    found: dict[str, object] = {}
    for dtype, values in ((torch.float32, (1.5 * 2.0**64, 1e36)), (torch.float64, (1.5 * 2.0**512, 1e300))):
        for value in values:
            one = torch.tensor(value, dtype=dtype, device=device)
            found[f"{dtype} {value:.3g}"] = {
                "stack_full": torch.linalg.vector_norm(torch.stack([one]), 2.0).item(),
                "reshape_1x1_dim1": torch.linalg.vector_norm(one.reshape(1, 1), 2.0, dim=1).item(),
                "rows_dim1": torch.linalg.vector_norm(
                    torch.stack([one, one / 2**40]).unsqueeze(1), 2.0, dim=1
                ).tolist(),
                "foreach_norm_1": torch._foreach_norm([one.reshape(1)])[0].item(),
                "vector_norm_1": torch.linalg.vector_norm(one.reshape(1)).item(),
            }
    policy = Policy.from_dict(
        {"version": 1, "rules": [{"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.5}]}]}
    )
    for dtype, element in (
        (torch.float32, 1e20),
        (torch.float32, 1e18),
        (torch.float64, 1e300),
        (torch.float64, 1e150),
    ):
        model = nn.Linear(4, 1, bias=False).to(device=device, dtype=dtype)
        ref = copy.deepcopy(model)
        grad = torch.tensor([[element, element / 3, 0.0, 1.0]], dtype=dtype, device=device)
        model.weight.grad, ref.weight.grad = grad.clone(), grad.clone()
        row: dict[str, object] = {}
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                with GradGuard(model, policy, logger=None) as guard:
                    guard.step()
            except Exception as error:  # recorded, this section judges nothing
                row["guard_error"] = f"{type(error).__name__}: {error}"[:300]
        row["warnings"] = [str(w.message)[:200] for w in seen]
        total = torch.nn.utils.clip_grad_norm_([ref.weight], 0.5)
        row.update(
            torch_total=total.item(),
            guard_grad=model.weight.grad.tolist(),
            torch_grad=ref.weight.grad.tolist(),
            equal=torch.equal(model.weight.grad, ref.weight.grad),
        )
        found[f"guard {dtype} {element:.3g}"] = row
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        return 0
    device = torch.device(args.device)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "coefficients": check_coefficients(device),
        "guard": check_guard(device),
        "edges": record_edges(device),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    bad = [
        key
        for part in ("coefficients", "guard")
        for key, value in result[part].items()
        if key.endswith("count") and value
    ]
    print("FAIL: " + ", ".join(bad) if bad else "PASS: every coefficient and every clipped gradient bitwise torch's")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
