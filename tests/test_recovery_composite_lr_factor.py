"""``lr_factor`` and a composite scheduler handed over with its parts (issue 42, item 4): ``lr_scheduler=[seq,
*parts]`` with ``LinearLR`` then ``CosineAnnealingLR`` (a large ``eta_min``, where scaling it twice shows), and a
``ChainedScheduler`` of the same parts. After the rewind every LR is exactly ``lr_factor`` times the LR of the twin:
the run, built by hand, that never trained on the undone batches and never rewound."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as schedulers

from gradguard import GradGuard, Policy

STEPS, FAULT, SNAPSHOT, SKIP = 50, 23, 20, 4
RESUME = FAULT + SKIP + 1
HALT = {"name": "nonfinite", "match": ["*"], "actions": [{"action": "halt_on_nonfinite"}]}
RECOVERY = {"snapshot_every": 5, "keep": 2, "min_age": 3, "skip_steps": SKIP, "lr_factor": 0.5}

_gen = torch.Generator().manual_seed(1)
DATA = [(torch.randn(3, 4, generator=_gen), torch.randn(3, 2, generator=_gen)) for _ in range(STEPS)]


def make(kind: str, opt: torch.optim.Optimizer, milestone: int) -> tuple[Any, list[Any]]:
    parts = [
        schedulers.LinearLR(opt, start_factor=0.5, total_iters=10),
        schedulers.CosineAnnealingLR(opt, T_max=30, eta_min=0.05),
    ]
    if kind == "sequential":
        composite: Any = schedulers.SequentialLR(opt, parts, milestones=[milestone])
    else:
        composite = schedulers.ChainedScheduler(parts, optimizer=opt)
    return composite, [composite, *parts]


def train(kind: str, steps: list[int], milestone: int, recovery: bool) -> dict[int, list[float]]:
    """The LRs each update of a step from RESUME on used, per group."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    groups = [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[2].parameters(), "lr": 0.2}]
    opt = torch.optim.SGD(groups, momentum=0.9)
    composite, handed = make(kind, opt, milestone)
    policy = Policy.from_dict({"version": 1, "rules": [HALT], **({"recovery": RECOVERY} if recovery else {})})
    used: dict[int, list[float]] = {}
    with GradGuard(model, policy, logger=None, lr_scheduler=handed) as guard:
        for i in steps:
            x, y = DATA[i]
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            (loss * float("nan") if recovery and i == FAULT else loss).backward()
            opt.step()
            if i >= RESUME:
                used[i] = [group["lr"] for group in opt.param_groups]
            composite.step()
    if recovery:
        assert guard.state_dict()["recovery"]["rewinds"] == 1
    return used


@pytest.mark.parametrize("kind", ["sequential", "chained"])
@pytest.mark.parametrize("milestone", [12, 22, 25, 33])  # before the snapshot, in the undone steps, the window, after
def test_every_lr_after_the_rewind_is_exactly_lr_factor_times_the_twins_with_the_composite_and_its_parts(
    kind: str, milestone: int
) -> None:
    got = train(kind, list(range(STEPS)), milestone, recovery=True)
    twin = train(kind, [*range(SNAPSHOT), *range(RESUME, STEPS)], milestone, recovery=False)
    assert got.keys() == twin.keys() == set(range(RESUME, STEPS))
    for step in got:
        assert got[step] == [0.5 * lr for lr in twin[step]], f"step {step}"
