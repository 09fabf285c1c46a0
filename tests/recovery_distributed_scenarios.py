"""Multi-process recovery scenarios for tests/test_recovery_distributed.py, run with real gloo process groups.

Run as ``python tests/recovery_distributed_scenarios.py SCENARIOS WORLD OUTDIR PORT`` (comma-separated
scenarios, WORLD processes spawned with torch.multiprocessing). Each scenario trains twice in the same
process group: a run whose NaN (on one rank only) turns into a rewind, and the reference run that never
trained on the undone batches. Every rank writes ``OUTDIR/SCENARIO/rank{r}.json``; the test compares them.
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from distributed_scenarios import batch  # tests/, this script's folder
from support.gloo_ranks import main
from torch import nn

from gradguard import GradGuard, Policy

STEPS = 40
FAULT = 23
"""The step whose gradient gets a NaN, on rank 1 only."""
SNAPSHOT_EVERY, KEEP, MIN_AGE, SKIP_STEPS = 5, 2, 3, 4
REWOUND_TO = 20
"""The newest snapshot at least MIN_AGE steps older than FAULT."""
SKIP_UNTIL = FAULT + SKIP_STEPS + 1
"""The first step applied again: the batches of REWOUND_TO .. SKIP_UNTIL - 1 are never learned from."""
REFERENCE_BATCHES = [*range(REWOUND_TO), *range(SKIP_UNTIL, STEPS)]

RULES: list[dict[str, Any]] = [
    {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
    {"name": "zclip", "match": "*", "actions": [{"action": "zclip", "max_norm": 5.0}]},
]
RECOVERY = {"snapshot_every": SNAPSHOT_EVERY, "keep": KEEP, "min_age": MIN_AGE, "skip_steps": SKIP_STEPS}


def make_model() -> nn.Module:
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(8, 16)
            self.body = nn.Linear(16, 5)  # 5 rows over 2 ranks under FSDP2: uneven shards (3 + 2)
            self.head = nn.Linear(5, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.head(torch.tanh(self.body(torch.tanh(self.embed(x)))))
            return out

    return Net()


def wrap(kind: str, model: nn.Module) -> nn.Module:
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as Ddp

        return Ddp(model)
    from torch.distributed.fsdp import fully_shard

    for module in (model.body, model.head):
        fully_shard(module)
    fully_shard(model)  # the root's own group holds embed's parameters, unsharded between forward and backward
    return model


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2), or the tensor itself."""
    out: torch.Tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return out.detach()


def local_state(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """A digest of what this rank holds: its parameters' shards and its optimizer state's shards, bit for bit."""
    sha = hashlib.sha256()
    for name, param in model.named_parameters():
        sha.update(name.encode())
        sha.update(local(param).contiguous().numpy().tobytes())
        for key, value in sorted(opt.state.get(param, {}).items()):
            sha.update(key.encode())
            data = local(value) if isinstance(value, torch.Tensor) else torch.tensor(value)
            sha.update(data.contiguous().numpy().tobytes())
    return sha.hexdigest()


def full_params(model: nn.Module) -> dict[str, str]:
    """Per parameter, the hex bytes of the full (gathered) tensor: a collective under FSDP2, made on every rank."""
    out = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[name.removeprefix("module.")] = full.detach().contiguous().numpy().tobytes().hex()
    return out


def guard_state(guard: GradGuard) -> dict[str, Any]:
    """What decides the guard's future steps, less the recovery bookkeeping (a rewind's own count)."""
    state = guard.state_dict()
    state.pop("recovery")
    return state


def train(kind: str, rank: int, outdir: Path, *, reference: bool, pass_steps: bool = False) -> dict[str, Any]:
    """40 steps of AdamW; with recovery a NaN on rank 1's gradient at FAULT; the reference skips the undone batches."""
    model = wrap(kind, make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    policy: dict[str, Any] = {"version": 1, "rules": RULES}
    if not reference:
        policy["recovery"] = RECOVERY
    log = outdir / f"audit-{'reference' if reference else 'recovery'}-rank{rank}.jsonl"
    result: dict[str, Any] = {"after_step": {}, "passed": [], "skipped": [], "fault_seconds": None}
    started_run = time.monotonic()
    with GradGuard(model, Policy.from_dict(policy), audit_log=log, logger=None) as guard:
        for step in REFERENCE_BATCHES if reference else range(STEPS):
            if reference and step == SKIP_UNTIL:
                state = guard.state_dict()
                state["step"] = SKIP_UNTIL  # the guard's step counts the loop's steps, undone ones included
                guard.load_state_dict(state)
            if pass_steps and guard.pass_step():
                result["passed"].append(step)
                continue
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if not reference and step == FAULT and rank == 1:
                param = next(p for name, p in model.named_parameters() if name.endswith("body.weight"))
                assert param.grad is not None
                local(param.grad).view(-1)[0] = float("nan")  # after DDP's all-reduce: rank 1 alone sees it
            started = time.monotonic()
            opt.step()  # a rewind, not a GradientHalt: the loop goes on
            if step == FAULT:
                result["fault_seconds"] = time.monotonic() - started
            if guard.last_step_skipped:
                result["skipped"].append(step)
            result["after_step"][str(step)] = local_state(model, opt)
        result["counters"] = guard.counters.snapshot()
        result["guard_state"] = guard_state(guard)
        result["guard_steps"] = guard.step_count
        result["metrics"] = guard.metrics()
    result["final_local"] = local_state(model, opt)
    result["final_full"] = full_params(model)
    result["events"] = [json.loads(line) for line in log.read_text().splitlines()]
    result["seconds"] = time.monotonic() - started_run
    return result


def scenario(name: str, rank: int, world: int, outdir: Path) -> dict[str, Any]:
    kind = "ddp" if name.startswith("ddp") else "fsdp2"
    recovered = train(kind, rank, outdir, reference=False, pass_steps=name.endswith("pass_step"))
    gc.collect()
    dist.barrier()
    reference = train(kind, rank, outdir, reference=True)
    return {"rank": rank, "recovery": recovered, "reference": reference}


if __name__ == "__main__":
    main(scenario, sys.argv[1:])
