"""A NaN in the input batch is the data's fault, named so whether the batch is given by position or by keyword
(``model(input_ids=...)``, as Hugging Face models take it), in every provenance mode, with or without a re-run."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from gradguard import GradGuard, GradientHalt, Policy
from gradguard.errors import origin_sentence

HALT = {"name": "halt", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}


class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def halt_on_a_nan_batch(provenance: str, by_keyword: bool, rerun: bool) -> GradientHalt:
    torch.manual_seed(0)
    model = Wrapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data: dict[str, Any] = {"version": 1, "rules": [HALT]}
    if rerun:
        data["rerun"] = {"on": ["nonfinite"]}
    with GradGuard(model, Policy.from_dict(data), logger=None, provenance=provenance):
        for step in range(4):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            if step == 2:
                x[0, 0] = float("nan")

            def closure(x: torch.Tensor = x) -> torch.Tensor:
                opt.zero_grad()
                loss = (model(x=x) if by_keyword else model(x)).pow(2).mean()
                loss.backward()
                return loss

            try:
                opt.step(closure)
            except GradientHalt as halt:
                return halt
    raise AssertionError("no halt")


@pytest.mark.parametrize("rerun", [False, True], ids=["no-rerun", "rerun"])
@pytest.mark.parametrize("by_keyword", [False, True], ids=["positional", "keyword"])
@pytest.mark.parametrize("provenance", ["first_fault", "always"])
def test_a_nan_in_the_input_batch_is_named_as_the_datas_fault_in_one_account(
    provenance: str, by_keyword: bool, rerun: bool
) -> None:
    halt = halt_on_a_nan_batch(provenance, by_keyword, rerun)
    assert halt.step == 2
    assert halt.origin is not None
    assert halt.origin["input_nonfinite"] is True
    assert (halt.origin["phase"], halt.origin["module"], halt.origin["kind"]) == ("forward", "net.0", "nan")
    assert origin_sentence(halt.origin).startswith("It started in the input batch, already nan before the first")
    assert origin_sentence(halt.origin) in str(halt)
