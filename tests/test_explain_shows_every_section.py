"""``gradguard explain --model`` shows every top-level section of the policy as ``explain`` without a model does:
the loss section's spike skip was left out with a model (#50 item 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from gradguard.cli import main

POLICY = {
    "version": 1,
    "rules": [{"name": "nonfinite", "match": ["*"], "actions": [{"action": "halt_on_nonfinite"}]}],
    "loss": {"nonfinite": "skip", "spike": {"factor": 4.0, "window": 50, "warmup": 20}},
    "rerun": {"on": ["loss"]},
}

MODELS = """
from torch import nn


def mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
"""

SPIKE_SKIP = "a loss above 4x the median of the last 50 applied steps' losses skips the step (judged once 20 losses"


@pytest.fixture
def policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models.py").write_text(MODELS, encoding="utf-8")
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(POLICY), encoding="utf-8")
    return path


def test_explain_with_a_model_shows_the_loss_section_s_spike_skip(policy: Path) -> None:
    done = CliRunner().invoke(main, ["explain", str(policy), "--model", "models.py:mlp"])
    assert done.exit_code == 0, done.output
    assert "The loss section" in done.output
    assert SPIKE_SKIP in done.output
    assert "The rerun section" in done.output


def test_explain_shows_the_loss_section_in_the_same_words_with_a_model_and_without(policy: Path) -> None:
    alone = CliRunner().invoke(main, ["explain", str(policy)])
    with_model = CliRunner().invoke(main, ["explain", str(policy), "--model", "models.py:mlp"])
    lines = [line.strip() for line in alone.output.splitlines() if line.strip().startswith(("loss:", "a NaN/Inf loss"))]
    assert len(lines) == 2
    assert all(line in with_model.output for line in lines)


def test_explain_s_json_with_a_model_carries_the_loss_and_rerun_sections(policy: Path) -> None:
    done = CliRunner().invoke(main, ["explain", str(policy), "--model", "models.py:mlp", "--format", "json"])
    found = json.loads(done.output)
    assert found["loss"]["spike"]["factor"] == 4.0
    assert found["loss"]["nonfinite"] == "skip"
    assert found["rerun"]["on"] == ["loss"]
