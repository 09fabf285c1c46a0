"""What a policy can load with and still never do: warnings, not errors (``gradguard validate`` prints them and
exits 0). Without a model only the policy's own text is read, so each warning is about the policy alone:

- a ``rerun`` section's verdict that nothing in the policy can give (``on: [spike]`` with no
  ``skip_step_on_spike``, ``loss`` with no ``loss`` section, ``nonfinite`` with no non-finite rule): a section
  whose every verdict is such never computes a step again;
- a pattern that is one whole name without a dot (``ok``): globs match the full dotted name, so it matches only a
  parameter registered on the model itself, never one inside a module (``layer.ok``), which is seldom meant.

Which parameters a pattern matches needs the model: ``gradguard explain POLICY --model MODULE:CALLABLE`` (and the
guard at attach) names a rule that matches none.
"""

from __future__ import annotations

from gradguard.policy.document import Policy
from gradguard.policy.patterns import REGEX_PREFIX
from gradguard.policy.schema import HaltOnNonfinite, SkipStepOnNonfinite, SkipStepOnSpike

__all__ = ["policy_warnings"]

_GLOB = frozenset("*?[")


def policy_warnings(policy: Policy) -> list[str]:
    """Each thing ``policy`` loads with but can never do, in words that repeat it and say how to fix it."""
    return [*_rerun_warnings(policy), *_pattern_warnings(policy)]


def _rerun_warnings(policy: Policy) -> list[str]:
    rerun = policy.rerun
    if rerun is None:
        return []
    actions = [action for rule in policy.rules for action in rule.actions]
    givers = {
        "nonfinite": any(isinstance(action, HaltOnNonfinite | SkipStepOnNonfinite) for action in actions),
        "spike": any(isinstance(action, SkipStepOnSpike) for action in actions),
        "loss": policy.loss is not None,
    }
    fixes = {
        "nonfinite": "a rule with halt_on_nonfinite or skip_step_on_nonfinite",
        "spike": "a rule with skip_step_on_spike",
        "loss": "a loss section",
    }
    never = [verdict for verdict in rerun.on if not givers[verdict]]
    if not never:
        return []
    given = list(rerun.on)
    if len(never) == len(given):
        head = f"rerun: on {given} can never fire: the policy gives none of these verdicts"
    else:
        head = (
            f"rerun: on {given}: {never} can never fire: the policy does not give {'it' if len(never) == 1 else 'them'}"
        )
    wanted = " / ".join(fixes[verdict] for verdict in never)
    return [f"{head}; add {wanted}, or take {never} out of rerun.on"]


def _pattern_warnings(policy: Policy) -> list[str]:
    found: list[str] = []
    for rule in policy.rules:
        for pattern in rule.match:
            if pattern.startswith(REGEX_PREFIX) or "." in pattern or _GLOB & set(pattern):
                continue
            found.append(
                f"rule {rule.name!r}: pattern {pattern!r} is a whole name without a dot: it matches only a parameter "
                f"registered on the model itself, never one inside a module ('layer.{pattern}'); write "
                f"'*.{pattern}' or '*{pattern}*' to match it anywhere, and check with "
                "`gradguard explain POLICY --model MODULE:CALLABLE`"
            )
    return found
