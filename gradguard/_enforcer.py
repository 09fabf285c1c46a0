"""The step-boundary engine: applies a bound policy to the gradients the optimizer is about to apply.

It runs once per optimizer step, after every backward pass of the step (so accumulation is
treated as one gradient), after GradScaler's unscale and after DDP's averaging, and before the
optimizer reads ``p.grad``. All tensor work is batched per action with torch's ``_foreach`` kernels
and stays on the device; every figure the host needs (halt decision, log fields, counters) comes back
in one transfer: exactly one host sync per step, and none while backward runs.

Norms follow ``torch.nn.utils.clip_grad_norm_`` operation for operation, so results are bitwise
equal to it, except in two deliberate ways: float16/bfloat16 gradients have their norms computed in
float32 (a finite gradient is never called infinite because a half-precision norm overflowed), and
a non-finite norm never rescales anything (torch would turn every gradient of the group into NaN).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gradguard._binding import Binding, BoundRule, GuardedParam
from gradguard._counters import Counters
from gradguard._errors import GradientHalt
from gradguard._events import EventLog
from gradguard._policy import ClipNorm, ClipValue, HaltOnNonfinite, Scale, Zero

__all__ = ["Enforcer", "Plan"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s epsilon; the same value keeps results bitwise equal.


def _norms(grads: Sequence[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Per-tensor norms, in float32 for half-precision gradients, in one ``_foreach_norm`` per dtype."""
    if all(g.dtype not in _LOW_PRECISION for g in grads):
        return list(torch._foreach_norm(list(grads), norm_type))
    out: list[torch.Tensor | None] = [None] * len(grads)
    low = [i for i, g in enumerate(grads) if g.dtype in _LOW_PRECISION]
    high = [i for i, g in enumerate(grads) if g.dtype not in _LOW_PRECISION]
    for indices, kwargs in ((low, {"dtype": torch.float32}), (high, {})):
        if indices:
            norms = torch._foreach_norm([grads[i] for i in indices], norm_type, **kwargs)
            for i, norm in zip(indices, norms, strict=True):
                out[i] = norm
    return [norm for norm in out if norm is not None]


def _stack_on(norms: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.stack([norm.to(device) for norm in norms])


def _clip_coefficients(totals: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_``'s coefficient, left at 1 where the norm is not finite."""
    coef = torch.clamp(max_norm / (totals + _EPS), max=1.0)
    return torch.where(torch.isfinite(totals), coef, torch.ones_like(coef))


@dataclass(eq=False)
class Plan:
    """What one enforcement pass treats: a subset of the guarded tensors (those one optimizer steps)."""

    params: tuple[GuardedParam, ...]
    rules: tuple[tuple[BoundRule, tuple[GuardedParam, ...]], ...]
    raw_norm_params: frozenset[int]
    """Indices of the tensors whose untouched 2-norm is needed: halt coverage and first-touch clips."""
    halt_rules_by_param: dict[int, tuple[int, ...]]

    @classmethod
    def build(cls, binding: Binding, params: Sequence[GuardedParam]) -> Plan:
        chosen = {entry.index for entry in params}
        ordered = tuple(entry for entry in binding.params if entry.index in chosen)
        rules = tuple(
            (bound, tuple(entry for entry in bound.params if entry.index in chosen)) for bound in binding.rules
        )
        raw: set[int] = set()
        touched: set[int] = set()
        halt_rules: dict[int, list[int]] = {}
        for bound, members in rules:
            for action in bound.actions:
                if isinstance(action, HaltOnNonfinite):
                    for entry in members:
                        raw.add(entry.index)
                        halt_rules.setdefault(entry.index, []).append(bound.index)
                    continue
                if isinstance(action, ClipNorm) and action.norm_type == 2.0:
                    raw.update(entry.index for entry in members if entry.index not in touched)
                touched.update(entry.index for entry in members)
        return cls(
            params=ordered,
            rules=rules,
            raw_norm_params=frozenset(raw),
            halt_rules_by_param={key: tuple(value) for key, value in halt_rules.items()},
        )


@dataclass
class _Pending:
    """Device tensors to read back in the step's one sync, and how to interpret them."""

    parts: list[torch.Tensor] = field(default_factory=list)
    readers: list[Callable[[list[float]], None]] = field(default_factory=list)

    def add(self, values: torch.Tensor, reader: Callable[[list[float]], None]) -> None:
        self.parts.append(values.reshape(-1))
        self.readers.append(reader)

    def sync(self) -> None:
        if not self.parts:
            return
        host = torch.cat([part.detach().to("cpu", torch.float64) for part in self.parts]).tolist()
        offset = 0
        for part, reader in zip(self.parts, self.readers, strict=False):
            size = part.numel()
            reader(host[offset : offset + size])
            offset += size


@dataclass
class _StepOutcome:
    nonfinite: dict[int, tuple[str, int]] = field(default_factory=dict)
    """Tensor index -> (kind, rule index to report it under)."""
    halted_by: dict[int, int] = field(default_factory=dict)
    """Tensor index -> halt rule index, for non-finite tensors an active halt rule covers."""
    counts: list[tuple[str, str, int]] = field(default_factory=list)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


class Enforcer:
    """Applies a :class:`Binding` at step boundaries; owns the step counter."""

    def __init__(self, binding: Binding, counters: Counters, events: EventLog, *, summary_every: int) -> None:
        self.binding = binding
        self.counters = counters
        self.events = events
        self.summary_every = summary_every
        self.step = 0
        """0-based index of the next step the guard will treat."""
        self.applied_versions: dict[int, tuple[int, int]] = {}
        """``(id(grad), grad._version)`` after the last pass, per tensor: a gradient already treated,
        and unchanged since, is not treated again (a second ``step()`` on the same gradient)."""

    def run(self, plan: Plan) -> bool:
        """Treat the current gradients of ``plan``'s tensors; return whether anything was treated.

        Raises :class:`GradientHalt` (before the optimizer step) when a halt rule sees NaN or Inf.
        """
        grads: dict[int, torch.Tensor] = {}
        for entry in plan.params:
            param = entry.ref()
            grad = param.grad if param is not None else None
            if grad is None:
                continue
            if self.applied_versions.get(entry.index) == (id(grad), grad._version):
                continue  # already treated, and unchanged since: a second step() on the same gradient
            grads[entry.index] = grad
        if not grads:
            return False

        step = self.step
        self.step += 1
        pending = _Pending()
        outcome = _StepOutcome()
        names = {entry.index: entry.name for entry in plan.params}

        raw_ids = [index for index in plan.raw_norm_params if index in grads]
        raw_ids.sort()
        raw = dict(zip(raw_ids, _norms([grads[i] for i in raw_ids], 2.0), strict=False)) if raw_ids else {}
        if raw_ids:
            self._read_raw_norms(pending, outcome, plan, raw_ids, raw, step)

        touched: set[int] = set()
        for bound, members in plan.rules:
            if not bound.rule.active_at(step):
                continue
            ids = [entry.index for entry in members if entry.index in grads]
            if not ids:
                continue
            for action in bound.actions:
                if not action.active_at(step) or isinstance(action, HaltOnNonfinite):
                    continue
                gs = [grads[i] for i in ids]
                if isinstance(action, ClipNorm):
                    reuse = action.norm_type == 2.0 and all(i in raw and i not in touched for i in ids)
                    norms = [raw[i] for i in ids] if reuse else _norms(gs, action.norm_type)
                    if action.scope == "tensor":
                        self._clip_tensors(pending, outcome, bound, action, ids, gs, norms, names, step)
                    else:
                        self._clip_group(pending, outcome, bound, action, ids, gs, norms, names, step)
                elif isinstance(action, ClipValue):
                    self._clip_values(pending, outcome, bound, action, ids, gs, names, step)
                elif isinstance(action, Scale):
                    torch._foreach_mul_(gs, action.factor)
                    outcome.counts.append((bound.name, "scale", len(ids)))
                elif isinstance(action, Zero):
                    torch._foreach_zero_(gs)
                    outcome.counts.append((bound.name, "zero", len(ids)))
                touched.update(ids)

        pending.sync()  # the step's one host sync
        self._report(outcome, plan, names, step)  # raises GradientHalt, leaving the gradients to be re-checked
        for index, grad in grads.items():
            self.applied_versions[index] = (id(grad), grad._version)
        return True

    # --- actions ------------------------------------------------------------------------------

    def _read_raw_norms(
        self,
        pending: _Pending,
        outcome: _StepOutcome,
        plan: Plan,
        raw_ids: list[int],
        raw: dict[int, torch.Tensor],
        step: int,
    ) -> None:
        halt_rules = self.binding.policy.rules

        def read(values: list[float], device_ids: list[int]) -> None:
            for index, value in zip(device_ids, values, strict=False):
                if value == value and abs(value) != float("inf"):
                    continue
                kind = "nan" if value != value else "inf"
                active = [
                    r
                    for r in plan.halt_rules_by_param.get(index, ())
                    if halt_rules[r].active_at(step) and _halt_action_active(halt_rules[r].actions, step)
                ]
                if active:
                    outcome.halted_by[index] = active[0]
                first_rule = active[0] if active else self._first_rule(index)
                outcome.nonfinite.setdefault(index, (kind, first_rule))

        raw_norms = [raw[i] for i in raw_ids]
        for device_ids, positions in _by_device(raw_ids, raw_norms):
            pending.add(
                _stack_on([raw_norms[k] for k in positions], raw_norms[positions[0]].device),
                functools.partial(read, device_ids=device_ids),
            )

    def _first_rule(self, index: int) -> int:
        return self.binding.params[index].rules[0]

    def _clip_tensors(
        self,
        pending: _Pending,
        outcome: _StepOutcome,
        bound: BoundRule,
        action: ClipNorm,
        ids: list[int],
        gs: list[torch.Tensor],
        norms: list[torch.Tensor],
        names: dict[int, str],
        step: int,
    ) -> None:
        for device_ids, positions in _by_device(ids, norms):
            device = norms[positions[0]].device
            per_tensor = _stack_on([norms[k] for k in positions], device)
            # clip_grad_norm_([p]) takes the norm of the one-element stack of norms; so do we, row-wise.
            totals = torch.linalg.vector_norm(per_tensor.unsqueeze(1), action.norm_type, dim=1)
            coefs = _clip_coefficients(totals, action.max_norm)
            torch._foreach_mul_([gs[k] for k in positions], list(coefs.unbind()))

            def read(values: list[float], device_ids: list[int] = device_ids) -> None:
                count = len(device_ids)
                for index, norm, coef in zip(device_ids, values[:count], values[count:], strict=False):
                    if norm != norm or abs(norm) == float("inf"):
                        outcome.nonfinite.setdefault(index, ("nan" if norm != norm else "inf", bound.index))
                    elif coef < 1.0:
                        outcome.counts.append((bound.name, "clip_norm", 1))
                        outcome.events.append(
                            (
                                "intervention",
                                {
                                    "step": step,
                                    "rule": bound.name,
                                    "action": "clip_norm",
                                    "param": names[index],
                                    "scope": "tensor",
                                    "norm_type": action.norm_type,
                                    "max_norm": action.max_norm,
                                    "before": norm,
                                    "after": norm * coef,
                                    "coef": coef,
                                },
                            )
                        )

            pending.add(torch.cat([totals, coefs]), read)

    def _clip_group(
        self,
        pending: _Pending,
        outcome: _StepOutcome,
        bound: BoundRule,
        action: ClipNorm,
        ids: list[int],
        gs: list[torch.Tensor],
        norms: list[torch.Tensor],
        names: dict[int, str],
        step: int,
    ) -> None:
        device = norms[0].device
        total = torch.linalg.vector_norm(_stack_on(norms, device), action.norm_type)
        coef = _clip_coefficients(total, action.max_norm)
        for _, positions in _by_device(ids, gs):
            torch._foreach_mul_([gs[k] for k in positions], coef.to(gs[positions[0]].device))

        def read(values: list[float]) -> None:
            norm, factor = values
            if norm != norm or abs(norm) == float("inf"):
                kind = "nan" if norm != norm else "inf"
                outcome.events.append(
                    (
                        "nonfinite_group_norm",
                        {"step": step, "rule": bound.name, "action": "clip_norm", "kind": kind, "n_params": len(ids)},
                    )
                )
            elif factor < 1.0:
                outcome.counts.append((bound.name, "clip_norm", len(ids)))
                outcome.events.append(
                    (
                        "intervention",
                        {
                            "step": step,
                            "rule": bound.name,
                            "action": "clip_norm",
                            "param": None,
                            "params": [names[i] for i in ids],
                            "n_params": len(ids),
                            "scope": "group",
                            "norm_type": action.norm_type,
                            "max_norm": action.max_norm,
                            "before": norm,
                            "after": norm * factor,
                            "coef": factor,
                        },
                    )
                )

        pending.add(torch.stack([total, coef]), read)

    def _clip_values(
        self,
        pending: _Pending,
        outcome: _StepOutcome,
        bound: BoundRule,
        action: ClipValue,
        ids: list[int],
        gs: list[torch.Tensor],
        names: dict[int, str],
        step: int,
    ) -> None:
        peaks = _norms(gs, float("inf"))
        torch._foreach_clamp_min_(gs, -action.limit)
        torch._foreach_clamp_max_(gs, action.limit)
        for device_ids, positions in _by_device(ids, peaks):

            def read(values: list[float], device_ids: list[int] = device_ids) -> None:
                for index, peak in zip(device_ids, values, strict=False):
                    if peak != peak or abs(peak) == float("inf"):
                        outcome.nonfinite.setdefault(index, ("nan" if peak != peak else "inf", bound.index))
                    elif peak > action.limit:
                        outcome.counts.append((bound.name, "clip_value", 1))
                        outcome.events.append(
                            (
                                "intervention",
                                {
                                    "step": step,
                                    "rule": bound.name,
                                    "action": "clip_value",
                                    "param": names[index],
                                    "limit": action.limit,
                                    "before": peak,
                                    "after": action.limit,
                                },
                            )
                        )

            pending.add(_stack_on([peaks[k] for k in positions], peaks[positions[0]].device), read)

    # --- after the sync -------------------------------------------------------------------------

    def _report(self, outcome: _StepOutcome, plan: Plan, names: dict[int, str], step: int) -> None:
        rules = self.binding.policy.rules
        for index in sorted(outcome.nonfinite):
            kind, rule_index = outcome.nonfinite[index]
            self.counters.add(rules[rule_index].name, kind)
            self.events.emit(
                "info",
                "nonfinite",
                step=step,
                rule=rules[rule_index].name,
                param=names[index],
                kind=kind,
                halts=index in outcome.halted_by,
            )
        passed = sorted(set(outcome.nonfinite) - set(outcome.halted_by))
        if passed:
            # No halt rule covers these: say loudly that the optimizer is about to apply them.
            self.events.emit(
                "warning",
                "nonfinite_unhalted",
                step=step,
                params=[names[i] for i in passed],
                kinds=sorted({outcome.nonfinite[i][0] for i in passed}),
            )
        if outcome.halted_by:
            offenders = sorted(outcome.halted_by)
            kinds = sorted({outcome.nonfinite[i][0] for i in offenders})
            kind = "+".join(kinds)
            rule = rules[outcome.halted_by[offenders[0]]].name
            for rule_index in sorted(set(outcome.halted_by.values())):
                self.counters.add(rules[rule_index].name, "halt_on_nonfinite")
            params = [names[i] for i in offenders]
            self.events.emit(
                "error",
                "halt",
                step=step,
                rule=rule,
                params=params,
                kinds={names[i]: outcome.nonfinite[i][0] for i in offenders},
                kind=kind,
                counters=self.counters.snapshot(),
            )
            raise GradientHalt(step=step, params=params, kind=kind, rule=rule)
        self.counters.add_many(outcome.counts)
        for event, fields in outcome.events:
            self.events.emit("warning" if event.startswith("nonfinite") else "debug", event, **fields)
        if self.summary_every and (step + 1) % self.summary_every == 0:
            self.emit_summary()

    def emit_summary(self) -> None:
        """Write the cumulative counters, so the log reproduces counts that are not logged per step."""
        self.events.emit("info", "counters", step=self.step - 1, steps=self.step, counters=self.counters.snapshot())


def _halt_action_active(actions: Sequence[Any], step: int) -> bool:
    return any(isinstance(action, HaltOnNonfinite) and action.active_at(step) for action in actions)


def _by_device(ids: Sequence[int], tensors: Sequence[torch.Tensor]) -> list[tuple[list[int], list[int]]]:
    """Group positions of parallel lists by device, keeping order: ``[(ids, positions), ...]``.

    One group in the common single-device case, found without building anything per tensor.
    """
    first = tensors[0].device
    if all(t.device == first for t in tensors):
        return [(list(ids), list(range(len(ids))))]
    groups: dict[torch.device, tuple[list[int], list[int]]] = {}
    for position, (index, tensor) in enumerate(zip(ids, tensors, strict=False)):
        bucket = groups.setdefault(tensor.device, ([], []))
        bucket[0].append(index)
        bucket[1].append(position)
    return list(groups.values())
