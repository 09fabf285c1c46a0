"""A run resumed from a checkpoint continues the step count: windows and log steps carry on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from gradguard import GradGuard, Policy

WARMUP_CLIP = Policy.from_dict(
    {
        "version": 1,
        "rules": [
            {"name": "warmup", "match": "*", "until_step": 3, "actions": [{"action": "clip_norm", "max_norm": 1e-6}]}
        ],
    }
)


def train(guard_kwargs: dict[str, object], steps: int, log: Path) -> dict[str, dict[str, int]]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradGuard(model, WARMUP_CLIP, logger=None, audit_log=log, **guard_kwargs) as guard:  # type: ignore[arg-type]
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).sum().backward()
            opt.step()
        return guard.counters.snapshot()


def test_a_resumed_run_continues_the_step_count_so_a_warmup_window_does_not_restart(tmp_path: Path) -> None:
    """start_step=2 with a clip on steps [0, 3): only the resumed run's first step is clipped, logged as step 2."""
    log = tmp_path / "resumed.jsonl"
    counters = train({"start_step": 2}, 4, log)
    assert counters == {"warmup": {"clip_norm": 2}}  # weight and bias, on step 2 only
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert events[0]["event"] == "attach"
    assert events[0]["start_step"] == 2
    assert sorted({event["step"] for event in events if event["event"] == "intervention"}) == [2]
    assert events[-1]["event"] == "detach"
    assert events[-1]["steps"] == 6


def test_a_negative_start_step_is_refused_with_the_value_given() -> None:
    """start_step=-1 is a ValueError that repeats the value."""
    with pytest.raises(ValueError, match="-1"):
        GradGuard(nn.Linear(2, 1), WARMUP_CLIP, start_step=-1, logger=None)
