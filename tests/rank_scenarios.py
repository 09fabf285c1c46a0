"""Multi-process scenarios for tests/test_which_rank.py: which rank made a fault, outliers, replicas, failures.

Run as ``python tests/rank_scenarios.py NAMES WORLD OUTDIR PORT`` (real gloo ranks, ``support.gloo_ranks``). Every
rank writes ``OUTDIR/NAME/rank{r}.json``. The failure scenarios end their process themselves (``os._exit``) after
writing their result: a rank that stopped in the middle of the guard's collective leaves the group unusable.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import socket
import sys
import time
import urllib.request
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from support.gloo_ranks import failure_record, keep_failure, main
from torch import nn
from torch.nn.parallel import DistributedDataParallel as Ddp

from gradguard import GradGuard, GradientHalt, GuardStateError, GuardWarning, Policy
from gradguard.enforce.step.participants import registered
from gradguard.enforce.work.participant import Participant
from gradguard.enforce.work.step_work import StepWork

STEPS = 6
BAD_STEP = 3
HOST = socket.gethostname()

HALT_AND_CLIP = {
    "version": 1,
    "rules": [
        {
            "name": "guard",
            "match": "*",
            "actions": [{"action": "halt_on_nonfinite"}, {"action": "clip_norm", "max_norm": 1.0}],
        }
    ],
}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 100 * rank + micro)
    return torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)


def digest(model: nn.Module) -> str:
    sha = hashlib.sha256()
    for _, tensor in sorted(model.state_dict().items()):
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        sha.update(full.detach().contiguous().numpy().tobytes())
    return sha.hexdigest()


Poison = Callable[[int, int, int], float | None]
"""(rank, step, micro) -> a factor the rank's own gradient of ``2.weight`` is multiplied by in backward, or None."""


def train(
    rank: int,
    outdir: Path,
    policy: Any,
    poison: Poison = lambda rank, step, micro: None,
    *,
    micro_batches: int = 1,
    after_backward: Callable[[nn.Module, int], None] | None = None,
    before_step: Callable[[nn.Module, int], None] | None = None,
    guarded: bool = True,
    provenance: str | None = "first_fault",
    fsdp2: bool = False,
    metrics: bool = False,
    comm_hook: str | None = None,
) -> dict[str, Any]:
    """A DDP loop as nanoGPT's: accumulation under no_sync, the loop's own clip, then step (or the same under
    FSDP2: each Linear and the model sharded)."""
    if fsdp2:
        from torch.distributed.fsdp import fully_shard

        inner = make_model()
        for layer in inner:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        ddp = fully_shard(inner)
    else:
        ddp = Ddp(make_model())
        inner = ddp.module
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    if comm_hook == "before":  # the user's own communication hook, registered before the guard attaches
        ddp.register_comm_hook(None, allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    where = {"step": 0, "micro": 0}

    def hook(grad: torch.Tensor) -> torch.Tensor:
        factor = poison(rank, where["step"], where["micro"])
        return grad if factor is None else grad * factor

    if fsdp2:  # a sharded parameter's own hooks never fire: the gradient handed back to the layer, on this rank

        def module_hook(module: nn.Module, grad_output: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            return (hook(grad_output[0]),)

        inner[2].register_full_backward_pre_hook(module_hook)
    else:
        inner[2].weight.register_hook(hook)  # the rank's own backward: before DDP's reduction
    log = outdir / f"audit-rank{rank}.jsonl"
    result: dict[str, Any] = {"rank": rank, "halt": None, "warnings": [], "steps": 0}
    if isinstance(policy, dict):
        policy = Policy.from_dict(policy)
    served = {"metrics_port": 0} if metrics else {}
    guard_context = (
        GradGuard(ddp, policy, audit_log=log, logger=None, provenance=provenance, **served)
        if guarded
        else contextlib.nullcontext()
    )
    with warnings.catch_warnings(record=True) as caught, guard_context as guard:
        warnings.simplefilter("always", GuardWarning)
        if comm_hook == "after":  # registered after the guard: it runs inside the guard's tap
            ddp.register_comm_hook(None, allreduce_hook)
        for step in range(STEPS):
            where["step"] = step
            if before_step is not None:
                before_step(inner, step)
            opt.zero_grad()
            for micro in range(micro_batches):
                where["micro"] = micro
                x, y = batch(rank, step, micro)
                last = micro == micro_batches - 1
                if fsdp2:
                    ddp.set_requires_gradient_sync(last)
                with contextlib.nullcontext() if last or fsdp2 else ddp.no_sync():
                    (nn.functional.mse_loss(ddp(x), y) / micro_batches).backward()
            if after_backward is not None:
                after_backward(inner, step)
            before = digest(inner)
            try:
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
                opt.step()
            except GradientHalt as halt:
                result["halt"] = {
                    "step": halt.step,
                    "params": list(halt.params),
                    "kind": halt.kind,
                    "ranks": {str(r): h for r, h in halt.ranks.items()},
                    "message": str(halt),
                    "origin": halt.origin,
                    "unchanged": digest(inner) == before,
                }
                if metrics:
                    with urllib.request.urlopen(guard.metrics_url, timeout=30) as response:
                        text = response.read().decode()
                    result["scraped"] = [line for line in text.splitlines() if line.startswith("gradguard_faults")]
                break
            result["steps"] = step + 1
        if guard is not None:
            result["counters"] = guard.counters.snapshot()
    if guard is not None:  # removed: DDP keeps the guard's communication hook, which must hold nothing more
        for _ in range(2):
            x, y = batch(rank, STEPS)
            nn.functional.mse_loss(ddp(x), y).backward()
        result["notes_after_removal"] = guard._enforcer.collective.local.held
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, GuardWarning)]
    result["digest"] = digest(inner)
    if guarded:
        result["events"] = [json.loads(line) for line in log.read_text().splitlines()]
    return result


def nan_on(*ranks: int, micro: int = 0) -> Poison:
    return lambda rank, step, at: math.nan if rank in ranks and step == BAD_STEP and at == micro else None


def nan_after_reduction(model: nn.Module, step: int) -> None:
    if step == BAD_STEP and dist.get_rank() == 1:
        grad = model[2].weight.grad
        assert grad is not None
        grad.view(-1)[0] = float("nan")


def nan_after_reduction_everywhere(model: nn.Module, step: int) -> None:
    """Every rank's reduced gradient made NaN after the reduction (code every rank runs): no rank to name."""
    if step == BAD_STEP:
        grad = model[2].weight.grad
        assert grad is not None
        grad.view(-1)[0] = float("nan")


def one_ulp_on_rank_two(model: nn.Module, step: int) -> None:
    """Before step 3's forward, rank 2's ``4.bias`` moves by one ulp: the replicas differ from then on."""
    if step == BAD_STEP and dist.get_rank() == 2:
        with torch.no_grad():
            bias = model[4].bias
            bias[0] = torch.nextafter(bias[0], torch.tensor(math.inf))


class FailsOnRankOne(Participant):
    """Raises inside the guard's step, on rank 1 only, at BAD_STEP: before the step's collective."""

    def before_figures(self, work: StepWork, context: Any) -> None:
        if work.step == BAD_STEP and dist.get_rank() == 1:
            raise ValueError("the device returned garbage")


def failure(rank: int, outdir: Path, *, exits: bool) -> dict[str, Any]:
    """Rank 1's step raises; every rank must raise GuardStateError naming it, within seconds, not at the timeout."""
    result: dict[str, Any] = {"rank": rank, "error": None}
    started = time.monotonic()
    with registered("fails_on_rank_one", lambda parts: FailsOnRankOne()):
        ddp = Ddp(make_model())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        guard = GradGuard(
            ddp, Policy.from_dict(HALT_AND_CLIP), audit_log=outdir / f"audit-rank{rank}.jsonl", logger=None
        )
        try:
            for step in range(STEPS):
                opt.zero_grad()
                x, y = batch(rank, step)
                nn.functional.mse_loss(ddp(x), y).backward()
                started = time.monotonic()
                opt.step()
        except GuardStateError as error:
            result["error"] = failure_record(error, started)
        result["steps"] = guard.step_count  # the guard stays referenced (and attached) until here
    keep_failure(result, outdir / f"audit-rank{rank}.jsonl", outdir, rank)
    if exits or rank != 1:
        os._exit(0)  # the group is unusable now: no barrier, no clean leave
    time.sleep(3)  # the failed rank lives on (a loop that catches to save a checkpoint) while the others stop
    os._exit(0)


MONITOR = {
    "version": 1,
    "rules": [{"name": "watch", "match": "*", "actions": [{"action": "monitor", "stats": ["mean", "std", "norm"]}]}],
}


def fsdp2_monitor(rank: int, outdir: Path) -> dict[str, Any]:
    """FSDP2: the monitor's mean and std of each gradient, beside the same figures of the whole (gathered) gradient
    taken in float64 by hand."""
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = outdir / f"audit-rank{rank}.jsonl"
    expected: dict[str, dict[str, float]] = {"mean": {}, "std": {}}
    with GradGuard(model, Policy.from_dict(MONITOR), audit_log=log, logger=None):
        x, y = batch(rank, 0)
        nn.functional.mse_loss(model(x), y).backward()
        for name, param in model.named_parameters():
            whole = param.grad.full_tensor().double()  # type: ignore[union-attr]
            expected["mean"][name], expected["std"][name] = whole.mean().item(), whole.std().item()
        opt.step()
    events = [json.loads(line) for line in log.read_text().splitlines()]
    (stats,) = [event for event in events if event["event"] == "stats"]
    return {"rank": rank, "expected": expected, "figures": stats["figures"]}


def outlier_unseen() -> dict[str, Any]:
    """``outlier_factor`` on a model that is neither DDP- nor FSDP2-wrapped: no rank's own gradient can be seen, so
    the check could never fire; refused at attach on every rank."""
    policy = Policy.from_dict({**HALT_AND_CLIP, "ranks": {"outlier_factor": 10}})
    try:
        GradGuard(nn.Linear(4, 4), policy, logger=None).remove()
    except GuardStateError as error:
        return {"error": str(error)}
    return {"error": None}


def scenario(name: str, rank: int, world: int, outdir: Path) -> dict[str, Any]:
    nan_at_two = nan_on(2)
    if name == "nan_one_rank":  # the shipped default policy, nothing else asked for
        return train(rank, outdir, "default", nan_at_two, metrics=True)
    if name == "nan_user_hook_before":
        return train(rank, outdir, "default", nan_at_two, comm_hook="before")
    if name == "nan_user_hook_after":
        return train(rank, outdir, "default", nan_at_two, comm_hook="after")
    if name == "nan_one_rank_always":
        return train(rank, outdir, "default", nan_at_two, provenance="always")
    if name == "nan_one_rank_untraced":
        return train(rank, outdir, "default", nan_at_two, provenance=None)
    if name == "nan_two_ranks":
        return train(rank, outdir, "default", nan_on(1, 2))
    if name == "nan_after_reduction":
        return train(rank, outdir, "default", after_backward=nan_after_reduction)
    if name == "nan_after_reduction_everywhere":
        return train(rank, outdir, "default", after_backward=nan_after_reduction_everywhere)
    if name == "nan_first_micro_batch":
        return train(rank, outdir, "default", nan_on(1, micro=0), micro_batches=2)
    if name == "fsdp2_nan_one_rank":
        return train(rank, outdir, "default", nan_on(1), fsdp2=True)
    if name == "fsdp2_nan_first_micro_batch":
        return train(rank, outdir, "default", nan_on(0, micro=0), fsdp2=True, micro_batches=2)
    if name == "fsdp2_outlier":
        policy = {**HALT_AND_CLIP, "ranks": {"outlier_factor": 10, "on_outlier": "skip"}}
        big: Poison = lambda r, step, micro: 1e4 if r == 1 and step == BAD_STEP else None  # noqa: E731
        return train(rank, outdir, policy, big, fsdp2=True)
    if name == "fsdp2_monitor":
        return fsdp2_monitor(rank, outdir)
    if name == "outlier":
        policy = {**HALT_AND_CLIP, "ranks": {"outlier_factor": 10, "on_outlier": "halt"}}
        big: Poison = lambda r, step, micro: 1e4 if r == 1 and step == BAD_STEP else None  # noqa: E731
        return train(rank, outdir, policy, big)
    if name == "drift":
        policy = {**HALT_AND_CLIP, "ranks": {"check_replicas_every": 2}}
        return train(rank, outdir, policy, before_step=one_ulp_on_rank_two)
    if name == "clean_every_check":
        policy = {**HALT_AND_CLIP, "ranks": {"check_replicas_every": 1, "outlier_factor": 10}}
        return train(rank, outdir, policy)
    if name == "outlier_unseen":
        return outlier_unseen()
    if name == "unguarded":
        return train(rank, outdir, None, guarded=False)
    if name == "quiet_guard":
        return train(rank, outdir, "default")
    if name == "failure_lives_on":
        return failure(rank, outdir, exits=False)
    if name == "failure_exits":
        return failure(rank, outdir, exits=True)
    raise ValueError(name)


if __name__ == "__main__":
    main(scenario, sys.argv[1:])
