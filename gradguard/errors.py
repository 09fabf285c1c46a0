"""The exceptions and warnings gradguard raises.

Every exception gradguard raises on purpose derives from [`GradGuardError`][gradguard.GradGuardError]:

    GradGuardError
    ├── PolicyError (also ValueError)      a policy file or dict is wrong, or does not fit the model
    ├── GradientHalt (also RuntimeError)   a non-finite gradient stopped training before the optimizer step
    └── GuardStateError (also RuntimeError) the guard was used in a way it cannot honour
        └── UnsupportedOptimizerError       an optimizer whose step the guard cannot treat soundly

    GuardWarning (UserWarning)             something the user should know, that does not stop training

Messages repeat what the user gave and say how to fix it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "GradGuardError",
    "GradientHalt",
    "GuardStateError",
    "GuardWarning",
    "PolicyError",
    "PolicyIssue",
    "UnsupportedOptimizerError",
    "origin_sentence",
    "ranks_words",
]


class GradGuardError(Exception):
    """Base class of every exception gradguard raises on purpose."""


@dataclass(frozen=True)
class PolicyIssue:
    """One thing wrong with a policy: where it is, and what to do about it."""

    source: str
    """The policy file's path, or ``<dict>`` for a policy built in code."""
    line: int | None
    """1-based line in ``source``, where the format lets us know it."""
    path: str
    """The field path, e.g. ``rules[1].actions[0].max_norm``; empty for the whole document."""
    message: str
    """What was given, what is expected, and how to fix it."""

    def __str__(self) -> str:
        where = self.source if self.line is None else f"{self.source}:{self.line}"
        field = f" {self.path}:" if self.path else ""
        return f"{where}:{field} {self.message}"


class PolicyError(GradGuardError, ValueError):
    """A policy could not be loaded, validated or bound to a model.

    ``issues`` lists every problem found, not only the first, so one edit can fix them all. ``head``:
    ``invalid policy``, or ``no such policy`` when there was nothing to read (no such file or shipped name).
    """

    def __init__(self, issues: Sequence[PolicyIssue], *, head: str = "invalid policy") -> None:
        self.issues: tuple[PolicyIssue, ...] = tuple(issues)
        count = len(self.issues)
        head = head if count == 1 else f"{head} ({count} problems)"
        super().__init__(head + ":\n" + "\n".join(f"  {issue}" for issue in self.issues))


class GradientHalt(GradGuardError, RuntimeError):
    """Training was stopped before the optimizer applied a non-finite gradient.

    The parameters and the optimizer state are exactly as they were after the last good step, so
    they can be checkpointed as they are.
    """

    def __init__(
        self,
        step: int,
        params: Sequence[str],
        kind: str,
        rule: str,
        reason: str | None = None,
        origin: Mapping[str, Any] | None = None,
        restored_to: int | None = None,
        ranks: Mapping[int, str] | None = None,
    ) -> None:
        self.step = step
        """The guard's 0-based step index at which the halt happened."""
        self.params: tuple[str, ...] = tuple(params)
        """Names of every parameter whose gradient was non-finite: those that went non-finite first as
        backward accumulated them (``origin["first_params"]``) first, then the others in model order. For a
        ``"transient"`` halt (the rerun section), the parameters whose two computations differed."""
        self.kind = kind
        """``"nan"``, ``"inf"`` or ``"nan+inf"``; ``"spike"`` when ``skip_step_on_spike`` escalated;
        ``"overflow"`` when GradScaler skipped more steps in a row than ``max_scaler_skips``."""
        self.rule = rule
        """The name of the (first) halt or skip rule that covered the offending parameters."""
        self.reason = reason
        """Why a skip rule escalated to a halt, or ``None`` for a plain halt."""
        self.origin: dict[str, Any] | None = dict(origin) if origin is not None else None
        """Where it started (``GradGuard(provenance=...)``): ``phase`` (``forward``, ``backward``, ``gradient``
        or ``after_backward``), ``module``, ``kind``, ``input_nonfinite`` (the input batch was already
        non-finite), ``first_params``, ``own`` (phase ``gradient``: one module's parameters went non-finite
        while the modules before it kept finite gradients, so it was made in those gradients themselves),
        ``before`` and ``consumers`` (a backward fault placed between modules), ``first`` and ``finite_own``
        (phase ``gradient`` in the first module with parameters, which no module before it can tell from a
        gradient passed back to it: its parameters whose gradients stayed finite), ``spread`` (a clip the guard saw
        run before its step spread it to every gradient), ``clip`` (that clip's name) and ``hint`` (one
        sentence: how to trace it, or to trace it further); ``None`` if not traced."""
        self.restored_to = restored_to
        """The step of the recovery snapshot restored before this halt (``max_rewinds`` reached), or ``None``."""
        self.ranks: dict[int, str] = dict(sorted((ranks or {}).items()))
        """Under ``torch.distributed``: the ranks where the fault was made and their hosts (``{2: "node-17"}``): drain
        those. Made before the reduction, in a rank's own gradient; or, where no rank's own gradient was non-finite,
        after it, on the replicas whose reduced gradients turned non-finite while the others' did not (the origin then
        says ``after_reduction``). Empty in one process, where every replica's turned non-finite after the reduction
        (the reduction itself, or code every rank runs), under sharding for a fault made after the reduction, or where
        the ranks' own gradients are unseen (the ``attach`` event's ``ranks`` says why). For ``kind`` ``"divergence"``,
        the replicas outside the majority; ``"outlier"``, the ranks far off the others."""
        shown = ", ".join(self.params[:8]) + (f" and {len(self.params) - 8} more" if len(params) > 8 else "")
        what = {
            "spike": "gradient norm spike",
            "overflow": "GradScaler overflow (inf/NaN) on every step",
            "divergence": "replica divergence (the data-parallel replicas' weights differ bitwise)",
            "outlier": "rank outlier (a rank's own gradient far off the others')",
        }.get(kind, f"non-finite gradient ({kind})")
        if rule == "loss":  # the policy's loss section, not a rule's gradient
            what = "loss spike" if kind == "spike" else f"non-finite loss ({kind})"
        elif kind == "transient":
            what = "transient fault (the step computed again differed)"
        where = f" in {len(self.params)} parameter(s): {shown}" if self.params else ""
        if self.ranks:
            made = "made on" if kind not in ("divergence", "outlier") else "on"
            where += f", {made} {ranks_words(self.ranks)}"
        traced = f" {origin_sentence(origin)}" if origin else ""
        state = "as they were after the last good step"
        if restored_to is not None:
            state = f"restored to the recovery snapshot of step {restored_to}"
        by = "the rerun section" if kind == "transient" else "the loss section" if rule == "loss" else f"rule {rule!r}"
        super().__init__(
            f"{what} at step {step}{where} "
            f"({by}){'; ' + reason if reason else ''}.{traced} The optimizer step was not taken: "
            f"parameters and optimizer state are {state}."
        )


def ranks_words(ranks: Mapping[int, str]) -> str:
    """``rank 2 (host node-17)``, or ``ranks 1 (host a) and 2 (host b)``; at most eight named."""
    named = [f"{rank} (host {host})" for rank, host in sorted(ranks.items())]
    shown = ", ".join(named[:8]) + (f" and {len(named) - 8} more" if len(named) > 8 else "")
    if len(named) == 2:
        shown = " and ".join(named)
    return ("rank " if len(named) == 1 else "ranks ") + shown


def origin_sentence(origin: Mapping[str, Any]) -> str:
    """Where a NaN/Inf started (a halt's or skip's ``origin``), in one or two sentences."""
    phase, module, seen_in = origin.get("phase"), origin.get("module"), origin.get("seen_in")
    kind = origin.get("kind") or "non-finite"
    first = list(origin.get("first_params") or ())
    if phase == "received" and origin.get("pipeline"):
        text = f"It was not made on this pipeline stage (rank {origin.get('rank')}): its gradients are finite; "
        text += f"{origin.get('note')}, and every stage stops before its update."
    elif phase == "received" and origin.get("after_reduction"):
        text = f"It was not made on this rank (rank {origin.get('rank')}): its gradients are finite, before and after "
        text += "the reduction; another rank's turned non-finite after it, and every rank stops together."
    elif phase == "received":
        text = f"It was not made on this rank (rank {origin.get('rank')}): its own gradient was finite before the "
        text += "reduction, which carried in what another rank made."
    elif phase == "forward" and origin.get("input_nonfinite"):
        text = f"It started in the input batch, already {kind} before the first module (the data is at fault, "
        text += f"not the model); first non-finite output: {seen_in}."
    elif phase == "forward" and module:
        text = f"It started in the forward pass: {module} was the first module whose output went {kind}."
        if seen_in and seen_in != module:
            text = f"It started in the forward pass, in {module}'s own code: {seen_in} received a {kind} input."
    elif phase == "backward" and module and origin.get("first") and origin.get("before"):
        # The first module with parameters (a stem, an input layer), the modules after it finite: with no module
        # before it to tell them apart (the last layer's case, ``own``), both readings remain; say which is likelier.
        consumers = list(origin.get("consumers") or ())
        # Whose backward hands the gradient to ``module``: the next module that took its output (``passer``), not a
        # sibling fed from the input (``beside``: an embedding whose output is summed with this one's).
        after = origin.get("passer") or (consumers[0] if consumers else origin["before"])
        kept_too = origin["passer_kept"] if "passer" in origin else after == origin["before"]
        beside = list(origin.get("beside") or ())
        aside = f"{', '.join(beside)}, fed from the input beside it, passed nothing back to it" if beside else ""
        kept = list(origin.get("finite_own") or ())
        made = "a hook on a parameter, the weight-gradient computation, or code that touched only these gradients"
        if kept:  # a gradient carried in would most likely have spoiled every parameter of the module
            text = f"It started in the gradients of {module}'s own parameters: {module} is the first module with "
            text += f"parameters, so no module before it can show whether backward carried it in, but {kept[0]} kept "
            text += f"a finite gradient, which a non-finite one passed back by {after}"
            text += f" ({aside})" if aside else ""
            text += f" would most likely have spoiled too ({made} made it)."
        else:
            text = f"It started in {module}, the first module with parameters: in the gradients of its own "
            text += f"parameters, or in the gradient of its output that {after} passed back (the modules from "
            text += f"{origin['before']} on kept finite gradients, and no module before {module} can tell the two "
            text += f"apart{'; ' + aside if aside else ''}). Likelier its own gradients ({made}): for {after} to have "
            text += "made it, its backward must "
            text += f"have turned finite gradients {kind}"
            text += ", while its own parameters' gradients stayed finite." if kept_too else "."
    elif phase == "backward" and module and origin.get("before"):
        text = f"It started in the backward pass, in {module} or after it: the parameters' gradients up to "
        text += f"{module} went {kind}, those from {origin['before']} on stayed finite"
        others = list(origin.get("consumers") or ())
        text += f" (between them: {', '.join(others)})." if others else "."
    elif phase == "backward" and module:
        text = f"It started in the backward pass: {module}'s backward produced the first {kind} gradient"
        text += f" (the gradient of {seen_in}'s output)." if seen_in and seen_in != module else "."
    elif phase == "gradient" and module and origin.get("own"):
        text = f"It started in the gradients of {module}'s own parameters: the modules that ran before it kept "
        text += "finite gradients, so backward did not carry it through the activations (the weight-gradient "
        text += "computation, a hook on a parameter, or code that touched only these gradients made it)."
    elif phase == "gradient" and first:
        text = f"First gradients to go {kind} as backward accumulated them: {', '.join(first[:8])} (in {module})."
    else:
        text = f"Origin: {origin.get('note') or phase}."
    if origin.get("hint"):
        text += f" {origin['hint']}"
    if first and phase != "gradient":
        text += f" First non-finite as accumulated: {', '.join(first[:8])}."
    if origin.get("spread"):
        clip = origin.get("clip") or "a global clip"
        text += (
            f" {clip} ran over these gradients before the guard's step (a GradScaler still held them scaled, or "
            "GradGuard(before_clip=False)), and a global clip turns one NaN into NaN in every gradient: the "
            "parameters named may not be where it started. Call scaler.unscale_(optimizer) before the clip, so the "
            "guard acts first."
        )
    if origin.get("after_reduction") and phase != "received":
        text += f" Made after the reduction, on rank {origin.get('rank')}: the other ranks' reduced gradients stayed "
        text += "finite."
    if origin.get("unseen"):
        text += f" Whether this rank made it cannot be told: {origin['unseen']}."
    return text


class GuardStateError(GradGuardError, RuntimeError):
    """The guard cannot do what was asked in its current state (e.g. a second guard on one model)."""


class UnsupportedOptimizerError(GuardStateError):
    """An optimizer steps guarded parameters in a way the guard cannot treat soundly.

    ``torch.optim.LBFGS`` (with ``max_iter > 1`` or a line search) evaluates its closure several times
    in one ``step()`` and moves the parameters between evaluations: there is no single gradient to
    treat before the update.
    """


class GuardWarning(UserWarning):
    """Something gradguard could not do as configured, or a guard dropped while still attached."""
