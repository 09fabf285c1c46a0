"""On a GPU: gradguard adds no host sync to backward, and exactly one to the optimizer step.

    python benchmarks/cuda_sync_check.py            # needs CUDA; without it, says so and exits 0
    python benchmarks/cuda_sync_check.py --require  # exit 1 when there is no CUDA device

Test-style checks on the benchmark's GPT model (``step_overhead.decoder_workload``), each printed as
PASS or FAIL (exit status 1 if any fails):

1. ``loss.backward()`` with gradguard attached runs under ``torch.cuda.set_sync_debug_mode("error")``
   (any synchronizing CUDA call raises). If torch's own backward of the model syncs (it does not in
   the versions we know of, but e.g. an embedding backward could), the check falls back to comparing
   the number of synchronizing calls with and without the guard, which must be equal.
2. The control: the same backward with a per-parameter ``.item()`` hook is caught (so 1 has teeth).
3. Under ``set_sync_debug_mode("warn")``, a whole training step with gradguard (a) (per-tensor clip +
   halt) and with the mixed policy (b) makes exactly one synchronizing call more than the same step
   without the guard.
4. A NaN gradient still halts the step, before the optimizer touches the weights.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_overhead import (
    MIXED_POLICY,
    ItemHook,
    Workload,
    decoder_workload,
    per_tensor_policy,
)

from gradguard import GradGuard, GradientHalt, Policy


@contextmanager
def sync_debug(mode: str) -> Iterator[list[warnings.WarningMessage]]:
    """``torch.cuda.set_sync_debug_mode(mode)`` for the block; the warnings it raised (mode "warn")."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _synchronizing(caught: list[warnings.WarningMessage]) -> int:
    return sum(1 for w in caught if "synchronizing" in str(w.message).lower())


def backward_syncs(work: Workload) -> tuple[bool, int]:
    """Whether backward ran under mode "error", and how many synchronizing calls mode "warn" saw."""
    work.opt.zero_grad(set_to_none=True)
    loss = work.loss()
    torch.cuda.synchronize()
    try:
        with sync_debug("error"):
            loss.backward()  # type: ignore[no-untyped-call]
        clean = True
    except RuntimeError:
        clean = False
    work.opt.zero_grad(set_to_none=True)
    loss = work.loss()
    torch.cuda.synchronize()
    with sync_debug("warn") as caught:
        loss.backward()  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()
    return clean, _synchronizing(caught)


def step_syncs(work: Workload) -> int:
    """Synchronizing calls in one whole training step (forward, backward, optimizer step)."""
    work.opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    with sync_debug("warn") as caught:
        work.loss().backward()  # type: ignore[no-untyped-call]
        work.opt.step()
    torch.cuda.synchronize()
    return _synchronizing(caught)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--require", action="store_true", help="fail (exit 1) when no CUDA device is available")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_sync_check: skipped, no CUDA device is available")
        return 1 if args.require else 0

    device = torch.device("cuda")
    work = decoder_workload("gpt", device, vocab=8192, width=384, depth=6, heads=6, batch=8, length=128)
    for _ in range(2):  # warm up kernels, the allocator and AdamW's state
        step_syncs(work)
    failures: list[str] = []

    def check(name: str, ok: bool, detail: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
        if not ok:
            failures.append(name)

    base_clean, base_count = backward_syncs(work)
    base_step = step_syncs(work)
    print(
        f"info  torch alone: backward {'has no' if base_clean else 'HAS'} sync ({base_count} seen in mode warn); "
        f"{base_step} synchronizing call(s) in a whole step"
    )

    policies: dict[str, Callable[[], Policy]] = {
        "gradguard (a)": lambda: per_tensor_policy(1.0),
        "gradguard (b)": lambda: Policy.from_dict(MIXED_POLICY, source="mixed"),
    }
    for label, policy in policies.items():
        with GradGuard(work.model, policy(), logger=None):
            step_syncs(work)  # the guard's first step builds its plan
            clean, count = backward_syncs(work)
            if base_clean:
                check(f"{label}: backward under sync debug mode 'error'", clean, "no synchronizing call")
            else:
                check(
                    f"{label}: backward syncs no more than torch's own", count == base_count, f"{count} vs {base_count}"
                )
            extra = step_syncs(work) - base_step
            check(f"{label}: one host sync per step", extra == 1, f"{extra} synchronizing call(s) more than without it")

    hook = ItemHook()
    hook.setup(work, Path("."))
    try:
        clean, count = backward_syncs(work)
    finally:
        hook.teardown(work)
    check("control: the .item() hook is caught in backward", not clean and count > 0, f"{count} synchronizing calls")

    with GradGuard(work.model, per_tensor_policy(1.0), logger=None):
        step_syncs(work)
        before = [p.detach().clone() for p in work.model.parameters()]
        work.opt.zero_grad(set_to_none=True)
        work.loss().backward()  # type: ignore[no-untyped-call]
        first = next(p for p in work.model.parameters() if p.grad is not None)
        assert first.grad is not None
        first.grad.view(-1)[0] = float("nan")
        try:
            work.opt.step()
            halted = False
        except GradientHalt:
            halted = True
        untouched = all(torch.equal(a, b) for a, b in zip(before, work.model.parameters(), strict=True))
        check("a NaN halts before the update", halted and untouched, f"halted={halted}, weights unchanged={untouched}")

    print("cuda_sync_check: " + ("all checks passed" if not failures else f"{len(failures)} check(s) failed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
