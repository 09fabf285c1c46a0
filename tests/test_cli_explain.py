"""``gradguard explain POLICY --model MODULE:CALLABLE``: which parameter gets which rules and actions."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from gradguard import GradGuard, Policy
from gradguard.cli import main
from gradguard.cli.demo import TinyDecoder

REPO = Path(__file__).resolve().parent.parent
LLM_POLICY = REPO / "policies" / "llm-pretraining.yaml"

MODELS = textwrap.dedent(
    """\
    from torch import nn


    def build():
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 6), nn.Linear(6, 10, bias=False))
        model[2].weight = model[0].weight  # tied: one tensor, names 0.weight and 2.weight
        model[1].bias.requires_grad_(False)
        return model


    def broken():
        return 1 / 0


    def not_a_model():
        return [1, 2, 3]


    def needs_arguments(width):
        return nn.Linear(width, width)


    NOT_CALLABLE = 3
    """
)

POLICY = textwrap.dedent(
    """\
    version: 1
    rules:
      - name: nonfinite
        match: ["*"]
        actions:
          - {action: halt_on_nonfinite}
      - name: dense
        match: ["1.*"]
        until_step: 500
        actions:
          - {action: clip_norm, max_norm: 1.0, norm_type: .inf}
          - {action: scale, factor: 0.5}
      - name: router
        match: ["*router*"]
        actions:
          - {action: clip_value, limit: 0.1}
    """
)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "explain_models.py").write_text(MODELS)
    (tmp_path / "policy.yaml").write_text(POLICY)
    (tmp_path / "allowed.yaml").write_text(
        POLICY.replace('match: ["*router*"]', 'match: ["*router*"]\n    allow_no_match: true')
    )
    (tmp_path / "partial.yaml").write_text(
        "version: 1\nrules:\n  - {name: dense, match: ['1.*'], actions: [{action: clip_norm, max_norm: 1.0}]}\n"
    )
    return tmp_path


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["explain", *args])
    return result.exit_code, result.output


def test_the_table_lists_every_parameter_with_its_rules_and_actions(project: Path) -> None:
    """Each tensor is listed once with shape, dtype, its rules and its actions in application order."""
    _code, out = invoke(str(project / "policy.yaml"), "--model", f"{project / 'explain_models.py'}:build")
    assert "3 parameter tensors (4 names), 70 elements; 3 covered by a rule, 0 not covered" in out
    rows = {line.split()[0]: line for line in out.splitlines() if "float32" in line}
    assert "(10, 4)" in rows["0.weight"]
    assert "float32" in rows["0.weight"]
    assert "tied: also 2.weight" in rows["0.weight"]
    assert "halt_on_nonfinite" in rows["0.weight"]
    assert "clip_norm" not in rows["0.weight"]
    dense = "halt_on_nonfinite; clip_norm(1.0, norm_type=inf) [rule until step 500]; scale(0.5) [rule until step 500]"
    assert dense in rows["1.weight"]
    assert "nonfinite, dense" in rows["1.weight"]
    assert "(6, 4)" in rows["1.weight"]
    assert "(6,)" in rows["1.bias"]
    assert "frozen (requires_grad=False)" in rows["1.bias"]
    assert "0.weight = 2.weight: rules nonfinite" in out


def test_a_rule_that_matches_nothing_is_a_finding_with_exit_1(project: Path) -> None:
    """A rule without allow_no_match that covers no parameter is flagged, with the guard's own error, and exits 1."""
    code, out = invoke(str(project / "policy.yaml"), "--model", f"{project / 'explain_models.py'}:build")
    assert code == 1
    assert "MATCHES NOTHING" in out
    assert "Rules that match nothing\n  router\n" in out
    assert "rule 'router' matches no parameter of the model" in out
    assert f"{project / 'policy.yaml'}:13: rules[2].match" in out
    assert "1 problem(s) (exit 1)" in out


def test_allow_no_match_makes_an_empty_rule_fine(project: Path) -> None:
    """With allow_no_match, the empty rule is shown as allowed and the command exits 0."""
    code, out = invoke(str(project / "allowed.yaml"), "--model", f"{project / 'explain_models.py'}:build")
    assert code == 0, out
    assert "matches nothing (allowed: allow_no_match)" in out
    assert "router (allow_no_match: true)" in out
    assert "Problems GradGuard would raise when attaching\n  none" in out


def test_parameters_no_rule_covers_are_listed(project: Path) -> None:
    """Parameters outside every rule are named, under all their names."""
    code, out = invoke(str(project / "partial.yaml"), "--model", f"{project / 'explain_models.py'}:build")
    assert code == 0, out
    assert "Parameters no rule covers (the guard never touches their gradients)\n  0.weight, 2.weight\n" in out
    assert "- (not covered)" in out


def test_json_output_is_complete_and_machine_readable(project: Path) -> None:
    """--format json gives every parameter with names, shape, dtype, rules and actions, plus rules, ties, issues."""
    code, out = invoke(
        str(project / "policy.yaml"), "--model", f"{project / 'explain_models.py'}:build", "--format", "json"
    )
    assert code == 1
    data = json.loads(out)
    params = {entry["name"]: entry for entry in data["parameters"]}
    assert list(params) == ["0.weight", "1.weight", "1.bias"]
    assert params["0.weight"]["names"] == ["0.weight", "2.weight"]
    assert params["1.weight"]["shape"] == [6, 4]
    assert params["1.weight"]["dtype"] == "float32"
    assert params["1.weight"]["rules"] == ["nonfinite", "dense"]
    actions = [(a["rule"], a["action"]) for a in params["1.weight"]["actions"]]
    assert actions == [("nonfinite", "halt_on_nonfinite"), ("dense", "clip_norm"), ("dense", "scale")]
    assert params["1.weight"]["actions"][1]["norm_type"] == "Infinity"
    assert params["1.bias"]["requires_grad"] is False
    rules = {rule["name"]: rule for rule in data["rules"]}
    assert rules["router"]["matches_nothing"] is True
    assert rules["dense"]["params"] == 2
    assert rules["dense"]["until_step"] == 500
    assert data["tied"] == [["0.weight", "2.weight"]]
    assert data["uncovered"] == []
    assert len(data["issues"]) == 1
    assert data["exit_code"] == 1


def test_explain_agrees_with_what_a_guard_binds() -> None:
    """For the demo decoder and the shipped LLM policy, explain's rules per parameter equal guard.guarded."""
    code, out = invoke(str(LLM_POLICY), "--model", "gradguard.cli.demo:TinyDecoder", "--format", "json")
    assert code == 0, out
    data = json.loads(out)
    shown = {entry["name"]: tuple(entry["rules"]) for entry in data["parameters"] if entry["rules"]}
    with GradGuard(TinyDecoder(), Policy.from_file(LLM_POLICY), logger=None) as guard:
        assert shown == guard.guarded
    assert data["tied"] == [["embed.weight", "head.weight"]]


def test_markdown_output_has_pipe_tables(project: Path) -> None:
    """--format markdown renders the same sections as Markdown tables."""
    code, out = invoke(
        str(project / "allowed.yaml"), "--model", f"{project / 'explain_models.py'}:build", "--format", "markdown"
    )
    assert code == 0
    assert out.startswith("## gradguard explain")
    assert "### Parameters (model order; actions apply in this order at every step)" in out
    assert "| parameter | shape | dtype | rules | actions | note |" in out


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("explain_models", "expected MODULE:CALLABLE"),
        (
            "explain_models:nope",
            "has no attribute 'nope' (callables defined there: broken, build, needs_arguments, not_a_model)",
        ),
        ("explain_models:NOT_CALLABLE", "is not callable (it is a 'int' object)"),
        ("explain_models:broken", "calling explain_models:broken() failed: ZeroDivisionError: division by zero (at "),
        ("explain_models:not_a_model", "explain_models:not_a_model() returned a list, not a torch.nn.Module"),
        ("explain_models:needs_arguments", "missing 1 required positional argument: 'width'"),
        ("no_such_module_anywhere:build", "no module named 'no_such_module_anywhere'"),
        ("missing/file.py:build", "no such file 'missing/file.py'"),
    ],
)
def test_a_bad_model_spec_is_an_input_error_with_exit_2(
    project: Path, monkeypatch: pytest.MonkeyPatch, spec: str, message: str
) -> None:
    """Every way MODULE:CALLABLE can fail gives one clear line on stderr, exit 2, and no traceback."""
    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(project))
    code, out = invoke("policy.yaml", "--model", spec)
    assert code == 2, out
    assert message in out
    assert "Traceback" not in out
    sys.modules.pop("explain_models", None)


def test_an_invalid_policy_is_an_input_error(project: Path) -> None:
    """explain refuses a policy that does not validate, printing its problems, with exit 2."""
    bad = project / "bad.yaml"
    bad.write_text("version: 2\nrules: []\n")
    code, out = invoke(str(bad), "--model", f"{project / 'explain_models.py'}:build")
    assert code == 2
    assert f"{bad}:1: version: got 2; expected 1" in out
    assert "Traceback" not in out


def test_explain_as_a_subprocess_imports_the_model_from_the_working_directory(project: Path) -> None:
    """`python -m gradguard.cli explain` run where the user's module lives finds it, as `python -m` would."""
    done = subprocess.run(
        [sys.executable, "-m", "gradguard.cli", "explain", "allowed.yaml", "--model", "explain_models:build"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "model: explain_models:build -> Sequential: 3 parameter tensors (4 names)" in done.stdout
    assert done.stderr == ""


RECOVERY_POLICY = textwrap.dedent(
    """\
    version: 1
    rules:
      - name: nonfinite
        match: ["*"]
        actions:
          - {action: halt_on_nonfinite, max_scaler_skips: 8}
      - name: spikes
        match: ["1.*"]
        actions:
          - {action: skip_step_on_spike, max_consecutive_skips: 3}
      - name: dense
        match: ["1.*"]
        actions:
          - {action: clip_norm, max_norm: 1.0}
    recovery:
      snapshot_every: 100
      keep: 3
      lr_factor: 0.5
    """
)


def test_the_recovery_section_is_told_in_words_with_the_bytes_a_snapshot_holds(project: Path) -> None:
    """With `recovery`, explain says what it will do (every, keep, min_age, skip, max rewinds, lr factor), which
    rules rewind and how, and the bytes a snapshot holds for this model; a real guard's attach event agrees."""
    (project / "recovery.yaml").write_text(RECOVERY_POLICY)
    args = (str(project / "recovery.yaml"), "--model", f"{project / 'explain_models.py'}:build")
    code, out = invoke(*args)
    assert code == 0, out
    section = out.split("Recovery (a halt becomes a rewind to an in-memory snapshot; the run goes on)\n", 1)[1]
    section = section.split("\n\n", 1)[0]
    assert (
        "one every 100 steps (at each step that is a multiple of 100, before its update), the newest 3 kept" in section
    )
    assert "back to the newest snapshot at least 10 steps older than the fault" in section
    assert "the next 10 steps are skipped" in section
    assert "at most 3 rewinds in a run; the next halt restores the snapshot, then halts" in section
    assert "lr_factor 0.5: every param group's LR" in section
    assert (
        "rule 'nonfinite' (3 params) rewinds on halt_on_nonfinite: a NaN/Inf gradient, or a GradScaler skip at a "
        "loss scale of 1 or less, or more than 8 GradScaler skips in a row"
    ) in section
    assert (
        "rule 'spikes' (2 params) rewinds on skip_step_on_spike past its limits (more than 3 skips in a row)" in section
    )
    assert "dense" not in section  # a clip cannot halt
    # Embedding(10, 4) tied with the last Linear's weight (once), Linear(4, 6): (40 + 24 + 6) float32 elements.
    assert "each snapshot holds the parameters and buffers: 280 bytes; 3 of them: 840 bytes" in section
    # AdamW: two moments and a float32 step per trainable tensor (the frozen bias has none).
    assert "with Adam or AdamW 520 bytes more per snapshot, 2.34 KiB (2,400 bytes) in all" in section

    _code, out = invoke(*args, "--format", "json")
    recovery = json.loads(out)["recovery"]
    assert {key: recovery[key] for key in ("snapshot_every", "keep", "min_age", "skip_steps", "max_rewinds")} == {
        "snapshot_every": 100,
        "keep": 3,
        "min_age": 10,
        "skip_steps": 10,
        "max_rewinds": 3,
    }
    assert recovery["lr_factor"] == 0.5
    assert [entry["rule"] for entry in recovery["rules_that_rewind"]] == ["nonfinite", "spikes"]
    assert recovery["snapshot_bytes"]["per_snapshot"] == 280
    assert recovery["snapshot_bytes"]["all_snapshots"] == 840

    # What the guard itself says: the attach event's estimate, and the bytes its snapshots hold after a step.
    sys.path.insert(0, str(project))
    try:
        from explain_models import build  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(project))
        sys.modules.pop("explain_models", None)
    model = build()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    every_step = project / "every-step.yaml"
    every_step.write_text(RECOVERY_POLICY.replace("snapshot_every: 100", "snapshot_every: 1"))
    policy = Policy.from_file(every_step)
    log = project / "guard.jsonl"
    with GradGuard(model, policy, logger=None, audit_log=log) as guard:
        for _ in range(2):
            for param in model.parameters():  # the tied shapes make no forward: gradients by hand
                param.grad = torch.ones_like(param) if param.requires_grad else None
            optimizer.step()
        held = guard.metrics()["gradguard/recovery/snapshot_bytes"]
    attach = json.loads(log.read_text().splitlines()[0])
    assert attach["recovery"]["snapshot_bytes"] == recovery["snapshot_bytes"]["all_snapshots"]
    assert held == 280 + (280 + 520)  # step 0's snapshot (no optimizer state yet) and step 1's (AdamW's)


def test_a_policy_without_recovery_has_no_recovery_section(project: Path) -> None:
    """No `recovery`: no section, and null in the JSON."""
    args = (str(project / "allowed.yaml"), "--model", f"{project / 'explain_models.py'}:build")
    _code, out = invoke(*args)
    assert "Recovery" not in out
    _code, out = invoke(*args, "--format", "json")
    assert json.loads(out)["recovery"] is None


def test_explain_without_a_model_explains_the_policy_and_says_what_a_model_would_add(tmp_path: Path) -> None:
    """``gradguard explain POLICY``: its rules, its recovery section in words, and what ``--model`` would add."""
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "version: 1\n"
        "rules:\n"
        "  - {name: nonfinite, match: ['*'], actions: [{action: halt_on_nonfinite}]}\n"
        "  - {name: embed, match: ['*embed*'], exclude: ['*norm*'], actions: [{action: clip_norm, max_norm: 0.5}]}\n"
        "recovery: {snapshot_every: 50, skip_steps: 5}\n"
    )
    result = CliRunner().invoke(main, ["explain", str(policy)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "top-level sections: rules, recovery" in out
    assert "no model given" in out
    assert "nonfinite  *" in out
    assert "*embed* (except *norm*)  clip_norm(0.5)" in out
    assert "The recovery section" in out
    assert "recovery: snapshot_every 50, keep 2" in out
    assert "the next 5 steps are skipped" in out
    assert "rules that can halt, and so rewind: nonfinite" in out
    assert "What a model adds\n  with --model MODULE:CALLABLE: each parameter of the model" in out
    data = json.loads(CliRunner().invoke(main, ["explain", str(policy), "--format", "json"]).output)
    assert data["model"] is None
    assert data["sections"] == ["rules", "recovery"]
    assert data["recovery"]["snapshot_every"] == 50
    assert [rule["name"] for rule in data["rules"]] == ["nonfinite", "embed"]
    shipped = CliRunner().invoke(main, ["explain", "default", "--format", "markdown"])
    assert shipped.exit_code == 0, shipped.output
    assert "### Rules (in the order they apply" in shipped.output


LOSS_AND_RECOVERY = (
    "version: 1\n"
    "rules:\n"
    "  - {name: clip, match: ['*'], actions: [{action: clip_norm, max_norm: 1.0}]}\n"
    "loss: {nonfinite: halt, spike: {factor: 5.0, action: skip, max_consecutive_skips: 2}}\n"
    "recovery: {snapshot_every: 50}\n"
)


def test_explain_lists_the_loss_section_among_what_can_halt_and_so_rewind(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(LOSS_AND_RECOVERY)
    result = CliRunner().invoke(main, ["explain", str(policy)])
    assert result.exit_code == 0, result.output
    assert (
        "rules that can halt, and so rewind: the loss section (nonfinite: halt: a NaN/Inf loss; spike skips past "
        "their limits (more than 2 spike skips in a row))" in result.output
    )


def test_explain_with_a_model_says_the_loss_section_rewinds_and_lists_it_in_json(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(LOSS_AND_RECOVERY)
    (tmp_path / "explain_models.py").write_text(MODELS)
    model = f"{tmp_path / 'explain_models.py'}:build"
    result = CliRunner().invoke(main, ["explain", str(policy), "--model", model])
    assert result.exit_code == 0, result.output
    assert "the loss section rewinds on nonfinite: halt: a NaN/Inf loss" in result.output
    as_json = CliRunner().invoke(main, ["explain", str(policy), "--model", model, "--format", "json"])
    rewinding = json.loads(as_json.output)["recovery"]["rules_that_rewind"]
    assert rewinding[-1]["rule"] == "loss"
    assert rewinding[-1]["how"][0] == "nonfinite: halt: a NaN/Inf loss"
