"""Conflicting rules on one tensor (``drop``/``zero`` beside another change, or a tied tensor reached through
two names) are found without visiting every pair of rules: on a tensor with one name only pairs with a
``drop``/``zero`` rule can conflict. Checked against every pair, as binding did before, on random policies
over a model with tied weights; and a thousand overlapping clips bind.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from gradguard import Policy, PolicyError
from gradguard.cli.demo import TinyDecoder
from gradguard.errors import PolicyIssue
from gradguard.policy.matching import _changing_actions, _conflict_issue, _overlap, bind
from gradguard.policy.patterns import rule_matches

PATTERNS = ["*", "embed.*", "head.weight", "embed.weight", "blocks.*", "*.weight", "*.bias", "re:blocks\\.0\\..*"]
ACTIONS: list[dict[str, Any]] = [
    {"action": "drop"},
    {"action": "zero"},
    {"action": "scale", "factor": 0.5},
    {"action": "clip_norm", "max_norm": 1.0},
    {"action": "monitor"},
    {"action": "halt_on_nonfinite"},
]


def _every_pair(policy: Policy, names: tuple[str, ...], rule_ids: tuple[int, ...]) -> PolicyIssue | None:
    """The check as it was: every pair of the tensor's rules, in policy order, the first conflict reported."""
    rules = [policy.rules[i] for i in rule_ids]
    for position, first in enumerate(rules):
        for second in rules[position + 1 :]:
            pairs = [
                (x, y)
                for x, x_window in _changing_actions(first)
                for y, y_window in _changing_actions(second)
                if _overlap(x_window, y_window)
            ]
            if not pairs:
                continue
            voiding = any((x in {"drop", "zero"}) != (y in {"drop", "zero"}) for x, y in pairs)
            first_names = {name for name in names if rule_matches(first, (name,))}
            second_names = {name for name in names if rule_matches(second, (name,))}
            if voiding or (len(names) > 1 and not first_names & second_names):
                return PolicyIssue(policy.source, None, "rules", f"{first.name} / {second.name}")
    return None


def _random_rule(rng: random.Random, index: int) -> dict[str, Any]:
    rule: dict[str, Any] = {
        "name": f"r{index}",
        "match": rng.sample(PATTERNS, rng.choice([1, 1, 2])),
        "actions": [dict(action) for action in rng.sample(ACTIONS, rng.choice([1, 1, 2]))],
        "allow_no_match": True,
    }
    if rng.random() < 0.3:
        rule["from_step"] = rng.choice([0, 5, 10])
    if rng.random() < 0.3:
        rule["until_step"] = rng.choice([20, 30])
    for action in rule["actions"]:
        if rng.random() < 0.2:
            action["until_step"] = rng.choice([3, 6, 12])
    return rule


def _model() -> TinyDecoder:
    torch.manual_seed(0)
    model = TinyDecoder(vocab=16, width=8, depth=2, heads=2, context=4)
    assert model.head.weight is model.embed.weight, "a tied tensor: two names, one parameter"
    return model


@pytest.mark.parametrize("seed", range(40))
def test_the_conflicts_found_are_those_every_pair_of_rules_gives(seed: int) -> None:
    rng = random.Random(seed)
    model = _model()
    rules = [_random_rule(rng, index) for index in range(rng.choice([2, 5, 12, 30]))]
    policy = Policy.from_dict({"version": 1, "rules": rules})
    # The same rules watching only: they bind (nothing conflicts), giving each tensor's names and rules.
    watching = [{**rule, "actions": [{"action": "monitor"}]} for rule in rules]
    entries = bind(Policy.from_dict({"version": 1, "rules": watching}), model).params
    changing = [_changing_actions(rule) for rule in policy.rules]
    found = 0
    for entry in entries:
        expected = _every_pair(policy, entry.names, entry.rules)
        actual = _conflict_issue(policy, entry, changing)
        assert (actual is None) == (expected is None), (entry.names, rules)
        if actual is not None and expected is not None:
            found += 1
            first, second = expected.message.split(" / ")
            assert f"{first!r}" in actual.message, (actual.message, expected.message)
            assert f"{second!r}" in actual.message, (actual.message, expected.message)
    if found:
        with pytest.raises(PolicyError, match="conflicting rules on one tensor"):
            bind(policy, model)


def test_a_thousand_overlapping_clips_on_every_tensor_bind() -> None:
    """Before, this visited 500,000 pairs of rules on each tensor (minutes for 200 tensors)."""
    model = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(20)))
    rules = [
        {"name": f"clip{i}", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 1.0 + i}]}
        for i in range(1000)
    ]
    binding = bind(Policy.from_dict({"version": 1, "rules": rules}), model)
    assert all(len(entry.rules) == 1000 for entry in binding.params)
    rules[500] = {"name": "frozen", "match": "5.*", "actions": [{"action": "zero"}]}
    with pytest.raises(PolicyError, match=r"rules 'clip0' \(clip_norm\) and 'frozen' \(zero\)"):
        bind(Policy.from_dict({"version": 1, "rules": rules}), model)
