"""``gradguard replay`` of a policy's ``recovery`` section, on the logs of real guarded runs: a halt the section
turns into a rewind does not end the replay, the skip window is skipped, and the halts that go through (no
snapshot old enough, ``max_rewinds`` reached) carry the guard's own reason."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from gradguard import GradGuard, GradientHalt, Policy
from gradguard.cli import main
from gradguard.tuning.replay import ReplayResult, replay_files

RECORD = {"name": "record-norms", "match": ["*"], "actions": [{"action": "monitor", "stats": ["norm"], "every": 1}]}
HALT = {"name": "nonfinite", "match": ["*"], "actions": [{"action": "halt_on_nonfinite"}]}
SKIP = {"name": "nonfinite", "match": ["*"], "actions": [{"action": "skip_step_on_nonfinite"}]}
RECOVERY = {"snapshot_every": 20, "min_age": 5, "skip_steps": 10}


def _policy(rule: dict[str, Any], recovery: dict[str, Any] | None) -> dict[str, Any]:
    data: dict[str, Any] = {"version": 1, "rules": [rule, RECORD]}
    if recovery is not None:
        data["recovery"] = recovery
    return data


def _run(log: Path, data: dict[str, Any], nan_at: Collection[int], steps: int = 200) -> dict[str, dict[str, int]]:
    """A tiny nn.Linear trained ``steps`` steps with a NaN loss at ``nan_at``; its guard's counters at the end."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with GradGuard(model, Policy.from_dict(data), logger=None, audit_log=log) as guard:
        for step in range(steps):
            if guard.pass_step():
                continue
            x, y = torch.randn(8, 4), torch.randn(8, 1)
            loss = nn.functional.mse_loss(model(x), y)
            if step in nan_at:
                loss = loss * float("nan")
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            try:
                opt.step()
            except GradientHalt:
                break
    return guard.counters.snapshot()


def _counted(result: ReplayResult) -> dict[str, dict[str, int]]:
    """The replay's actions as the guard's counters would hold them (empty actions left out)."""
    counted: dict[str, dict[str, int]] = {}
    for entry in result.actions:
        if entry.steps:
            counted.setdefault(entry.rule, {})[entry.action] = len(entry.steps)
    return counted


def _events(log: Path, name: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line["event"] == name]


@pytest.fixture(scope="module")
def rewound(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], dict[str, dict[str, int]]]:
    """A 200-step run whose NaN at step 150 its recovery section rewound to step 140."""
    log = tmp_path_factory.mktemp("rewound") / "run.jsonl"
    data = _policy(HALT, RECOVERY)
    counters = _run(log, data, {150})
    return log, data, counters


def test_a_rewound_halt_does_not_end_the_replay_which_goes_on_to_the_run_s_last_step(
    rewound: tuple[Path, dict[str, Any], dict[str, dict[str, int]]],
) -> None:
    log, data, _counters = rewound
    result = replay_files(Policy.from_dict(data), [log])
    assert result.halt is None
    assert result.exit_code == 0
    assert result.recording.last_step == 199
    [rewind] = result.rewinds
    [event] = _events(log, "rewind")
    assert (rewind.halt.step, rewind.to_step, rewind.skip_until) == (event["step"], event["to_step"], 161)
    assert event["skip_until"] == 161
    assert result.steps_replayed == 190  # 200 steps less the 10 of the window


def test_the_replay_of_a_rewound_run_counts_what_its_guard_counted(
    rewound: tuple[Path, dict[str, Any], dict[str, dict[str, int]]],
) -> None:
    log, data, counters = rewound
    result = replay_files(Policy.from_dict(data), [log])
    guard_counts = {
        rule: {k: v for k, v in kinds.items() if k not in {"nan", "inf"}} for rule, kinds in counters.items()
    }
    assert _counted(result) == guard_counts == {"nonfinite": {"rewind": 1}, "recovery": {"skip": 10}}
    skip = next(entry for entry in result.actions if entry.rule == "recovery")
    assert skip.steps == list(range(151, 161))


def test_the_cli_says_where_the_replay_rewound_and_that_it_went_on(
    rewound: tuple[Path, dict[str, Any], dict[str, dict[str, int]]], tmp_path: Path
) -> None:
    log, data, _ = rewound
    policy_file = tmp_path / "policy.json"
    policy_file.write_text(json.dumps(data), encoding="utf-8")
    text = CliRunner().invoke(main, ["replay", str(policy_file), str(log)])
    assert text.exit_code == 0, text.output
    assert "rewind at step 150" in text.output
    assert "goes back to the snapshot of step 140 and skips steps 151-160" in text.output
    assert "the replay goes on at step 161" in text.output
    assert "the replay stops there" not in text.output
    assert "not replayed:" in text.output
    assert "lr_factor" in text.output
    as_json = CliRunner().invoke(main, ["replay", str(policy_file), str(log), "--format", "json"])
    report = json.loads(as_json.output)
    assert report["halt"] is None
    assert [(r["step"], r["to_step"], r["skip_until"]) for r in report["rewinds"]] == [(150, 140, 161)]


def test_without_the_recovery_section_the_same_log_halts_at_the_fault(
    rewound: tuple[Path, dict[str, Any], dict[str, dict[str, int]]],
) -> None:
    log, _, _ = rewound
    result = replay_files(Policy.from_dict(_policy(HALT, None)), [log])
    assert result.halt is not None
    assert result.halt.step == 150
    assert result.exit_code == 1
    assert result.rewinds == []


def test_past_max_rewinds_the_replay_halts_where_the_run_halted_with_the_guard_s_reason(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    data = _policy(HALT, {**RECOVERY, "max_rewinds": 1})
    counters = _run(log, data, {60, 150})
    result = replay_files(Policy.from_dict(data), [log])
    [halt_event] = _events(log, "halt")
    assert [rewind.halt.step for rewind in result.rewinds] == [60]
    assert result.halt is not None
    assert result.halt.step == halt_event["step"] == 150
    assert "recovery: max_rewinds (1) reached; restored to step 140's snapshot" in halt_event["reason"]
    assert result.halt.reason.endswith("recovery: max_rewinds (1) reached; restored to step 140's snapshot")
    assert _counted(result)["recovery"] == counters["recovery"] == {"skip": 10}


def test_a_fault_with_no_snapshot_old_enough_halts_in_the_replay_as_in_the_run(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    data = _policy(HALT, RECOVERY)
    _run(log, data, {3})
    [halt_event] = _events(log, "halt")
    result = replay_files(Policy.from_dict(data), [log])
    assert result.halt is not None
    assert result.halt.step == halt_event["step"] == 3
    why = "recovery: no snapshot at least 5 steps older than step 3 (held: [0])"
    assert why in halt_event["reason"]
    assert result.halt.reason.endswith(why)
    assert result.rewinds == []


def test_a_recovery_policy_replayed_on_a_run_that_skipped_instead_says_the_later_norms_are_that_run_s(
    tmp_path: Path,
) -> None:
    log = tmp_path / "run.jsonl"
    _run(log, _policy(SKIP, None), {150})  # the NaN step is skipped and the run goes on: no window in the log
    result = replay_files(Policy.from_dict(_policy(HALT, RECOVERY)), [log])
    [rewind] = result.rewinds
    assert (rewind.halt.step, rewind.to_step, rewind.recorded_in_window) == (150, 140, 10)
    assert result.window_steps == 10
    assert result.steps_replayed == 190
    assert any("did not rewind at step 150" in line for line in result.not_replayed)


def test_a_rerun_section_is_said_to_be_left_out_of_the_replay(
    rewound: tuple[Path, dict[str, Any], dict[str, dict[str, int]]],
) -> None:
    log, data, _ = rewound
    with_rerun = {**data, "rerun": {"on": ["nonfinite"]}}
    result = replay_files(Policy.from_dict(with_rerun), [log])
    assert any(line.startswith("rerun: a log cannot compute a step again") for line in result.not_replayed)
