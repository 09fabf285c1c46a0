"""Run by ``tests/test_agc.py`` under torchrun (2 ranks, gloo): ``agc`` on an FSDP2 model against timm's
formula applied to an unsharded copy trained on the whole batch. Writes ``rank{N}.json`` in the working directory."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from support.gloo_ranks import shutdown  # tests/, this script's folder
from torch import nn
from torch.distributed.fsdp import fully_shard

from gradguard import GradGuard, Policy
from tests.test_agc import _units_over, adaptive_clip_grad, group_agc


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # 5 rows over 2 ranks: uneven shards (3 + 2); a 1-D LayerNorm weight and biases sharded too.
    return nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3))


def main(scope: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sharded, reference = make_model(), make_model()
    for module in sharded:
        if any(True for _ in module.parameters()):
            fully_shard(module)
    fully_shard(sharded)
    opt_s = torch.optim.SGD(sharded.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(reference.parameters(), lr=0.1)
    policy = Policy.from_dict(
        {
            "version": 1,
            "rules": [
                {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
                {"name": "agc", "match": "*", "actions": [{"action": "agc", "clipping": 0.05, "scope": scope}]},
            ],
        }
    )
    worst, expected = 0.0, 0
    with GradGuard(sharded, policy, logger=None) as guard:
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(world * 4, 6, generator=g), torch.randn(world * 4, 3, generator=g)
            scale = (0.01, 1.0, 10.0, 0.1)[step]
            opt_s.zero_grad()
            mine = slice(rank * 4, rank * 4 + 4)
            (nn.functional.mse_loss(sharded(x[mine]), y[mine]) * scale).backward()
            opt_s.step()
            opt_r.zero_grad()
            (nn.functional.mse_loss(reference(x), y) * scale).backward()
            if scope == "tensor":
                expected += sum(1 for over, _ in _units_over(reference, clipping=0.05).values() if over)
                adaptive_clip_grad(reference.parameters(), clip_factor=0.05)
            else:
                params = list(reference.parameters())
                total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
                weight = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.detach()) for p in params]))
                expected += len(params) if total >= weight.clamp(min=1e-3) * 0.05 else 0
                group_agc(params, 0.05, 1e-3)
            opt_r.step()
            for (name, p), q in zip(sharded.named_parameters(), reference.parameters(), strict=True):
                full = p.full_tensor().detach()
                assert torch.allclose(full, q.detach(), rtol=1e-5, atol=1e-6), (step, name)
                worst = max(worst, float((full - q.detach()).abs().max()))
        counters = guard.counters.snapshot()
    # A file per rank: two ranks printing to one pipe can interleave their lines.
    Path(f"rank{rank}.json").write_text(json.dumps({"counters": counters, "expected": expected, "worst": worst}))
    shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1])
