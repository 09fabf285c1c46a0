"""What a policy can load with and still never do: warnings, not errors (``gradguard validate`` prints them and
exits 0). Without a model only the policy's own text is read, so each warning is about the policy alone:

a ``rerun`` section's verdict that nothing in the policy can give (``on: [spike]`` with no ``skip_step_on_spike``,
``loss`` with no ``loss`` section, ``nonfinite`` with no non-finite rule): a section whose every verdict is such
never computes a step again.

Which parameters a pattern matches needs the model, so nothing is said here about a pattern: a name without a dot
(``pos_embed``) is right for a parameter of the model itself (ViT's ``pos_embed``, ``cls_token``; ``suggest`` writes
such names) and wrong for one inside a module, and only the model tells which. ``validate --model``, ``explain
--model`` and the guard at attach say it where it is wrong (``gradguard.policy.matching.binding_warnings``: the
pattern matches nothing and ``*.NAME`` would), with a rule that matches nothing and an exclude that excludes nothing.
"""

from __future__ import annotations

from gradguard.policy.document import Policy
from gradguard.policy.schema import HaltOnNonfinite, SkipStepOnNonfinite, SkipStepOnSpike

__all__ = ["policy_warnings"]


def policy_warnings(policy: Policy) -> list[str]:
    """Each thing ``policy`` loads with but can never do, in words that repeat it and say how to fix it."""
    return _rerun_warnings(policy)


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
