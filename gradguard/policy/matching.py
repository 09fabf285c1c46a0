"""Binding a policy to a model: which tensor gets which actions, keyed by tensor identity.

Tied parameters appear once, under every name they have; wrapper prefixes (DDP's ``module.``,
torch.compile's ``_orig_mod.``, activation checkpointing's ``_checkpoint_wrapped_module.``) are
ignored when matching, so one policy fits the model however it is wrapped.
"""

from __future__ import annotations

import bisect
import difflib
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from gradguard.errors import GuardStateError, PolicyError, PolicyIssue
from gradguard.policy.document import Policy
from gradguard.policy.patterns import pattern_matcher, rule_matches
from gradguard.policy.schema import GRADIENT_CHANGING_ACTIONS, Action, Rule

__all__ = [
    "Binding",
    "BoundRule",
    "GuardedParam",
    "bind",
    "binding_warnings",
    "canonical_name",
    "pattern_matcher",
    "rule_matches",
]

_TRANSPARENT_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
_DATA_PARALLEL_TYPES: tuple[type[nn.Module], ...] = (
    nn.DataParallel,
    nn.parallel.DistributedDataParallel,
)


def canonical_name(name: str, *, strip_module_prefix: bool) -> str:
    """The name a policy matches against: wrapper segments removed."""
    parts = [part for part in name.split(".") if part not in _TRANSPARENT_SEGMENTS]
    if strip_module_prefix:
        while parts and parts[0] == "module":
            parts.pop(0)
    return ".".join(parts)


@dataclass(eq=False)
class GuardedParam:
    """One guarded tensor, however many names it has."""

    index: int
    """Position in model order (the order of first appearance in ``named_parameters``)."""
    names: tuple[str, ...]
    """Every canonical name of the tensor, first one first."""
    ref: weakref.ReferenceType[nn.Parameter]
    rules: tuple[int, ...]
    """Indices of the policy rules that cover the tensor, in policy order."""

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass(frozen=True, eq=False)
class BoundRule:
    """A policy rule with the tensors it covers, in model order."""

    index: int
    rule: Rule
    params: tuple[GuardedParam, ...]

    @property
    def name(self) -> str:
        return self.rule.name

    @property
    def actions(self) -> tuple[Action, ...]:
        return self.rule.actions


@dataclass(frozen=True, eq=False)
class Binding:
    """The result of matching a policy against a model."""

    policy: Policy
    params: tuple[GuardedParam, ...]
    """Every tensor covered by at least one rule, in model order."""
    rules: tuple[BoundRule, ...]
    by_id: dict[int, GuardedParam]
    all_names: tuple[str, ...]
    """Every canonical parameter name of the model, covered or not."""
    model_params: tuple[weakref.ReferenceType[nn.Parameter], ...]
    """Every parameter tensor of the model at bind time, in ``parameters()`` order."""
    warnings: tuple[str, ...] = ()
    """What the policy says that this model makes void (``binding_warnings``): the guard warns of each."""
    unmatched: tuple[int, ...] = ()
    """The rules that match no tensor of this model (without ``allow_no_match``), where the model is one pipeline
    stage (``bind(..., stage=True)``): refused at the attach agreement if no stage has a tensor they match."""

    def still_matches(self, model: nn.Module) -> bool:
        """Whether the model still has exactly the tensors it was bound to (by identity, not by ``id``:
        a new parameter may reuse a freed one's id)."""
        current = list(model.parameters())
        return len(current) == len(self.model_params) and all(
            ref() is param for ref, param in zip(self.model_params, current, strict=True)
        )


def bind(policy: Policy, model: nn.Module, *, stage: bool = False) -> Binding:
    """Match every rule against the model's parameters; raise [`PolicyError`][gradguard.PolicyError] for empty rules.

    ``stage``: the model is one stage of a pipeline, which holds part of the model: a rule may match another stage's
    tensors alone, so the rules that match none here are noted (``Binding.unmatched``), not refused; the attach
    agreement refuses those no stage matches (``no_stage_matches``)."""
    _refuse_wrappers(model)
    strip = isinstance(model, _DATA_PARALLEL_TYPES)
    names_by_id: dict[int, list[str]] = {}
    tensors: dict[int, nn.Parameter] = {}
    all_names: list[str] = []
    for raw_name, param in model.named_parameters(remove_duplicate=False):
        name = canonical_name(raw_name, strip_module_prefix=strip)
        all_names.append(name)
        key = id(param)
        if key not in tensors:
            tensors[key] = param
            names_by_id[key] = []
        if name not in names_by_id[key]:
            names_by_id[key].append(name)

    guarded: list[GuardedParam] = []
    members: list[list[GuardedParam]] = [[] for _ in policy.rules]
    for key, param in tensors.items():
        names = tuple(names_by_id[key])
        rule_ids = tuple(i for i, rule in enumerate(policy.rules) if rule_matches(rule, names))
        if not rule_ids:
            continue
        entry = GuardedParam(index=len(guarded), names=names, ref=weakref.ref(param), rules=rule_ids)
        guarded.append(entry)
        for i in rule_ids:
            members[i].append(entry)

    unmatched = tuple(i for i, rule in enumerate(policy.rules) if not members[i] and not rule.allow_no_match)
    issues = [] if stage else [_no_match_issue(policy, index, policy.rules[index], all_names) for index in unmatched]
    changing = [_changing_actions(rule) for rule in policy.rules]
    issues.extend(issue for entry in guarded if (issue := _conflict_issue(policy, entry, changing)) is not None)
    if issues:
        raise PolicyError(issues)
    _refuse_unsupported(model, policy, guarded)
    found = binding_warnings(policy, [tuple(names) for names in names_by_id.values()])
    return Binding(
        policy=policy,
        params=tuple(guarded),
        rules=tuple(BoundRule(i, rule, tuple(members[i])) for i, rule in enumerate(policy.rules)),
        by_id={id(entry.ref()): entry for entry in guarded},
        all_names=tuple(all_names),
        model_params=tuple(weakref.ref(param) for param in model.parameters()),
        warnings=tuple(found),
        unmatched=unmatched if stage else (),
    )


def no_stage_matches(policy: Policy, unmatched: Sequence[Sequence[int]], names: list[str]) -> PolicyError | None:
    """The error for the rules that match no tensor of any pipeline stage (``unmatched``: each stage's
    ``Binding.unmatched``; ``names``: this stage's parameter names, for the nearest), or None where each matches a
    tensor of some stage."""
    nowhere = sorted(set.intersection(*(set(indices) for indices in unmatched))) if unmatched else []
    if not nowhere:
        return None
    return PolicyError([_no_match_issue(policy, i, policy.rules[i], names, of="any pipeline stage") for i in nowhere])


def binding_warnings(policy: Policy, tensors: Sequence[tuple[str, ...]]) -> list[str]:
    """What ``policy`` says that a model whose tensors have the names ``tensors`` (each tensor's canonical names)
    makes void, in words that name the rule, where it is, the nearest names and the fix; not errors, since the
    guard does all the rest of the policy:

    - an ``exclude`` pattern that excludes nothing: none of the tensors the rule's ``match`` reaches matches it,
      so the tensor it was written for keeps the rule's actions (and gets those of the rule it was meant for too);
    - a ``match`` pattern that is one whole name without a dot (``pos_embed``) and matches nothing, where ``*.NAME``
      would: a glob matches the full dotted name, so it was meant for the parameter inside a module.

    A rule with ``allow_no_match`` is written for models that may lack what it names, and is not warned about;
    nor is a rule that matches nothing (``bind``'s error says so).
    """
    found: list[str] = []
    all_names = [name for names in tensors for name in names]
    for index, rule in enumerate(policy.rules):
        if rule.allow_no_match:
            continue
        matchers = [pattern_matcher(pattern) for pattern in rule.match]
        reached = [names for names in tensors if any(m(name) for m in matchers for name in names)]
        if not reached:
            continue
        where = policy.rule_location(index)
        reached_names = [name for names in reached for name in names if any(m(name) for m in matchers)]
        for pattern in rule.exclude:
            excludes = pattern_matcher(pattern)
            if any(excludes(name) for name in reached_names):
                continue
            nearest = ", ".join(_nearest_names(pattern, reached_names))
            found.append(
                f"{where}: rule {rule.name!r}: exclude {pattern!r} excludes nothing: none of the {len(reached)} "
                f"parameter(s) its match {list(rule.match)} reaches is named so, so each keeps the rule's actions. "
                f"Nearest of them: {nearest}. Fix the pattern, or remove it."
            )
        for pattern in rule.match:
            dotless = not pattern.startswith("re:") and "." not in pattern and not set("*?[") & set(pattern)
            if not dotless or any(map(pattern_matcher(pattern), all_names)):
                continue
            within = pattern_matcher(f"*.{pattern}")
            inside = [name for name in all_names if within(name) and name not in reached_names]
            if inside:
                found.append(
                    f"{where}: rule {rule.name!r}: pattern {pattern!r} matches no parameter: a name without a dot "
                    f"matches only a parameter of the model itself, and this model has none so named, but "
                    f"{len(inside)} inside a module ({', '.join(inside[:3])}). Write '*.{pattern}' to match them."
                )
    return found


def _no_match_issue(policy: Policy, index: int, rule: Rule, names: list[str], of: str = "the model") -> PolicyIssue:
    nearest: list[str] = []
    for pattern in rule.match:
        for candidate in _nearest_names(pattern, names):
            if candidate not in nearest:
                nearest.append(candidate)
    where = policy.rule_location(index)
    source, _, line = where.rpartition(":") if where != policy.source else (where, "", "")
    shown = ", ".join(nearest[:5]) if nearest else "(the model has no parameters)"
    return PolicyIssue(
        source if line else policy.source,
        int(line) if line.isdigit() else None,
        f"rules[{index}].match",
        f"rule {rule.name!r} matches no parameter of {of} (patterns {list(rule.match)}, "
        f"exclude {list(rule.exclude)}). Nearest parameter names: {shown}. "
        "Fix the pattern, or set 'allow_no_match: true' on the rule if that is intended.",
    )


def _nearest_names(pattern: str, names: list[str], count: int = 3) -> list[str]:
    """The parameter names closest to what ``pattern`` seems to mean, best first.

    A glob is compared segment by segment: each literal part of the pattern (``*`` removed) against
    the most similar segment of the name, so ``blocks.*.atn.*`` points at ``blocks.0.attn.in_proj_weight``
    and not at some name that merely shares characters. A regex is compared as text.
    """
    unique = list(dict.fromkeys(names))
    if pattern.startswith("re:"):
        return difflib.get_close_matches(pattern[3:], unique, n=count, cutoff=0.0)
    literals = [part.replace("*", "").replace("?", "") for part in pattern.split(".")]
    literals = [part for part in literals if part]
    flat = pattern.replace("*", "")

    def score(name: str) -> tuple[float, float]:
        segments = name.split(".")
        per_part = [
            max(
                1.0 if part in segment else difflib.SequenceMatcher(None, part, segment).ratio() for segment in segments
            )
            for part in literals
        ]
        mean = sum(per_part) / len(per_part) if per_part else 0.0
        return mean, difflib.SequenceMatcher(None, flat, name).ratio()

    return sorted(unique, key=score, reverse=True)[:count]


_VOIDING = frozenset({"drop", "zero"})
_Window = tuple[int, float]


def _changing_actions(rule: Rule) -> list[tuple[str, _Window]]:
    """Each gradient-changing action of the rule with the steps ``[lo, hi)`` on which it acts."""
    out: list[tuple[str, _Window]] = []
    for action in rule.actions:
        if action.action not in GRADIENT_CHANGING_ACTIONS:
            continue
        lo = max(rule.from_step or 0, action.from_step or 0)
        hi = min(
            float("inf") if rule.until_step is None else rule.until_step,
            float("inf") if action.until_step is None else action.until_step,
        )
        if lo < hi:
            out.append((action.action, (lo, hi)))
    return out


def _overlap(a: _Window, b: _Window) -> bool:
    return max(a[0], b[0]) < min(a[1], b[1])


def _conflict_issue(
    policy: Policy, entry: GuardedParam, changing: Sequence[list[tuple[str, _Window]]]
) -> PolicyIssue | None:
    """Two rules that both change one tensor's gradient, on the same steps, in ways that cannot both be meant.

    - ``drop`` or ``zero`` in one rule and any other gradient change in another: the other is void.
    - a tied tensor reached by two rules through different names only, both changing its gradient:
      the user most likely believes they are two tensors.

    Rules whose step windows never overlap do not conflict (freeze for N steps, then train slowly).
    ``changing``: each rule's ``_changing_actions``. Pairs are visited in policy order (the first conflict is
    reported), but on a tensor with one name only a pair of a ``drop``/``zero`` and another change can
    conflict, so only those are visited: a thousand overlapping clips, or zeros, bind in linear time. (Many
    ``drop``/``zero`` rules beside many other changes on steps they never share still cost a pair each.)
    """
    ids = [i for i in entry.rules if changing[i]]
    tied = len(entry.names) > 1
    voids = [position for position, i in enumerate(ids) if any(a in _VOIDING for a, _ in changing[i])]
    others = [position for position, i in enumerate(ids) if any(a not in _VOIDING for a, _ in changing[i])]
    if not tied and not (voids and others):
        return None
    void_set, other_set = set(voids), set(others)
    for position, i in enumerate(ids):
        if tied:
            later = ids[position + 1 :]
        else:  # a drop/zero against another change, in either order
            after = set(others[bisect.bisect_right(others, position) :]) if position in void_set else set()
            if position in other_set:
                after.update(voids[bisect.bisect_right(voids, position) :])
            later = [ids[p] for p in sorted(after)]
        first = policy.rules[i]
        for j in later:
            second = policy.rules[j]
            pairs = [
                (x, y) for x, x_window in changing[i] for y, y_window in changing[j] if _overlap(x_window, y_window)
            ]
            if not pairs:
                continue
            a, b = {x for x, _ in pairs}, {y for _, y in pairs}
            voiding = any((x in _VOIDING) != (y in _VOIDING) for x, y in pairs)
            first_names = {name for name in entry.names if rule_matches(first, (name,))} if tied else set()
            second_names = {name for name in entry.names if rule_matches(second, (name,))} if tied else set()
            tied_apart = tied and not first_names & second_names
            if not voiding and not tied_apart:
                continue
            if tied_apart:
                why = (
                    f"{' and '.join(entry.names)} are one tied tensor; rule {first.name!r} reaches it as "
                    f"{sorted(first_names)[0]!r} and rule {second.name!r} as {sorted(second_names)[0]!r}, and both "
                    "change its gradient, so it would get both rules' actions"
                )
            else:
                why = (
                    f"rules {first.name!r} ({', '.join(sorted(a))}) and {second.name!r} ({', '.join(sorted(b))}) "
                    f"both change the gradient of {entry.name!r}, and drop/zero makes the other rule's action void"
                )
            return PolicyIssue(
                policy.source,
                None,
                "rules",
                f"conflicting rules on one tensor: {why}. Fix: merge the two rules, or exclude "
                f"{entry.name!r} from one of them.",
            )
    return None


_SPARSE_MODULES: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)


def _refuse_wrappers(model: nn.Module) -> None:
    """FSDP1 and DeepSpeed hide parameters in flat shards: refuse before matching any name.

    Checked on the modules and on the parameters, so a model wrapped after the guard attached (the
    inner module then holds FSDP1's ``FlatParameter``) is refused when the guard re-binds.
    """
    flat = next(
        (name for name, p in model.named_parameters() if name.split(".")[-1] == "_flat_param"),  # FSDP1's
        None,
    )
    kinds = [type(module).__name__ for module in model.modules()]
    if flat is not None:
        kinds.append("FullyShardedDataParallel")
    for kind in kinds:
        if kind == "DeepSpeedEngine":
            raise GuardStateError(
                "the model holds a DeepSpeedEngine: pass the engine itself, GradGuard(engine, policy), to guard "
                "its model at ZeRO 0-2 (docs/distributed.md), not a module that contains one."
            )
        if kind == "FullyShardedDataParallel":
            raise GuardStateError(
                f"the model is wrapped by {kind}, which replaces parameters by flat shards that gradguard "
                "cannot match by name. Use FSDP2 (torch.distributed.fsdp.fully_shard) or DDP, or attach the "
                "guard to a model that is not wrapped this way."
            )


def _refuse_unsupported(model: nn.Module, policy: Policy, guarded: list[GuardedParam]) -> None:
    """Refuse, at attach time, what the guard could not treat correctly at step time."""
    sparse = {
        id(param)
        for module in model.modules()
        if isinstance(module, _SPARSE_MODULES) and getattr(module, "sparse", False)
        for param in module.parameters(recurse=False)
    }
    rules = policy.rules
    for entry in guarded:
        param = entry.ref()
        if param is None:
            continue
        if id(param) in sparse:
            raise GuardStateError(
                f"parameter {entry.name!r} gets sparse gradients (its module was built with sparse=True), "
                f"which the actions of rule(s) {', '.join(rules[i].name for i in entry.rules)} cannot treat "
                "(norms, clamps and finiteness checks reject sparse tensors). Exclude it from those rules, or "
                "build the module with sparse=False."
            )
        if param.is_complex():
            for i in entry.rules:
                if any(action.action == "clip_value" for action in rules[i].actions):
                    raise GuardStateError(
                        f"parameter {entry.name!r} is complex, and rule {rules[i].name!r} has clip_value, which "
                        "cannot clamp complex numbers. Use clip_norm for it, or exclude it from that rule."
                    )
