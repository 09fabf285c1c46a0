"""``gradguard explain POLICY`` without ``--model``: the policy itself in words, and what a model would add.

Its rules in the order they apply (patterns, actions, steps), its ``recovery`` section and any other
top-level section, read as the guard reads them; which parameter gets what, and the problems of
attaching, need a model (``--model MODULE:CALLABLE``). ``top_level_sections`` is also what ``gradguard
validate`` names. The words for an action and a step window are here too, and ``explain --model``
(``gradguard.cli.explain``, which imports torch) builds on them: the import runs one way, from the model's view
to the policy's. Importing this module does not import torch (``validate`` does not).
"""

from __future__ import annotations

from typing import Any

from gradguard.audit.layout import Section, Table
from gradguard.policy.document import Policy
from gradguard.policy.schema import can_halt
from gradguard.policy.sections import Loss

__all__ = [
    "MODEL_ADDS",
    "action_text",
    "loss_halts",
    "policy_header",
    "policy_json",
    "policy_sections",
    "section_lines",
    "top_level_sections",
    "window_text",
]

MODEL_ADDS = (
    "with --model MODULE:CALLABLE: each parameter of the model (shape, dtype) and the rules and actions it gets, "
    "the parameters no rule covers, the rules that match nothing (an error when the guard attaches, unless "
    "allow_no_match), the tied parameters, what recovery's snapshots would hold, and every problem GradGuard "
    "would raise when attaching"
)
"""What ``explain`` adds when it is given a model."""


def top_level_sections(policy: Policy) -> list[str]:
    """The top-level sections a policy gives besides ``version`` and ``rules`` (``recovery``, ...), in schema order."""
    return [name for name in type(policy).model_fields if name not in ("version", "rules") and getattr(policy, name)]


def policy_header(policy: Policy) -> list[str]:
    rules = len(policy.rules)
    sections = ["rules", *top_level_sections(policy)]
    return [
        f"policy {policy.source}: version {policy.version}, {rules} rule{'s' if rules != 1 else ''}; "
        f"top-level sections: {', '.join(sections)}",
        "no model given: the policy alone (which parameters each rule covers needs --model)",
    ]


def policy_sections(policy: Policy) -> list[Section]:
    """The rules, each further top-level section, and what a model would add."""
    rows = [
        [
            rule.name,
            ", ".join(rule.match) + (f" (except {', '.join(rule.exclude)})" if rule.exclude else ""),
            "; ".join(action_text(action) for action in rule.actions),
            window_text(rule) or "all",
            "allow_no_match" if rule.allow_no_match else "",
        ]
        for rule in policy.rules
    ]
    sections = [
        Section(
            "Rules (in the order they apply; a parameter several match gets all their actions)",
            [],
            Table(["rule", "match", "actions", "steps", "note"], rows, frozenset()),
        )
    ]
    for name in top_level_sections(policy):
        sections.append(Section(f"The {name} section", section_lines(policy, name)))
    sections.append(Section("What a model adds", [MODEL_ADDS]))
    sections.append(Section("Findings", ["none: the policy is valid (exit 0)"]))
    return sections


def window_text(rule_or_action: Any) -> str:
    """``steps 10..19``, ``from step 10``, ``until step 20``: when a rule or action acts (empty: at every step)."""
    start, stop = rule_or_action.from_step, rule_or_action.until_step
    if start is not None and stop is not None:
        return f"steps {start}..{stop - 1}"
    if start is not None:
        return f"from step {start}"
    if stop is not None:
        return f"until step {stop}"
    return ""


_MAIN_FIELD = {"clip_norm": "max_norm", "clip_value": "limit", "scale": "factor"}


def action_text(action: Any) -> str:
    """``clip_norm(1.0, scope=group) until step 2000``: the action's non-default settings, compactly."""
    data = action.model_dump(exclude_defaults=True)
    name = str(data.pop("action", action.action))
    data.pop("from_step", None)
    data.pop("until_step", None)
    args = []
    main = _MAIN_FIELD.get(name)
    if main is not None and main in data:
        args.append(str(data.pop(main)))
    args.extend(f"{key}={_setting(value)}" for key, value in data.items())
    text = name + (f"({', '.join(args)})" if args else "")
    window = window_text(action)
    return f"{text} {window}" if window else text


def _setting(value: Any) -> str:
    """A setting as written in a policy: ``norm+grad_to_weight`` for a list of names."""
    return "+".join(map(str, value)) if isinstance(value, tuple) else str(value)


def section_lines(policy: Policy, name: str) -> list[str]:
    """A top-level section in words: its settings, and for ``recovery`` what a halt becomes and which rules halt
    (``explain --model`` shows the same lines for every section but recovery, which it tells with the model)."""
    value = getattr(policy, name)
    settings = ", ".join(f"{key} {_word(item)}" for key, item in value.model_dump().items())
    lines = [f"{name}: {settings}"]
    if name == "loss":
        lines.append(_loss_words(value))
    if name == "recovery":
        lines.append(
            f"a halt becomes a rewind to the newest snapshot (one every {value.snapshot_every} steps, the newest "
            f"{value.keep} kept) at least {value.min_age} steps older than the fault; the fault's update and "
            f"those of the next {value.skip_steps} steps are skipped; at most {value.max_rewinds} rewinds, then "
            "the next halt restores the snapshot and halts"
        )
        halting = [rule.name for rule in policy.rules if can_halt(rule)]
        loss = loss_halts(policy.loss)
        if loss:
            halting.append(f"the loss section ({'; '.join(loss)})")
        lines.append("rules that can halt, and so rewind: " + (", ".join(halting) if halting else "none"))
    return lines


def _loss_words(loss: Loss) -> str:
    """What the loss section does, in a sentence: the verdict on a NaN/Inf loss, and on a spike."""
    nonfinite = {"halt": "halts", "skip": "skips the step", "ignore": "is let through"}[loss.nonfinite]
    spike = loss.spike
    if spike is None:
        return f"a NaN/Inf loss {nonfinite}; spikes are not watched"
    verdict = "skips the step" if spike.action == "skip" else "halts"
    return (
        f"a NaN/Inf loss {nonfinite}; a loss above {spike.factor:g}x the median of the last {spike.window} applied "
        f"steps' losses {verdict} (judged once {spike.warmup} losses are in)"
    )


def loss_halts(loss: Loss | None) -> list[str]:
    """How the ``loss`` section can halt, and so rewind under a ``recovery`` section, in words (none: it cannot)."""
    if loss is None:
        return []
    how = []
    if loss.nonfinite == "halt":
        how.append("nonfinite: halt: a NaN/Inf loss")
    spike = loss.spike
    if spike is not None:
        if spike.action == "halt":
            how.append(f"spike action halt: a loss above {spike.factor:g}x its reference")
        limits = []
        if spike.max_consecutive_skips is not None:
            limits.append(f"more than {spike.max_consecutive_skips} spike skips in a row")
        if spike.max_skips is not None:
            limits.append(f"more than {spike.max_skips} spike skips in {spike.window_steps} steps")
        if spike.action == "skip" and limits:
            how.append(f"spike skips past their limits ({' or '.join(limits)})")
    return how


def _word(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} {_word(item)}" for key, item in value.items()) + "}"
    return "none" if value is None else str(value)


def policy_json(policy: Policy) -> dict[str, Any]:
    """``--format json`` without a model: the policy as the guard reads it, and ``model: null``."""
    return {
        "policy": policy.source,
        "model": None,
        "sections": ["rules", *top_level_sections(policy)],
        "rules": [
            {
                "name": rule.name,
                "match": list(rule.match),
                "exclude": list(rule.exclude),
                "actions": [action.model_dump(exclude_defaults=True) for action in rule.actions],
                "steps": [rule.from_step, rule.until_step],
                "allow_no_match": rule.allow_no_match,
            }
            for rule in policy.rules
        ],
        **{name: getattr(policy, name).model_dump() for name in top_level_sections(policy)},
        "model_adds": MODEL_ADDS,
        "exit_code": 0,
    }
