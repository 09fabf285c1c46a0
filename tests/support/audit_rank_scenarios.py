"""Real 2-rank gloo runs whose logs ``gradguard audit`` is tested on (tests/test_audit_rank_runs.py).

Run as ``python tests/support/audit_rank_scenarios.py NAMES 2 OUTDIR PORT`` (``support.gloo_ranks``); each scenario
writes ``OUTDIR/NAME/audit-rank{r}.jsonl``, a DDP loop as nanoGPT's (``rank_scenarios.train``):

- ``divergence_halt``: rank 1's weights move by one ulp before step 3; the replica check halts (``ranks`` section);
- ``outlier_halt`` / ``outlier_skip``: rank 1's own gradient 1e4 times the others' at step 3, halted / skipped;
- ``nan_both_ranks_skip``: a NaN made on both ranks at step 3, skipped (a tie of faults between the ranks);
- ``nan_rank_one_skip``: a NaN made on rank 1 only at step 3, skipped (rank 0 only received it).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

# Run as a script (and imported again by the spawned ranks): tests/ holds ``support`` and ``rank_scenarios``.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rank_scenarios as scenarios
import torch
import torch.distributed as dist
from torch import nn

from support.gloo_ranks import main

SKIP_NONFINITE: dict[str, Any] = {
    "version": 1,
    "rules": [
        {"name": "nonfinite", "match": "*", "actions": [{"action": "skip_step_on_nonfinite"}]},
        {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 1.0}]},
    ],
}
SCENARIOS = ("divergence_halt", "outlier_halt", "outlier_skip", "nan_both_ranks_skip", "nan_rank_one_skip")


def one_ulp_on_rank_one(model: nn.Module, step: int) -> None:
    """Before step 3's forward, rank 1's ``4.bias`` moves by one ulp: the replicas differ from then on."""
    if step == scenarios.BAD_STEP and dist.get_rank() == 1:
        with torch.no_grad():
            bias = model[4].bias
            bias[0] = torch.nextafter(bias[0], torch.tensor(math.inf))


def large_on_rank_one(rank: int, step: int, micro: int) -> float | None:
    return 1e4 if rank == 1 and step == scenarios.BAD_STEP else None


def scenario(name: str, rank: int, world: int, outdir: Path) -> dict[str, Any]:
    halt_and_clip = scenarios.HALT_AND_CLIP
    if name == "divergence_halt":
        policy = {**halt_and_clip, "ranks": {"check_replicas_every": 1}}
        return scenarios.train(rank, outdir, policy, before_step=one_ulp_on_rank_one)
    if name in ("outlier_halt", "outlier_skip"):
        action = name.removeprefix("outlier_")
        policy = {**halt_and_clip, "ranks": {"outlier_factor": 10, "on_outlier": action}}
        return scenarios.train(rank, outdir, policy, large_on_rank_one)
    if name == "nan_both_ranks_skip":
        return scenarios.train(rank, outdir, SKIP_NONFINITE, scenarios.nan_on(0, 1))
    if name == "nan_rank_one_skip":
        return scenarios.train(rank, outdir, SKIP_NONFINITE, scenarios.nan_on(1))
    raise ValueError(name)


if __name__ == "__main__":
    main(scenario, sys.argv[1:])
