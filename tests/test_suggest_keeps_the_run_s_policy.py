"""``gradguard suggest`` on a newcomer's real run (a clip, a loss section, a recovery section, a loss spike at step
80 of 200): the suggestion keeps the recovery section and the halt, catches the spike, and names its rules in
words; ``--loss`` on a log without ``stats`` events says what is missing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner
from torch import nn

from gradguard import GradGuard, Policy
from gradguard.cli import main
from gradguard.policy.schema import HaltOnNonfinite, SkipStepOnNonfinite
from gradguard.tuning.suggest import NoNorms, suggest_files

RUN_POLICY: dict[str, Any] = {
    "version": 1,
    "rules": [
        {"name": "nonfinite", "match": ["*"], "actions": [{"action": "halt_on_nonfinite"}]},
        {"name": "clip", "match": ["*"], "actions": [{"action": "clip_norm", "max_norm": 100.0}]},
        {"name": "record-norms", "match": ["*"], "actions": [{"action": "monitor", "stats": ["norm"], "every": 1}]},
    ],
    "loss": {"nonfinite": "halt", "spike": {"factor": 5.0, "window": 20, "warmup": 10}},
    "recovery": {"snapshot_every": 20, "min_age": 5, "skip_steps": 5},
}
SPIKE_AT = 80


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The log of a 200-step run of a small regression net whose loss is 30x at step 80, and its policy file."""
    folder = tmp_path_factory.mktemp("newcomer")
    log, policy_file = folder / "run.jsonl", folder / "policy.json"
    policy_file.write_text(json.dumps(RUN_POLICY), encoding="utf-8")
    torch.manual_seed(0)
    model = nn.Sequential()
    body = [nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32)]
    model.add_module("body", nn.Sequential(*body))
    model.add_module("head", nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    target = nn.Linear(8, 1)
    with GradGuard(model, Policy.from_dict(RUN_POLICY), logger=None, audit_log=log) as guard:
        for step in range(200):
            if guard.pass_step():
                continue
            generator = torch.Generator().manual_seed(step)
            x = torch.randn(16, 8, generator=generator)
            with torch.no_grad():
                y = 3 * target(x) + 0.3 * torch.randn(16, 1, generator=generator)
            loss = nn.functional.mse_loss(model(x), y)
            if step == SPIKE_AT:
                loss = loss * 30.0
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
    return log, policy_file


def test_the_suggested_loss_section_catches_a_spike_at_step_80_of_a_200_step_run(newcomer: tuple[Path, Path]) -> None:
    log, _ = newcomer
    suggestion = suggest_files([log], loss=True)
    spike = suggestion.policy.loss.spike if suggestion.policy.loss is not None else None
    assert spike is not None
    assert spike.warmup < SPIKE_AT
    assert suggestion.loss is not None
    assert suggestion.loss.spikes == [SPIKE_AT]


def test_the_suggestion_keeps_the_recovery_section_of_the_log_s_attach_event_and_halts_under_it(
    newcomer: tuple[Path, Path],
) -> None:
    log, _ = newcomer
    policy = suggest_files([log], loss=True).policy
    assert policy.recovery is not None
    assert (policy.recovery.snapshot_every, policy.recovery.min_age, policy.recovery.skip_steps) == (20, 5, 5)
    nonfinite = next(rule for rule in policy.rules if rule.name == "nonfinite")
    assert [type(action) for action in nonfinite.actions] == [HaltOnNonfinite]


def test_with_the_run_s_policy_the_suggestion_keeps_its_loss_verdict_and_sections(newcomer: tuple[Path, Path]) -> None:
    log, policy_file = newcomer
    done = CliRunner().invoke(main, ["suggest", str(log), "--loss", "--policy", str(policy_file)])
    assert done.exit_code == 0, done.output
    policy = Policy.from_dict(yaml.safe_load(done.output))
    assert policy.loss is not None
    assert policy.loss.nonfinite == "halt"
    assert policy.recovery == Policy.from_dict(RUN_POLICY).recovery
    assert "kept from the run's policy" in done.output


def test_a_run_without_a_recovery_section_still_gets_the_skip(tmp_path: Path, newcomer: tuple[Path, Path]) -> None:
    log, _ = newcomer
    lines = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    for line in lines:
        line.pop("recovery", None)
    without = tmp_path / "without-recovery.jsonl"
    without.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    policy = suggest_files([without]).policy
    assert policy.recovery is None
    nonfinite = next(rule for rule in policy.rules if rule.name == "nonfinite")
    assert [type(action) for action in nonfinite.actions] == [SkipStepOnNonfinite]


def test_merged_families_are_named_in_words_not_with_a_count(newcomer: tuple[Path, Path]) -> None:
    log, _ = newcomer
    names = [rule.name for rule in suggest_files([log]).policy.rules]
    assert "body.*.weight & head.weight" in names
    assert not any("+" in name for name in names)


def test_suggest_loss_on_a_log_without_stats_events_names_the_missing_losses_too(tmp_path: Path) -> None:
    log = tmp_path / "clean.jsonl"
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    halt_only = Policy.from_dict({"version": 1, "rules": [RUN_POLICY["rules"][0]]})
    with GradGuard(model, halt_only, logger=None, audit_log=log):
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()  # type: ignore[no-untyped-call]
            opt.step()
    with pytest.raises(NoNorms, match=r"no losses and no gradient norms in .*clean\.jsonl \(no 'stats' events\)"):
        suggest_files([log], loss=True)
    done = CliRunner().invoke(main, ["suggest", "--loss", str(log)])
    assert done.exit_code == 2
    assert "suggest --loss needs both" in done.output
