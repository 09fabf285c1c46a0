"""The logs' side of the ``loss`` section: ``gradguard audit`` lists and plots its verdicts, ``suggest`` proposes
a ``spike.factor`` from the recorded losses, and ``replay`` gives the guard's own verdicts."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from gradguard import GradGuard, GradientHalt, Policy
from gradguard.audit.filters import Filters
from gradguard.audit.plot import PlotCollector
from gradguard.audit.reader import ReadStats, read_merged
from gradguard.cli import main
from gradguard.tuning import replay_files, suggest_files
from gradguard.tuning.records import Recording, recorded_steps
from gradguard.tuning.replay import Replayer

RECORD = {"name": "record-norms", "match": "*", "actions": [{"action": "monitor", "stats": ["norm"], "every": 1}]}
SKIP = {"name": "nonfinite", "match": "*", "actions": [{"action": "skip_step_on_nonfinite"}]}


def policy(loss: dict[str, Any] | None, recovery: dict[str, Any] | None = None) -> Policy:
    data: dict[str, Any] = {"version": 1, "rules": [SKIP, RECORD]}
    if loss is not None:
        data["loss"] = loss
    if recovery is not None:
        data["recovery"] = recovery
    return Policy.from_dict(data)


def train(log: Path, guard_policy: Policy, poison: Callable[[int], float], steps: int = 300) -> list[int]:
    """A falling, noisy regression loss; ``poison(step)`` multiplies it (NaN: added, the gradients stay finite).

    Returns the steps the guard skipped (a halt ends the run)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)  # a spike's update is no larger than another's
    target = nn.Linear(8, 1)
    skipped = []
    with GradGuard(model, guard_policy, logger=None, audit_log=log) as guard:
        for step in range(steps):
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
            with torch.no_grad():
                y = 3.0 * target(x) + 0.3 * torch.randn(8, 1, generator=torch.Generator().manual_seed(10_000 + step))
            bad = poison(step)
            loss = nn.functional.mse_loss(model(x), y)
            loss = loss + torch.tensor(bad) if math.isnan(bad) else loss * bad
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            try:
                opt.step()
            except GradientHalt:
                break
            if guard.last_step_skipped:
                skipped.append(step)
    return skipped


def events(log: Path, kind: str) -> list[dict[str, Any]]:
    return [e for line in log.read_text().splitlines() if (e := json.loads(line))["event"] == kind]


SPIKES = {150: 50.0, 220: 20.0}
NANS = {180}


def poisoned(step: int) -> float:
    return math.nan if step in NANS else SPIKES.get(step, 1.0)


SECTION = {"nonfinite": "skip", "spike": {"factor": 5, "window": 50, "warmup": 50}}


def test_audit_lists_loss_spikes_and_non_finite_losses_as_skipped_steps_of_the_loss_section(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    assert train(log, policy(SECTION), poisoned) == [150, 180, 220]
    result = CliRunner().invoke(main, ["audit", str(log)])
    assert result.exit_code == 1, result.output  # skipped steps are a finding
    text = result.stdout
    assert "3 steps skipped by the guard (rule loss 3) at steps 150, 180, 220" in text
    assert "loss spikes (largest" in text
    assert "non-finite losses: 1" in text
    section = text.split("Loss spikes and non-finite losses (the loss section)")[1].split("\n\n")[0]
    spike_line = next(line for line in section.splitlines() if line.strip().startswith("loss spike"))
    assert spike_line.split()[2:5] == ["skip", "2", "150,"], spike_line
    spike = max(events(log, "loss_spike"), key=lambda e: e["loss"] / e["reference"])
    assert f"{spike['loss'] / spike['reference']:.3g}x @ {spike['step']}" in spike_line
    nan_line = next(line for line in section.splitlines() if line.strip().startswith("non-finite loss"))
    assert nan_line.split()[2:6] == ["skip", "1", "180", "nan"], nan_line
    assert "MISMATCH" not in text
    assert re.search(r"\n  loss +spike +2\n  loss +nonfinite +1\n", text), "the counters, reproduced"

    data = json.loads(CliRunner().invoke(main, ["audit", str(log), "--format", "json"]).stdout)
    rows = {(row["kind"], row["action"]): row for row in data["loss"]}
    assert rows[("spike", "skip")]["steps"]["steps"] == [150, 220]
    assert rows[("spike", "skip")]["largest_step"] == spike["step"]
    assert rows[("spike", "skip")]["largest_ratio"] == pytest.approx(spike["loss"] / spike["reference"])
    assert rows[("nonfinite", "skip")]["values"] == {"nan": 1}
    assert data["skips"]["steps"] == [150, 180, 220]
    markdown = CliRunner().invoke(main, ["audit", str(log), "--format", "markdown"]).stdout
    assert "### Loss spikes and non-finite losses (the loss section)" in markdown


@pytest.mark.parametrize(
    ("loss", "poison", "kind"),
    [
        ({"nonfinite": "halt"}, lambda step: math.nan if step == 60 else 1.0, "nan"),
        (
            {"spike": {"factor": 5, "window": 20, "warmup": 20, "action": "halt"}},
            lambda s: 50.0 if s == 60 else 1.0,
            "spike",
        ),
    ],
    ids=["nan", "spike"],
)
def test_a_loss_halt_is_listed_and_its_counters_are_reproduced_without_a_mismatch(
    loss: dict[str, Any], poison: Callable[[int], float], kind: str, tmp_path: Path
) -> None:
    log = tmp_path / "run.jsonl"
    train(log, policy(loss), poison, steps=80)
    text = CliRunner().invoke(main, ["audit", str(log)]).stdout
    assert f"step 60: rule 'loss' halted on {kind}" in text
    assert re.search(r"\n  loss +halt +1\n", text)
    assert "MISMATCH" not in text
    assert "1 halt (exit 1)" in text


def test_audit_plot_draws_the_loss_beside_the_norms_with_the_spikes_marked(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    train(log, policy(SECTION), poisoned)
    collector = PlotCollector(Filters(), [], "clip_norm")
    collector.add_all(read_merged([log], ReadStats()))
    xs, values, _, _ = collector.loss.points()
    recorded = [e["loss"] for e in events(log, "stats") if isinstance(e["loss"], float)]
    assert len(xs) == len(recorded) == 299, "every step's finite loss, the NaN left out"
    assert max(values) == pytest.approx(max(recorded))
    assert [(step, action) for step, _, _, action in collector.loss_spikes] == [(150, "skip"), (220, "skip")]
    assert collector.loss_nonfinite.points()[0] == [180.0]
    assert collector.skips.points()[0] == [150.0, 180.0, 220.0]
    pytest.importorskip("matplotlib")
    picture = tmp_path / "run.png"
    result = CliRunner().invoke(main, ["audit", str(log), "--plot", str(picture)])
    assert f"plot written to {picture}" in result.stderr
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_suggest_proposes_a_loss_factor_that_catches_a_20x_spike_and_flags_no_ordinary_step(tmp_path: Path) -> None:
    """A falling, noisy loss with one 20x spike: measured against a running median, as the guard's reference."""
    log = tmp_path / "run.jsonl"
    train(log, policy(None), lambda step: 20.0 if step == 250 else 1.0)
    suggestion = suggest_files([log], loss=True)
    assert suggestion.loss is not None
    suggested = suggestion.policy
    assert suggested.loss is not None
    assert suggested.loss.spike is not None
    factor = suggested.loss.spike.factor
    assert 2.0 <= factor <= 10.0
    assert (suggested.loss.nonfinite, suggested.loss.spike.window, suggested.loss.spike.action) == ("skip", 100, "skip")
    replay = replay_files(suggested, [log])
    flagged = {entry.action: entry.steps for entry in replay.actions if entry.rule == "loss"}
    assert flagged == {"nonfinite": [], "spike": [250]}, "the spike, and no ordinary step"
    assert suggestion.loss.spikes == [250]
    text = suggestion.text
    assert "against the median of the 100 before it" in text
    assert f"# factor: {factor:.3g} = " in text
    assert "never above 10" in text
    assert "On the recorded run it skips 1 of 300 recorded steps" in text
    whole_run = torch.tensor([e["loss"] for e in events(log, "stats")]).median().item()
    assert any(e["loss"] > factor * whole_run for e in events(log, "stats")[:30]), (
        "the whole run's median would flag the early losses: the running median does not"
    )


def test_suggest_proposes_no_loss_section_from_a_log_without_losses(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    train(log, policy(None), lambda step: 1.0, steps=60)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    for line in lines:
        line.pop("loss", None)
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert suggest_files([log]).policy.loss is None, "without --loss, no loss section"
    suggestion = suggest_files([log], loss=True)
    assert suggestion.loss is None
    assert suggestion.policy.loss is None
    assert "# No loss section: the log holds no loss" in suggestion.text


@pytest.mark.parametrize(
    "loss",
    [
        SECTION,
        {"nonfinite": "halt", "spike": {"factor": 5, "window": 50, "warmup": 50, "action": "skip"}},
        {"nonfinite": "ignore", "spike": {"factor": 3, "window": 30, "warmup": 10, "max_consecutive_skips": 1}},
        {"spike": {"factor": 5, "window": 50, "warmup": 50, "action": "halt"}},
    ],
    ids=["skips", "nan-halts", "tight-with-limit", "spike-halts"],
)
def test_replaying_a_run_s_own_loss_section_gives_the_guard_s_own_verdicts(
    loss: dict[str, Any], tmp_path: Path
) -> None:
    log = tmp_path / "run.jsonl"
    train(
        log,
        policy(loss),
        lambda step: SPIKES.get(step, 3.0 if step in (100, 101) else 1.0) if step not in NANS else math.nan,
    )
    guard_steps = {
        "spike": [e["step"] for e in events(log, "loss_spike")],
        "nonfinite": [e["step"] for e in events(log, "loss_nonfinite")],
    }
    result = replay_files(Policy.from_dict({"version": 1, "rules": [SKIP, RECORD], "loss": loss}), [log])
    replayed = {entry.action: entry.steps for entry in result.actions if entry.rule == "loss"}
    assert replayed == {kind: guard_steps[kind] for kind in replayed}
    assert any(replayed.values()), "the run gives the section something to judge"
    halts = events(log, "halt")
    if halts:
        assert result.halt is not None
        assert (result.halt.step, result.halt.rule) == (halts[0]["step"], "loss")
        assert result.halt.reason == halts[0]["reason"]
    else:
        assert result.halt is None
    one = Replayer(result_policy := Policy.from_dict({"version": 1, "rules": [SKIP, RECORD], "loss": loss}))
    assert one.in_blocks, "a loss section does not stop the blocks"
    one.in_blocks = False
    recording = Recording()
    for recorded in recorded_steps([log], recording):
        if not one.feed(recorded):
            break
    assert one.result(recording).as_json() == replay_files(result_policy, [log]).as_json()


def test_a_loss_section_replayed_on_a_log_without_losses_is_undecidable(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    train(log, policy(None), lambda step: 1.0, steps=30)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    log.write_text("".join(json.dumps({k: v for k, v in line.items() if k != "loss"}) + "\n" for line in lines))
    result = replay_files(policy(SECTION), [log])
    assert [(u.rule, u.action) for u in result.undecidable] == [("loss", "nonfinite"), ("loss", "spike")]
    assert "the log holds no loss" in result.undecidable[0].reason


def test_a_clean_runs_log_says_the_loss_was_watched_and_its_audit_that_nothing_fired(tmp_path: Path) -> None:
    log = tmp_path / "clean.jsonl"
    rules = [{"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}]
    policy = Policy.from_dict({"version": 1, "rules": rules, "loss": {"spike": {"factor": 10, "warmup": 2}}})
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradGuard(model, policy, logger=None, audit_log=log):
        for _ in range(10):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
    (attach,) = [e for line in log.read_text().splitlines() if (e := json.loads(line))["event"] == "attach"]
    assert policy.loss is not None
    assert attach["loss"] == policy.loss.model_dump(mode="json")
    assert "rerun" not in attach
    result = CliRunner().invoke(main, ["audit", str(log)])
    assert result.exit_code == 0, result.output
    assert "Loss spikes and non-finite losses (the loss section)" in result.output
    assert "watched at every step: no spike, no non-finite loss" in result.output
