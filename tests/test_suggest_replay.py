"""``gradguard suggest`` learns a policy from a recorded run; ``gradguard replay`` tries any policy on one.

Real runs of :class:`~support.four_families.FourFamilies` (four families of gradients, 1 : 1e-4 apart,
stationary), recorded by a real :class:`~gradguard.GradGuard`, with spikes and NaNs injected.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner, Result
from support.four_families import MONITOR_RULE, FourFamilies, Schedule, record_run

from gradguard import GradGuard, Policy
from gradguard.audit.plot import policy_thresholds
from gradguard.cli import main
from gradguard.tuning.replay import replay_files
from gradguard.tuning.suggest import suggest_files

SPIKES = {60: "huge", 110: "large", 160: "small", 210: "tiny", 260: "all", 330: "tiny"}
"""A spike in one family at a time, and in all at once."""
FAMILIES = ("huge", "large", "small", "tiny")


def _cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def _monitor_only() -> dict[str, Any]:
    return {"version": 1, "rules": [MONITOR_RULE]}


def _acted_steps(log: Path) -> dict[tuple[str, str], set[int]]:
    """(rule, action) -> the steps of the log's intervention, adaptive_clip, spike_skip and skip events."""
    out: dict[tuple[str, str], set[int]] = {}
    for line in log.read_text().splitlines():
        event = json.loads(line)
        kind = event["event"]
        if kind in ("intervention", "adaptive_clip"):
            key = (event["rule"], event["action"])
        elif kind == "spike_skip":
            key = (event["rule"], "skip_step_on_spike")
        elif kind == "skip":
            key = (event["rule"], "skip_step_on_nonfinite")
        else:
            continue
        out.setdefault(key, set()).add(event["step"])
    return out


def _spiked_rules(steps: dict[str, set[int]], rule_of: dict[str, str]) -> None:
    """Every spike is caught by the rule of every family that spiked."""
    for step, family in SPIKES.items():
        for name in FAMILIES if family == "all" else (family,):
            assert step in steps[rule_of[name]], (step, name, sorted(steps[rule_of[name]]))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 400-step stationary run with spikes, recorded by a monitor alone."""
    log = tmp_path_factory.mktemp("recorded") / "run.jsonl"
    record_run(log, _monitor_only(), Schedule(400, spikes=SPIKES))
    return log


@pytest.fixture(scope="module")
def suggested(recorded: Path) -> Path:
    path = recorded.parent / "suggested.yaml"
    result = _cli("suggest", str(recorded), "-o", str(path))
    assert result.exit_code == 0, result.output
    return path


def _rule_of(policy: Policy) -> dict[str, str]:
    """Family name -> the suggested rule that clips it."""
    out = {}
    for rule in policy.rules:
        for family in FAMILIES:
            if any(f".{family}." in pattern or f"\\.{family}\\." in pattern for pattern in rule.match):
                out[family] = rule.name
    assert set(out) == set(FAMILIES), [rule.match for rule in policy.rules]
    return out


def test_the_suggested_policy_has_one_rule_per_family_and_loads_validates_and_binds(
    suggested: Path, recorded: Path
) -> None:
    """The file loads with Policy.from_file, passes `gradguard validate`, binds to the model without allow_no_match."""
    policy = Policy.from_file(suggested)
    assert not any(rule.allow_no_match for rule in policy.rules)
    rules = _rule_of(policy)
    assert len(set(rules.values())) == 4, "four families four orders of magnitude apart are not merged"
    assert _cli("validate", str(suggested)).exit_code == 0
    model = FourFamilies()
    with GradGuard(model, policy) as guard:
        covered = {name for name, _ in model.named_parameters()}
        assert guard is not None
        assert covered
    nonfinite = next(rule for rule in policy.rules if any(a.action == "skip_step_on_nonfinite" for a in rule.actions))
    assert nonfinite.match == ("*",), "every parameter is covered by a non-finite rule"


def test_the_suggested_policy_s_replay_catches_every_spike_and_acts_on_at_most_1_percent_of_other_steps(
    suggested: Path, recorded: Path
) -> None:
    """On the run it learned from, each family's clip acts on its spikes; all clips on <= 1% of the other steps."""
    result = _cli("replay", str(suggested), str(recorded), "--format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    steps = {entry["rule"]: set(entry["steps"]) for entry in report["actions"]}
    _spiked_rules(steps, _rule_of(Policy.from_file(suggested)))
    others = set().union(*steps.values()) - set(SPIKES)
    assert len(others) <= 0.01 * (400 - len(SPIKES)), sorted(others)
    assert report["undecidable"] == []


def test_a_real_run_with_the_suggested_policy_clips_every_spike_and_at_most_1_percent_of_other_steps(
    suggested: Path, tmp_path: Path
) -> None:
    """A guarded run with the suggestion, on the same data, clips each spike and little else."""
    log = tmp_path / "guarded.jsonl"
    policy = Policy.from_file(suggested)
    run = record_run(log, policy, Schedule(400, spikes=SPIKES))
    assert run.halted_at is None
    assert run.skipped == []
    acted = _acted_steps(log)
    steps = {rule: acted.get((rule, "clip_norm"), set()) for rule in _rule_of(policy).values()}
    _spiked_rules(steps, _rule_of(policy))
    others = set().union(*steps.values()) - set(SPIKES)
    assert len(others) <= 0.01 * (400 - len(SPIKES)), sorted(others)


def test_the_suggested_policy_skips_a_nan_in_the_smallest_family(suggested: Path, tmp_path: Path) -> None:
    """A NaN in the family whose norms are 1e-4 of the largest skips the step; replay names the same step."""
    log = tmp_path / "nan.jsonl"
    policy = Policy.from_file(suggested)
    run = record_run(log, policy, Schedule(120, nans={77: "tiny"}))
    assert run.skipped == [77]
    assert run.halted_at is None
    assert _acted_steps(log)[("nonfinite", "skip_step_on_nonfinite")] == {77}
    replayed = {(entry.rule, entry.action): entry.steps for entry in replay_files(policy, [log]).actions}
    assert replayed[("nonfinite", "skip_step_on_nonfinite")] == [77]


def test_each_number_of_the_suggestion_is_explained_in_a_comment(suggested: Path) -> None:
    """Members, how many norms, the median, the quantile and the recorded steps it acts on, per family."""
    text = suggested.read_text()
    block = text[text.index("# blocks.*.tiny.weight") :]
    block = block[: block.index("max_norm:", block.index("- name"))]
    for needle in ("3 tensors: blocks.0.tiny.weight", "1,200 norms", "median", "% quantile", "acts on", "210"):
        assert needle in block, (needle, block)


def test_replaying_a_run_s_own_policy_gives_exactly_that_run_s_steps(tmp_path: Path) -> None:
    """Per-tensor and group clip_norm, zclip (also after a clip), autoclip, spike skips and NaN skips: exact."""
    policy = Policy.from_dict(
        {
            "version": 1,
            "rules": [
                MONITOR_RULE,
                {"name": "nan", "match": "*", "actions": [{"action": "skip_step_on_nonfinite"}]},
                {
                    "name": "clip",
                    "match": "blocks.*.huge.weight",
                    "actions": [{"action": "clip_norm", "max_norm": 0.5}],
                },
                {
                    "name": "zclip-after-clip",
                    "match": "blocks.*.huge.weight",
                    "actions": [{"action": "zclip", "z_thresh": 0.5, "warmup_steps": 10}],
                },
                {
                    "name": "zclip",
                    "match": "blocks.*.large.weight",
                    "actions": [{"action": "zclip", "z_thresh": 2.0, "warmup_steps": 10}],
                },
                {
                    "name": "autoclip",
                    "match": "blocks.*.small.weight",
                    "actions": [{"action": "autoclip", "percentile": 90, "history": 50}],
                },
                {
                    "name": "group",
                    "match": "blocks.*.tiny.weight",
                    "actions": [{"action": "clip_norm", "max_norm": 8.5e-5, "scope": "group"}],
                },
                {
                    "name": "spike",
                    "match": "blocks.*.large.weight",
                    "actions": [{"action": "skip_step_on_spike", "window": 32, "min_samples": 16, "z_thresh": 4.0}],
                },
                {
                    "name": "spike-per-tensor",
                    "match": "blocks.*.small.weight",
                    "actions": [
                        {
                            "action": "skip_step_on_spike",
                            "window": 32,
                            "min_samples": 16,
                            "z_thresh": 5.0,
                            "scope": "tensor",
                        }
                    ],
                },
            ],
        }
    )
    log = tmp_path / "run.jsonl"
    schedule = Schedule(300, spikes={60: "large", 120: "small", 180: "all", 181: "large"}, nans={90: "tiny"})
    run = record_run(log, policy, schedule)
    actual = _acted_steps(log)
    assert {"clip_norm", "zclip", "autoclip", "skip_step_on_spike", "skip_step_on_nonfinite"} <= {a for _, a in actual}
    assert len(actual[("zclip-after-clip", "zclip")]) > 10, "the chained zclip acts: the test tests it"
    assert ("group", "clip_norm") in actual
    assert 90 in run.skipped
    replayed = {(e.rule, e.action): set(e.steps) for e in replay_files(policy, [log]).actions if e.steps}
    assert replayed == actual


def test_a_log_without_norms_exits_2_with_one_line_naming_the_monitor_to_add(tmp_path: Path) -> None:
    """A run whose policy had no monitor: suggest and replay say which monitor rule to add, exit 2."""
    log = tmp_path / "clip-only.jsonl"
    clip = {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 1.0}]}
    record_run(log, {"version": 1, "rules": [clip]}, Schedule(5))
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nrules:\n  - {name: c, match: '*', actions: [{action: clip_norm, max_norm: 1.0}]}\n")
    for args in (("suggest", str(log)), ("replay", str(policy), str(log))):
        result = _cli(*args)
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1, lines
        assert "monitor" in lines[0], lines
        assert "stats: [norm]" in lines[0], lines


def test_corrupt_log_lines_are_reported_with_their_line_and_skipped(recorded: Path, tmp_path: Path) -> None:
    """A torn or foreign line is a warning naming the file and line; the rest of the log is used."""
    log = tmp_path / "damaged.jsonl"
    lines = recorded.read_text().splitlines(keepends=True)
    log.write_text("".join(lines[:50]) + "{not json\n" + "".join(lines[50:]) + '{"event": "stats", "run"')
    result = CliRunner().invoke(main, ["suggest", str(log)])
    assert result.exit_code == 0, result.output
    assert "unreadable log line" in result.stderr
    assert f"{log}:51" in result.stderr
    Policy.from_dict(yaml.safe_load(result.stdout))


def test_a_policy_that_does_not_load_is_a_clear_error_not_a_traceback(recorded: Path, tmp_path: Path) -> None:
    """replay with an invalid policy file: exit 2, the policy's own error message, no traceback."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nrules:\n  - {name: c, match: '*', actions: [{action: clip_norm, max_norm: -1}]}\n")
    result = _cli("replay", str(bad), str(recorded))
    assert result.exit_code == 2
    assert "max_norm" in result.output
    assert "Traceback" not in result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)


def test_actions_the_log_cannot_decide_are_listed_with_the_reason(recorded: Path, tmp_path: Path) -> None:
    """clip_value without max_abs, agc per output unit, a rule matching no recorded parameter: undecidable."""
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "version: 1\nrules:\n"
        "  - {name: values, match: 'blocks.*', actions: [{action: clip_value, limit: 0.1}]}\n"
        "  - {name: agc, match: 'blocks.*', actions: [{action: agc}]}\n"
        "  - {name: head, match: 'head.*', allow_no_match: true, actions: [{action: clip_norm, max_norm: 1.0}]}\n"
        "  - {name: clip, match: 'blocks.*', actions: [{action: clip_norm, max_norm: 1.0e+9}]}\n"
    )
    result = _cli("replay", str(policy), str(recorded), "--format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    reasons = {entry["rule"]: entry["reason"] for entry in report["undecidable"]}
    assert set(reasons) == {"values", "agc", "head"}
    assert "max_abs" in reasons["values"]
    assert "output unit" in reasons["agc"]
    assert "matches no parameter" in reasons["head"]
    assert report["actions"] == [{"rule": "clip", "action": "clip_norm", "steps": []}]


def test_replay_exits_1_when_an_action_would_have_halted(tmp_path: Path) -> None:
    """A halt_on_nonfinite rule on a log with a NaN: the halt's step and rule are reported, exit 1."""
    log = tmp_path / "nan.jsonl"
    record_run(log, _monitor_only(), Schedule(30, nans={12: "small"}))
    policy = tmp_path / "halt.yaml"
    policy.write_text("version: 1\nrules:\n  - {name: stop, match: '*', actions: [{action: halt_on_nonfinite}]}\n")
    result = _cli("replay", str(policy), str(log))
    assert result.exit_code == 1, result.output
    assert "halt at step 12: rule 'stop'" in result.output
    report = json.loads(_cli("replay", str(policy), str(log), "--format", "json").output)
    assert report["actions"] == [{"rule": "stop", "action": "halt_on_nonfinite", "steps": [12]}]
    assert report["halt"]["step"] == 12


def test_families_fold_layer_indices_and_merge_when_their_norms_are_alike(tmp_path: Path) -> None:
    """Two families with the same gradient scale become one rule with both patterns; a distant one stays apart."""
    log = tmp_path / "alike.jsonl"
    scales = {"left": 1.0, "right": 1.0, "far": 1e-3}
    record_run(log, _monitor_only(), Schedule(200), scales=scales)
    suggestion = suggest_files([log])
    matches = sorted(sorted(t.patterns) for t in suggestion.thresholds)
    assert matches == [["blocks.*.far.weight"], ["blocks.*.left.weight", "blocks.*.right.weight"]]
    with GradGuard(FourFamilies(scales=scales), suggestion.policy):
        pass
    assert torch.isfinite(torch.tensor([t.max_norm for t in suggestion.thresholds])).all()


def test_audit_plot_draws_the_suggested_max_norm_over_each_plotted_parameter_s_norm(
    suggested: Path, recorded: Path, tmp_path: Path
) -> None:
    """--threshold-policy with --plot: each plotted parameter's line gets the max_norm its family's rule clips at."""
    out = tmp_path / "norms.png"
    result = _cli("audit", str(recorded), "--plot", str(out), "--threshold-policy", str(suggested))
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:4] == b"\x89PNG"
    policy = Policy.from_file(suggested)
    rule = _rule_of(policy)["tiny"]
    max_norm = next(r for r in policy.rules if r.name == rule).actions[0]
    assert policy_thresholds(policy, ["blocks.2.tiny.weight"]) == {"blocks.2.tiny.weight": (rule, max_norm.max_norm)}
    alone = _cli("audit", str(recorded), "--threshold-policy", str(suggested))
    assert alone.exit_code == 2
    assert "--plot" in alone.output
