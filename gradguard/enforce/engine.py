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

import math
import operator
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gradguard.enforce.distributed import Collective, combine_shard_norms, is_sharded, local_tensor
from gradguard.enforce.micro_batch import HookRecord, MicroBatchHooks, handled_in_hooks
from gradguard.errors import GradientHalt, GuardStateError, GuardWarning
from gradguard.events.counters import Counters
from gradguard.events.log import EventLog
from gradguard.policy.matching import Binding, BoundRule, GuardedParam
from gradguard.policy.schema import Action, ClipNorm, ClipValue, Drop, HaltOnNonfinite, Scale, SkipStepOnNonfinite, Zero

__all__ = ["SCALER_RULE", "Enforcer", "Plan", "StepContext"]

SCALER_RULE = "grad_scaler"
"""Counter key for steps GradScaler skipped (inf/NaN found in a normal loss-scale search)."""

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_WATCHING = (HaltOnNonfinite, SkipStepOnNonfinite)
_OVERFLOW_NOTE = (
    "every element is finite but the float32 2-norm overflowed: not a non-finite gradient; its tensor-scope "
    "clips used a float64 norm"
)
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
    if all(norm.device == device for norm in norms):
        return torch.stack(list(norms))  # the common case: no per-tensor ``.to`` (a no-op, but a dispatch)
    return torch.stack([norm.to(device) for norm in norms])


def _clamp_(grads: list[torch.Tensor], limit: float) -> None:
    """``clip_grad_value_``'s clamp, with the limit capped at each dtype's largest finite value.

    torch refuses a float16 clamp bound above 65504; no finite float16 exceeds it, so the cap changes
    nothing but the (reported) Inf, which becomes the largest finite value instead of staying Inf.
    """
    if all(limit <= torch.finfo(g.dtype).max for g in grads):
        torch._foreach_clamp_min_(grads, -limit)
        torch._foreach_clamp_max_(grads, limit)
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for dtype, group in by_dtype.items():
        bound = min(limit, torch.finfo(dtype).max)
        torch._foreach_clamp_min_(group, -bound)
        torch._foreach_clamp_max_(group, bound)


def _in_torch_order(grads: Sequence[torch.Tensor], norms: list[torch.Tensor]) -> list[torch.Tensor]:
    """The per-tensor norms in the order ``clip_grad_norm_`` sums them: grouped by (device, dtype).

    The same order keeps a group clip over mixed dtypes bitwise equal to torch's.
    """
    first = grads[0]
    if all(g.dtype == first.dtype and g.device == first.device for g in grads):
        return norms
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

    groups = _group_tensors_by_device_and_dtype([list(grads)], with_indices=True)
    return [norms[i] for _, (_, indices) in groups.items() for i in indices]


def _clip_coefficients(totals: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_``'s coefficient, left at 1 where the norm is not finite.

    A NaN or Inf gradient is left as it is and reported (torch would spread the NaN to every tensor
    of a group clip). A finite gradient whose float32 norm overflowed is clipped after the sync, with
    its norm taken in float64 (:meth:`Enforcer._clear_overflows`).
    """
    coef = torch.clamp(max_norm / (totals + _EPS), max=1.0)
    return torch.where(torch.isfinite(totals), coef, torch.ones_like(coef))


@dataclass(eq=False)
class Plan:
    """What one enforcement pass treats: a subset of the guarded tensors (those one optimizer steps)."""

    names: dict[int, str]
    """Tensor index -> first name, built once (``run`` used to rebuild it every step)."""
    params: tuple[GuardedParam, ...]
    rules: tuple[tuple[BoundRule, tuple[GuardedParam, ...]], ...]
    raw_norm_params: frozenset[int]
    """Indices of the tensors whose untouched 2-norm is needed: halt/skip coverage and first-touch clips."""
    watchers_by_param: dict[int, tuple[int, ...]]
    """Tensor index -> indices of the rules with a halt or skip action covering it, in policy order."""
    fragile: frozenset[int]
    """Watched tensors that an action may make finite (zero, clip_value, drop, scale by 0): their
    NaN/Inf verdict is taken from the max-abs norm before any action, not checked afterwards."""
    raw_sorted: tuple[int, ...] = ()
    """``sorted(raw_norm_params)``: the raw norms to take when every tensor of the plan has a gradient."""
    member_ids: tuple[tuple[int, ...], ...] = ()
    """Per rule, the indices of its members: its tensors to treat when every tensor has a gradient."""

    @classmethod
    def build(cls, binding: Binding, params: Sequence[GuardedParam]) -> Plan:
        chosen = {entry.index for entry in params}
        ordered = tuple(entry for entry in binding.params if entry.index in chosen)
        rules = tuple(
            (bound, tuple(entry for entry in bound.params if entry.index in chosen)) for bound in binding.rules
        )
        raw: set[int] = set()
        touched: set[int] = set()
        watchers: dict[int, list[int]] = {}
        for bound, members in rules:
            for action in bound.actions:
                if isinstance(action, HaltOnNonfinite | SkipStepOnNonfinite):
                    for entry in members:
                        raw.add(entry.index)
                        if bound.index not in watchers.setdefault(entry.index, []):
                            watchers[entry.index].append(bound.index)
                    continue
                if isinstance(action, ClipNorm) and action.norm_type == 2.0:
                    raw.update(entry.index for entry in members if entry.index not in touched)
                touched.update(entry.index for entry in members)
        fragile = {
            entry.index
            for bound, members in rules
            if any(_may_erase_nonfinite(action) for action in bound.actions)
            for entry in members
            if entry.index in watchers
        }
        return cls(
            names={entry.index: entry.name for entry in ordered},
            params=ordered,
            rules=rules,
            raw_norm_params=frozenset(raw),
            fragile=frozenset(fragile),
            watchers_by_param={key: tuple(value) for key, value in watchers.items()},
            raw_sorted=tuple(sorted(raw)),
            member_ids=tuple(tuple(entry.index for entry in members) for _, members in rules),
        )


@dataclass
class _Pending:
    """Device tensors to read back in the step's one sync, and how to interpret them."""

    parts: list[torch.Tensor] = field(default_factory=list)
    readers: list[Callable[[list[float]], None]] = field(default_factory=list)
    raw_stack: tuple[list[torch.Tensor], torch.Tensor] | None = None
    """The raw norms and their stack, so a clip over exactly those norms does not stack them again."""

    def stack(self, norms: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """``_stack_on(norms, device)``, reusing the raw norms' stack when ``norms`` are those tensors."""
        memo = self.raw_stack
        if memo is not None and len(memo[0]) == len(norms) and all(map(operator.is_, memo[0], norms)):
            return memo[1]
        return _stack_on(norms, device)

    def add(self, values: torch.Tensor, reader: Callable[[list[float]], None]) -> None:
        self.parts.append(values.reshape(-1))
        self.readers.append(reader)

    def sync(self) -> None:
        if not self.parts:
            return
        device = self.parts[0].device
        if all(part.device == device for part in self.parts):
            # Joined on the device first: one device-to-host copy, so one sync (a copy per part would
            # be a sync each on a GPU). cat promotes floats exactly, as the per-part float64 did.
            host = torch.cat([part.detach() for part in self.parts]).to("cpu", torch.float64).tolist()
        else:
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
    skipped_by: dict[int, int] = field(default_factory=dict)
    """Tensor index -> skip rule index, for non-finite tensors an active skip rule (and no halt rule) covers."""
    scaler_found_inf: bool = False
    """GradScaler (fused optimizer path) found inf/NaN: the optimizer skips this step itself."""
    counts: list[tuple[str, str, int]] = field(default_factory=list)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def norm_clipped(
        self, step: int, rule: str, param: str | None, action: ClipNorm, before: float, coef: float, **extra: Any
    ) -> None:
        """Count a clip_norm that changed ``extra.get("n_params", 1)`` tensors, and log it."""
        self.counts.append((rule, "clip_norm", int(extra.get("n_params", 1))))
        event = {"step": step, "rule": rule, "action": "clip_norm", "param": param, **extra}
        event |= {"scope": action.scope, "norm_type": action.norm_type, "max_norm": action.max_norm}
        event |= {"before": before, "after": before * coef, "coef": coef}
        self.events.append(("intervention", event))

    def value_clipped(self, step: int, rule: str, param: str, limit: float, before: float, **extra: Any) -> None:
        """Count a clip_value that clamped one tensor, and log it."""
        self.counts.append((rule, "clip_value", 1))
        event = {"step": step, "rule": rule, "action": "clip_value", "param": param, **extra}
        self.events.append(("intervention", event | {"limit": limit, "before": before, "after": limit}))


@dataclass
class StepContext:
    """What one enforcement pass needs to know about the update it precedes."""

    optimizer: Any | None
    """The ``torch.optim.Optimizer`` about to step, or ``None`` for ``guard.step()``."""
    stepped_params: Callable[[], Iterable[torch.Tensor]]
    """Every parameter the update would change: a skipped step sets all their gradients to None."""
    explicit: bool = False
    """An explicit boundary (``guard.step()``, a framework integration), not an optimizer's step pre-hook:
    the gradients it treats are left alone by the optimizer's coming step, whatever changes them between."""
    found_inf: Sequence[torch.Tensor] = ()
    """A GradScaler's inf/NaN flags for gradients it has already unscaled: if set, the step is the
    scaler's to skip (no halt, no intervention counted)."""


@dataclass
class _SkipHistory:
    consecutive: int = 0
    recent: deque[int] = field(default_factory=deque)


class Enforcer:
    """Applies a :class:`Binding` at step boundaries; owns the step counter."""

    def __init__(
        self,
        binding: Binding,
        counters: Counters,
        events: EventLog,
        *,
        summary_every: int,
        collective: Collective | None = None,
    ) -> None:
        self.binding = binding
        self.collective = collective if collective is not None else Collective()
        self.counters = counters
        self.events = events
        self.summary_every = summary_every
        self.step = 0
        """How many steps have begun (the 0-based index of the next step)."""
        self._in_step: set[int] = set()
        self._scaler_skip_noted = False
        self.micro_batch: MicroBatchHooks | None = None
        """Set in per-micro-batch mode: tensor-scope actions then run in hooks, not here."""
        self.last_run_treated = False
        """Whether the last :meth:`run` found new gradients to treat."""
        self.skip_history: dict[int, _SkipHistory] = {}
        self._warned_scheduler = False
        self.applied_versions: dict[int, tuple[weakref.ReferenceType[torch.Tensor], int, bool]] = {}
        """``(weakref to grad, version, held)`` after the last pass, per tensor: a gradient already
        treated, and unchanged since, is not treated again (a second ``step()`` on the same gradient).
        ``held`` marks a gradient treated at an explicit boundary: the optimizer's step pre-hook leaves
        it alone even if changed since (a framework's own clip), until :meth:`seal_explicit` runs after
        the optimizer step."""
        self._explicit_marks = False
        self.scaler_skip_at_boundary = False
        """This step's GradScaler skip was already recorded at an explicit boundary (one-shot)."""

    @torch.no_grad()
    def run(self, plan: Plan, context: StepContext) -> bool:
        """Treat the current gradients of ``plan``'s tensors; return False if the step must be skipped.

        Raises :class:`GradientHalt` (before the optimizer step) when a halt rule sees NaN or Inf, or a
        skip rule's limits are exceeded.
        """
        grads: dict[int, torch.Tensor] = {}
        wrapped: dict[int, torch.Tensor] = {}  # index -> the gradient itself where it is a DTensor
        applied, plain, strided = self.applied_versions, torch.Tensor, torch.strided  # locals: a loop per tensor
        honour_explicit = not context.explicit
        for entry in plan.params:
            param = entry.ref()
            grad = param.grad if param is not None else None
            if grad is None:
                continue
            local = grad if type(grad) is plain else local_tensor(grad)
            if local is not grad:
                wrapped[entry.index] = grad
            if local.layout is not strided:
                raise GuardStateError(
                    f"parameter {entry.name!r} has a {local.layout} gradient (e.g. from F.embedding(..., "
                    "sparse=True)), which gradguard's actions cannot treat. Exclude it from the policy's rules, "
                    "or compute a dense gradient."
                )
            seen = applied.get(entry.index)
            if (
                seen is not None
                and seen[0]() is grad
                and (seen[1] == local._version or (honour_explicit and seen[2]))
            ):
                continue  # already treated (and unchanged since, or at this step's explicit boundary)
            grads[entry.index] = local
        self.last_run_treated = bool(grads)
        if not grads:
            return True

        step = self._begin_step(grads)
        pending = _Pending()
        outcome = _StepOutcome()
        names = plan.names
        self._adopt_fused_scaler(context, pending, outcome)
        self._read_found_inf(context, pending, outcome)
        if self.micro_batch is not None:
            self._read_hook_records(pending, outcome, names, step)

        collective = self.collective if self.collective.active() else None
        sharded = collective is not None and any(is_sharded(self._grad_of(i)) for i in grads)
        everyone = len(plan.params)  # while len(grads) is this, every tensor of the plan has a gradient
        if len(grads) == everyone:
            raw_ids = list(plan.raw_sorted)
        else:
            raw_ids = sorted(index for index in plan.raw_norm_params if index in grads)
        raw: dict[int, torch.Tensor] = {}
        if raw_ids:
            raw = self._raw_norms(pending, outcome, plan, raw_ids, grads, step, collective, sharded)

        touched: set[int] = set()
        for (bound, members), member_ids in zip(plan.rules, plan.member_ids, strict=True):
            if not bound.rule.active_at(step) or all(isinstance(a, _WATCHING) for a in bound.actions):
                continue  # inactive, or it only watches (halt/skip): its verdict came with the raw norms
            if len(grads) == everyone:
                ids = list(member_ids)
            else:
                ids = [entry.index for entry in members if entry.index in grads]
            if not ids:
                continue
            for action in bound.actions:
                if not action.active_at(step) or isinstance(action, HaltOnNonfinite | SkipStepOnNonfinite):
                    continue
                if self.micro_batch is not None and handled_in_hooks(action):
                    continue
                gs = [grads[i] for i in ids]
                if isinstance(action, ClipNorm):
                    reuse = action.norm_type == 2.0 and all(i in raw and i not in touched for i in ids)
                    norms = [raw[i] for i in ids] if reuse else self._norms(gs, action.norm_type, sharded)
                    if action.scope == "tensor":
                        self._clip_tensors(pending, outcome, bound, action, ids, gs, norms, names, step)
                    else:
                        self._clip_group(pending, outcome, bound, action, ids, gs, norms, names, step)
                elif isinstance(action, ClipValue):
                    self._clip_values(pending, outcome, bound, action, ids, gs, names, step, sharded)
                elif isinstance(action, Scale):
                    torch._foreach_mul_(gs, action.factor)
                    outcome.counts.append((bound.name, "scale", len(ids)))
                elif isinstance(action, Zero):
                    torch._foreach_zero_(gs)
                    outcome.counts.append((bound.name, "zero", len(ids)))
                elif isinstance(action, Drop):
                    for i in ids:
                        param = self.binding.params[i].ref()
                        if param is not None:
                            param.grad = None
                        del grads[i]
                    outcome.counts.append((bound.name, "drop", len(ids)))
                    break  # the rule's later actions have no gradient left to act on
                touched.update(ids)

        pending.sync()  # the step's one host sync
        self._clear_overflows(outcome, plan, grads, names, step, collective)
        if outcome.scaler_found_inf:
            self.record_scaler_skip((), step=step, fused=context.optimizer is not None and not context.explicit)
            self.scaler_skip_at_boundary = context.explicit
            return True  # the scaler (or the fused kernel it drives) skips the update itself
        try:
            self._report(outcome, names, step)
        except GradientHalt:
            # The other gradients were treated: a retry after the user dropped the bad ones must not
            # treat them again. The offending ones stay untreated, so a retry checks them again.
            for index, local in grads.items():
                if index not in outcome.halted_by and index not in outcome.skipped_by:
                    self.applied_versions[index] = (weakref.ref(wrapped.get(index, local)), local._version, False)
            raise
        if outcome.skipped_by:
            self._skip(outcome, names, step, context)
            return False
        self._reset_consecutive_skips()
        # A weak reference, not id(): a new gradient may reuse a freed one's id and version.
        ref = weakref.ref
        held = context.explicit
        self._explicit_marks |= held
        applied.update({i: (ref(wrapped.get(i, local)), local._version, held) for i, local in grads.items()})
        return True

    def seal_explicit(self) -> None:
        """The optimizer has stepped: gradients treated at an explicit boundary become plain "treated".

        From now on they count as treated only while unchanged, so the next backward (which
        accumulates into them in place, after ``zero_grad(set_to_none=False)``) is treated again.
        """
        if not self._explicit_marks:
            return
        self._explicit_marks = False
        for index, (ref, _, held) in list(self.applied_versions.items()):
            grad = ref()
            if held and grad is not None:
                self.applied_versions[index] = (ref, local_tensor(grad)._version, False)

    def rebind(self, binding: Binding) -> None:
        """Switch to a new binding (the model's parameters were replaced); tensor indices start afresh."""
        self.binding = binding
        self.applied_versions.clear()

    def _adopt_fused_scaler(self, context: StepContext, pending: _Pending, outcome: _StepOutcome) -> None:
        """A fused optimizer under GradScaler still holds scaled gradients here; unscale them first.

        GradScaler hands such an optimizer ``grad_scale`` and ``found_inf`` instead of unscaling. We
        unscale every gradient of the optimizer ourselves (what its kernel would have done) and clear
        ``grad_scale``, so thresholds apply to true gradients; ``found_inf`` still makes the kernel skip.
        """
        optimizer = context.optimizer
        if optimizer is None:
            return
        grad_scale = getattr(optimizer, "grad_scale", None)
        found_inf = getattr(optimizer, "found_inf", None)
        if isinstance(grad_scale, torch.Tensor):
            # Exactly the gradients the fused kernel would have unscaled: this optimizer's, each once.
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for grad in grads:
                by_device.setdefault(grad.device, []).append(grad)
            inverse = grad_scale.double().reciprocal().float()
            for device, device_grads in by_device.items():
                torch._foreach_mul_(device_grads, inverse.to(device))
            optimizer.grad_scale = None
        if isinstance(found_inf, torch.Tensor):

            def read(values: list[float]) -> None:
                outcome.scaler_found_inf = values[0] > 0

            pending.add(found_inf.reshape(-1)[:1].float(), read)

    def _read_found_inf(self, context: StepContext, pending: _Pending, outcome: _StepOutcome) -> None:
        """Read a GradScaler's inf/NaN flags with the step's one sync (explicit boundary after its unscale_)."""
        if not context.found_inf:
            return
        device = context.found_inf[0].device
        total = torch.stack([flag.reshape(-1)[:1].to(device, torch.float32) for flag in context.found_inf]).sum()

        def read(values: list[float]) -> None:
            outcome.scaler_found_inf = outcome.scaler_found_inf or values[0] > 0

        pending.add(total, read)

    def _begin_step(self, indices: Iterable[int]) -> int:
        """The 0-based index of the step these tensors' gradients belong to.

        Several optimizers each step their own parameters within one training step; a step begins
        when a tensor already seen in the current step comes again. So the count (and every step
        window) follows training steps, not optimizer calls.
        """
        ids = set(indices)
        if not self._in_step or ids & self._in_step:
            self.step += 1
            self._in_step = set()
            self._scaler_skip_noted = False
            self.scaler_skip_at_boundary = False
        self._in_step |= ids
        return self.step - 1

    def record_scaler_skip(self, indices: Iterable[int], *, step: int | None = None, fused: bool = False) -> None:
        """GradScaler found inf/NaN and skipped the step: its business, so no halt and no clip; say so.

        Counted once per training step, however many optimizers the scaler skipped in it.
        """
        if step is None:
            step = self._begin_step(indices)
        if self._scaler_skip_noted:
            return
        self._scaler_skip_noted = True
        self.counters.add(SCALER_RULE, "skip")
        self.events.emit("info", "scaler_skip", step=step, fused=fused)

    # --- actions ------------------------------------------------------------------------------

    def _clear_overflows(
        self,
        outcome: _StepOutcome,
        plan: Plan,
        grads: dict[int, torch.Tensor],
        names: dict[int, str],
        step: int,
        collective: Collective | None,
    ) -> None:
        """A +inf 2-norm with no NaN/Inf element is an overflow, not a non-finite gradient.

        Only on a step where some norm came out infinite, and with one more sync: the elements are
        checked, and a gradient that turns out finite gets its tensor-scope clips with a float64 norm,
        all on the device and read back together. (Those clips come after the step's other actions
        here; in exact arithmetic a clip and a scale commute.)
        """
        suspects = sorted(
            index
            for index, (kind, _) in outcome.nonfinite.items()
            if kind == "inf" and index not in plan.fragile and index in grads
        )
        if not suspects:
            return
        device = grads[suspects[0]].device
        flags = torch.stack([(~torch.isfinite(grads[i])).any().to(device) for i in suspects]).float()
        if collective is not None:
            flags = collective.sum_(flags)
        clips: list[tuple[int, BoundRule, ClipNorm, torch.Tensor, torch.Tensor]] = []
        for position, index in enumerate(suspects):
            finite = flags[position] == 0
            for bound, action in self._tensor_clips(index, step):
                grad = grads[index]
                norm = torch.linalg.vector_norm(grad.double(), action.norm_type)
                coef = torch.where(finite, torch.clamp(action.max_norm / (norm + _EPS), max=1.0), 1.0)
                grad.mul_(coef.to(grad.dtype))
                clips.append((index, bound, action, norm, coef))
        host = torch.cat([flags.double(), *(torch.stack([n, c]) for *_, n, c in clips)]).tolist()
        finite_ids = {index for index, nonfinite in zip(suspects, host, strict=False) if not nonfinite}
        rules = self.binding.policy.rules
        for index in finite_ids:
            _, rule_index = outcome.nonfinite.pop(index)
            outcome.halted_by.pop(index, None)
            outcome.skipped_by.pop(index, None)
            rule = rules[rule_index].name
            outcome.counts.append((rule, "norm_overflow", 1))
            event = {"step": step, "rule": rule, "param": names[index], "note": _OVERFLOW_NOTE}
            outcome.events.append(("norm_overflow", event))
        for position, (index, bound, action, _, _) in enumerate(clips):
            norm, coef = host[len(suspects) + 2 * position : len(suspects) + 2 * position + 2]
            if index not in finite_ids or coef >= 1.0:
                continue
            outcome.norm_clipped(step, bound.name, names[index], action, norm, coef, overflowed=True)

    def _tensor_clips(self, index: int, step: int) -> list[tuple[BoundRule, ClipNorm]]:
        """The tensor-scope clips active on ``step`` for one tensor, in policy order."""
        out = []
        for rule_index in self.binding.params[index].rules:
            bound = self.binding.rules[rule_index]
            for action in bound.actions:
                tensor_clip = isinstance(action, ClipNorm) and action.scope == "tensor"
                if tensor_clip and bound.rule.active_at(step) and action.active_at(step):
                    assert isinstance(action, ClipNorm)
                    out.append((bound, action))
        return out

    def _read_hook_records(self, pending: _Pending, outcome: _StepOutcome, names: dict[int, str], step: int) -> None:
        """Fold what the per-micro-batch hooks did into this step's sync, counters and events."""
        assert self.micro_batch is not None
        records, counts = self.micro_batch.drain()
        rules = self.binding.policy.rules
        outcome.counts.extend((rules[rule].name, action, count) for rule, action, count in counts)
        if not records:
            return
        device = records[0].before.device
        befores = [record.before.to(device, torch.float32) for record in records]
        coefs = [
            record.coef.to(device, torch.float32) if record.coef is not None else before
            for record, before in zip(records, befores, strict=True)
        ]
        values = torch.stack(befores + coefs)

        def read(host: list[float], records: list[HookRecord] = records) -> None:
            for record, before, coef in zip(records, host[: len(records)], host[len(records) :], strict=True):
                rule = rules[record.rule].name
                action = record.action
                if before != before or abs(before) == float("inf"):
                    outcome.nonfinite.setdefault(record.index, ("nan" if before != before else "inf", record.rule))
                    continue
                param = self.binding.params[record.index].name
                if isinstance(action, ClipNorm) and coef < 1.0:
                    outcome.norm_clipped(step, rule, param, action, before, coef, micro_batch=True)
                elif isinstance(action, ClipValue) and before > action.limit:
                    outcome.value_clipped(step, rule, param, action.limit, before, micro_batch=True)

        pending.add(values, read)

    def _grad_of(self, index: int) -> torch.Tensor:
        param = self.binding.params[index].ref()
        assert param is not None, "a tensor with a gradient this step is alive"
        assert param.grad is not None, "only called for tensors with a gradient"
        return param.grad

    def _norms(self, grads: Sequence[torch.Tensor], norm_type: float, sharded: bool) -> list[torch.Tensor]:
        """Per-tensor norms; under FSDP2, of the full tensors (one collective), not of this rank's shards."""
        norms = _norms(grads, norm_type)
        return combine_shard_norms(self.collective, norms, norm_type) if sharded else norms

    def _raw_norms(
        self,
        pending: _Pending,
        outcome: _StepOutcome,
        plan: Plan,
        raw_ids: list[int],
        grads: dict[int, torch.Tensor],
        step: int,
        collective: Collective | None,
        sharded: bool,
    ) -> dict[int, torch.Tensor]:
        """2-norms of the untouched gradients, and the non-finite verdict every rank agrees on."""
        local = _norms([grads[i] for i in raw_ids], 2.0)
        device = local[0].device
        pending.raw_stack = (local, _stack_on(local, device))
        stacked = pending.raw_stack[1].float()
        evidence = stacked
        fragile = [position for position, index in enumerate(raw_ids) if index in plan.fragile]
        if fragile:
            # A 2-norm can overflow while every element is finite; the max-abs norm cannot. Tensors an
            # action may make finite are judged by it now, the others are re-checked after the sync.
            peaks = _stack_on(_norms([grads[raw_ids[k]] for k in fragile], float("inf")), device).float()
            evidence = stacked.index_copy(0, torch.tensor(fragile, device=device), peaks)
        flags = torch.stack([torch.isnan(evidence), torch.isinf(evidence)]).float().reshape(-1)
        count = len(raw_ids)
        if collective is None:
            norms = local
        elif sharded:
            # One collective: the shards' squared norms (summed into full norms) and every rank's flags.
            payload = collective.sum_(torch.cat([stacked.square(), flags]))
            norms = list(payload[:count].sqrt().unbind())
            flags = payload[count:]
        else:
            # Replicas hold the same averaged gradient; a NaN injected on one rank must stop them all.
            flags = collective.sum_(flags)
            norms = local
        rules = self.binding.policy.rules

        def read(values: list[float]) -> None:
            if not any(values):
                return  # every flag is 0: nothing non-finite (the common case, without a loop in Python)
            for position, index in enumerate(raw_ids):
                has_nan, has_inf = values[position] > 0, values[count + position] > 0
                if not has_nan and not has_inf:
                    continue
                kind = "nan" if has_nan else "inf"
                watchers = [r for r in plan.watchers_by_param.get(index, ()) if rules[r].active_at(step)]
                halts = [r for r in watchers if _has_active(rules[r].actions, HaltOnNonfinite, step)]
                skips = [r for r in watchers if _has_active(rules[r].actions, SkipStepOnNonfinite, step)]
                if halts:
                    outcome.halted_by[index] = halts[0]
                elif skips:
                    outcome.skipped_by[index] = skips[0]
                reported_under = (halts or skips or [self._first_rule(index)])[0]
                outcome.nonfinite.setdefault(index, (kind, reported_under))

        pending.add(flags, read)
        return dict(zip(raw_ids, norms, strict=True))

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
            per_tensor = pending.stack([norms[k] for k in positions], device)
            # clip_grad_norm_([p]) takes the norm of the one-element stack of norms; so do we, row-wise.
            totals = torch.linalg.vector_norm(per_tensor.unsqueeze(1), action.norm_type, dim=1)
            coefs = _clip_coefficients(totals, action.max_norm)
            torch._foreach_mul_([gs[k] for k in positions], list(coefs.unbind()))

            def read(values: list[float], device_ids: list[int] = device_ids) -> None:
                count = len(device_ids)
                if min(values[count:]) >= 1.0 and math.isfinite(sum(values[:count])):
                    return  # nothing clipped, every norm finite (coefficients are never NaN)
                for index, norm, coef in zip(device_ids, values[:count], values[count:], strict=False):
                    if norm != norm or abs(norm) == float("inf"):
                        outcome.nonfinite.setdefault(index, ("nan" if norm != norm else "inf", bound.index))
                    elif coef < 1.0:
                        outcome.norm_clipped(step, bound.name, names[index], action, norm, coef)

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
        total = torch.linalg.vector_norm(_stack_on(_in_torch_order(gs, norms), device), action.norm_type)
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
                params = [names[i] for i in ids]
                outcome.norm_clipped(step, bound.name, None, action, norm, factor, params=params, n_params=len(ids))

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
        sharded: bool,
    ) -> None:
        peaks = self._norms(gs, float("inf"), sharded)
        _clamp_(gs, action.limit)
        for device_ids, positions in _by_device(ids, peaks):

            def read(values: list[float], device_ids: list[int] = device_ids) -> None:
                if max(values) <= action.limit and math.isfinite(sum(values)):
                    return  # nothing clamped, every peak finite
                for index, peak in zip(device_ids, values, strict=False):
                    if peak != peak or abs(peak) == float("inf"):
                        outcome.nonfinite.setdefault(index, ("nan" if peak != peak else "inf", bound.index))
                    elif peak > action.limit:
                        outcome.value_clipped(step, bound.name, names[index], action.limit, peak)

            pending.add(_stack_on([peaks[k] for k in positions], peaks[positions[0]].device), read)

    # --- after the sync -------------------------------------------------------------------------

    def _report(self, outcome: _StepOutcome, names: dict[int, str], step: int) -> None:
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
                skips=index in outcome.skipped_by,
            )
        passed = sorted(set(outcome.nonfinite) - set(outcome.halted_by) - set(outcome.skipped_by))
        if passed and not outcome.halted_by and not outcome.skipped_by:
            # No halt or skip rule covers these: say loudly that the optimizer is about to apply them.
            self.events.emit(
                "warning",
                "nonfinite_unhalted",
                step=step,
                params=[names[i] for i in passed],
                kinds=sorted({outcome.nonfinite[i][0] for i in passed}),
            )
        if outcome.halted_by:
            offenders = sorted(outcome.halted_by)
            kind = _joined_kind(outcome.nonfinite[i][0] for i in offenders)
            rule = rules[outcome.halted_by[offenders[0]]].name
            for rule_index in sorted(set(outcome.halted_by.values())):
                self.counters.add(rules[rule_index].name, "halt_on_nonfinite")
            params = [names[i] for i in offenders]
            self._halt(step, rule, params, {names[i]: outcome.nonfinite[i][0] for i in offenders}, kind, None)
        if outcome.skipped_by:
            return  # the step will not happen: its interventions did not either
        self.counters.add_many(outcome.counts)
        for event, fields in outcome.events:
            level = "warning" if event.startswith("nonfinite") or event == "norm_overflow" else "debug"
            self.events.emit(level, event, **fields)
        if self.summary_every and (step + 1) % self.summary_every == 0:
            self.emit_summary()

    def _halt(
        self, step: int, rule: str, params: list[str], kinds: dict[str, str], kind: str, reason: str | None
    ) -> None:
        self.events.emit(
            "error",
            "halt",
            step=step,
            rule=rule,
            params=params,
            kinds=kinds,
            kind=kind,
            reason=reason,
            counters=self.counters.snapshot(),
        )
        self.events.flush()
        raise GradientHalt(step=step, params=params, kind=kind, rule=rule, reason=reason)

    def _skip(self, outcome: _StepOutcome, names: dict[int, str], step: int, context: StepContext) -> None:
        """Skip the update: no gradient is left for the optimizer, so nothing it owns can change."""
        rules = self.binding.policy.rules
        offenders = sorted(outcome.skipped_by)
        params = [names[i] for i in offenders]
        kinds = {names[i]: outcome.nonfinite[i][0] for i in offenders}
        kind = _joined_kind(kinds.values())
        for rule_index in sorted(set(outcome.skipped_by.values())):
            rule = rules[rule_index]
            history = self.skip_history.setdefault(rule_index, _SkipHistory())
            history.consecutive += 1
            history.recent.append(step)
            for action in rule.actions:
                if not isinstance(action, SkipStepOnNonfinite) or not action.active_at(step):
                    continue
                reason = None
                if action.max_consecutive_skips is not None and history.consecutive > action.max_consecutive_skips:
                    reason = f"{history.consecutive} consecutive skipped steps (max_consecutive_skips: "
                    reason += f"{action.max_consecutive_skips})"
                if action.max_skips is not None and action.window_steps is not None:
                    while history.recent and history.recent[0] <= step - action.window_steps:
                        history.recent.popleft()
                    if len(history.recent) > action.max_skips:
                        reason = f"{len(history.recent)} skipped steps within the last {action.window_steps} steps "
                        reason += f"(max_skips: {action.max_skips})"
                if reason is not None:
                    self.counters.add(rule.name, "halt_on_nonfinite")
                    self._halt(step, rule.name, params, kinds, kind, f"skip limit exceeded: {reason}")
            self.counters.add(rule.name, "skip_step_on_nonfinite")
        for param in context.stepped_params():
            param.grad = None
        self.events.emit(
            "warning",
            "skip",
            step=step,
            rule=rules[outcome.skipped_by[offenders[0]]].name,
            params=params,
            kinds=kinds,
            kind=kind,
        )
        optimizer = context.optimizer
        if (
            optimizer is not None
            and not self._warned_scheduler
            and getattr(optimizer.step, "_wrapped_by_lr_sched", False)
        ):
            self._warned_scheduler = True
            warnings.warn(
                f"gradguard skipped optimizer step {step} (non-finite gradient), but an LR scheduler wraps this "
                "optimizer and will still advance when you call scheduler.step(). To keep the schedule on "
                "applied steps, call scheduler.step() only when guard.last_step_skipped is False.",
                GuardWarning,
                stacklevel=6,
            )

    def state_dict(self) -> dict[str, Any]:
        """The step number and every rule's skip history: what decides future steps."""
        rules = self.binding.policy.rules
        skips = {
            rules[index].name: {"consecutive": history.consecutive, "recent": list(history.recent)}
            for index, history in sorted(self.skip_history.items())
        }
        return {"step": self.step, "skips": skips}

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        """Take over a saved :meth:`state_dict`; returns the rule names it held that this policy lacks."""
        by_name = {rule.name: index for index, rule in enumerate(self.binding.policy.rules)}
        self.step = int(state["step"])
        self._in_step = set()
        self.skip_history = {}
        unknown = []
        for name, saved in dict(state.get("skips", {})).items():
            if name not in by_name:
                unknown.append(name)
                continue
            history = _SkipHistory(int(saved["consecutive"]), deque(int(step) for step in saved["recent"]))
            self.skip_history[by_name[name]] = history
        return unknown

    def _reset_consecutive_skips(self) -> None:
        for history in self.skip_history.values():
            history.consecutive = 0

    def emit_summary(self) -> None:
        """Write the cumulative counters, so the log reproduces counts that are not logged per step."""
        self.events.emit("info", "counters", step=self.step - 1, steps=self.step, counters=self.counters.snapshot())


def _may_erase_nonfinite(action: Action) -> bool:
    return isinstance(action, Zero | ClipValue | Drop) or (isinstance(action, Scale) and action.factor == 0)


def _joined_kind(kinds: Iterable[str]) -> str:
    """``"nan"``, ``"inf"`` or ``"nan+inf"``, always in that order."""
    present = set(kinds)
    return "+".join(kind for kind in ("nan", "inf") if kind in present)


def _has_active(actions: Sequence[Action], kind: type, step: int) -> bool:
    return any(isinstance(action, kind) and action.active_at(step) for action in actions)


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
