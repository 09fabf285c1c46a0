"""The opt-in per-micro-batch mode: tensor-scope actions applied to each backward's contribution.

By default the guard treats the step's final gradient once (g1 + ... + gk under accumulation). With
``GradGuard(..., per_micro_batch=True)`` the actions that act on one tensor alone (``clip_norm`` with
``scope: tensor``, ``clip_value``, ``scale``, ``zero``) run in a tensor hook on each parameter, on
each backward's contribution before it is accumulated, out of place (changing a hook's argument in
place would corrupt other parameters' gradients). Group clips, ``drop``, halts and skips stay at the
step boundary, on the accumulated gradient. The hooks never sync: the figures they produce are read
in the step's one sync.

Caveats, documented in docs/where-the-guard-acts.md: under DDP a tensor hook sees this rank's local contribution,
before the all-reduce; ``torch.autograd.grad`` calls are recognised and left untouched, but for pipelining's
zero-bubble weight pass, which adds its ``autograd.grad`` results into ``.grad`` by hand (``pipeline_weights``). A
clip (``clip_norm``, ``clip_value``) of a DTensor parameter (tensor parallel) is refused at attach: its figure is the
whole tensor's, a collective in every micro-batch's backward (``refuse_sharded``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from gradguard.enforce.actions.nonfinite import judge_nonfinite
from gradguard.enforce.distributed.collective import is_sharded
from gradguard.enforce.hooks import pipeline_weights
from gradguard.enforce.work.participant import Participant
from gradguard.enforce.work.step_work import StepContext, StepWork
from gradguard.enforce.work.tensors import EPS, LOW_PRECISION
from gradguard.errors import GuardStateError
from gradguard.policy.matching import Binding, GuardedParam
from gradguard.policy.schema import Action, ClipNorm, ClipValue, Scale, Zero

__all__ = ["HookRecord", "MicroBatchHooks", "handled_in_hooks", "refuse_fsdp2", "refuse_sharded"]


def handled_in_hooks(action: Action) -> bool:
    """Whether an action runs per micro-batch (in the hooks) rather than at the step boundary."""
    if isinstance(action, ClipNorm):
        return action.scope == "tensor"
    return isinstance(action, ClipValue | Scale | Zero)


def refuse_sharded(binding: Binding) -> None:
    """Refuse a per-micro-batch clip of a DTensor parameter (tensor parallel; the same on every rank, so every rank
    refuses at once): its norm or peak is the whole tensor's, over every rank's shard (and a sequence-parallel
    gradient is a partial sum until reduced), which a hook could only have by a collective in each micro-batch's
    backward. ``scale`` and ``zero`` act element by element on any piece: they stay."""
    rules = binding.policy.rules
    for entry in binding.params:
        param = entry.ref()
        if param is None or not param.requires_grad or not is_sharded(param):
            continue
        for i in entry.rules:
            for action in rules[i].actions:
                if not handled_in_hooks(action) or not isinstance(action, ClipNorm | ClipValue):
                    continue
                figure = "norm" if isinstance(action, ClipNorm) else "peak (its Inf watch and its count)"
                raise GuardStateError(
                    f"per_micro_batch=True cannot run rule {rules[i].name!r}'s {action.action} on {entry.name!r}, a "
                    f"DTensor (sharded: tensor parallel, FSDP2): a per-micro-batch clip needs each contribution's "
                    f"{figure} over the whole tensor, every rank's shard, a collective in each micro-batch's backward. "
                    "Turn per_micro_batch off (the step then clips the accumulated gradient, with the whole tensor's "
                    "figures agreed across the ranks), or keep the DTensor parameters out of the rule (exclude); "
                    "scale and zero do act per micro-batch under tensor parallel"
                )


def refuse_fsdp2(binding: Binding, model: nn.Module) -> None:
    """Refuse any per-micro-batch action on a parameter FSDP2 manages: its gradient reaches the parameter only from
    FSDP2's reduce-scatter, after the micro-batches were accumulated, so a tensor hook on it never runs (a ``scale``
    or ``zero`` left to the hooks would never act, and the step leaves it to them)."""
    managed = {id(p) for module in model.modules() if hasattr(module, "_get_fsdp_state") for p in module.parameters()}
    if not managed:
        return
    rules = binding.policy.rules
    for entry in binding.params:
        param = entry.ref()
        if param is None or id(param) not in managed or not param.requires_grad:
            continue
        for i in entry.rules:
            for action in rules[i].actions:
                if handled_in_hooks(action):
                    raise GuardStateError(
                        f"per_micro_batch=True cannot run rule {rules[i].name!r}'s {action.action} on {entry.name!r}, "
                        "a parameter FSDP2 shards: its gradient reaches it only from FSDP2's reduce-scatter, after the "
                        "micro-batches accumulated, so no tensor hook sees a micro-batch's contribution and the action "
                        "would never run. Turn per_micro_batch off (the step then acts on the accumulated gradient), "
                        "or keep FSDP2's parameters out of the rule (exclude)"
                    )


@dataclass(frozen=True)
class HookRecord:
    """One per-micro-batch clip, with its figures still on the device."""

    rule: int
    index: int
    action: ClipNorm | ClipValue
    before: torch.Tensor
    coef: torch.Tensor | None


def _accumulates(accumulator: torch.autograd.graph.Node | None) -> bool:
    """False inside ``torch.autograd.grad``, whose results never reach ``p.grad``."""
    if accumulator is None:
        return True
    try:
        return bool(torch._C._will_engine_execute_node(accumulator))
    except RuntimeError:
        return False  # torch refuses to answer for a leaf inside autograd.grad(): not an accumulation


class MicroBatchHooks(Participant):
    """Registers one tensor hook per guarded parameter that has a per-micro-batch action."""

    def __init__(self, binding: Binding, current_step: Callable[[], int], model: nn.Module | None = None) -> None:
        self._current_step = current_step
        self._lock = threading.Lock()
        self._records: list[HookRecord] = []
        self._counts: list[tuple[int, str, int]] = []
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        refuse_sharded(binding)
        if model is not None:
            refuse_fsdp2(binding, model)
        rules = binding.policy.rules
        for entry in binding.params:
            actions = [(i, action) for i in entry.rules for action in rules[i].actions if handled_in_hooks(action)]
            param = entry.ref()
            if not actions or param is None or not param.requires_grad:
                continue
            accumulator = param.view_as(param).grad_fn
            node = accumulator.next_functions[0][0] if accumulator is not None else None
            self.handles.append(param.register_hook(self._make_hook(binding, entry, actions, node)))  # type: ignore[no-untyped-call]
        self._enlisted = bool(self.handles)
        if self._enlisted:
            pipeline_weights.enlist()  # pipelining's zero-bubble weight pass accumulates by hand

    def _make_hook(
        self,
        binding: Binding,
        entry: GuardedParam,
        actions: list[tuple[int, Action]],
        node: torch.autograd.graph.Node | None,
    ) -> Callable[[torch.Tensor], torch.Tensor | None]:
        rules = binding.policy.rules

        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            if not _accumulates(node) and not pipeline_weights.by_hand(node):
                return None
            step = self._current_step()
            out = grad
            records: list[HookRecord] = []
            counts: list[tuple[int, str, int]] = []
            for rule_index, action in actions:
                if not (rules[rule_index].active_at(step) and action.active_at(step)):
                    continue
                if isinstance(action, ClipNorm):
                    source = out.float() if out.dtype in LOW_PRECISION else out
                    norm = torch.linalg.vector_norm(source, action.norm_type)
                    coef = torch.clamp(action.max_norm / (norm + EPS), max=1.0)
                    coef = torch.where(torch.isnan(norm), torch.ones_like(coef), coef)
                    out = out * coef.to(out.dtype)
                    records.append(HookRecord(rule_index, entry.index, action, norm, coef))
                elif isinstance(action, ClipValue):
                    peak = torch.linalg.vector_norm(out, float("inf"))
                    out = out.clamp(-action.limit, action.limit)
                    records.append(HookRecord(rule_index, entry.index, action, peak, None))
                elif isinstance(action, Scale):
                    out = out * action.factor
                    counts.append((rule_index, "scale", 1))
                elif isinstance(action, Zero):
                    out = torch.zeros_like(out)
                    counts.append((rule_index, "zero", 1))
            with self._lock:
                self._records.extend(records)
                self._counts.extend(counts)
            return out

        return hook

    def drain(self) -> tuple[list[HookRecord], list[tuple[int, str, int]]]:
        """Everything the hooks recorded since the last step, to be read in the step's one sync."""
        with self._lock:
            records, self._records = self._records, []
            counts, self._counts = self._counts, []
        return records, counts

    def before_figures(self, work: StepWork, context: StepContext) -> None:
        self.report(work)

    def report(self, work: StepWork) -> None:
        """Fold what the hooks did since the last step into this step's sync, counters and events."""
        records, counts = self.drain()
        binding, outcome, step = work.binding, work.outcome, work.step
        rules = binding.policy.rules
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
                    # A value clip made it finite before it accumulated: the step's own watch would never see it.
                    kind, watchers = "nan" if before != before else "inf", binding.params[record.index].rules
                    judge_nonfinite(outcome, rules, watchers, record.index, kind, step, record.rule)
                    continue
                param = binding.params[record.index].name
                if isinstance(action, ClipNorm) and coef < 1.0:
                    outcome.norm_clipped(step, rule, param, action, before, coef, micro_batch=True)
                elif isinstance(action, ClipValue) and before > action.limit:
                    outcome.value_clipped(step, rule, param, action.limit, before, micro_batch=True)

        work.pending.add(values, read)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self._enlisted:
            self._enlisted = False
            pipeline_weights.release()
