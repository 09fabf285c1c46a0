"""The commands that read only files (a policy, a log) answer without importing torch (#51 item 3).

Importing torch is most of such a command's time (1.2 to 1.4 s of a 1.5 s `gradguard explain` on 2 busy
cores), so each command runs in a fresh interpreter, on a log a real guarded run wrote and on every shipped
policy, and says whether ``torch`` ended up in ``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.four_families import MONITOR_RULE, Schedule, record_run

from gradguard.policy.shipped import shipped_policies

SHIPPED = [policy.name for policy in shipped_policies()]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 120-step run of a real guard with a monitor of every tensor's norm and one spike, as suggest needs."""
    log = tmp_path_factory.mktemp("recorded") / "run.jsonl"
    record_run(log, {"version": 1, "rules": [MONITOR_RULE]}, Schedule(120, spikes={60: "huge"}))
    return log


def _run(*args: str) -> tuple[int, bool, str]:
    """Run ``gradguard ARGS`` in a fresh interpreter, in-process there: its exit code, whether torch was imported,
    and its output."""
    probe = textwrap.dedent(
        f"""
        import json, sys
        from click.testing import CliRunner
        from gradguard.cli import main
        result = CliRunner().invoke(main, {list(args)!r})
        print(json.dumps([result.exit_code, "torch" in sys.modules, result.output]))
        """
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    code, torch_imported, output = json.loads(done.stdout.splitlines()[-1])
    return code, torch_imported, output


@pytest.mark.parametrize("policy", SHIPPED)
def test_validate_and_explain_of_a_shipped_policy_never_import_torch(policy: str) -> None:
    for command in ("validate", "explain"):
        code, torch_imported, output = _run(command, policy)
        assert code == 0, output
        assert not torch_imported, f"gradguard {command} {policy} imported torch"


def test_audit_of_a_real_run_s_log_never_imports_torch(recorded: Path) -> None:
    code, torch_imported, output = _run("audit", str(recorded))
    assert code == 0, output
    assert "1 run" in output
    assert not torch_imported


def test_explain_with_a_model_does_import_torch_so_the_probe_can_tell(tmp_path: Path) -> None:
    """The probe is not blind: a command that builds a model reports torch imported."""
    models = tmp_path / "models.py"
    models.write_text("from torch import nn\n\ndef build():\n    return nn.Linear(2, 2)\n")
    code, torch_imported, output = _run("explain", "default", "--model", f"{models}:build")
    assert code == 0, output
    assert torch_imported


def test_suggest_on_a_real_run_s_log_never_imports_torch(recorded: Path) -> None:
    code, torch_imported, output = _run("suggest", str(recorded))
    assert code == 0, output
    assert not torch_imported


@pytest.mark.parametrize("policy", ["per-tensor-clip", "llm-pretraining"])
def test_replay_of_a_shipped_policy_on_a_real_run_s_log_never_imports_torch(recorded: Path, policy: str) -> None:
    code, torch_imported, output = _run("replay", policy, str(recorded))
    assert code == 0, output
    assert not torch_imported


@pytest.mark.parametrize("policy", ["llm-adaptive", "default"])
def test_replay_of_a_policy_with_an_adaptive_action_imports_torch_for_the_guard_s_own_decisions(
    recorded: Path, policy: str
) -> None:
    """zclip, autoclip and skip_step_on_spike decide with the guard's own torch functions (their float64 means and
    ring sums are torch's reductions): torch is imported for such a policy only (llm-adaptive has all three; the
    shipped default a zclip)."""
    code, torch_imported, output = _run("replay", policy, str(recorded))
    assert code in (0, 1), output
    assert torch_imported
