"""The policy's ``ranks`` section (#48) read as users write it, broken ones too: every mistake is a PolicyError that
names the file, the line, the field and the fix, never a traceback from inside."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradguard import Policy, PolicyError

RULES = [{"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}]


def refused(ranks: object) -> str:
    with pytest.raises(PolicyError) as error:
        Policy.from_dict({"version": 1, "rules": RULES, "ranks": ranks})
    return str(error.value)


def test_a_ranks_section_with_both_watches_keeps_what_it_was_given_and_the_defaults() -> None:
    policy = Policy.from_dict(
        {"version": 1, "rules": RULES, "ranks": {"outlier_factor": 10, "check_replicas_every": 100}}
    )
    assert policy.ranks is not None
    assert (policy.ranks.outlier_factor, policy.ranks.on_outlier) == (10.0, "warn")
    assert (policy.ranks.check_replicas_every, policy.ranks.on_divergence) == (100, "halt")


def test_a_ranks_section_that_asks_for_nothing_says_what_to_add() -> None:
    message = refused({})
    assert "ranks" in message
    assert "outlier_factor" in message
    assert "check_replicas_every" in message


def test_a_misspelt_ranks_key_is_named_with_the_key_it_likely_meant() -> None:
    message = refused({"outlier": 10})
    assert "ranks.outlier: unknown field 'outlier' (did you mean 'outlier_factor'?)" in message


@pytest.mark.parametrize(
    ("ranks", "field"),
    [
        ({"outlier_factor": 1}, "ranks.outlier_factor"),
        ({"outlier_factor": "ten"}, "ranks.outlier_factor"),
        ({"outlier_factor": 10, "on_outlier": "panic"}, "ranks.on_outlier"),
        ({"check_replicas_every": 0}, "ranks.check_replicas_every"),
        ({"check_replicas_every": 1.5}, "ranks.check_replicas_every"),
        ({"check_replicas_every": 10, "on_divergence": "skip"}, "ranks.on_divergence"),
        ([10], "ranks"),
    ],
)
def test_a_wrong_ranks_value_names_its_field(ranks: object, field: str) -> None:
    assert f"{field}:" in refused(ranks)


def test_a_broken_ranks_section_in_a_yaml_file_names_the_file_and_the_line(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(
        "version: 1\nrules:\n  - {name: n, match: '*', actions: [{action: halt_on_nonfinite}]}\nranks:\n"
        "  outlier_factor: 0.5\n",
        encoding="utf-8",
    )
    with pytest.raises(PolicyError) as error:
        Policy.from_file(path)
    assert f"{path}:5: ranks.outlier_factor:" in str(error.value)
