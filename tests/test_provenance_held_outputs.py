"""The light trace holds small outputs and reduces them together at the end of the forward (figures.HeldOutputs):
fewer launches, and the same module named, also where a later operation changes an output in place."""

from __future__ import annotations

import dataclasses
import weakref
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradguard import GradGuard, GradientHalt, Policy
from gradguard.enforce.provenance import provenance
from gradguard.enforce.provenance.figures import HeldOutputs

HALT = {"version": 1, "rules": [{"name": "halt", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}]}


class Switch:
    on = False


class MakesNaN(nn.Module):
    """Identity (a copy), NaN while its switch is on."""

    def __init__(self, switch: Switch) -> None:
        super().__init__()
        self.switch = switch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float("nan") if self.switch.on else x * 1.0


class PoisonsInPlace(nn.Module):
    """Changes its input in place (NaN while its switch is on) and hands the same tensor on."""

    def __init__(self, switch: Switch) -> None:
        super().__init__()
        self.switch = switch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(float("nan") if self.switch.on else 1.0)


class ThenReLUInPlace(nn.Module):
    """``fc`` -> ``act`` (makes the NaN) -> ``relu`` in place on act's output -> ``head``."""

    def __init__(self) -> None:
        super().__init__()
        self.switch = Switch()
        self.fc = nn.Linear(4, 8)
        self.act = MakesNaN(self.switch)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.relu(self.act(self.fc(x))))
        return out


class InPlacePoisoner(nn.Module):
    """``fc`` -> ``scale`` (a copy) -> ``poison`` (in place on scale's output: makes the NaN) -> ``head``."""

    def __init__(self) -> None:
        super().__init__()
        self.switch = Switch()
        self.fc = nn.Linear(4, 8)
        self.scale = MakesNaN(Switch())
        self.poison = PoisonsInPlace(self.switch)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.poison(self.scale(self.fc(x))))
        return out


class ResidualBlock(nn.Module):
    def __init__(self, switch: Switch) -> None:
        super().__init__()
        self.f = nn.Linear(8, 8)
        self.g = MakesNaN(switch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x += self.g(self.f(torch.relu(x)))  # the residual added in place, to the previous block's output (unsaved)
        return x


class InPlaceResiduals(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.switch = Switch()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([ResidualBlock(Switch()), ResidualBlock(self.switch), ResidualBlock(Switch())])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(h)
        return out


def origin_of_a_nan_at(model: nn.Module, switch: Switch, at: int) -> dict[str, Any]:
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with GradGuard(model, Policy.from_dict(HALT), logger=None, provenance="first_fault"):
        for step in range(at + 1):
            switch.on = step == at
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            model(x).square().mean().backward()
            if step < at:
                opt.step()
                continue
            with pytest.raises(GradientHalt) as info:
                opt.step()
            assert info.value.origin is not None
            return info.value.origin
    raise AssertionError("no halt")


def named(origin: dict[str, Any]) -> tuple[str, str, str]:
    return origin["phase"], origin["module"], origin["kind"]


@pytest.fixture(params=[True, False], ids=["held", "each-in-its-hook"])
def hold(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Every test runs with the held outputs and with each output reduced in its hook: the same answers. The light
    trace runs at every forward, as on a model the default cannot replay (a replay reduces each in its hook)."""
    monkeypatch.setattr(provenance, "LIGHT", dataclasses.replace(provenance.LIGHT, replay=False))
    if not request.param:
        monkeypatch.setattr(HeldOutputs, "hold", lambda self, figures, tensor, index: False)
    return bool(request.param)


@pytest.mark.parametrize("at", [0, 3])
def test_a_nan_made_before_an_in_place_relu_is_blamed_on_the_module_that_made_it(hold: bool, at: int) -> None:
    """At the first forward (nothing learned yet) and after: act made the NaN; relu only changed it in place."""
    model = ThenReLUInPlace()
    assert named(origin_of_a_nan_at(model, model.switch, at)) == ("forward", "act", "nan")


@pytest.mark.parametrize("at", [0, 3])
def test_a_nan_made_in_place_is_blamed_on_the_module_that_changed_the_output_not_on_the_one_that_made_it(
    hold: bool, at: int
) -> None:
    model = InPlacePoisoner()
    assert named(origin_of_a_nan_at(model, model.switch, at)) == ("forward", "poison", "nan")


@pytest.mark.parametrize("at", [0, 3])
def test_residuals_added_in_place_name_the_sub_module_that_made_the_nan(hold: bool, at: int) -> None:
    model = InPlaceResiduals()
    assert named(origin_of_a_nan_at(model, model.switch, at)) == ("forward", "blocks.1.g", "nan")


class Reductions(TorchDispatchMode):
    """Counts the reductions dispatched (a sum or a norm per output, or a multi-tensor norm for many)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in {"sum", "linalg_vector_norm", "_foreach_norm"}:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def test_after_one_forward_the_small_outputs_take_one_multi_tensor_reduction_not_one_each(hold: bool) -> None:
    torch.manual_seed(0)
    model = InPlaceResiduals()
    hooked = len(list(model.modules()))
    with GradGuard(model, Policy.from_dict(HALT), logger=None, provenance="first_fault"):
        x = torch.randn(6, 4)
        model(x).sum().backward()  # the first forward: each output reduced in its hook, watched
        counted = Reductions()
        with counted:
            model(x)
    assert hooked == 13  # the model, inp, the ModuleList (never called), 3 blocks of 3, head: 12 outputs a forward
    if hold:
        # inp's and the first two blocks' outputs are changed in place by the next block (x += ...), and f's and g's
        # outputs are freed before the forward ends (g multiplies by a number, += saves nothing): holding those would
        # keep them alive, so these 10 stay in their hooks; the last block's output (saved by head) and head's
        # (returned) are reduced together.
        assert counted.counts == {"sum": 10, "_foreach_norm": 1}
    else:
        assert counted.counts == {"sum": 12}


class SavedChain(nn.Module):
    """Every output is saved for backward by the next module (a Linear saves its input): holding them is free."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(8, 8) for _ in range(6)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layers(x)
        return out


def test_outputs_that_the_forward_keeps_alive_take_one_multi_tensor_reduction(hold: bool) -> None:
    torch.manual_seed(0)
    model = SavedChain()
    with GradGuard(model, Policy.from_dict(HALT), logger=None, provenance="first_fault"):
        x = torch.randn(6, 8)
        model(x).sum().backward()
        counted = Reductions()
        with counted:
            out = model(x)
        del out
    # The batch is summed in the model's pre-hook; the 6 Linears' outputs (the last one passed on by layers and
    # returned by the model) are each saved by the next Linear, or held by the caller.
    assert counted.counts == ({"sum": 1, "_foreach_norm": 1} if hold else {"sum": 7})


def test_an_output_nobody_keeps_is_freed_when_its_last_user_is_done_not_at_the_end_of_the_forward(hold: bool) -> None:
    """The trace holds outputs weakly: a residual branch's output, freed once it is added to the stream, is gone
    before the forward ends, at every step (holding it would add its bytes to the step's peak)."""
    torch.manual_seed(0)
    model = InPlaceResiduals()
    branch: list[weakref.ReferenceType[torch.Tensor]] = []
    alive_at_the_next_block: list[bool] = []
    model.blocks[1].g.register_forward_hook(lambda module, args, output: branch.append(weakref.ref(output)))
    model.blocks[2].register_forward_hook(lambda *_: alive_at_the_next_block.append(branch[-1]() is not None))
    with GradGuard(model, Policy.from_dict(HALT), logger=None, provenance="first_fault"):
        for _ in range(3):
            model(torch.randn(6, 4)).sum().backward()
    assert alive_at_the_next_block == [False, False, False]
