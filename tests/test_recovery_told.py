"""What is told after a rewind: the monitors' current figures, the attach event, a resumed run's row in the audit.

A NaN at step 23 with ``recovery: {snapshot_every: 5, keep: 2, min_age: 3, skip_steps: 4}`` rewinds to step 20 and
skips steps 24-27. The fault step's figures are in its ``stats`` event, never the current ones in
``guard.metrics()``; an audit counts a resumed run's own steps, not the steps before it started.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from support.training import events_of
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradguard import GradGuard, Policy
from gradguard.cli import main

RECOVERY = {"snapshot_every": 5, "keep": 2, "min_age": 3, "skip_steps": 4}
RULES = [
    {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
    {"name": "health", "match": "*", "actions": [{"action": "monitor", "stats": ["norm"]}]},
]


def health_norms(metrics: dict[str, float]) -> dict[str, float]:
    return {key: value for key, value in metrics.items() if key.startswith("gradguard/health/norm/")}


def test_the_health_figures_after_a_rewind_are_never_the_fault_steps_nan(tmp_path: Path) -> None:
    """Steps 23-27 (the fault and its window): guard.metrics() shows the last applied step's figures, not NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    policy = Policy.from_dict({"version": 1, "rules": RULES, "recovery": RECOVERY})
    audit = tmp_path / "run.jsonl"
    shown: list[dict[str, float]] = []
    with GradGuard(model, policy, logger=None, audit_log=audit) as guard:
        for step in range(32):
            x = torch.randn(4, 8)
            if step == 23:
                x[0, 0] = float("nan")
            opt.zero_grad()
            nn.functional.mse_loss(model(x), torch.zeros(4, 1)).backward()
            opt.step()
            shown.append(health_norms(guard.metrics()))
    assert guard.state_dict()["recovery"]["rewinds"] == 1
    assert all(shown[step] == shown[22] for step in range(23, 28)), "the window shows the last applied step's"
    assert all(not math.isnan(value) for figures in shown for value in figures.values())
    assert shown[28] != shown[22]  # the first step applied again has figures of its own
    (fault,) = [e for e in events_of(audit, "stats") if e["step"] == 23]  # its figures are logged all the same
    assert any(value == "NaN" or value != value for value in fault["figures"]["norm"].values())


def test_a_skipped_steps_nan_figures_are_not_shown_as_the_current_ones() -> None:
    """skip_step_on_nonfinite at step 3, a monitor sampling steps 0 and 3: steps 3 and 4 show step 0's figures."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rules = [
        {"name": "nonfinite", "match": "*", "actions": [{"action": "skip_step_on_nonfinite"}]},
        {"name": "health", "match": "*", "actions": [{"action": "monitor", "stats": ["norm"], "every": 3}]},
    ]
    shown: list[dict[str, float]] = []
    with GradGuard(model, Policy.from_dict({"version": 1, "rules": rules}), logger=None) as guard:
        for step in range(5):
            x = torch.randn(3, 4)
            if step == 3:
                x[0, 0] = float("nan")
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            shown.append(health_norms(guard.metrics()))
    assert guard.counters.snapshot()["nonfinite"]["skip_step_on_nonfinite"] == 1
    assert shown[0]
    assert shown[3] == shown[4] == shown[0]


def test_the_audit_row_of_a_resumed_run_counts_the_steps_it_ran(tmp_path: Path) -> None:
    """A guard resumed at step 65 that runs 55 steps: its row reads 65-119 (55 steps), not 120."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    audit = tmp_path / "resumed.jsonl"
    policy = Policy.from_dict({"version": 1, "rules": RULES[:1]})
    with GradGuard(model, policy, logger=None, audit_log=audit, start_step=65, summary_every=1):
        for _ in range(55):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
    result = CliRunner().invoke(main, ["audit", str(audit), "--format", "json"])
    (run,) = json.loads(result.output)["runs"]
    assert (run["first_step"], run["last_step"], run["steps"]) == (65, 119, 55)
    text = CliRunner().invoke(main, ["audit", str(audit)]).output
    assert "65-119 (55 steps)" in text


@pytest.mark.filterwarnings(
    "ignore:.*does not have many workers:UserWarning", "ignore:.*isinstance\\(treespec, LeafSpec\\).*"
)
def test_a_lightning_fits_attach_event_counts_the_schedulers_the_callback_hands_over(tmp_path: Path) -> None:
    """The attach event's recovery says "schedulers": 1 for configure_optimizers' scheduler."""
    pl = pytest.importorskip("lightning.pytorch")
    from gradguard.integrations.lightning import GradGuardCallback

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1)}

    audit = tmp_path / "run.jsonl"
    policy = Policy.from_dict({"version": 1, "rules": RULES[:1], "recovery": RECOVERY})
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
    trainer = pl.Trainer(
        max_steps=2,
        callbacks=[GradGuardCallback(policy, logger=None, audit_log=audit)],
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(Net(), data)
    (attach,) = events_of(audit, "attach")
    assert attach["recovery"]["schedulers"] == 1
