"""``gradguard audit`` on logs written by real guarded training runs: the totals are the guard's counters."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from gradguard import GradGuard, GradientHalt, Policy
from gradguard.cli import main

POLICY = {
    "version": 1,
    "rules": [
        {"name": "nonfinite", "match": ["*"], "actions": [{"action": "halt_on_nonfinite"}]},
        {"name": "first", "match": ["0.*"], "actions": [{"action": "clip_norm", "max_norm": 0.05}]},
        {"name": "middle", "match": ["2.*"], "actions": [{"action": "clip_norm", "max_norm": 0.05, "scope": "group"}]},
        {"name": "values", "match": ["4.weight"], "actions": [{"action": "clip_value", "limit": 0.01}]},
        {"name": "slow", "match": ["4.bias"], "actions": [{"action": "scale", "factor": 0.5}]},
        {"name": "frozen", "match": ["6.*"], "actions": [{"action": "zero"}]},
    ],
}
NAN_STEP = 33


@dataclass
class Run:
    log: Path
    counters: dict[str, dict[str, int]]
    per_step: list[dict[str, dict[str, int]]]
    """``guard.counters.snapshot()`` after each completed step."""
    halt: GradientHalt | None


def train(log: Path, *, steps: int, nan_step: int | None) -> Run:
    """A real guarded training loop: a small MLP, AdamW, a NaN injected into the input at ``nan_step``."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per_step = []
    halt = None
    with GradGuard(model, Policy.from_dict(POLICY), audit_log=log, logger=None, summary_every=10) as guard:
        for step in range(steps):
            x = torch.randn(16, 4) * (50.0 if step % 7 == 3 else 1.0)
            if step == nan_step:
                x[0, 0] = float("nan")
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), torch.ones(16, 2)) * (20.0 if step % 5 == 0 else 1.0)
            loss.backward()  # type: ignore[no-untyped-call]
            try:
                optimizer.step()
            except GradientHalt as exc:
                halt = exc
                break
            per_step.append(guard.counters.snapshot())
        counters = guard.counters.snapshot()
    return Run(log, counters, per_step, halt)


@pytest.fixture(scope="module")
def halted(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return train(tmp_path_factory.mktemp("real") / "run.jsonl", steps=60, nan_step=NAN_STEP)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return train(tmp_path_factory.mktemp("clean") / "run.jsonl", steps=25, nan_step=None)


def audit_json(*args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(main, ["audit", "--format", "json", *args])
    return result.exit_code, json.loads(result.stdout)


def test_the_json_totals_equal_the_guards_counters_snapshot(halted: Run) -> None:
    """The counters the audit reproduces from the log are exactly guard.counters.snapshot() of that run."""
    assert halted.halt is not None
    assert halted.halt.step == NAN_STEP
    assert {"clip_norm", "clip_value", "scale", "zero", "nan", "halt_on_nonfinite"} <= {
        action for by_action in halted.counters.values() for action in by_action
    }, "the run should exercise every kind of count"
    code, data = audit_json(str(halted.log))
    assert data["totals"] == halted.counters
    assert data["runs"][0]["counters"] == halted.counters
    assert data["mismatches_total"] == 0
    assert code == 1  # the halt and the NaNs are findings


def test_the_summary_tells_where_and_when_the_run_halted(halted: Run) -> None:
    """The halt is reported with its step, rule, parameters and the run's shape; per-rule counts match the guard."""
    assert halted.halt is not None
    _, data = audit_json(str(halted.log))
    (run,) = data["runs"]
    assert run["first_step"] == 0
    assert run["last_step"] == NAN_STEP
    assert run["steps"] == NAN_STEP + 1
    assert run["ended"] == f"halted at step {NAN_STEP}; detached (removed)"
    (halt,) = data["halts"]
    assert halt["step"] == NAN_STEP
    assert halt["rule"] == "nonfinite"
    assert halt["kind"] == "nan"
    assert halt["params"] == list(halted.halt.params)
    assert halt["n_params"] == len(halted.halt.params)
    by_rule = {(row["rule"], row["action"]): row["count"] for row in data["by_rule_action"]}
    assert by_rule[("first", "clip_norm")] == halted.counters["first"]["clip_norm"]
    assert by_rule[("middle", "clip_norm")] == halted.counters["middle"]["clip_norm"]
    assert by_rule[("values", "clip_value")] == halted.counters["values"]["clip_value"]
    assert data["nonfinite"]["events"] == halted.counters["nonfinite"]["nan"]
    assert data["nonfinite"]["steps"] == [NAN_STEP]
    offenders = {row["param"]: row["count"] for row in data["by_param"]}
    assert offenders["0.weight"] + offenders["0.bias"] == halted.counters["first"]["clip_norm"]


def test_a_clean_run_audits_with_exit_0(clean: Run) -> None:
    """A run without NaN, skips or damage has no findings: exit 0, and the totals are still the guard's counters."""
    code, data = audit_json(str(clean.log))
    assert code == 0, data["findings"]
    assert data["findings"] == []
    assert data["totals"] == clean.counters
    assert data["runs"][0]["counters_source"] == "detach event after step 24"


def test_a_log_cut_off_by_a_crash_reproduces_the_counts_up_to_the_cut(halted: Run, tmp_path: Path) -> None:
    """Without detach (the process died), clips come from the events, scale/zero from the last counters event."""
    lines = halted.log.read_text().splitlines(keepends=True)
    events = [json.loads(line) for line in lines]
    last_of_step_24 = max(i for i, event in enumerate(events) if event.get("step") == 24)
    cut = tmp_path / "crashed.jsonl"
    cut.write_text("".join(lines[: last_of_step_24 + 1]) + lines[last_of_step_24 + 1][:25])  # torn mid-write
    code, data = audit_json(str(cut))
    expected = halted.per_step[24]
    at_19 = halted.per_step[19]  # the last counters event before the cut
    for rule, by_action in data["totals"].items():
        for action, count in by_action.items():
            wanted = at_19 if action in {"scale", "zero"} else expected
            assert count == wanted[rule][action], (rule, action)
    assert data["runs"][0]["counters_complete"] is False
    assert data["runs"][0]["ended"] == "no detach event: still running, or the process died"
    (bad,) = data["bad_lines"]
    assert bad["line"] == last_of_step_24 + 2
    assert bad["reason"].startswith("truncated last line")
    assert code == 1


def test_the_gradguard_script_audits_a_real_log(halted: Run) -> None:
    """The installed `gradguard` script (or python -m gradguard.cli) prints the table and exits 1 for the halt."""
    script = shutil.which("gradguard")
    command = [script] if script else [sys.executable, "-m", "gradguard.cli"]
    done = subprocess.run([*command, "audit", str(halted.log)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1, done.stderr
    assert f"step {NAN_STEP}: rule 'nonfinite' halted on nan in" in done.stdout
    assert "Counters reproduced from the log (= guard.counters.snapshot())" in done.stdout
    assert "cross-check: the per-event lines reproduce every clip" in done.stdout
    assert done.stderr == ""


def test_audit_never_imports_torch(halted: Run) -> None:
    """Auditing a log in a fresh interpreter leaves torch unimported."""
    probe = textwrap.dedent(
        f"""
        import sys
        from click.testing import CliRunner
        from gradguard.cli import main
        result = CliRunner().invoke(main, ["audit", {str(halted.log)!r}, "--format", "markdown"])
        assert result.exit_code == 1, result.output
        print("torch imported:", "torch" in sys.modules)
        """
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "torch imported: False" in done.stdout


def test_the_demo_prints_the_audit_command_for_its_own_log(tmp_path: Path) -> None:
    """`gradguard demo` ends with the exact `gradguard audit` command, which then audits its log."""
    log = tmp_path / "demo run.jsonl"
    result = CliRunner().invoke(main, ["demo", "--steps", "4", "--log", str(log)])
    assert result.exit_code == 0, result.output
    last = result.output.rstrip("\n").splitlines()[-1]
    assert last == f"  next: gradguard audit '{log}'"
    code, data = audit_json(str(log))
    assert code == 0
    assert data["runs"][0]["model"] == "TinyDecoder"
    assert data["runs"][0]["steps"] == 4


def test_skipped_steps_and_a_skip_limit_halt_are_reproduced_exactly(tmp_path: Path) -> None:
    """Steps skipped on NaN, then a halt when a skip rule's limit is exceeded: totals and cross-check hold."""
    policy = Policy.from_dict(
        {
            "version": 1,
            "rules": [
                {
                    "name": "skip-a",
                    "match": ["0.*"],
                    "actions": [{"action": "skip_step_on_nonfinite", "max_consecutive_skips": 2}],
                },
                {
                    "name": "skip-b",
                    "match": ["2.*"],
                    "actions": [{"action": "skip_step_on_nonfinite", "max_consecutive_skips": 2}],
                },
                {"name": "clip", "match": ["*"], "actions": [{"action": "clip_norm", "max_norm": 0.01}]},
            ],
        }
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tmp_path / "skips.jsonl"
    halt = None
    with GradGuard(model, policy, audit_log=log, logger=None, summary_every=5) as guard:
        for step in range(20):
            x = torch.randn(8, 4)
            if step in (6, 10, 11, 12):
                x[0, 0] = float("nan")
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()  # type: ignore[no-untyped-call]
            try:
                optimizer.step()
            except GradientHalt as exc:
                halt = exc
                break
        counters = guard.counters.snapshot()
    assert halt is not None
    assert halt.step == 12
    code, data = audit_json(str(log))
    assert code == 1
    assert data["totals"] == counters
    assert data["mismatches"] == []
    assert data["skips"]["steps"] == [6, 10, 11]
    (row,) = data["halts"]
    assert row["step"] == 12
    assert row["rule"] == "skip-a"
    assert row["reason"].startswith("skip limit exceeded: 3 consecutive skipped steps")
