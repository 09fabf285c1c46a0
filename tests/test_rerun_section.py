"""The policy's ``rerun`` section: a suspect step is computed again where the guard holds its closure; a fault that
does not come back was transient and the run goes on, bitwise as if it never happened; one that does stands."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gradguard import GradGuard, GradientHalt, Policy

HALT = {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}
STEPS = 40
FAULT = 30
RECOVERY = {"snapshot_every": 5, "keep": 2, "min_age": 3, "skip_steps": 4}


def policy(rerun: dict[str, Any] | None, recovery: dict[str, Any] | None = None) -> Policy:
    data: dict[str, Any] = {"version": 1, "rules": [HALT]}
    if rerun is not None:
        data["rerun"] = rerun
    if recovery is not None:
        data["recovery"] = recovery
    return Policy.from_dict(data)


class Net(nn.Module):
    """With dropout: a second computation is the same only if the random numbers are."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.tanh(self.inp(x))))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)


def events(log: Path, kind: str) -> list[dict[str, Any]]:
    return [e for line in log.read_text().splitlines() if (e := json.loads(line))["event"] == kind]


Faults = Callable[[int, int], bool]
"""``(step, computation) -> poison``: computation 1 is the first run of the step's closure, 2 the second."""


def train(
    faults: Faults, rerun: dict[str, Any] | None, log: Path | None = None, recovery: dict[str, Any] | None = None
) -> tuple[Net, torch.optim.Optimizer, GradGuard]:
    torch.manual_seed(1)  # the dropout masks' stream
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with GradGuard(model, policy(rerun, recovery), logger=None, audit_log=log) as guard:
        for step in range(STEPS):
            calls = [0]

            def closure(step: int = step, calls: list[int] = calls) -> torch.Tensor:
                calls[0] += 1
                x, y = batch(step)
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                if faults(step, calls[0]):
                    loss = loss * float("nan")
                loss.backward()
                return loss

            opt.step(closure)
    return model, opt, guard


def same(a: tuple[Net, torch.optim.Optimizer, GradGuard], b: tuple[Net, torch.optim.Optimizer, GradGuard]) -> None:
    for p, q in zip(a[0].parameters(), b[0].parameters(), strict=True):
        assert torch.equal(p, q)
    for x, y in zip(a[1].state.values(), b[1].state.values(), strict=True):
        assert all(torch.equal(x[key], y[key]) for key in x)
    assert torch.equal(torch.get_rng_state(), torch.get_rng_state())


def test_a_nan_in_the_first_computation_only_is_transient_and_the_run_ends_as_if_it_never_happened(
    tmp_path: Path,
) -> None:
    log = tmp_path / "run.jsonl"
    got = train(lambda step, call: step == FAULT and call == 1, {}, log)
    rng_after_fault = torch.get_rng_state()
    clean = train(lambda step, call: False, {}, None)
    assert torch.equal(rng_after_fault, torch.get_rng_state()), "the second computation drew what the first did"
    same(got, clean)
    (rerun,) = events(log, "rerun")
    assert (rerun["step"], rerun["verdict"], rerun["asked"]) == (FAULT, "transient", "nonfinite")
    assert rerun["loss_first"] == "NaN"
    assert rerun["ranks"] == [0]
    assert got[2].counters.snapshot()["rerun"] == {"transient": 1}
    assert got[2].step_count == STEPS
    assert not events(log, "halt")


def test_a_nan_in_both_computations_is_reproducible_and_the_halt_says_so(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    with pytest.raises(GradientHalt, match="reproducible") as caught:
        train(lambda step, call: step == FAULT, {}, log)
    assert caught.value.step == FAULT
    assert caught.value.rule == "nonfinite"
    (rerun,) = events(log, "rerun")
    assert rerun["verdict"] == "reproducible"


def test_a_reproducible_fault_under_recovery_rewinds_exactly() -> None:
    got = train(lambda step, call: step == FAULT, {}, None, RECOVERY)
    assert got[2].counters.snapshot()["rerun"] == {"reproducible": 1}
    assert got[2].counters.snapshot()["nonfinite"]["rewind"] == 1
    assert got[2].step_count == STEPS


def test_transient_halt_halts_on_a_transient_fault_and_says_so(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    with pytest.raises(GradientHalt, match="transient fault") as caught:
        train(lambda step, call: step == FAULT and call == 1, {"transient": "halt"}, log)
    assert (caught.value.step, caught.value.rule, caught.value.kind) == (FAULT, "rerun", "transient")
    (halt,) = events(log, "halt")
    assert halt["kind"] == "transient"


def test_a_plain_loop_without_a_closure_keeps_the_verdict_and_says_once_that_it_could_not_rerun(
    tmp_path: Path,
) -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    log = tmp_path / "run.jsonl"
    skip = {"name": "skip", "match": "*", "actions": [{"action": "skip_step_on_nonfinite"}]}
    with GradGuard(model, Policy.from_dict({"version": 1, "rules": [skip], "rerun": {}}), logger=None, audit_log=log):
        for step in range(6):
            x, y = batch(step)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y) * (float("nan") if step in (2, 4) else 1.0)
            loss.backward()
            opt.step()
    (note,) = events(log, "rerun_unavailable")
    assert note["step"] == 2
    assert "no closure" in note["why"]
    assert len(events(log, "skip")) == 2
    assert not events(log, "rerun")


def test_a_clean_closure_step_is_never_computed_twice() -> None:
    computations = []
    got = train(lambda step, call: computations.append(call) is not None, {}, None)
    assert computations == [1] * STEPS
    assert "rerun" not in got[2].counters.snapshot()


def test_a_lightning_fit_with_automatic_optimization_reruns_a_transient_fault(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from gradguard.integrations.lightning import GradGuardCallback

    def fit(fault: bool, log: Path | None) -> Any:
        class Module(pl.LightningModule):  # type: ignore[misc,name-defined]
            def __init__(self) -> None:
                super().__init__()
                self.net = Net()
                self.calls: dict[int, int] = {}

            def training_step(self, data: Any, index: int) -> torch.Tensor:
                x, y = data
                self.calls[index] = self.calls.get(index, 0) + 1
                loss = nn.functional.mse_loss(self.net(x), y)
                return loss * float("nan") if fault and index == 5 and self.calls[index] == 1 else loss

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.SGD(self.parameters(), lr=0.05)

        torch.manual_seed(2)
        xs, ys = zip(*(batch(step) for step in range(10)), strict=True)
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=16
        )
        module = Module()
        callback = GradGuardCallback(policy({}), logger=None, audit_log=log)
        trainer = pl.Trainer(
            max_epochs=1, callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False
        )
        trainer.fit(module, loader)
        return module

    log = tmp_path / "run.jsonl"
    faulty, clean = fit(True, log), fit(False, None)
    (rerun,) = events(log, "rerun")
    assert rerun["verdict"] == "transient"
    for p, q in zip(faulty.parameters(), clean.parameters(), strict=True):
        assert torch.equal(p, q)


def test_the_rerun_cost_benchmark_runs_and_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        import rerun_cost
    finally:
        sys.path.pop(0)
    threads = torch.get_num_threads()
    try:
        assert rerun_cost.main(["--quick"]) == 0
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "| guard + rerun |" in printed
    assert "| suspect |" in printed


def test_the_audit_lists_the_re_runs_and_the_ranks_whose_faults_were_transient(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from gradguard.cli import main

    log = tmp_path / "run.jsonl"
    train(lambda step, call: step == FAULT and call == 1, {}, log)
    result = CliRunner().invoke(main, ["audit", str(log)])
    assert result.exit_code == 0, result.output
    assert "Re-runs (the rerun section)" in result.output
    assert "transient faults by rank (a rank with many is a suspect device): rank 0 1 (steps 30)" in result.output
    data = json.loads(CliRunner().invoke(main, ["audit", str(log), "--format", "json"]).output)
    assert data["reruns"][0]["verdict"] == "transient"
    assert "mismatches" not in data or not data["mismatches"]
