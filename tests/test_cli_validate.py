"""``gradguard validate``: policy files checked from the command line, without torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from gradguard.cli import main

REPO = Path(__file__).resolve().parent.parent
SHIPPED = sorted(str(path) for path in (REPO / "policies").iterdir() if not path.name.endswith(".schema.json"))

BAD_YAML = textwrap.dedent(
    """\
    version: 1
    rules:
      - name: embeddings
        match: ["*embed*"]
        actions:
          - {action: clip_norm, max_norm: -1.0}
          - {action: clip, limit: 0.5}
      - name: everything
        mtch: ["*"]
        actions:
          - {action: halt_on_nonfinite}
    """
)


@pytest.fixture
def bad_policy(tmp_path: Path) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD_YAML)
    return path


def test_every_shipped_policy_validates_with_exit_0() -> None:
    """Each shipped policy is reported ok with its rule names, and the command exits 0."""
    result = CliRunner().invoke(main, ["validate", *SHIPPED])
    assert result.exit_code == 0, result.output
    for path in SHIPPED:
        assert f"{path}: ok (" in result.output
    assert "nonfinite, embeddings, attention, router, warmup-global" in result.output
    assert f"{len(SHIPPED)} of {len(SHIPPED)} policy files valid" in result.output


def test_validating_the_whole_policies_folder_skips_the_json_schema_beside_the_policies() -> None:
    """`gradguard validate policies/*` says the shipped JSON Schema is skipped and still exits 0."""
    everything = sorted(str(path) for path in (REPO / "policies").iterdir())
    schema = str(REPO / "policies" / "gradguard-policy.schema.json")
    assert schema in everything
    result = CliRunner().invoke(main, ["validate", *everything])
    assert result.exit_code == 0, result.output
    assert f"{schema}: skipped (a JSON Schema for editors, not a policy)" in result.output
    assert f"{len(SHIPPED)} of {len(SHIPPED)} policy files valid" in result.output


def test_an_invalid_policy_prints_each_error_with_file_line_field_and_fix(bad_policy: Path) -> None:
    """Every problem of a bad file is printed as file:line: field: what was given and what to write; exit 1."""
    result = CliRunner().invoke(main, ["validate", str(bad_policy)])
    assert result.exit_code == 1
    out = result.output
    assert f"{bad_policy}: invalid policy (4 problems):" in out
    assert f"{bad_policy}:6: rules[0].actions[0].max_norm: got -1.0; expected a number greater than 0" in out
    assert f"{bad_policy}:7: rules[0].actions[1]: unknown action 'clip' (did you mean 'clip_norm'?)" in out
    assert f"{bad_policy}:9: rules[1].mtch: unknown field 'mtch' (did you mean 'match'?)" in out
    assert "missing required field 'match'; add it" in out
    assert "Traceback" not in out


def test_a_mix_of_good_and_bad_files_reports_each_and_exits_1(bad_policy: Path) -> None:
    """All files are checked even after a bad one, with a count of the valid ones at the end."""
    good = str(REPO / "policies" / "default.yaml")
    result = CliRunner().invoke(main, ["validate", str(bad_policy), good])
    assert result.exit_code == 1
    assert f"{good}: ok (3 rules: nonfinite, explosions, health)" in result.output
    assert "1 of 2 policy files valid" in result.output


def test_syntax_errors_in_json_and_toml_are_located(tmp_path: Path) -> None:
    """A JSON or TOML syntax error names the file and line, and exits 1 without a traceback."""
    broken_json = tmp_path / "p.json"
    broken_json.write_text('{"version": 1,\n "rules": [}\n')
    broken_toml = tmp_path / "p.toml"
    broken_toml.write_text("version = 1\n[[rules]\nname = 'x'\n")
    result = CliRunner().invoke(main, ["validate", str(broken_json), str(broken_toml)])
    assert result.exit_code == 1
    assert f"{broken_json}:2: JSON syntax error" in result.output
    assert f"{broken_toml}:2: TOML syntax error" in result.output
    assert "Traceback" not in result.output


def test_a_missing_file_is_a_usage_error_with_exit_2(tmp_path: Path) -> None:
    """A path that does not exist is refused before anything is checked, with exit code 2."""
    result = CliRunner().invoke(main, ["validate", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2
    assert "does not exist" in result.output


def test_validate_without_arguments_is_a_usage_error() -> None:
    """Calling validate with no file prints the usage and exits 2."""
    result = CliRunner().invoke(main, ["validate"])
    assert result.exit_code == 2
    assert "Usage: main validate [OPTIONS] POLICIES..." in result.output


def test_every_command_has_help() -> None:
    """--help works on the group and on every command, and mentions the exit codes."""
    runner = CliRunner()
    top = runner.invoke(main, ["--help"])
    assert top.exit_code == 0
    assert "Exit codes: 0 ok; 1 findings; 2 usage or input error." in top.output
    for command in ("validate", "explain", "audit", "demo"):
        result = runner.invoke(main, [command, "--help"])
        assert result.exit_code == 0, command
        assert "Usage:" in result.output


def test_validate_as_a_subprocess_never_imports_torch(bad_policy: Path) -> None:
    """Run in a fresh interpreter, validate answers without torch ever being imported."""
    good = str(REPO / "policies" / "default.yaml")
    probe = textwrap.dedent(
        f"""
        import sys
        from click.testing import CliRunner
        from gradguard.cli import main
        result = CliRunner().invoke(main, ["validate", {good!r}, {str(bad_policy)!r}])
        assert result.exit_code == 1, result.output
        print("torch imported:", "torch" in sys.modules)
        """
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "torch imported: False" in done.stdout


def test_the_gradguard_script_validates_without_loading_torch(bad_policy: Path) -> None:
    """`python -m gradguard.cli validate` in a subprocess gives exit codes 0 and 1 and never loads torch (what
    keeps it quick: counted by -X importtime, not timed; the subprocess timeout is a hang guard)."""
    command = [sys.executable, "-X", "importtime", "-m", "gradguard.cli", "validate"]
    good = subprocess.run([*command, *SHIPPED], capture_output=True, text=True, timeout=60, check=False)
    assert good.returncode == 0, good.stderr
    assert " torch" not in good.stderr.replace("|", " ")  # -X importtime lists every module imported
    bad = subprocess.run([*command, str(bad_policy)], capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 1
    assert "unknown action 'clip'" in bad.stdout


def test_validate_names_the_top_level_sections_it_accepted_besides_the_rules(tmp_path):
    """A policy with a recovery section: ``ok (1 rule: nonfinite; and a recovery section)``."""
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "version: 1\nrules:\n  - {name: nonfinite, match: ['*'], actions: [{action: halt_on_nonfinite}]}\n"
        "recovery: {snapshot_every: 50}\n"
    )
    result = CliRunner().invoke(main, ["validate", str(policy)])
    assert result.exit_code == 0, result.output
    assert f"{policy}: ok (1 rule: nonfinite; and a recovery section)" in result.output


def test_a_rerun_section_that_can_never_fire_is_a_warning_with_exit_0(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "version: 1\nrules:\n  - {name: nonfinite, match: ['*'], actions: [{action: halt_on_nonfinite}]}\n"
        "rerun:\n  on: [spike]\n"
    )
    result = CliRunner().invoke(main, ["validate", str(policy)])
    assert result.exit_code == 0, result.output
    assert f"{policy}: warning: rerun: on ['spike'] can never fire" in result.output
    assert "add a rule with skip_step_on_spike, or take ['spike'] out of rerun.on" in result.output


def test_a_rerun_verdict_the_policy_gives_is_not_warned_about(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "version: 1\nrules:\n  - {name: nonfinite, match: ['*'], actions: [{action: halt_on_nonfinite}]}\n"
        "rerun:\n  on: [nonfinite, loss]\n"
    )
    result = CliRunner().invoke(main, ["validate", str(policy)])
    assert result.exit_code == 0, result.output
    assert "warning: rerun: on ['nonfinite', 'loss']: ['loss'] can never fire" in result.output
    assert "add a loss section" in result.output


def test_a_pattern_without_a_dot_is_not_warned_about_without_a_model(tmp_path: Path) -> None:
    """'ok' is right for a parameter of the model itself and wrong for one inside a module: only a model tells
    which (tests/test_warnings_are_right.py holds what validate --model and the guard say)."""
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "version: 1\nrules:\n  - {name: clip, match: ['ok', '*.weight'], allow_no_match: true,"
        " actions: [{action: clip_norm, max_norm: 1.0}]}\n"
    )
    result = CliRunner().invoke(main, ["validate", str(policy)])
    assert result.exit_code == 0, result.output
    assert "warning" not in result.output


def test_the_shipped_policies_validate_without_a_warning() -> None:
    result = CliRunner().invoke(main, ["validate", *SHIPPED])
    assert result.exit_code == 0, result.output
    assert "warning" not in result.output
