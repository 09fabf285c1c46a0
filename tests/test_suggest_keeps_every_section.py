"""``gradguard suggest`` keeps every section the run's policy had, and a clip the user held a tensor under (#50 item 1).

The run: a small embedding model whose embedding the user clips hard (to a tenth of its ordinary norm), a loose
clip on everything else, a loss section and a recovery section. Without ``--policy`` the suggestion reads them from
the log (the attach event and the clip's interventions); with it, from the file. Either way the loss watch survives,
the embedding keeps its clip apart from the families, and the output says what was kept and what changed.
"""

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
from gradguard.policy.patterns import rule_matches
from gradguard.policy.schema import ClipNorm
from gradguard.tuning.suggest import suggest_files

HARD = 0.004
"""The embedding's clip: far below its gradient's ordinary norm (about 0.04), so it acts on every step."""

RUN_POLICY: dict[str, Any] = {
    "version": 1,
    "rules": [
        {"name": "nonfinite", "match": ["*"], "actions": [{"action": "halt_on_nonfinite"}]},
        {"name": "embedding", "match": ["embed.*"], "actions": [{"action": "clip_norm", "max_norm": HARD}]},
        {
            "name": "loose",
            "match": ["*"],
            "exclude": ["embed.*"],
            "actions": [{"action": "clip_norm", "max_norm": 100.0}],
        },
        {"name": "record-norms", "match": ["*"], "actions": [{"action": "monitor", "stats": ["norm"], "every": 1}]},
    ],
    "loss": {"nonfinite": "skip", "spike": {"factor": 5.0, "window": 20, "warmup": 10}},
    "recovery": {"snapshot_every": 20, "min_age": 5},
}


class Embedder(nn.Module):
    """Token embedding, two hidden layers and a head over the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 50)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)))  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The log of a 100-step run under ``RUN_POLICY``, and the policy's file."""
    folder = tmp_path_factory.mktemp("hard-clip")
    log, policy_file = folder / "run.jsonl", folder / "policy.json"
    policy_file.write_text(json.dumps(RUN_POLICY), encoding="utf-8")
    torch.manual_seed(0)
    model = Embedder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with GradGuard(model, Policy.from_dict(RUN_POLICY), logger=None, audit_log=log) as guard:
        for step in range(100):
            if guard.pass_step():
                continue
            tokens = torch.randint(0, 50, (32,), generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            nn.functional.cross_entropy(model(tokens), tokens).backward()  # type: ignore[no-untyped-call]
            opt.step()
    return log, policy_file


def _clips_of(policy: Policy, name: str) -> list[tuple[str, float]]:
    """Every rule's clip_norm that reaches the parameter ``name``: (rule, max_norm)."""
    return [
        (rule.name, action.max_norm)
        for rule in policy.rules
        if rule_matches(rule, (name,))
        for action in rule.actions
        if isinstance(action, ClipNorm)
    ]


def test_without_the_run_s_policy_the_suggestion_keeps_the_loss_section_of_the_log_s_attach_event(
    run: tuple[Path, Path],
) -> None:
    log, _ = run
    suggested = suggest_files([log]).policy
    run_policy = Policy.from_dict(RUN_POLICY)
    assert suggested.loss == run_policy.loss
    assert suggested.recovery == run_policy.recovery


def test_the_cli_s_suggestion_has_a_loss_section_where_the_run_had_one(run: tuple[Path, Path], tmp_path: Path) -> None:
    log, _ = run
    written = tmp_path / "s.yaml"
    done = CliRunner().invoke(main, ["suggest", str(log), "-o", str(written)])
    assert done.exit_code == 0, done.output
    assert [line for line in written.read_text(encoding="utf-8").splitlines() if line.startswith("loss")]
    assert "kept the run's loss and recovery sections" in done.output
    assert f"kept the run's clip of embed.weight at {HARD:g} (rule 'embedding')" in done.output


def test_a_clip_the_run_held_a_tensor_under_is_kept_apart_from_the_families_read_from_the_log(
    run: tuple[Path, Path],
) -> None:
    log, _ = run
    suggestion = suggest_files([log])
    assert _clips_of(suggestion.policy, "embed.weight") == [("embedding", HARD)]
    assert "embed.weight" not in {name for threshold in suggestion.thresholds for name in threshold.family.members}
    assert "its rule 'embedding' clipped embed.weight to 0.004, below the recorded median norm" in suggestion.text


def test_a_clip_the_run_held_a_tensor_under_is_kept_apart_read_from_the_run_s_policy(run: tuple[Path, Path]) -> None:
    log, policy_file = run
    suggestion = suggest_files([log], keep=Policy.from_file(policy_file))
    assert _clips_of(suggestion.policy, "embed.weight") == [("embedding", HARD)]
    assert "Kept from the run's policy" in suggestion.text


def test_a_loose_clip_of_the_run_is_replaced_by_the_families_and_the_header_says_so(run: tuple[Path, Path]) -> None:
    log, _ = run
    suggestion = suggest_files([log])
    assert "loose" not in [rule.name for rule in suggestion.policy.rules]
    assert all(len(_clips_of(suggestion.policy, name)) == 1 for name in ("body.0.weight", "head.bias"))
    assert "its rules (nonfinite, embedding, loose, record-norms) are replaced by the rules below" in suggestion.text


def test_a_proposed_loss_section_replaces_the_run_s_with_its_nonfinite_verdict_and_says_so(
    run: tuple[Path, Path],
) -> None:
    log, _ = run
    suggestion = suggest_files([log], loss=True)
    loss = suggestion.policy.loss
    assert loss is not None
    assert loss.nonfinite == "skip"  # the run's verdict on a NaN loss, not the default halt
    assert 'its loss section {"nonfinite": "skip", "spike": {"factor": 5.0' in suggestion.text
    assert "is replaced by the one --loss proposes" in suggestion.text
    assert yaml.safe_load(suggestion.text)["recovery"] == RUN_POLICY["recovery"]
