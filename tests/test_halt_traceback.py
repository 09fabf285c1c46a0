"""A halt's traceback ends at the hook torch called, not a dozen frames into the guard's step (issue 58, item 8): the
user's line, torch's optimizer or the intercepted clip, and the one gradguard frame that raised it."""

from __future__ import annotations

import traceback
from collections.abc import Callable

import pytest
import torch
from torch import nn

from gradguard import GradGuard, GradientHalt


def _step_only(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()


def _clip_then_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the guard's step runs here, first
    optimizer.step()


@pytest.mark.parametrize("loop", [_step_only, _clip_then_step], ids=["at the optimizer's step", "at the loop's clip"])
def test_a_halt_s_traceback_shows_no_frame_of_the_guard_s_step_below_the_hook_that_raised_it(
    loop: Callable[[nn.Module, torch.optim.Optimizer], None],
) -> None:
    model = nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters())
    with GradGuard(model, "default", logger=None):
        model(torch.tensor([[float("nan"), 1.0, 2.0]])).sum().backward()
        with pytest.raises(GradientHalt) as caught:
            loop(model, optimizer)
    frames = traceback.extract_tb(caught.value.__traceback__)
    ours = [frame for frame in frames if "/gradguard/" in frame.filename.replace("\\", "/")]
    assert frames[0].name == "test_a_halt_s_traceback_shows_no_frame_of_the_guard_s_step_below_the_hook_that_raised_it"
    assert frames[1].name == loop.__name__  # the user's line that stepped or clipped
    assert ours[-1] == frames[-1]  # the last frame is the hook's, which raised it again
    assert frames[-1].filename.replace("\\", "/").endswith("gradguard/enforce/hooks/torch_hooks.py")
    assert len(frames) <= 6, [(frame.filename, frame.name) for frame in frames]
    assert caught.value.kind == "nan"
    assert "The optimizer step was not taken" in str(caught.value)
