"""``gradguard explain``: which parameter of a model gets which rules and actions of a policy.

The model comes from ``MODULE:CALLABLE`` (a dotted module importable from the working directory, or
a ``path/to/file.py``, and a callable there that takes no arguments and returns an ``nn.Module``).
Matching uses the guard's own functions (``canonical_name``, ``rule_matches``), and the problems
listed are the ones ``bind`` raises when a guard attaches, so what is shown is what the guard does.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import nn

from gradguard.audit.render import Section, Table, short_path
from gradguard.cli.explain_policy import action_text, loss_halts, section_lines, top_level_sections, window_text
from gradguard.enforce.recovery.snapshot_memory import memory_text, memory_where, readable_bytes
from gradguard.errors import GradGuardError, PolicyError
from gradguard.policy.document import Policy
from gradguard.policy.matching import bind, binding_warnings, canonical_name, rule_matches
from gradguard.policy.schema import HaltOnNonfinite, Rule, SkipStepOnNonfinite, SkipStepOnSpike, can_halt

__all__ = ["Explanation", "ModelSpecError", "explain", "explain_sections", "load_model"]

_EXAMPLE = "e.g. mypkg.models:build_model, or path/to/models.py:build_model"
_DATA_PARALLEL = (nn.DataParallel, nn.parallel.DistributedDataParallel)


class ModelSpecError(Exception):
    """``--model MODULE:CALLABLE`` could not give a model; the message says why and what to do."""


# --- loading the model -----------------------------------------------------------------------------


def _where(exc: BaseException) -> str:
    """`` (at file:line)`` of the innermost frame of the user's code, or nothing."""
    here = os.path.abspath(__file__)
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if os.path.abspath(frame.filename) != here]
    if not frames:
        return ""
    last = frames[-1]
    return f" (at {short_path(last.filename)}:{last.lineno})"


def _import(module_part: str) -> ModuleType:
    looks_like_path = module_part.endswith(".py") or "/" in module_part or os.sep in module_part
    if looks_like_path:
        path = Path(module_part)
        if not path.is_file():
            raise ModelSpecError(f"--model: no such file {module_part!r}; expected MODULE:CALLABLE, {_EXAMPLE}")
        name = f"_gradguard_model_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ModelSpecError(f"--model: cannot import {module_part!r} as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit) as exc:
            sys.modules.pop(name, None)
            raise ModelSpecError(
                f"--model: importing {module_part!r} failed: {type(exc).__name__}: {exc}{_where(exc)}"
            ) from None
        return module
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: modules next to the user are importable
    try:
        return importlib.import_module(module_part)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_part == exc.name or module_part.startswith(exc.name + ".")):
            raise ModelSpecError(
                f"--model: no module named {module_part!r} (looked in the working directory and the installed "
                f"packages); expected MODULE:CALLABLE, {_EXAMPLE}"
            ) from None
        raise ModelSpecError(
            f"--model: importing {module_part!r} failed: ModuleNotFoundError: {exc}{_where(exc)}"
        ) from None
    except (Exception, SystemExit) as exc:
        raise ModelSpecError(
            f"--model: importing {module_part!r} failed: {type(exc).__name__}: {exc}{_where(exc)}"
        ) from None


def load_model(spec: str) -> nn.Module:
    """Import ``MODULE:CALLABLE``, call it with no arguments, and check that it returns an ``nn.Module``."""
    module_part, _, attribute = spec.rpartition(":")
    if not module_part or not attribute:
        raise ModelSpecError(f"--model {spec!r}: expected MODULE:CALLABLE, {_EXAMPLE}")
    module = _import(module_part)
    try:
        factory = functools.reduce(getattr, attribute.split("."), module)
    except AttributeError:
        callables = sorted(
            name
            for name, value in vars(module).items()
            if callable(value) and not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
        )
        shown = ", ".join(callables[:12]) if callables else "none"
        raise ModelSpecError(
            f"--model: {module_part!r} has no attribute {attribute!r} (callables defined there: {shown})"
        ) from None
    if not callable(factory):
        raise ModelSpecError(
            f"--model: {spec} is not callable (it is a {type(factory).__name__!r} object); name a function or "
            "class that takes no arguments and returns an nn.Module"
        )
    try:
        model = factory()
    except (Exception, SystemExit) as exc:
        raise ModelSpecError(
            f"--model: calling {spec}() failed: {type(exc).__name__}: {exc}{_where(exc)}; the callable must "
            "take no arguments and return an nn.Module"
        ) from None
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"--model: {spec}() returned a {type(model).__name__}, not a torch.nn.Module")
    return model


# --- explaining ------------------------------------------------------------------------------------


@dataclass
class ParamEntry:
    names: list[str]
    shape: list[int]
    dtype: str
    numel: int
    requires_grad: bool
    rules: list[int]
    """Indices of the rules that cover the tensor, in policy (= application) order."""


@dataclass
class SnapshotBytes:
    """What one recovery snapshot holds for the model, in bytes (host memory; pinned for a CUDA model)."""

    parameters: int
    """Every parameter tensor (tied ones once, frozen ones too: a rewind restores them all)."""
    buffers: int
    """The model's buffers (BatchNorm's running statistics, ...)."""
    adam_state: int
    """What Adam or AdamW adds: two moments (the parameter's dtype) and a step count per trainable tensor."""

    @property
    def model(self) -> int:
        return self.parameters + self.buffers


@dataclass
class Explanation:
    policy: Policy
    model_spec: str
    model_class: str
    params: list[ParamEntry]
    """Every tensor of the model (tied ones once), in model order."""
    members: list[list[int]]
    """For each rule, the indices into ``params`` that it covers."""
    issues: list[str] = field(default_factory=list)
    """What ``bind`` refuses: the errors GradGuard would raise at attach."""
    snapshot: SnapshotBytes | None = None
    """With a ``recovery`` section: the bytes one snapshot will hold for this model."""
    warnings: list[str] = field(default_factory=list)
    """What the model makes void in the policy (an exclude that excludes nothing): the guard warns of each."""

    @property
    def findings(self) -> list[str]:
        return list(self.issues)

    @property
    def exit_code(self) -> int:
        return 1 if self.issues else 0

    def as_json(self) -> dict[str, Any]:
        rules = self.policy.rules
        return {
            "schema": 1,
            "policy": self.policy.source,
            "model": self.model_spec,
            "model_class": self.model_class,
            "tensors": len(self.params),
            "names": sum(len(entry.names) for entry in self.params),
            "elements": sum(entry.numel for entry in self.params),
            "parameters": [
                {
                    "name": entry.names[0],
                    "names": entry.names,
                    "shape": entry.shape,
                    "dtype": entry.dtype,
                    "numel": entry.numel,
                    "requires_grad": entry.requires_grad,
                    "rules": [rules[i].name for i in entry.rules],
                    "actions": [
                        {"rule": rules[i].name, **action.model_dump(mode="json")}
                        for i in entry.rules
                        for action in rules[i].actions
                    ],
                }
                for entry in self.params
            ],
            "uncovered": [name for entry in self.params if not entry.rules for name in entry.names],
            "rules": [
                {
                    "name": rule.name,
                    "params": len(self.members[i]),
                    "elements": sum(self.params[k].numel for k in self.members[i]),
                    "from_step": rule.from_step,
                    "until_step": rule.until_step,
                    "allow_no_match": rule.allow_no_match,
                    "matches_nothing": not self.members[i],
                    "actions": [action.model_dump(mode="json") for action in rule.actions],
                }
                for i, rule in enumerate(rules)
            ],
            "tied": [entry.names for entry in self.params if len(entry.names) > 1],
            "recovery": self._recovery_json(),
            **{name: getattr(self.policy, name).model_dump(mode="json") for name in self.other_sections()},
            "issues": self.issues,
            "warnings": self.warnings,
            "exit_code": self.exit_code,
        }

    def other_sections(self) -> list[str]:
        """The policy's top-level sections but its rules and recovery (which the model's figures tell): ``loss``,
        ``rerun``, ...; shown as ``explain`` without a model shows them."""
        return [name for name in top_level_sections(self.policy) if name != "recovery"]

    def _recovery_json(self) -> dict[str, Any] | None:
        recovery = self.policy.recovery
        if recovery is None:
            return None
        rules = self.policy.rules
        out: dict[str, Any] = recovery.model_dump(mode="json")
        out["rules_that_rewind"] = [
            {"rule": rule.name, "params": len(self.members[i]), "how": _halting_actions(rule)}
            for i, rule in enumerate(rules)
            if can_halt(rule)
        ]
        loss = loss_halts(self.policy.loss)
        if loss:
            out["rules_that_rewind"].append({"rule": "loss", "params": None, "how": loss})
        out["where"] = memory_where(recovery.memory)
        snapshot = self.snapshot
        if snapshot is not None:
            out["snapshot_bytes"] = {
                "parameters": snapshot.parameters,
                "buffers": snapshot.buffers,
                "per_snapshot": snapshot.model,
                "all_snapshots": snapshot.model * recovery.keep,
                "adam_state_per_snapshot": snapshot.adam_state,
                "all_snapshots_with_adam": (snapshot.model + snapshot.adam_state) * recovery.keep,
            }
        return out


def snapshot_bytes(model: nn.Module) -> SnapshotBytes:
    """The bytes a recovery snapshot holds for ``model`` (as the guard's snapshots copy it), before optimizer state."""
    params = list(model.parameters())  # each tensor once, as a snapshot holds it
    buffers = [buffer for buffer in model.buffers() if buffer is not None]
    adam = sum(2 * p.numel() * p.element_size() + 4 for p in params if p.requires_grad)  # + a float32 step
    return SnapshotBytes(
        parameters=sum(p.numel() * p.element_size() for p in params),
        buffers=sum(b.numel() * b.element_size() for b in buffers),
        adam_state=adam,
    )


def explain(policy: Policy, model: nn.Module, model_spec: str) -> Explanation:
    """Match ``policy`` against ``model`` the way a guard does, and collect what attaching would refuse."""
    strip = isinstance(model, _DATA_PARALLEL)
    order: dict[int, ParamEntry] = {}
    for raw_name, param in model.named_parameters(remove_duplicate=False):
        name = canonical_name(raw_name, strip_module_prefix=strip)
        entry = order.get(id(param))
        if entry is None:
            entry = order[id(param)] = ParamEntry(
                [], list(param.shape), str(param.dtype).removeprefix("torch."), param.numel(), param.requires_grad, []
            )
        if name not in entry.names:
            entry.names.append(name)
    params = list(order.values())
    members: list[list[int]] = [[] for _ in policy.rules]
    for index, entry in enumerate(params):
        names = tuple(entry.names)
        entry.rules = [i for i, rule in enumerate(policy.rules) if rule_matches(rule, names)]
        for i in entry.rules:
            members[i].append(index)
    issues: list[str] = []
    try:
        bind(policy, model)
    except PolicyError as exc:
        issues = [str(issue) for issue in exc.issues]
    except GradGuardError as exc:
        issues = [str(exc)]
    snapshot = snapshot_bytes(model) if policy.recovery is not None else None
    found = binding_warnings(policy, [tuple(entry.names) for entry in params])
    return Explanation(policy, model_spec, type(model).__name__, params, members, issues, snapshot, found)


def _rule_actions(rule: Rule) -> list[str]:
    window = window_text(rule)
    return [action_text(action) + (f" [rule {window}]" if window else "") for action in rule.actions]


def explain_header(expl: Explanation) -> list[str]:
    covered = sum(1 for entry in expl.params if entry.rules)
    names = sum(len(entry.names) for entry in expl.params)
    elements = sum(entry.numel for entry in expl.params)
    return [
        f"policy: {short_path(expl.policy.source)} ({len(expl.policy.rules)} rules, applied in this order: "
        f"{', '.join(rule.name for rule in expl.policy.rules)})",
        f"model: {expl.model_spec} -> {expl.model_class}: {len(expl.params):,} parameter tensors "
        f"({names:,} names), {elements:,} elements; {covered:,} covered by a rule, "
        f"{len(expl.params) - covered:,} not covered",
    ]


def explain_sections(expl: Explanation) -> list[Section]:
    rules = expl.policy.rules
    rows = []
    for entry in expl.params:
        notes = []
        if len(entry.names) > 1:
            notes.append("tied: also " + ", ".join(entry.names[1:]))
        if not entry.requires_grad:
            notes.append("frozen (requires_grad=False)")
        actions = [text for i in entry.rules for text in _rule_actions(rules[i])]
        rows.append(
            [
                entry.names[0],
                "(" + ", ".join(map(str, entry.shape)) + ("," if len(entry.shape) == 1 else "") + ")",
                entry.dtype,
                ", ".join(rules[i].name for i in entry.rules) or "-",
                "; ".join(actions) or "- (not covered)",
                "; ".join(notes),
            ]
        )
    parameters = Section(
        "Parameters (model order; actions apply in this order at every step)",
        [],
        Table(["parameter", "shape", "dtype", "rules", "actions", "note"], rows),
    )
    rule_rows = []
    for i, rule in enumerate(rules):
        matched = expl.members[i]
        if matched:
            note = ""
        elif rule.allow_no_match:
            note = "matches nothing (allowed: allow_no_match)"
        else:
            note = "MATCHES NOTHING"
        rule_rows.append(
            [
                rule.name,
                f"{len(matched):,}",
                f"{sum(expl.params[k].numel for k in matched):,}",
                "; ".join(action_text(action) for action in rule.actions),
                window_text(rule) or "all",
                note,
            ]
        )
    rule_section = Section(
        "Rules", [], Table(["rule", "params", "elements", "actions", "steps", "note"], rule_rows, frozenset({1, 2}))
    )
    uncovered = [name for entry in expl.params if not entry.rules for name in entry.names]
    uncovered_section = Section(
        "Parameters no rule covers (the guard never touches their gradients)",
        [", ".join(uncovered) if uncovered else "none"],
    )
    nothing = [rule.name for i, rule in enumerate(rules) if not expl.members[i]]
    nothing_section = Section(
        "Rules that match nothing",
        [
            f"{name}" + (" (allow_no_match: true)" if rules[[r.name for r in rules].index(name)].allow_no_match else "")
            for name in nothing
        ]
        or ["none"],
    )
    tied = [entry for entry in expl.params if len(entry.names) > 1]
    tied_section = Section(
        "Tied parameters (one tensor, several names; each action applies once per tensor)",
        [f"{' = '.join(entry.names)}: rules {', '.join(rules[i].name for i in entry.rules) or '-'}" for entry in tied]
        or ["none"],
    )
    recovery = _recovery_section(expl)
    others = [Section(f"The {name} section", section_lines(expl.policy, name)) for name in expl.other_sections()]
    problems = Section("Problems GradGuard would raise when attaching", expl.issues or ["none"])
    warned = Section("Warnings GradGuard would give when attaching (it attaches)", expl.warnings or ["none"])
    verdict = f"{len(expl.issues)} problem(s)" if expl.issues else "none"
    verdict += f", {len(expl.warnings)} warning(s)" if expl.warnings else ""
    return [
        parameters,
        rule_section,
        uncovered_section,
        nothing_section,
        tied_section,
        *([recovery] if recovery is not None else []),
        *others,
        problems,
        warned,
        Section("Findings", [f"{verdict} (exit {expl.exit_code})"]),
    ]


def _halting_actions(rule: Rule) -> list[str]:
    """How ``rule`` can halt, and so rewind, in words."""
    how = []
    for action in rule.actions:
        if isinstance(action, HaltOnNonfinite):
            scaler = []
            if action.min_loss_scale is not None:
                scaler.append(f"a GradScaler skip at a loss scale of {action.min_loss_scale:g} or less")
            if action.max_scaler_skips is not None:
                scaler.append(f"more than {action.max_scaler_skips} GradScaler skips in a row")
            how.append("halt_on_nonfinite: a NaN/Inf gradient" + "".join(f", or {text}" for text in scaler))
        elif isinstance(action, SkipStepOnNonfinite | SkipStepOnSpike):
            limits = []
            if action.max_consecutive_skips is not None:
                limits.append(f"more than {action.max_consecutive_skips} skips in a row")
            if action.max_skips is not None:
                limits.append(f"more than {action.max_skips} skips in {action.window_steps} steps")
            if limits:
                how.append(f"{action.action} past its limits ({' or '.join(limits)})")
    return how


def _recovery_section(expl: Explanation) -> Section | None:
    """What the policy's ``recovery`` section will do, in words, and what its snapshots will hold for this model."""
    recovery = expl.policy.recovery
    if recovery is None:
        return None
    every, keep = recovery.snapshot_every, recovery.keep
    lines = [
        f"snapshots: one every {every} steps (at each step that is a multiple of {every}, before its update), "
        f"the newest {keep} kept",
        f"a halt becomes a rewind: back to the newest snapshot at least {recovery.min_age} steps older than the "
        f"fault, restored in place; the fault's update and those of the next {recovery.skip_steps} steps are "
        "skipped, so the batches from the snapshot's step to the end of that window are never learned from",
        f"at most {recovery.max_rewinds} rewinds in a run; the next halt restores the snapshot, then halts",
    ]
    if recovery.lr_factor == 1.0:
        lines.append("lr_factor 1.0: the LRs are left as they are at a rewind (new data alone)")
    else:
        lines.append(
            f"lr_factor {recovery.lr_factor:g}: every param group's LR (and a known scheduler's base LRs) is "
            f"multiplied by {recovery.lr_factor:g} at each rewind, for the rest of the run"
        )
    rewinding = [(i, rule) for i, rule in enumerate(expl.policy.rules) if can_halt(rule)]
    for i, rule in rewinding:
        params = len(expl.members[i])
        lines.append(f"rule {rule.name!r} ({params:,} params) rewinds on " + "; ".join(_halting_actions(rule)))
    loss = loss_halts(expl.policy.loss)
    if loss:
        lines.append("the loss section rewinds on " + "; ".join(loss))
    if rewinding and not loss and not any(expl.members[i] for i, _ in rewinding):
        lines.append(
            "note: no rule that can halt covers a parameter of this model; only a GradScaler overflow can rewind"
        )
    snapshot = expl.snapshot
    if snapshot is not None:
        lines.append(
            f"each snapshot holds the parameters and buffers: {readable_bytes(snapshot.model)}; {keep} of them: "
            f"{readable_bytes(snapshot.model * keep)}"
        )
        lines.append(
            f"plus each optimizer's state: with Adam or AdamW {readable_bytes(snapshot.adam_state)} more per snapshot, "
            f"{readable_bytes((snapshot.model + snapshot.adam_state) * keep)} in all; the attach event and "
            "guard.metrics() give the real figure and where"
        )
    per_snapshot = None if snapshot is None else snapshot.model + snapshot.adam_state
    lines.append(memory_text(recovery.memory, keep, per_snapshot))  # where they live (recovery.memory)
    return Section("Recovery (a halt becomes a rewind to an in-memory snapshot; the run goes on)", lines)
