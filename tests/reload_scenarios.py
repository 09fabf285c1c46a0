"""Hot reload under a real gloo process group, for tests/test_distributed_reload.py (as distributed_scenarios.py).

Run as ``python tests/reload_scenarios.py SCENARIO WORLD OUTDIR PORT``. Every rank guards a DDP model
with ``reload=True`` on a policy file in OUTDIR that rank 0 rewrites between steps (atomically); the
ranks poll it at different intervals (or one only reloads on demand, later), so they notice it at
different times, and must still switch at the same step. Each rank writes ``OUTDIR/SCENARIO/rank{r}.json``:
its digests after every step and the ``policy_reload`` / ``policy_reload_failed`` events of its audit log.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from distributed_scenarios import batch, digest, make_model
from support.gloo_ranks import main

from gradguard import GradGuard

STEPS = 30
STEP_SECONDS = 0.03
INTERVALS = {"reload_switch": (0.01, 60.0), "reload_bad_then_good": (0.02, 0.15)}
"""Per scenario, each rank's ``reload_interval``: rank 0 notices a change long before rank 1."""
ON_DEMAND = {"reload_switch": 8}
"""Rank 1, whose watcher never looks in time, calls ``guard.reload()`` before this step."""
NEW_MAX_NORM = 1e-3  # bites on every step, so a rank that switched alone would part from the other


def clip_policy(max_norm: float) -> str:
    rule = {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": max_norm, "scope": "group"}]}
    return json.dumps({"version": 1, "rules": [rule]})


def write_atomically(path: Path, text: str) -> None:
    scratch = path.with_suffix(".tmp")
    scratch.write_text(text)
    os.replace(scratch, path)


# Rank 0 rewrites the file before these steps.
REWRITES = {
    "reload_switch": {3: clip_policy(NEW_MAX_NORM)},
    "reload_bad_then_good": {3: '{"version": 1, "rules": [', 15: clip_policy(NEW_MAX_NORM)},
}


def scenario(name: str, rank: int, world: int, outdir: Path) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as Ddp

    path = outdir / "policy.json"
    if rank == 0:
        write_atomically(path, clip_policy(1.0))
    dist.barrier()
    model = Ddp(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    log = outdir / f"audit-rank{rank}.jsonl"
    digests = []
    guard = GradGuard(model, path, audit_log=log, logger=None, reload=True, reload_interval=INTERVALS[name][rank])
    with guard:
        for step in range(STEPS):
            if step in REWRITES[name]:
                dist.barrier()  # the file changes between steps, on every rank's clock
                if rank == 0:
                    write_atomically(path, REWRITES[name][step])
                dist.barrier()
            if rank == 1 and ON_DEMAND.get(name) == step:
                assert guard.reload()
            opt.zero_grad()
            x, y = batch(rank, step)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            digests.append(digest(model))
            time.sleep(STEP_SECONDS)
        max_norm = guard.policy.rules[0].actions[0].max_norm  # type: ignore[union-attr]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    return {
        "digests": digests,
        "max_norm": max_norm,
        "reloads": [e for e in events if e["event"] == "policy_reload"],
        "failures": [e for e in events if e["event"] == "policy_reload_failed"],
    }


if __name__ == "__main__":
    main(scenario, sys.argv[1:])
