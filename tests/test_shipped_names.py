"""Everything that takes a policy path takes a shipped policy's name too; a path that exists wins."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from gradguard import GradGuard, Policy, PolicyError


def test_a_guard_given_a_shipped_name_loads_that_policy() -> None:
    with GradGuard(torch.nn.Linear(3, 2), "default", logger=None) as guard:
        assert guard.policy == Policy.shipped("default")
        assert guard.policy.rules[0].name == "nonfinite"


def test_a_file_that_exists_wins_over_the_shipped_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("default.yaml").write_text(
        "version: 1\nrules:\n  - {name: mine, match: ['*'], actions: [{action: clip_norm, max_norm: 2.0}]}\n"
    )
    assert [rule.name for rule in Policy.load("default.yaml").rules] == ["mine"]
    assert Policy.load("default") == Policy.shipped("default")  # no file called 'default' here
    Path("default").write_text("not a policy")
    with pytest.raises(PolicyError, match="unsupported file type"):
        Policy.load("default")  # the file wins, and says what is wrong with it
    assert os.fspath(Policy.load(Path("default.yaml")).source) == "default.yaml"


def test_an_unknown_name_lists_the_shipped_policies_with_a_suggestion() -> None:
    with pytest.raises(PolicyError, match=r"no shipped policy is called 'defualt' \(did you mean 'default'\?\)"):
        GradGuard(torch.nn.Linear(3, 2), "defualt", logger=None)
