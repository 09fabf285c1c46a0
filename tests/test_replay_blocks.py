"""``gradguard replay`` decides a policy without adaptive actions a block of steps at a time
(``gradguard.tuning.blocks``): the same verdicts, step for step, as replaying one step at a time.

Each log is irregular where a block could go wrong: names missing on some steps, a name first seen mid-run,
NaN and infinite norms (skips, consecutive-skip limits, a halt), rules and actions that start and stop
inside a block, several blocks, steps that go back (two runs in one log), and thresholds set where the
norms lie so that clips act on about half the steps.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
from support.four_families import MONITOR_RULE, Schedule, record_run
from support.synthetic_log import LogBuilder

from gradguard import Policy
from gradguard.tuning.blocks import BLOCK_STEPS, decides_in_blocks
from gradguard.tuning.records import Recording, recorded_steps
from gradguard.tuning.replay import Replayer, replay_files

NAMES = [f"blocks.{layer}.{part}" for layer in range(4) for part in ("attn.weight", "mlp.weight", "norm.bias")]
MEDIANS = {"attn.weight": 1.0, "mlp.weight": 0.01, "norm.bias": 1e-4}
LATE = "head.weight"
"""A name first recorded at step 300."""


def _irregular_log(path: Path, seed: int, steps: int = 3 * BLOCK_STEPS + 40, nans: bool = True) -> None:
    rng = random.Random(seed)
    with LogBuilder(path) as log:
        log.attach({"norms": len(NAMES) + 1}, model="Irregular")
        stepping = [*range(steps), *range(100, 160)]  # a second run appended: the steps go back
        for step in stepping:
            names = NAMES + ([LATE] if step >= 300 else [])
            norms: dict[str, Any] = {}
            for name in names:
                median = MEDIANS.get(name.split(".", 2)[-1], 0.5)
                norms[name] = float(f"{median * math.exp(rng.gauss(0.0, 0.5)):.9g}")
            if step % 97 == 13:
                del norms[rng.choice(names)]
            if nans and step % 53 == 7:
                norms[rng.choice(names)] = rng.choice(["NaN", "Infinity", "-Infinity"])
            if nans and step in (500, 501, 502, 503):  # four NaN steps in a row: past a skip limit of 3
                norms[NAMES[0]] = "NaN"
            log.stats(step, "norms", {"norm": norms})


_CLIP = {"action": "clip_norm", "max_norm": 0.5}


def _rule(name: str, match: str, *actions: dict[str, Any], **window: int) -> dict[str, Any]:
    return {"name": name, "match": match, "actions": list(actions), **window}


STATELESS = {
    "clips": [
        _rule("attn", "*.attn.weight", {"action": "clip_norm", "max_norm": 1.0}),
        _rule("mlp-group", "*.mlp.weight", {"action": "clip_norm", "max_norm": 0.02, "scope": "group"}),
        _rule("bias-then-group", "*.bias", {"action": "clip_norm", "max_norm": 1e-4}, until_step=400),
        _rule("all-group", "*", {"action": "clip_norm", "max_norm": 1.9, "scope": "group"}),
        _rule("nan", "*", {"action": "skip_step_on_nonfinite"}),
    ],
    "scale-zero-drop-and-windows": [
        _rule("scaled", "blocks.0.*", {"action": "scale", "factor": 3.0}, {"action": "clip_norm", "max_norm": 1.5}),
        _rule("zeroed", "blocks.1.attn.weight", {"action": "zero", "from_step": 200, "until_step": 290}),
        _rule("dropped", "blocks.2.*", {"action": "drop", "from_step": 250}, {"action": "clip_norm", "max_norm": 0.5}),
        _rule("late", LATE, {"action": "clip_norm", "max_norm": 0.5}, from_step=320),
        _rule("after", "*", {"action": "clip_norm", "max_norm": 1.2, "scope": "group"}, from_step=50, until_step=700),
        _rule("nan", "*", {"action": "skip_step_on_nonfinite", "max_consecutive_skips": 3}),
    ],
    "halt": [
        _rule("attn", "*.attn.weight", {"action": "clip_norm", "max_norm": 1.0}),
        _rule("skip", "blocks.3.*", {"action": "skip_step_on_nonfinite"}),
        _rule("halt", "blocks.0.*", {"action": "halt_on_nonfinite"}, from_step=400),
    ],
}


def _policy(rules: list[dict[str, Any]]) -> Policy:
    return Policy.from_dict({"version": 1, "rules": [MONITOR_RULE, *rules]})


def _one_step_at_a_time(policy: Policy, log: Path) -> dict[str, Any]:
    recording = Recording()
    replayer = Replayer(policy)
    assert replayer.in_blocks
    replayer.in_blocks = False
    for recorded in recorded_steps([log], recording):
        if not replayer.feed(recorded):
            break
    return replayer.result(recording).as_json()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", sorted(STATELESS))
def test_a_block_replay_gives_the_verdicts_of_a_replay_one_step_at_a_time(name: str, seed: int, tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    _irregular_log(log, seed)
    policy = _policy(STATELESS[name])
    assert decides_in_blocks(policy.rules)
    blocks = replay_files(policy, [log]).as_json()
    assert blocks == _one_step_at_a_time(policy, log)
    acted = [entry for entry in blocks["actions"] if entry["action"] == "clip_norm"]
    assert all(0 < len(entry["steps"]) < blocks["steps"] for entry in acted), "each clip acts on some steps only"
    if name == "halt":
        assert blocks["halt"] is not None
        assert blocks["halt"]["step"] >= 400
    if name == "scale-zero-drop-and-windows":
        assert blocks["halt"] == {
            "step": 503,
            "rule": "nan",
            "action": "skip_step_on_nonfinite",
            "reason": "skip limit exceeded: 4 consecutive skipped steps (max_consecutive_skips: 3)",
        }


def test_a_policy_with_statistics_or_max_abs_is_replayed_one_step_at_a_time() -> None:
    for action in (
        {"action": "zclip"},
        {"action": "autoclip"},
        {"action": "skip_step_on_spike"},
        {"action": "clip_value", "limit": 1.0},
        {"action": "clip_norm", "max_norm": 1.0, "norm_type": math.inf},
        {"action": "agc", "scope": "group"},
    ):
        assert not decides_in_blocks(_policy([_rule("r", "*", action)]).rules), action
    assert decides_in_blocks(_policy(STATELESS["clips"]).rules)


def test_a_block_replay_of_a_run_s_own_policy_gives_exactly_that_run_s_steps(tmp_path: Path) -> None:
    """A real guarded run with per-tensor and group clips and NaN skips: the block replay names its steps."""
    rules = [
        _rule("nan", "*", {"action": "skip_step_on_nonfinite"}),
        _rule("clip", "blocks.*.huge.weight", {"action": "clip_norm", "max_norm": 0.5}),
        _rule("group", "blocks.*.tiny.weight", {"action": "clip_norm", "max_norm": 8.5e-5, "scope": "group"}),
        _rule("small", "blocks.*.small.weight", {"action": "clip_norm", "max_norm": 4e-3}, from_step=100),
    ]
    policy = _policy(rules)
    assert decides_in_blocks(policy.rules)
    log = tmp_path / "run.jsonl"
    run = record_run(log, policy, Schedule(600, spikes={60: "small", 300: "all"}, nans={90: "tiny", 400: "huge"}))
    assert run.skipped == [90, 400]
    actual: dict[tuple[str, str], list[int]] = {}
    for line in log.read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "intervention":
            steps = actual.setdefault((event["rule"], event["action"]), [])
            if not steps or steps[-1] != event["step"]:
                steps.append(event["step"])
        elif event["event"] == "skip":
            actual.setdefault((event["rule"], "skip_step_on_nonfinite"), []).append(event["step"])
    assert {rule for rule, _ in actual} == {"nan", "clip", "group", "small"}, "every rule acts in the run"
    replayed = {(entry.rule, entry.action): entry.steps for entry in replay_files(policy, [log]).actions if entry.steps}
    assert replayed == actual


def _write_steps(path: Path, steps: list[tuple[int, dict[str, Any]]]) -> None:
    with LogBuilder(path) as log:
        log.attach({"norms": 2}, model="Two")
        for step, norms in steps:
            log.stats(step, "norms", {"norm": norms})


ONES = {"a": 1.0, "b": 1.0}
OVER = {"a": 3.5e38, "b": 1.0}
"""Finite as a double, infinite in float32 (where the guard and the replay decide): a non-finite norm."""


Expected = tuple[tuple[int, str] | None, dict[str, list[int]]]
"""What the case must decide, worked out by hand: the halt (step, rule) or None, and each rule's steps."""


@pytest.mark.parametrize(
    ("case", "steps", "rules", "expected"),
    [
        (
            "a halt, then a rule starts",
            [(0, ONES), (1, OVER), *((step, ONES) for step in range(2, 5))],
            [_rule("halt", "*", {"action": "halt_on_nonfinite"}), _rule("clip", "*", _CLIP, from_step=2)],
            ((1, "halt"), {"halt": [1], "clip": []}),  # 3.5e38 is Inf in float32: halted before the clip starts
        ),
        (
            "a halt on the 257th step",
            [*((step, ONES) for step in range(BLOCK_STEPS)), (BLOCK_STEPS, OVER), (BLOCK_STEPS + 1, ONES)],
            [_rule("halt", "*", {"action": "halt_on_nonfinite"}), _rule("clip", "*", _CLIP)],
            ((BLOCK_STEPS, "halt"), {"halt": [BLOCK_STEPS], "clip": list(range(BLOCK_STEPS))}),  # 1.0 > max_norm 0.5
        ),
        (
            "a skip limit, then a rule starts",
            [(0, ONES), (1, OVER), (2, OVER), (3, ONES), (4, ONES)],
            [
                _rule("skip", "*", {"action": "skip_step_on_nonfinite", "max_consecutive_skips": 1}),
                _rule("clip", "*", _CLIP, from_step=3),
            ],
            ((2, "skip"), {"skip": [1, 2], "clip": []}),  # the second skip in a row is past the limit: a halt
        ),
        (
            "no names on the first steps",
            [(0, {}), (1, {}), (2, {"a": 1.0}), (3, {"a": 2.0})],
            [_rule("c", "*", _CLIP)],
            (None, {"c": [2, 3]}),
        ),
    ],
)
def test_a_norm_beyond_float32_and_an_empty_step_are_decided_as_one_step_at_a_time_decides_them(
    case: str,
    steps: list[tuple[int, dict[str, Any]]],
    rules: list[dict[str, Any]],
    expected: Expected,
    tmp_path: Path,
) -> None:
    """A halt is read as far as one step at a time reads it (first and last step included), and both decide what
    the float32 maths says: a norm of 3.5e38 is not finite."""
    log = tmp_path / "run.jsonl"
    _write_steps(log, steps)
    policy = _policy(rules)
    replayed = replay_files(policy, [log]).as_json()
    assert replayed == _one_step_at_a_time(policy, log), case
    halt, by_rule = expected
    assert (None if replayed["halt"] is None else (replayed["halt"]["step"], replayed["halt"]["rule"])) == halt, case
    assert {entry["rule"]: entry["steps"] for entry in replayed["actions"]} == by_rule, case
