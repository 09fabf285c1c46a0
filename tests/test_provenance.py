"""Where a NaN starts: models built to fail at a known place, and the origin the halt or skip names."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradguard import GradGuard, GradientHalt, Policy
from gradguard.cli import main
from tests.support.faulty_models import EmitsNaN, Faults, InfInBackward, Net
from tests.support.host_syncs import count_host_syncs
from tests.support.training import SmallMLP

HALT = {"version": 1, "rules": [{"name": "halt", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}]}
SKIP = {"version": 1, "rules": [{"name": "skip", "match": "*", "actions": [{"action": "skip_step_on_nonfinite"}]}]}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(6, 4, generator=generator), torch.randn(6, 2, generator=generator)


def train_until_halt(
    model: Net, guard_kwargs: dict[str, Any], fault: str, at: int, *, poison_input: bool = False, steps: int = 5
) -> GradientHalt:
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with GradGuard(model, Policy.from_dict(HALT), logger=None, **guard_kwargs):
        for step in range(steps):
            setattr(model.faults, fault, step == at) if fault else None
            x, y = batch(step)
            if poison_input and step == at:
                x[2, 1] = float("nan")
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if step < at:
                opt.step()
                continue
            with pytest.raises(GradientHalt) as info:
                opt.step()
            assert info.value.step == at
            return info.value
    raise AssertionError("no halt")


def test_a_forward_nan_in_one_block_is_traced_to_the_module_that_emitted_it():
    halt = train_until_halt(Net(), {"provenance": "always"}, "forward_nan", at=3)
    origin = halt.origin
    assert origin is not None
    assert (origin["phase"], origin["module"], origin["kind"]) == ("forward", "blocks.1.act", "nan")
    assert origin["input_nonfinite"] is False
    assert "blocks.1.act was the first module whose output went nan" in str(halt)


def test_an_inf_made_by_a_modules_custom_backward_is_traced_to_that_module_in_the_backward_phase():
    halt = train_until_halt(Net(), {"provenance": "always"}, "backward_inf", at=2)
    origin = halt.origin
    assert origin is not None
    assert (origin["phase"], origin["module"], origin["kind"]) == ("backward", "blocks.1.boom", "inf")
    assert origin["seen_in"] == "blocks.1.act"  # the output whose gradient went inf: boom's input
    assert "blocks.1.boom's backward produced the first inf gradient" in str(halt)


def test_nan_in_the_input_batch_is_blamed_on_the_data_not_the_model():
    halt = train_until_halt(Net(), {"provenance": "always"}, "", at=1, poison_input=True)
    origin = halt.origin
    assert origin is not None
    assert origin["phase"] == "forward"
    assert origin["input_nonfinite"] is True
    assert origin["module"] == "inp"  # the first module whose output it made non-finite
    assert "the data is at fault" in str(halt)


@pytest.mark.parametrize("fault", ["log_negative", "sqrt_negative"])
def test_a_log_or_sqrt_of_a_negative_in_a_blocks_own_code_is_traced_to_that_block(fault):
    halt = train_until_halt(Net(), {"provenance": "always"}, fault, at=2)
    origin = halt.origin
    assert origin is not None
    assert (origin["phase"], origin["module"], origin["kind"]) == ("forward", "blocks.1", "nan")
    assert origin["seen_in"] == "blocks.1.fc2"  # the first module to receive it
    assert "in blocks.1's own code" in str(halt)


def test_under_activation_checkpointing_the_recomputed_forward_does_not_change_the_origin():
    forward = train_until_halt(Net(checkpointed=True), {"provenance": "always"}, "forward_nan", at=2)
    assert forward.origin is not None
    assert (forward.origin["phase"], forward.origin["module"]) == ("forward", "blocks.1.act")
    backward = train_until_halt(Net(checkpointed=True), {"provenance": "always"}, "backward_inf", at=2)
    assert backward.origin is not None
    assert (backward.origin["phase"], backward.origin["module"]) == ("backward", "blocks.1.boom")


def _clipping_loop_halt(tmp_path, provenance: str) -> GradientHalt:
    """nanoGPT's loop: backward, clip_grad_norm_ over all parameters, step; one gradient poisoned at step 4."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    poisoned = model.blocks[2].fc1.weight
    poisoned.register_hook(lambda grad: grad * float("nan") if state["poison"] else grad)
    state = {"poison": False}
    log = tmp_path / "audit.jsonl"
    with GradGuard(model, Policy.from_dict(HALT), logger=None, audit_log=log, provenance=provenance):
        for step in range(5):
            state["poison"] = step == 4
            x, y = batch(step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if step == 4:
                with pytest.raises(GradientHalt) as info:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the guard's step runs first
                break
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    assert info.value.step == 4
    return info.value


def test_a_loop_that_clips_globally_before_the_step_gets_the_poisoned_parameter_named(tmp_path):
    """provenance="always": the guard acts before the loop's clip; the halt names the one parameter, no clip."""
    halt = _clipping_loop_halt(tmp_path, "always")
    log = tmp_path / "audit.jsonl"
    assert halt.params == ("blocks.2.fc1.weight",)
    assert halt.origin is not None
    assert halt.origin["spread"] is False
    assert "clip" not in str(halt)
    event = next(e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "halt")
    assert event["params"] == ["blocks.2.fc1.weight"]
    assert event["origin"]["spread"] is False


def test_by_default_a_first_fault_in_a_clipping_loop_names_its_parameter_and_blames_no_clip(tmp_path):
    """The default provenance, no hook armed before the first fault: the guard's step before the loop's clip
    still names the one poisoned parameter, and the halt says nothing of clips."""
    halt = _clipping_loop_halt(tmp_path, "after_fault")
    assert halt.params == ("blocks.2.fc1.weight",)
    assert halt.origin is not None
    assert halt.origin["spread"] is False
    assert "clip" not in str(halt)


def test_gradients_poisoned_after_backward_are_said_to_have_gone_bad_after_backward():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradGuard(model, Policy.from_dict(HALT), logger=None, provenance="always"):
        nn.functional.mse_loss(model(batch(0)[0]), batch(0)[1]).backward()
        model.head.weight.grad[0, 0] = float("inf")  # type: ignore[index]
        with pytest.raises(GradientHalt) as info:
            opt.step()
    assert info.value.origin is not None
    assert info.value.origin["phase"] == "after_backward"
    assert info.value.params == ("head.weight",)


def test_after_fault_registers_nothing_until_a_skip_then_traces_the_second_occurrence(tmp_path):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    log = tmp_path / "audit.jsonl"
    module_hooks = lambda: sum(len(m._forward_hooks) for m in model.modules())  # noqa: E731
    with GradGuard(model, Policy.from_dict(SKIP), logger=None, audit_log=log, provenance="after_fault") as guard:
        assert module_hooks() == 0  # "after_fault": no module hook before a fault
        for step in range(6):
            model.faults.forward_nan = step in (2, 4)
            x, y = batch(step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            assert guard.last_step_skipped == (step in (2, 4))
            if step < 2:
                assert module_hooks() == 0
        assert module_hooks() == len(list(model.modules()))
    skips = [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "skip"]
    assert [e["step"] for e in skips] == [2, 4]
    first, second = skips[0]["origin"], skips[1]["origin"]
    assert first["phase"] == "untraced"
    assert first["module"] is None
    assert "after_fault" in first["note"]
    assert (second["phase"], second["module"], second["kind"]) == ("forward", "blocks.1.act", "nan")


def test_after_fault_disarms_its_module_hooks_after_enough_clean_steps():
    from gradguard.enforce.provenance import provenance

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradGuard(model, Policy.from_dict(SKIP), logger=None, provenance="after_fault"):
        for step in range(provenance.ARMED_STEPS + 3):
            model.faults.forward_nan = step == 0
            x, y = batch(step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            armed = any(m._forward_hooks for m in model.modules())
            assert armed == (step < provenance.ARMED_STEPS), step


def test_provenance_none_registers_no_hook_at_all():
    model = Net()
    with GradGuard(model, Policy.from_dict(HALT), logger=None, provenance=None):
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
        assert not any(getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())
    with pytest.raises(ValueError, match="provenance must be"):
        GradGuard(model, Policy.from_dict(HALT), logger=None, provenance="sometimes")


class Tied(nn.Module):
    """One module under two names, called twice per forward; a NaN in its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.emit = EmitsNaN(Faults())
        self.shared = nn.Linear(8, 8)
        self.again = self.shared  # the same module under a second name
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(self.emit(self.first(x.repeat(1, 2))))
        out: torch.Tensor = self.head(self.again(torch.tanh(h)))
        return out


def test_a_module_called_twice_under_two_names_is_named_once_by_its_first_call():
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradGuard(model, Policy.from_dict(HALT), logger=None, provenance="always"):
        x, y = batch(0)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        model.shared.weight.data[0, 0] = float("inf")  # its first call's output goes inf, then NaN after tanh
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        with pytest.raises(GradientHalt) as info:
            opt.step()
    origin = info.value.origin
    assert origin is not None
    assert (origin["phase"], origin["module"], origin["kind"]) == ("forward", "shared", "inf")


class InPlaceAfter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.relu = nn.ReLU(inplace=True)  # modifies fc's output in place: full backward hooks would refuse it
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.relu(self.fc(x)))
        return out


def test_always_runs_one_host_sync_per_step_none_in_backward_and_allows_in_place_ops_after_a_module():
    torch.manual_seed(0)
    model = InPlaceAfter()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradGuard(model, Policy.from_dict(HALT), logger=None, provenance="always"):
        for step in range(3):
            x, y = batch(step)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            assert count_host_syncs(loss.backward) == 0
            assert count_host_syncs(opt.step) == 1
        model.fc.bias.data[0] = float("nan")
        opt.zero_grad()
        nn.functional.mse_loss(model(batch(9)[0]), batch(9)[1]).backward()
        with pytest.raises(GradientHalt) as info:
            opt.step()
    assert info.value.origin is not None
    assert info.value.origin["module"] == "fc"


def test_the_audit_shows_the_origin_of_each_halt_and_skip(tmp_path):
    log = tmp_path / "audit.jsonl"
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradGuard(model, Policy.from_dict(SKIP), logger=None, audit_log=log, provenance="always"):
        for step in range(3):
            model.faults.backward_inf = step == 1
            x, y = batch(step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    halt_log = tmp_path / "halt.jsonl"
    train_until_halt(Net(), {"provenance": "always", "audit_log": halt_log}, "forward_nan", at=1)
    result = CliRunner().invoke(main, ["audit", str(log), str(halt_log)])
    text = result.output
    assert "step 1 (run" in text, text
    assert "blocks.1.boom's backward produced the first inf gradient" in text, text
    assert "origin: It started in the forward pass: blocks.1.act was the first module whose output went nan" in text
    as_json = json.loads(CliRunner().invoke(main, ["audit", "--format", "json", str(halt_log)]).output)
    assert as_json["halts"][0]["origin"]["module"] == "blocks.1.act"


def test_torch_compile_traces_the_module_hooks_into_the_compiled_forward():
    """Under torch.compile the forward hooks are traced into the graph: a forward NaN is still named."""
    torch._dynamo.reset()
    model = Net()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradGuard(compiled, Policy.from_dict(HALT), logger=None, provenance="always"):
        for step in range(3):
            model.faults.forward_nan = step == 2
            x, y = batch(step)
            opt.zero_grad()
            nn.functional.mse_loss(compiled(x), y).backward()
            try:
                opt.step()
            except GradientHalt as halt:
                origin = halt.origin
                break
        else:
            raise AssertionError("no halt")
    assert origin is not None
    assert (origin["phase"], origin["module"]) == ("forward", "blocks.1.act")


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")
def test_under_ddp_each_rank_reports_its_own_origin_and_the_audit_shows_every_rank(tmp_path):
    from tests.test_distributed import launch

    launch(["ddp_provenance"], 2, tmp_path)
    folder = tmp_path / "ddp_provenance"
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["halt_step"] for r in ranks] == [2, 2]  # the verdict is agreed: both ranks halt
    assert ranks[1]["origin"]["phase"] == "forward"
    assert ranks[1]["origin"]["input_nonfinite"] is True
    assert ranks[1]["origin"]["module"] == "embed"
    # Rank 0's own gradient was finite before DDP's all-reduce: it says the fault came in through the reduction,
    # from rank 1 (the origin rank, named by every rank).
    assert ranks[0]["origin"]["phase"] == "received"
    assert "not made on this rank" in ranks[0]["origin"]["note"]
    logs = [str(folder / f"audit-rank{r}.jsonl") for r in range(2)]
    text = CliRunner().invoke(main, ["audit", *logs]).output
    assert "ranks 0, 1" in text  # one halt, both ranks named
    # The halt's origin is the origin rank's own account (rank 1's: the data), not a rank's that received it.
    assert "the data is at fault" in text, text
    assert "not made on this rank" not in text, text


# --- first_fault: the first fault's origin, traced from the start ------------------------------------


def test_first_fault_names_the_module_and_the_forward_phase_of_the_very_first_fault():
    """provenance="first_fault" traces from the start: the first fault's halt names its module and phase."""
    halt = train_until_halt(Net(), {"provenance": "first_fault"}, "forward_nan", at=2)
    assert halt.origin is not None
    assert (halt.origin["phase"], halt.origin["module"], halt.origin["kind"]) == ("forward", "blocks.1.act", "nan")
    assert "hint" not in halt.origin  # the trace reached every module of this small model
    assert "It started in the forward pass: blocks.1.act was the first module whose output went nan" in str(halt)


def test_first_fault_places_a_fault_made_in_backward_between_the_last_bad_and_the_first_good_parameters():
    """A backward fault, its forward finite: the halt names the backward phase and where it lies, from which
    parameters' gradients went non-finite (those before it in forward order) and which stayed finite."""
    halt = train_until_halt(Net(), {"provenance": "first_fault"}, "backward_inf", at=2)
    origin = halt.origin
    assert origin is not None
    assert (origin["phase"], origin["module"], origin["before"]) == ("backward", "blocks.1.fc1", "blocks.1.fc2")
    assert origin["consumers"] == ["blocks.1.act", "blocks.1.boom"]  # the culprit, boom, is among them
    assert "It started in the backward pass, in blocks.1.fc1 or after it" in str(halt)
    assert "(between them: blocks.1.act, blocks.1.boom)" in str(halt)


def test_first_fault_traces_a_modules_output_whose_python_object_reuses_a_freed_tensors_id():
    """tanh between Linear layers frees each Linear's output object at once, and CPython hands its address (its
    id) to the next module's output: that output is still traced, every time, and the fault placed by it (one
    module's own gradient, made NaN after backward: the module before it kept finite gradients)."""
    for seed in range(10):
        torch.manual_seed(seed)
        model = SmallMLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with GradGuard(model, Policy.from_dict(HALT), logger=None, provenance="first_fault"):
            nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 4)).backward()
            model.hidden.weight.grad[0, 0] = math.nan  # type: ignore[union-attr,index]
            with pytest.raises(GradientHalt) as caught:
                opt.step()
        assert caught.value.origin is not None
        origin = caught.value.origin
        assert (origin["phase"], origin["module"], origin["own"]) == ("gradient", "hidden", True), seed
        assert "It started in the gradients of hidden's own parameters" in str(caught.value)


def test_first_fault_reads_no_host_data_in_forward_or_backward_and_one_read_at_the_step():
    """The light trace's figures ride the step's one host read: none in forward, none in backward."""
    torch.manual_seed(0)
    model = InPlaceAfter()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradGuard(model, Policy.from_dict(HALT), logger=None, provenance="first_fault"):
        losses: list[torch.Tensor] = []

        def forward(x: torch.Tensor, y: torch.Tensor) -> None:
            losses.append(nn.functional.mse_loss(model(x), y))

        for step in range(3):
            opt.zero_grad()
            assert count_host_syncs(functools.partial(forward, *batch(step))) == 0
            assert count_host_syncs(losses[-1].backward) == 0
            assert count_host_syncs(opt.step) == 1


class Stack(nn.Module):
    """Twenty blocks of three Linear layers: more modules than the light trace's budget."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(20))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        out: torch.Tensor = self.head(h)
        return out


def test_first_fault_names_the_module_inside_an_untraced_block_whose_own_gradient_went_nan():
    """Beyond the budget, blocks.7[2]'s weight gradient poisoned by a hook: the modules before it kept finite
    gradients, so the halt names that module's own gradients, not the block, and needs no hint."""
    model = Stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.blocks[7][2].weight.register_hook(lambda grad: grad * math.nan)
    with GradGuard(model, Policy.from_dict(HALT), logger=None):
        x, y = batch(0)
        nn.functional.mse_loss(model(x), y).backward()
        with pytest.raises(GradientHalt) as info:
            opt.step()
    assert info.value.params == ("blocks.7.2.weight",)
    origin = info.value.origin
    assert origin is not None
    assert (origin["phase"], origin["module"], origin["own"]) == ("gradient", "blocks.7.2", True)
    assert "hint" not in origin


def test_first_fault_on_a_model_beyond_its_budget_names_the_block_and_how_to_see_inside_it():
    """On a big model the light trace hooks its outer levels only: the halt names the block and says how to
    name the module inside (provenance="always")."""
    from gradguard.enforce.provenance.provenance import LIGHT

    model = Stack()
    assert LIGHT.budget is not None
    assert len(list(model.modules())) > LIGHT.budget
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with GradGuard(model, Policy.from_dict(HALT), logger=None, provenance="first_fault"):
        hooked = sum(1 for m in model.modules() if m._forward_hooks)
        assert hooked <= LIGHT.budget
        model.blocks[7][2].weight.data[0, 0] = float("inf")
        x, y = batch(0)
        nn.functional.mse_loss(model(x), y).backward()
        with pytest.raises(GradientHalt) as info:
            opt.step()
    origin = info.value.origin
    assert origin is not None
    assert (origin["phase"], origin["module"]) == ("forward", "blocks.7")
    assert "provenance='always'" in origin["hint"]
    assert "provenance='always'" in str(info.value)


def test_first_fault_arms_every_modules_hooks_after_a_fault_and_goes_back_to_the_light_trace():
    """After a skipped first fault, the full hooks (every module) trace recurrences; after ARMED_STEPS clean
    steps the light trace is back."""
    from gradguard.enforce.provenance import provenance

    model = Stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    every = len(list(model.modules()))
    hooked = lambda: sum(1 for m in model.modules() if m._forward_hooks)  # noqa: E731
    with GradGuard(model, Policy.from_dict(SKIP), logger=None, provenance="first_fault") as guard:
        light = hooked()
        assert 0 < light < every
        for step in range(provenance.ARMED_STEPS + 2):
            x, y = batch(step)
            if step == 0:
                x[0, 0] = float("nan")
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            assert guard.last_step_skipped == (step == 0)
            assert hooked() == (every if step < provenance.ARMED_STEPS else light), step
    assert hooked() == 0


def test_an_untraced_halt_says_in_one_line_how_to_trace_the_first_fault(tmp_path):
    """provenance="after_fault" cannot trace a first fault; its halt says how to (one sentence)."""
    halt = _clipping_loop_halt(tmp_path, "after_fault")
    assert halt.origin is not None
    assert halt.origin["hint"] == "To trace a first fault: GradGuard(..., provenance='first_fault')."
    assert halt.origin["hint"] in str(halt)


def test_under_torch_compile_the_default_trace_breaks_no_graph_and_names_the_module():
    """torch.compile (aot_eager) inlines first_fault's forward hooks with no graph break; a forward NaN is named."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = Net()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradGuard(compiled, Policy.from_dict(HALT), logger=None):
        for step in range(3):
            model.faults.forward_nan = step == 2
            x, y = batch(step)
            opt.zero_grad()
            nn.functional.mse_loss(compiled(x), y).backward()
            if step < 2:
                opt.step()
        with pytest.raises(GradientHalt) as info:
            opt.step()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert info.value.origin is not None
    assert (info.value.origin["phase"], info.value.origin["module"]) == ("forward", "blocks.1.act")


class StemNet(nn.Module):
    """timm's naming in miniature: a stem ``conv1`` (conv without bias, batch norm, ReLU), a block, a head ``fc``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layer1 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(self.layer1(self.conv1(x)).mean(dim=(2, 3)))
        return out


class FirstBoom(nn.Module):
    """An input Linear, then a module whose backward emits Inf (no parameters), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.faults = Faults()
        self.inp = nn.Linear(4, 8)
        self.boom = InfInBackward(self.faults)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.boom(self.inp(x))))
        return out


def poison_first_element(grad: torch.Tensor) -> torch.Tensor:
    """A tensor hook that writes one NaN into the gradient it is given."""
    grad = grad.clone()
    grad.view(-1)[0] = math.nan
    return grad


def halt_of(model: nn.Module, x: torch.Tensor) -> GradientHalt:
    """One step of the model on ``x`` under a halting guard (the default trace): the halt it raises."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradGuard(model, Policy.from_dict(HALT), logger=None):
        model(x).square().mean().backward()
        with pytest.raises(GradientHalt) as caught:
            opt.step()
    return caught.value


def test_a_nan_hooked_into_the_stems_weight_names_both_readings_and_calls_its_own_gradients_likelier():
    """conv1.0 is the first module with parameters: no module before it can show whether backward carried the
    NaN in, so the origin names its own gradients and the gradient conv1.1 passed back, the first as likelier,
    instead of "in conv1.0 or after it"."""
    torch.manual_seed(0)
    model = StemNet()
    model.conv1[0].weight.register_hook(poison_first_element)
    halt = halt_of(model, torch.randn(4, 3, 8, 8))
    assert halt.params == ("conv1.0.weight",)
    origin = halt.origin
    assert origin is not None
    assert (origin["phase"], origin["module"], origin["before"]) == ("backward", "conv1.0", "conv1.1")
    assert (origin["first"], origin["finite_own"]) == (True, [])  # a conv without bias: its only gradient is NaN
    message = str(halt)
    assert "or after it" not in message
    assert (
        "It started in conv1.0, the first module with parameters: in the gradients of its own parameters, or in "
        "the gradient of its output that conv1.1 passed back" in message
    )
    assert "Likelier its own gradients (a hook on a parameter" in message
    assert "its backward must have turned finite gradients nan, while its own parameters' gradients" in message


def test_the_same_nan_hooked_into_the_last_layer_is_still_named_in_its_own_gradients():
    torch.manual_seed(0)
    model = StemNet()
    model.fc.weight.register_hook(poison_first_element)
    halt = halt_of(model, torch.randn(4, 3, 8, 8))
    assert halt.params == ("fc.weight",)
    assert halt.origin is not None
    assert (halt.origin["phase"], halt.origin["module"], halt.origin["own"]) == ("gradient", "fc", True)
    assert "first" not in halt.origin
    assert "It started in the gradients of fc's own parameters: the modules that ran before it" in str(halt)


def test_a_nan_hooked_into_the_first_linears_weight_is_named_in_its_own_gradients_as_its_bias_kept_finite():
    """An MLP's input layer: inp.bias kept a finite gradient, which a NaN passed back by the module after it
    would have spoiled as well, so the origin names inp's own gradients and says why."""
    torch.manual_seed(0)
    model = SmallMLP()
    first = next(name for name, _ in model.named_modules() if name)
    getattr(model, first).weight.register_hook(poison_first_element)
    halt = halt_of(model, torch.randn(4, 8))
    assert halt.params == (f"{first}.weight",)
    origin = halt.origin
    assert origin is not None
    assert (origin["phase"], origin["module"], origin["first"]) == ("backward", first, True)
    assert origin["finite_own"] == [f"{first}.bias"]
    message = str(halt)
    assert f"It started in the gradients of {first}'s own parameters: {first} is the first module with " in message
    assert f"but {first}.bias kept a finite gradient, which a non-finite one passed back by " in message


def test_an_inf_passed_back_into_the_first_layer_is_named_as_one_of_the_two_readings():
    """The other reading is real: boom's backward (no parameters) hands inp an Inf gradient. Both inp.weight
    and inp.bias go Inf, and the origin names boom as the module that may have passed it back."""
    torch.manual_seed(0)
    model = FirstBoom()
    model.faults.backward_inf = True
    halt = halt_of(model, torch.randn(6, 4))
    assert halt.params == ("inp.weight", "inp.bias")
    origin = halt.origin
    assert origin is not None
    assert (origin["module"], origin["before"], origin["consumers"]) == ("inp", "head", ["boom"])
    assert (origin["first"], origin["finite_own"]) == (True, [])
    message = str(halt)
    assert "in the gradient of its output that boom passed back (the modules from head on kept finite" in message
    # Inf times activations of both signs summed: inf - inf, so NaN and Inf both, "non-finite"
    assert "for boom to have made it, its backward must have turned finite gradients non-finite." in message


# --- the loss and the model's own code: never a module named (model) -----------------------------------


class OwnCode(nn.Module):
    """Two Linear layers with the model's own code between them: a log of a negative, when ``log`` is on."""

    def __init__(self) -> None:
        super().__init__()
        self.log = False
        self.inp = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        out: torch.Tensor = self.head(torch.log(h - 100.0) if self.log else h)
        return out


def _origins(model: nn.Module, mode: str, fault: Any, tmp_path: Any) -> list[dict[str, Any]]:
    """The skips' origins of three steps, ``fault(step, loss)`` making step 0 and 2 non-finite (step 0's skip arms
    the full trace under first_fault, so step 2 shows the full trace's words)."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    log = tmp_path / f"{mode}.jsonl"
    with GradGuard(model, Policy.from_dict(SKIP), logger=None, audit_log=log, provenance=mode):
        for step in range(3):
            x, y = batch(step)
            opt.zero_grad()
            fault(step, nn.functional.mse_loss(model(x), y)).backward()
            opt.step()
    skips = [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "skip"]
    assert [e["step"] for e in skips] == [0, 2]
    return [e["origin"] for e in skips]


def test_a_nan_made_by_the_loss_is_blamed_on_the_loss_by_both_traces_and_on_no_module(tmp_path):
    """loss * nan: the light trace and the full one (provenance="always", or armed by a first fault) both say
    that the forward was finite and the loss made it; neither names a module, least of all "(model)"."""
    poison = lambda step, loss: loss * math.nan if step in (0, 2) else loss  # noqa: E731
    light, armed = _origins(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), "first_fault", poison, tmp_path)
    full = _origins(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), "always", poison, tmp_path)
    for origin in (light, armed, *full):
        assert origin["module"] is None, origin
        assert origin["note"].startswith("its forward was finite and "), origin
        assert "the loss" in origin["note"], origin
        assert "(model)" not in json.dumps(origin)
    assert "as backward began: the loss made it" in armed["note"]  # the full trace can rule out code after backward


def test_a_nan_made_by_the_models_own_code_between_its_modules_is_said_so_without_naming_a_module(tmp_path):
    """The model's own forward code (not a module) takes a log of a negative: under the full trace the origin
    says so in words, names head as the module that received it, and no module "(model)"."""
    model = OwnCode()

    def fault(step: int, loss: torch.Tensor) -> torch.Tensor:
        model.log = step in (1, 2)  # for the next step's forward
        return loss

    model.log = True
    first, second = _origins(model, "always", fault, tmp_path)
    for origin in (first, second):
        assert (origin["phase"], origin["module"], origin["seen_in"]) == ("forward", None, "head")
        assert "the model's own code, outside its modules, made it in forward: head received a nan" in origin["note"]
        assert "(model)" not in json.dumps(origin)


# --- a large output: a vocabulary head watched through its input and weight ---------------------------


class WideHead(nn.Module):
    """A small trunk and a head 16 times wider than its input, its logits handed out as float64 (a widening
    cast, as models that upcast their logits do)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.head = nn.Linear(4, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inp(x))).double()


class _Reductions(TorchDispatchMode):
    """The sizes of the tensors that sums read."""

    def __init__(self) -> None:
        super().__init__()
        self.read: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in (torch.ops.aten.sum, torch.ops.aten.linalg_vector_norm):
            self.read.append(args[0].numel())
        return func(*args, **(kwargs or {}))


@pytest.fixture
def every_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default's light trace at every forward, as it runs on a model it cannot replay (FSDP2, ZeRO 3, ...)."""
    from gradguard.enforce.provenance import provenance

    monkeypatch.setattr(provenance, "LIGHT", dataclasses.replace(provenance.LIGHT, replay=False))


def test_first_fault_watches_a_wide_linear_head_through_its_input_and_weight_and_still_names_it(every_forward):
    """The light trace reads neither the head's logits nor their upcast copy (their finiteness is that of the
    head's input, weight and bias, read instead), and a NaN in the head's weight is still named at the head."""
    torch.manual_seed(0)
    model = WideHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 4), torch.randn(64, 256, dtype=torch.float64)
    logits = 64 * 256
    with GradGuard(model, Policy.from_dict(HALT), logger=None, provenance="first_fault"):
        with _Reductions() as reductions:
            loss = nn.functional.mse_loss(model(x), y)
        assert reductions.read
        assert logits not in reductions.read  # neither the logits nor their float64 copy
        loss.backward()
        opt.step()
        with torch.no_grad():
            model.head.weight[3, 1] = math.nan
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        with pytest.raises(GradientHalt) as info:
            opt.step()
    origin = info.value.origin
    assert origin is not None
    assert (origin["phase"], origin["module"], origin["kind"]) == ("forward", "head", "nan")
