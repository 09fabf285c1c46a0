"""Multi-process scenarios for tests/test_distributed.py, run with real gloo process groups.

Run as ``python tests/distributed_scenarios.py SCENARIO WORLD OUTDIR`` (spawns WORLD processes with
torch.multiprocessing), or under torchrun with ``--torchrun`` (one process per rank, env:// init).
Every rank writes ``OUTDIR/rank{r}.json``; the test compares the ranks' results.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from support.gloo_ranks import main
from torch import nn

from gradguard import GradGuard, GradientHalt, Policy

STEPS = 5
BAD_STEP = 2


def digest(model: nn.Module) -> str:
    sha = hashlib.sha256()
    for _, tensor in sorted(model.state_dict().items()):
        local = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        sha.update(local.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()


def final_params(model: nn.Module) -> dict[str, list[float]]:
    out = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[name.removeprefix("module.")] = full.detach().reshape(-1).tolist()
    return out


def make_model(seed: int = 0, unused: bool = False) -> nn.Module:
    torch.manual_seed(seed)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(8, 16)
            self.body = nn.Linear(16, 16)
            self.head = nn.Linear(16, 4)
            self.unused = nn.Linear(16, 16) if unused else None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.head(torch.tanh(self.body(torch.tanh(self.embed(x)))))
            return out

    return Net()


def batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 100 * rank + micro)
    x = torch.randn(6, 8, generator=generator) * 3
    y = torch.randn(6, 4, generator=generator)
    return x, y


POLICY = {
    "version": 1,
    "rules": [
        {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
        {"name": "embed", "match": "embed.*", "actions": [{"action": "clip_norm", "max_norm": 0.05}]},
        {
            "name": "rest",
            "match": "*",
            "exclude": "embed.*",
            "actions": [{"action": "clip_norm", "max_norm": 0.1, "scope": "group"}],
        },
    ],
}

SKIP_POLICY = {
    "version": 1,
    "rules": [
        {"name": "nonfinite", "match": "*", "actions": [{"action": "skip_step_on_nonfinite"}]},
        {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.1}]},
    ],
}


LOSS_POLICY = {**POLICY, "loss": {"spike": {"factor": 10, "window": 4, "warmup": 2}}}
"""The loss section: a 50x loss on rank 1 alone at BAD_STEP spikes the ranks' mean loss (25.5x)."""


def train(
    rank: int,
    world: int,
    model: nn.Module,
    policy: dict[str, Any],
    outdir: Path,
    inject: Callable[[nn.Module, int], None] | None = None,
    micro_batches: int = 1,
    loss_factor: Callable[[int, int], float] = lambda rank, step: 1.0,
) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    result: dict[str, Any] = {"rank": rank, "digests": [], "halt": None, "skipped": []}
    log = outdir / f"audit-rank{rank}.jsonl"
    with GradGuard(model, Policy.from_dict(policy), audit_log=log, logger=None) as guard:
        for step in range(STEPS):
            opt.zero_grad()
            for micro in range(micro_batches):
                x, y = batch(rank, step, micro)
                last = micro == micro_batches - 1
                context = model.no_sync() if (not last and hasattr(model, "no_sync")) else contextlib.nullcontext()
                with context:
                    loss = nn.functional.mse_loss(model(x), y) * loss_factor(rank, step) / micro_batches
                    loss.backward()
            if inject is not None:
                inject(model, step)
            before = digest(model)
            started = time.monotonic()
            try:
                opt.step()
            except GradientHalt as exc:
                result["halt"] = {
                    "step": exc.step,
                    "params": list(exc.params),
                    "kind": exc.kind,
                    "seconds": time.monotonic() - started,
                    "unchanged": digest(model) == before,
                }
                break
            if guard.last_step_skipped:
                result["skipped"].append({"step": step, "unchanged": digest(model) == before})
            result["digests"].append(digest(model))
        result["counters"] = guard.counters.snapshot()
    result["final"] = final_params(model)
    result["log_ranks"] = sorted({json.loads(line)["rank"] for line in log.read_text().splitlines()})
    return result


def rerun_one_rank(rank: int, model: nn.Module, outdir: Path, fault: str = "loss") -> dict[str, Any]:
    """optimizer.step(closure) under a policy with a rerun section; at BAD_STEP rank 1's first computation is NaN:
    its loss (``loss``), or its own piece of ``body.weight``'s gradient after the backward (``grad``: under FSDP2
    its shard, which no reduction reaches), or that piece in both computations (``grad_again``)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    policy = {**POLICY, "rerun": {}}
    log = outdir / f"audit-rank{rank}.jsonl"
    result: dict[str, Any] = {"rank": rank, "halt": None}
    with GradGuard(model, Policy.from_dict(policy), audit_log=log, logger=None) as guard:
        try:
            for step in range(STEPS):
                calls = [0]

                def closure(step: int = step, calls: list[int] = calls) -> torch.Tensor:
                    calls[0] += 1
                    x, y = batch(rank, step)
                    opt.zero_grad()
                    loss = nn.functional.mse_loss(model(x), y)
                    if step == BAD_STEP and rank == 1 and calls[0] == 1 and fault == "loss":
                        loss = loss * float("nan")
                    loss.backward()
                    if fault == "grad_again" or (fault == "grad" and calls[0] == 1):
                        nan_on_rank_one_grad(model, step)
                    return loss

                opt.step(closure)
        except GradientHalt as halt:
            result["halt"] = {"step": halt.step, "kind": halt.kind, "rule": halt.rule, "params": list(halt.params)}
        result["counters"] = guard.counters.snapshot()
        result["steps"] = guard.step_count
    result["final"] = final_params(model)
    result["reruns"] = [e for line in log.read_text().splitlines() if (e := json.loads(line))["event"] == "rerun"]
    return result


def spike_on_rank_one(rank: int, step: int) -> float:
    return 50.0 if step == BAD_STEP and rank == 1 else 1.0


def nan_on_rank_one_grad(model: nn.Module, step: int) -> None:
    if step == BAD_STEP and dist.get_rank() == 1:
        param = next(p for name, p in model.named_parameters() if name.endswith("body.weight"))
        assert param.grad is not None
        local = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        local.view(-1)[0] = float("nan")


def inf_on_rank_zero_grad(model: nn.Module, step: int) -> None:
    if step == BAD_STEP and dist.get_rank() == 0:
        param = next(p for name, p in model.named_parameters() if name.endswith("head.weight"))
        assert param.grad is not None
        param.grad.view(-1)[0] = float("inf")


RERUNS = {"fsdp2_rerun_transient_one_rank": "grad", "fsdp2_rerun_reproducible_one_rank": "grad_again"}
"""The rerun section under FSDP2: a NaN in rank 1's shard, made in the first computation only, or in both."""


def scenario(name: str, rank: int, world: int, outdir: Path) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as Ddp

    if name == "ddp_clip":
        return train(rank, world, Ddp(make_model()), POLICY, outdir)
    if name == "ddp_no_sync":
        return train(rank, world, Ddp(make_model()), POLICY, outdir, micro_batches=3)
    if name == "ddp_unused":
        model = Ddp(make_model(unused=True), find_unused_parameters=True)
        policy = {**POLICY, "rules": [*POLICY["rules"]]}
        return train(rank, world, model, policy, outdir)
    if name == "ddp_nan_one_rank":
        return train(rank, world, Ddp(make_model()), POLICY, outdir, inject=nan_on_rank_one_grad)
    if name == "ddp_skip_one_rank":
        return train(rank, world, Ddp(make_model()), SKIP_POLICY, outdir, inject=inf_on_rank_zero_grad)
    if name == "ddp_rerun_transient_one_rank":
        return rerun_one_rank(rank, Ddp(make_model()), outdir)
    if name == "ddp_loss_spike_one_rank":
        return train(rank, world, Ddp(make_model()), LOSS_POLICY, outdir, loss_factor=spike_on_rank_one)
    if name == "ddp_metrics":
        return ddp_metrics(rank, Ddp(make_model()))
    if name == "ddp_provenance":
        return ddp_provenance(rank, Ddp(make_model()), outdir)
    if name in {"fsdp2_clip", "fsdp2_nan_one_rank", "fsdp2_attach_before_shard", "fsdp2_loss_spike_one_rank", *RERUNS}:
        from torch.distributed.fsdp import fully_shard

        model = make_model()
        if name == "fsdp2_attach_before_shard":
            return fsdp_attach_before_shard(rank, world, model, outdir)
        for module in (model.embed, model.body, model.head):
            fully_shard(module)
        fully_shard(model)
        if name in RERUNS:
            return rerun_one_rank(rank, model, outdir, RERUNS[name])
        inject = nan_on_rank_one_grad if name == "fsdp2_nan_one_rank" else None
        if name == "fsdp2_loss_spike_one_rank":
            return train(rank, world, model, LOSS_POLICY, outdir, loss_factor=spike_on_rank_one)
        return train(rank, world, model, POLICY, outdir, inject=inject)
    if name.startswith("attach_"):
        return attach(name, rank, make_model())
    if name == "ddp_agreement":
        return ddp_agreement(rank, world)
    if name.startswith("adaptive_"):
        import adaptive_scenarios  # tests/, the script's own folder

        return adaptive_scenarios.run(name, rank, world, outdir, make_model, batch)
    raise SystemExit(f"unknown scenario {name!r}")


# Does DDP's all-reduce carry a NaN or Inf on one rank's gradient to every rank? Values are injected
# by a tensor hook on ``body.weight``, before the gradient is accumulated (so before DDP's reducer
# sees it), on the ranks named; "after" injects into ``.grad`` once backward has returned, as a
# user's own code between backward and step would.
AGREEMENT_INJECTIONS: dict[str, dict[int, float]] = {
    "nan": {1: float("nan")},
    "+inf": {1: float("inf")},
    "-inf": {1: float("-inf")},
    "+inf/-inf": {0: float("inf"), 1: float("-inf")},
    "1e5": {1: 1e5},  # finite in fp32, past fp16's largest finite value (65504)
}
AGREEMENT_CONFIGS = [
    "default",
    "gradient_as_bucket_view",
    "static_graph",
    "find_unused_parameters",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "powerSGD_hook",
    "no_sync_inside",
    "no_sync_after_sync",
    "after_allreduce",
]


def grad_flags(model: nn.Module) -> dict[str, Any]:
    """Per parameter: None (no gradient) or [has NaN, has Inf]."""
    out: dict[str, Any] = {}
    for name, param in model.named_parameters():
        grad = param.grad
        key = name.removeprefix("module.")
        out[key] = None if grad is None else [bool(grad.isnan().any()), bool(grad.isinf().any())]
    return out


def ddp_agreement(rank: int, world: int) -> dict[str, Any]:
    """Every (DDP option or comm hook) x injection: each rank's per-parameter NaN/Inf flags after backward."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as Ddp

    flags: dict[str, dict[str, Any]] = {}
    for config in AGREEMENT_CONFIGS:
        for injection, values in AGREEMENT_INJECTIONS.items():
            options: dict[str, Any] = {}
            if config in {"gradient_as_bucket_view", "static_graph", "find_unused_parameters"}:
                options[config] = True
            model = Ddp(make_model(unused=config == "find_unused_parameters"), **options)
            warmup = 0
            if config == "fp16_compress_hook":
                model.register_comm_hook(None, default_hooks.fp16_compress_hook)
            elif config == "bf16_compress_hook":
                try:
                    model.register_comm_hook(None, default_hooks.bf16_compress_hook)
                except TypeError:  # needs NCCL 2.10+ on CUDA (or XCCL): not on gloo
                    flags[config] = {"unavailable": None}
                    del model
                    gc.collect()
                    break
            elif config == "powerSGD_hook":
                state = powerSGD_hook.PowerSGDState(
                    process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
                )
                model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
                warmup = 3  # past start_powerSGD_iter: the gradients are compressed, not all-reduced
            for step in range(warmup):
                model.zero_grad()
                x, y = batch(rank, step)
                nn.functional.mse_loss(model(x), y).backward()
            model.zero_grad(set_to_none=True)
            target = model.module.body.weight
            value = values.get(rank)

            def inject(grad: torch.Tensor, value: float | None = value) -> torch.Tensor:
                if value is None:
                    return grad
                grad = grad.clone()
                grad.view(-1)[0] = value
                return grad

            x, y = batch(rank, 10)
            if config.startswith("no_sync"):
                handle = target.register_hook(inject)
                with model.no_sync():
                    nn.functional.mse_loss(model(x), y).backward()
                handle.remove()
                if config == "no_sync_after_sync":
                    x2, y2 = batch(rank, 10, micro=1)
                    nn.functional.mse_loss(model(x2), y2).backward()
            elif config == "after_allreduce":
                nn.functional.mse_loss(model(x), y).backward()
                if value is not None:
                    assert target.grad is not None
                    target.grad.view(-1)[0] = value
            else:
                handle = target.register_hook(inject)
                nn.functional.mse_loss(model(x), y).backward()
                handle.remove()
            flags.setdefault(config, {})[injection] = grad_flags(model)
            del model
            gc.collect()
    return {"rank": rank, "flags": flags}


ATTACH_TIMEOUT = 3.0
FAILING_ATTACH_TIMEOUT = 20.0
"""attach_fails_on_one_rank's: the other rank must hear of the failure well before it."""


def attach(name: str, rank: int, model: nn.Module) -> dict[str, Any]:
    """Attach a guard on every rank (or not): whether it attached, the error it raised, and how long it took."""
    policy = POLICY
    if name == "attach_policy_differs" and rank == 1:
        extra = {"name": "extra", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}
        policy = {**POLICY, "rules": [*POLICY["rules"], extra]}
    if name == "attach_params_differ" and rank == 1:
        model.extra = nn.Linear(2, 2)
    if name == "attach_fails_on_one_rank" and rank == 0:  # its binding raises PolicyError, before any agreement
        nowhere = {"name": "nowhere", "match": "decoder.*", "actions": [{"action": "clip_norm", "max_norm": 1.0}]}
        policy = {**POLICY, "rules": [*POLICY["rules"], nowhere]}
    result: dict[str, Any] = {"rank": rank, "attached": False, "error": None}
    if name == "attach_missing_rank" and rank == 1:
        return result  # this rank never attaches: the other must say so within the timeout
    timeout = FAILING_ATTACH_TIMEOUT if name == "attach_fails_on_one_rank" else ATTACH_TIMEOUT
    started = time.monotonic()
    try:
        guard = GradGuard(model, Policy.from_dict(policy), logger=None, attach_timeout=timeout)
    except Exception as exc:  # the test asserts the type and the message
        result["error"] = {
            "type": type(exc).__name__,
            "message": str(exc),
            "failed_rank": getattr(exc, "failed_rank", None),
        }
    else:
        result["attached"] = True
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = batch(rank, 0)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        result["steps"] = guard.step_count
        guard.remove()
    result["seconds"] = time.monotonic() - started
    return result


def ddp_metrics(rank: int, model: nn.Module) -> dict[str, Any]:
    """Each rank serves its own live metrics (metrics_port=0) and scrapes them after a skipped step."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return {"rank": rank, "metrics": None}
    import urllib.request

    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with GradGuard(model, Policy.from_dict(SKIP_POLICY), logger=None, metrics_port=0) as guard:
        for step in range(STEPS):
            opt.zero_grad()
            x, y = batch(rank, step)
            nn.functional.mse_loss(model(x), y).backward()
            inf_on_rank_zero_grad(model, step)
            opt.step()
        url = guard.metrics_url
        assert url is not None
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode("utf-8")
        return {"rank": rank, "url": url, "metrics": text, "counters": guard.counters.snapshot(), "steps": STEPS}


def ddp_provenance(rank: int, model: nn.Module, outdir: Path) -> dict[str, Any]:
    """A NaN in rank 1's input batch: every rank halts, each with its own origin (rank 1: its data)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = outdir / f"audit-rank{rank}.jsonl"
    result: dict[str, Any] = {"rank": rank, "origin": None, "halt_step": None}
    with GradGuard(model, Policy.from_dict(POLICY), audit_log=log, logger=None, provenance="always"):
        for step in range(STEPS):
            x, y = batch(rank, step)
            if step == BAD_STEP and rank == 1:
                x[0, 0] = float("nan")
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            try:
                opt.step()
            except GradientHalt as exc:
                result["origin"], result["halt_step"] = exc.origin, exc.step
                break
    return result


def fsdp_attach_before_shard(rank: int, world: int, model: nn.Module, outdir: Path) -> dict[str, Any]:
    """Attach first, shard after: the guard must re-bind to the DTensor parameters, not go quiet."""
    from torch.distributed.fsdp import fully_shard

    guard = GradGuard(model, Policy.from_dict(POLICY), audit_log=outdir / f"early-rank{rank}.jsonl", logger=None)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = batch(rank, 0)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    guard.remove()
    events = [json.loads(line) for line in (outdir / f"early-rank{rank}.jsonl").read_text().splitlines()]
    return {
        "rank": rank,
        "events": [event["event"] for event in events],
        "counters": guard.counters.snapshot(),
        "digests": [digest(model)],
        "halt": None,
        "skipped": [],
    }


if __name__ == "__main__":
    main(scenario, sys.argv[1:])
