"""An ``exclude`` that excludes nothing is warned about, with the nearest names (#50 item 2): at attach (a
GuardWarning), in ``gradguard explain --model`` and in ``gradguard validate --model``. A rule's ``match`` that matches
nothing is an error already; an exclude with a typo left the tensor it was written for with both rules' clips.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from torch import nn

from gradguard import GradGuard, GuardWarning, Policy
from gradguard.cli import main


class Tagger(nn.Module):
    """A token embedding and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 3)


def _policy(exclude: str, **rest: Any) -> dict[str, Any]:
    """The embedding clipped hard; the rest clipped by a rule meant to leave the embedding out."""
    return {
        "version": 1,
        "rules": [
            {"name": "embedding", "match": ["embed.*"], "actions": [{"action": "clip_norm", "max_norm": 0.1}]},
            {
                "name": "rest",
                "match": ["*"],
                "exclude": [exclude],
                **rest,
                "actions": [{"action": "clip_norm", "max_norm": 1.0}],
            },
        ],
    }


MODELS = """
from torch import nn


def tagger():
    model = nn.Module()
    model.embed = nn.Embedding(10, 4)
    model.head = nn.Linear(4, 3)
    return model
"""


def test_attaching_with_an_exclude_that_excludes_nothing_warns_naming_the_rule_the_pattern_and_the_nearest_names() -> (
    None
):
    with pytest.warns(GuardWarning) as caught:
        GradGuard(Tagger(), Policy.from_dict(_policy("embd.*"))).remove()
    [warning] = [str(record.message) for record in caught]
    assert "rule 'rest': exclude 'embd.*' excludes nothing" in warning
    assert "Nearest of them: embed.weight" in warning
    assert "Fix the pattern, or remove it" in warning


def test_an_exclude_that_excludes_a_parameter_attaches_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradGuard(Tagger(), Policy.from_dict(_policy("embed.*"))).remove()


def test_a_rule_written_for_models_that_may_lack_the_name_is_not_warned_about() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradGuard(Tagger(), Policy.from_dict(_policy("embd.*", allow_no_match=True))).remove()


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
    """A policy file whose exclude has a typo, and the model's MODULE:CALLABLE."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models.py").write_text(MODELS, encoding="utf-8")
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(_policy("embd.*")), encoding="utf-8")
    return policy, "models.py:tagger"


def test_explain_with_a_model_lists_the_exclude_that_excludes_nothing(files: tuple[Path, str]) -> None:
    policy, model = files
    table = CliRunner().invoke(main, ["explain", str(policy), "--model", model])
    assert table.exit_code == 0, table.output
    assert "Warnings GradGuard would give when attaching" in table.output
    assert "exclude 'embd.*' excludes nothing" in table.output
    done = CliRunner().invoke(main, ["explain", str(policy), "--model", model, "--format", "json"])
    [warning] = json.loads(done.output)["warnings"]
    assert "Nearest of them: embed.weight" in warning


def test_validate_with_a_model_warns_of_the_exclude_and_still_exits_0(files: tuple[Path, str]) -> None:
    policy, model = files
    done = CliRunner().invoke(main, ["validate", str(policy), "--model", model])
    assert done.exit_code == 0, done.output
    assert f"{policy}: warning: {policy}:" in done.output
    assert "rule 'rest': exclude 'embd.*' excludes nothing" in done.output


def test_validate_with_a_model_refuses_a_rule_that_matches_nothing_as_attaching_would(
    files: tuple[Path, str], tmp_path: Path
) -> None:
    _, model = files
    policy = tmp_path / "typo.yaml"
    data = _policy("embed.*")
    data["rules"][0]["match"] = ["embd.*"]
    policy.write_text(yaml.safe_dump(data), encoding="utf-8")
    done = CliRunner().invoke(main, ["validate", str(policy), "--model", model])
    assert done.exit_code == 1, done.output
    assert f"{policy}: does not bind to {model}" in done.output
    assert "rule 'embedding' matches no parameter of the model" in done.output
