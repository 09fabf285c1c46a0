"""The audit's step ranges are the steps each run ran, from its guard's first step to its last: not from the first
step that wrote an event (a clean step writes none), in the header, the Runs table, the JSON and the plot's axis."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from gradguard import GradGuard, GradientHalt, Policy
from gradguard.audit.filters import Filters
from gradguard.audit.reader import ReadStats, read_merged
from gradguard.audit.summarizer import Summarizer
from gradguard.cli import main

POLICY = {
    "version": 1,
    "rules": [
        {"name": "nonfinite", "match": ["*"], "actions": [{"action": "halt_on_nonfinite"}]},
        {"name": "clip", "match": ["*"], "actions": [{"action": "clip_norm", "max_norm": 100.0}]},
    ],
}
STEPS = 60
CLIP_STEP = 30
"""The only step whose gradients are large enough to clip: the run's first intervention."""


def train(log: Path, *, start_step: int = 0, nan_step: int | None = None, summary_every: int = 1000) -> int:
    """A real guarded run of ``STEPS`` steps from ``start_step`` (a tiny ``nn.Linear``); the steps it took."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    taken = 0
    policy = Policy.from_dict(POLICY)
    with GradGuard(
        model, policy, audit_log=log, logger=None, summary_every=summary_every, start_step=start_step
    ) as guard:
        for step in range(start_step, start_step + STEPS):
            x = torch.ones(8, 4) * (1000.0 if step == start_step + CLIP_STEP else 1.0)
            if step == nan_step:
                x[0, 0] = float("nan")
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()  # type: ignore[no-untyped-call]
            try:
                optimizer.step()
            except GradientHalt:
                break
            taken += 1
    assert guard.counters.snapshot()["clip"] == {"clip_norm": 2}
    return taken


def audit(*paths: Path) -> tuple[str, dict[str, Any]]:
    runner = CliRunner()
    table = runner.invoke(main, ["audit", *map(str, paths)])
    data = json.loads(runner.invoke(main, ["audit", "--format", "json", *map(str, paths)]).stdout)
    return table.output, data


def test_the_audit_of_a_run_whose_first_intervention_is_at_step_30_reports_steps_0_to_59(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    assert train(log) == STEPS
    written = [json.loads(line) for line in log.read_text().splitlines()]
    first_with_a_step = min(event["step"] for event in written if "step" in event)
    assert first_with_a_step == CLIP_STEP, "the log's first stepped event is the clip (no counters event before it)"
    output, data = audit(log)
    header = output.splitlines()[1]
    assert "; steps 0-59;" in header, header
    assert "0-59 (60 steps)" in output
    (run,) = data["runs"]
    assert (run["first_step"], run["last_step"], run["steps"]) == (0, 59, 60)
    assert (data["first_step"], data["last_step"]) == (0, 59)


def test_the_audit_of_a_halted_run_reports_the_steps_from_0_to_the_halt(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    assert train(log, nan_step=45) == 45
    output, data = audit(log)
    assert "; steps 0-45;" in output.splitlines()[1]
    assert "0-45 (46 steps)" in output
    assert "halted at step 45" in output
    (run,) = data["runs"]
    assert (run["first_step"], run["last_step"], run["steps"]) == (0, 45, 46)


def test_the_audit_of_a_resumed_run_reports_the_steps_from_the_one_it_started_at(tmp_path: Path) -> None:
    first, resumed = tmp_path / "first.jsonl", tmp_path / "resumed.jsonl"
    train(first)
    train(resumed, start_step=STEPS)
    output, data = audit(first, resumed)
    assert "; steps 0-119;" in output.splitlines()[1]
    assert "60-119 (60 steps)" in output
    ranges = sorted((run["first_step"], run["last_step"], run["steps"]) for run in data["runs"])
    assert ranges == [(0, 59, 60), (60, 119, 60)]


def test_the_audit_of_a_log_cut_before_its_attach_event_starts_at_the_first_step_it_holds(tmp_path: Path) -> None:
    """Without the attach event the first step is not known: the first event's stands (the detach gives the last)."""
    log = tmp_path / "run.jsonl"
    train(log)
    lines = log.read_text().splitlines()
    assert json.loads(lines[0])["event"] == "attach"
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(lines[1:]) + "\n")
    _, data = audit(cut)
    (run,) = data["runs"]
    assert (run["first_step"], run["last_step"]) == (CLIP_STEP, 59)


def test_an_attach_event_without_start_step_reads_as_a_run_from_step_0(tmp_path: Path) -> None:
    """A log of a guard that did not write ``start_step`` yet (older logs) still reads: its runs start at 0."""
    log = tmp_path / "run.jsonl"
    train(log)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    del lines[0]["start_step"]
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps(line) + "\n" for line in lines))
    output, data = audit(old)
    assert data["bad_lines_total"] == 0
    assert (data["runs"][0]["first_step"], data["runs"][0]["last_step"]) == (0, 59)
    assert "0-59 (60 steps)" in output


def test_the_plot_of_a_run_spans_the_steps_it_ran_not_just_those_with_events(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from gradguard.audit.plot import PlotCollector, draw_figure

    log = tmp_path / "run.jsonl"
    train(log)
    for filters, span in ((Filters(), (0, 59)), (Filters(since=20, until=40), (20, 40))):
        summarizer = Summarizer([str(log)], ReadStats(), filters)
        summarizer.add_all(read_merged([log], ReadStats()))
        summary = summarizer.summary()
        collector = PlotCollector(filters, ["weight"], "clip_norm")
        collector.add_all(read_merged([log], ReadStats()))
        figure = draw_figure(collector, summary, "run")
        assert figure.axes[-1].get_xlim() == (span[0] - 0.5, span[1] + 0.5)
        assert figure.get_suptitle().startswith("run: steps 0-59,")
