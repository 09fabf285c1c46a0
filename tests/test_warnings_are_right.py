"""A warning must be right, or users learn to ignore them (#50 item 3): a pattern naming a parameter of the model
itself (a ViT's ``pos_embed`` and ``cls_token``) is not warned about, by ``validate`` nor on ``suggest``'s own
output; where such a name is wrong (the parameter sits inside a module), the model says so, and the guard warns.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from gradguard import GradGuard, GuardWarning, Policy
from gradguard.cli import main
from gradguard.tuning.suggest import suggest_files


class TinyViT(nn.Module):
    """A patch projection, a class token and a position embedding held by the model itself (as timm's ViT), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(12, 8)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 8))
        self.pos_embed = nn.Parameter(torch.randn(1, 5, 8) * 0.02)
        self.head = nn.Linear(8, 3)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        tokens = torch.cat([self.cls_token.expand(len(patches), -1, -1), self.patch(patches)], dim=1)
        return self.head((tokens + self.pos_embed)[:, 0])  # type: ignore[no-any-return]


POS_EMBED_POLICY: dict[str, Any] = {
    "version": 1,
    "rules": [
        {
            "name": "positions",
            "match": ["pos_embed", "cls_token"],
            "actions": [{"action": "clip_norm", "max_norm": 0.1}],
        },
        {
            "name": "rest",
            "match": ["*"],
            "exclude": ["pos_embed", "cls_token"],
            "actions": [{"action": "clip_norm", "max_norm": 1.0}],
        },
    ],
}

MODELS = """
import torch
from torch import nn


def vit():
    model = nn.Module()
    model.patch = nn.Linear(12, 8)
    model.cls_token = nn.Parameter(torch.zeros(1, 1, 8))
    model.pos_embed = nn.Parameter(torch.zeros(1, 5, 8))
    model.head = nn.Linear(8, 3)
    return model
"""


def test_validate_does_not_warn_about_a_pattern_naming_a_parameter_of_the_model_itself(tmp_path: Path) -> None:
    policy = tmp_path / "vit.json"
    policy.write_text(Policy.from_dict(POS_EMBED_POLICY).model_dump_json(), encoding="utf-8")
    done = CliRunner().invoke(main, ["validate", str(policy)])
    assert done.exit_code == 0, done.output
    assert "warning" not in done.output


def test_validate_and_the_guard_do_not_warn_about_suggest_s_own_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "run.jsonl"
    record = {"version": 1, "rules": [{"name": "record-norms", "match": ["*"], "actions": [{"action": "monitor"}]}]}
    torch.manual_seed(0)
    model = TinyViT()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradGuard(model, Policy.from_dict(record), logger=None, audit_log=log):
        for _ in range(30):
            opt.zero_grad()
            model(torch.randn(4, 4, 12)).square().mean().backward()
            opt.step()
    suggested = tmp_path / "suggested.yaml"
    suggested.write_text(suggest_files([log]).text, encoding="utf-8")
    assert '"pos_embed"' in suggested.read_text(encoding="utf-8")  # a name without a dot, and right
    done = CliRunner().invoke(main, ["validate", str(suggested)])
    assert done.exit_code == 0, done.output
    assert "warning" not in done.output
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models.py").write_text(MODELS, encoding="utf-8")
    done = CliRunner().invoke(main, ["validate", str(suggested), "--model", "models.py:vit"])
    assert done.exit_code == 0, done.output
    assert "warning" not in done.output
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradGuard(TinyViT(), Policy.from_file(suggested)).remove()


class Wrapped(nn.Module):
    """The position embedding inside a module: ``embeddings.pos_embed``, which ``pos_embed`` does not match."""

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = nn.Module()
        self.embeddings.pos_embed = nn.Parameter(torch.zeros(1, 5, 8))
        self.embeddings.cls_token = nn.Parameter(torch.zeros(1, 1, 8))
        self.head = nn.Linear(8, 3)


def test_where_the_name_without_a_dot_is_wrong_for_the_model_the_guard_warns_naming_the_pattern_to_write() -> None:
    policy = {
        "version": 1,
        "rules": [
            {
                "name": "positions",
                "match": ["pos_embed", "head.*"],
                "actions": [{"action": "clip_norm", "max_norm": 0.1}],
            }
        ],
    }
    with pytest.warns(GuardWarning) as caught:
        GradGuard(Wrapped(), Policy.from_dict(policy)).remove()
    [warning] = [str(record.message) for record in caught]
    assert "rule 'positions': pattern 'pos_embed' matches no parameter" in warning
    assert "(embeddings.pos_embed). Write '*.pos_embed' to match them" in warning
