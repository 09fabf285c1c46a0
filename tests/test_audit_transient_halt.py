"""A halt of the ``rerun`` section (``transient: halt``): the halt says what happened (a transient fault found by
computing the step again, in which parameters), and the audit reproduces its counters without a mismatch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from gradguard import GradGuard, GradientHalt, Policy
from gradguard.cli import main

FAULT = 12
PARAMS = ["0.bias", "0.weight", "2.bias", "2.weight"]


def train(log: Path) -> GradientHalt:
    """A real closure loop whose step ``FAULT`` has a NaN loss in its first computation only; the halt it ends in."""
    policy = Policy.from_dict(
        {
            "version": 1,
            "rules": [{"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}],
            "rerun": {"transient": "halt"},
        }
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    with GradGuard(model, policy, audit_log=log, logger=None) as guard:
        for step in range(20):
            calls = [0]

            def closure(step: int = step, calls: list[int] = calls) -> torch.Tensor:
                calls[0] += 1
                gen = torch.Generator().manual_seed(step)
                x, y = torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                if step == FAULT and calls[0] == 1:
                    loss = loss * float("nan")
                loss.backward()  # type: ignore[no-untyped-call]
                return loss

            try:
                optimizer.step(closure)
            except GradientHalt as halt:
                assert guard.counters.snapshot() == {"rerun": {"transient": 1, "halt": 1}}
                return halt
    raise AssertionError("the transient fault did not halt the run")


@pytest.fixture(scope="module")
def halted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GradientHalt]:
    log = tmp_path_factory.mktemp("transient") / "run.jsonl"
    return log, train(log)


def events(log: Path, name: str) -> list[dict[str, Any]]:
    return [event for line in log.read_text().splitlines() if (event := json.loads(line))["event"] == name]


def test_the_audit_of_a_transient_halt_reports_no_counter_mismatch(halted: tuple[Path, GradientHalt]) -> None:
    log, _ = halted
    result = CliRunner().invoke(main, ["audit", "--format", "json", str(log)])
    data = json.loads(result.stdout)
    assert data["mismatches_total"] == 0, data["mismatches"]
    assert data["totals"] == {"rerun": {"transient": 1, "halt": 1}}
    assert data["findings"] == ["1 halt"]  # the halt alone: a halt is a finding (exit 1), a mismatch is not there
    assert result.exit_code == 1
    table = CliRunner().invoke(main, ["audit", str(log)]).output
    assert "MISMATCH" not in table
    assert "cross-check: the per-event lines reproduce every" in table


def test_the_audit_of_a_transient_halt_says_the_rerun_section_halted_on_a_transient_fault(
    halted: tuple[Path, GradientHalt],
) -> None:
    log, _ = halted
    output = CliRunner().invoke(main, ["audit", str(log)]).output
    assert (
        f"step {FAULT}: the rerun section halted on a transient fault (the step computed again differed) "
        f"in 4 parameters: {', '.join(PARAMS)}"
    ) in output
    assert "rule 'rerun' halted" not in output


def test_the_halt_event_of_a_transient_fault_names_the_parameters_that_differed_and_what_they_held(
    halted: tuple[Path, GradientHalt],
) -> None:
    log, _ = halted
    (rerun,) = events(log, "rerun")
    (halt,) = events(log, "halt")
    assert (halt["step"], halt["rule"], halt["kind"]) == (FAULT, "rerun", "transient")
    assert halt["params"] == rerun["params"] == PARAMS
    assert halt["kinds"] == dict.fromkeys(PARAMS, "nan")
    assert halt["reason"].startswith(
        f"the rerun section (transient: halt) computed step {FAULT} again, asked by nonfinite, and the second "
        "computation differed from the first (max relative difference inf; loss nan then "
    )
    assert "a transient fault, not the model's" in halt["reason"]
    assert "set rerun.transient: continue" in halt["reason"]


def test_the_gradient_halt_of_a_transient_fault_says_what_happened(halted: tuple[Path, GradientHalt]) -> None:
    _, halt = halted
    assert (halt.step, halt.rule, halt.kind) == (FAULT, "rerun", "transient")
    assert list(halt.params) == PARAMS
    message = str(halt)
    assert message.startswith(f"transient fault (the step computed again differed) at step {FAULT} in 4 parameter(s)")
    assert f"the rerun section (transient: halt) computed step {FAULT} again" in message
    assert "drain the node" in message
