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


def test_an_unknown_name_is_no_such_policy_and_says_that_a_path_works_where_the_name_was_given() -> None:
    """Not "invalid policy" (nothing was read), and not Policy.from_file: GradGuard takes a file's path as it is."""
    with pytest.raises(PolicyError) as caught:
        GradGuard(torch.nn.Linear(3, 2), "defualt", logger=None)
    message = str(caught.value)
    assert message.startswith("no such policy:\n"), message
    assert "Policy.from_file" not in message
    assert "give its path where you gave the name (GradGuard(model, 'my-policy.yaml'))" in message


def test_a_missing_policy_file_says_where_it_was_looked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A path that is not there: the error names the file it looked for, resolved from the working directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PolicyError) as caught:
        GradGuard(torch.nn.Linear(3, 2), "configs/my-policy.yaml", logger=None)
    message = str(caught.value)
    assert message.startswith("no such policy:\n"), message
    assert f"no such file (looked for {tmp_path / 'configs' / 'my-policy.yaml'})" in message


def test_validate_and_explain_take_a_shipped_name_and_refuse_an_unknown_one_with_a_suggestion(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from gradguard.cli import main

    runner = CliRunner()
    ok = runner.invoke(main, ["validate", "default", "llm-pretraining"])
    assert ok.exit_code == 0, ok.output
    assert "default: ok (3 rules: nonfinite, explosions, health)" in ok.output
    unknown = runner.invoke(main, ["validate", "defualt"])
    assert unknown.exit_code == 2
    assert "no shipped policy is called that (did you mean 'default'?)" in unknown.output
    models = tmp_path / "models.py"
    models.write_text("import torch\n\ndef build():\n    return torch.nn.Linear(4, 2)\n")
    explained = runner.invoke(main, ["explain", "default", "--model", f"{models}:build", "--format", "json"])
    assert explained.exit_code == 0, explained.output
    assert '"weight"' in explained.output


@pytest.mark.parametrize("framework", ["lightning", "transformers"])
def test_the_integrations_callbacks_take_a_shipped_name(framework: str) -> None:
    pytest.importorskip(framework)
    if framework == "lightning":
        from gradguard.integrations.lightning import GradGuardCallback
    else:
        from gradguard.integrations.transformers import GradGuardCallback  # type: ignore[assignment]
    assert GradGuardCallback("vision").policy == Policy.shipped("vision")
