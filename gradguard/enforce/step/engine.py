"""The step-boundary engine: applies a bound policy to the gradients the optimizer is about to apply.

It runs once per optimizer step, after every backward pass of the step (so accumulation is
treated as one gradient), after GradScaler's unscale and after DDP's averaging, and before the
optimizer reads ``p.grad``. All tensor work is batched per action with torch's ``_foreach`` kernels
and stays on the device; every figure the host needs (halt decision, log fields, counters) comes back
in one transfer: exactly one host sync per step, and none while backward runs.

The engine gathers the gradients, takes the raw figures the plan's actions need, lets the observing
actions (``monitor``) take their figures of the gradients as they arrived, runs each rule's
actions in policy order through their kernels (``gradguard.enforce.actions``), syncs once, and
reports: counters, events, a halt or a skip. What an action does lives in its kernel, not here.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from typing import Any

import torch

from gradguard.enforce.actions import ActionKernel, kernel_for
from gradguard.enforce.actions.clipping import clear_overflows
from gradguard.enforce.actions.nonfinite import SkipLimits, watch_raw_norms
from gradguard.enforce.distributed.collective import Collective, local_tensor
from gradguard.enforce.hooks.micro_batch import MicroBatchHooks, handled_in_hooks
from gradguard.enforce.hooks.scaler import adopt_fused_scaler, read_found_inf, stepped_when_skipped
from gradguard.enforce.plans.plan import Plan
from gradguard.enforce.provenance.provenance import Provenance
from gradguard.enforce.recovery.recovery import HaltReport, Recovery, RewindRequested
from gradguard.enforce.step.fused_update import FusedUpdate
from gradguard.enforce.step.known_norms import KnownNorms
from gradguard.enforce.step.verdicts import Verdicts
from gradguard.enforce.triggers.health import Health
from gradguard.enforce.triggers.loss import LossWatch
from gradguard.enforce.triggers.rerun import Figures, Reruns
from gradguard.enforce.work.statistics import Statistics
from gradguard.enforce.work.step_work import Carry, Pending, StepContext, StepOutcome, StepWork
from gradguard.enforce.work.tensors import version_of, without_grad
from gradguard.errors import GradientHalt, GuardStateError
from gradguard.events.counters import RERUN_RULE, SCALER_RULE, Counters
from gradguard.events.log import EventLog
from gradguard.policy.matching import Binding, GuardedParam

__all__ = ["Enforcer"]


class Enforcer:
    """Applies a ``Binding`` at step boundaries; owns the step counter."""

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
        self.provenance: Provenance | None = None
        """Where a NaN started: its figures ride the step's one read (``GradGuard(provenance=...)``)."""
        self.last_run_treated = False
        """Whether the last ``run`` found new gradients to treat."""
        self.skip_limits = SkipLimits()
        self.health = Health(counters, events)
        """The monitors' figures, warnings and metrics across steps."""
        self.statistics = Statistics()
        """The adaptive actions' statistics across steps (changed only by applied steps)."""
        self.recovery = Recovery(self.statistics, self.skip_limits, counters)
        """Snapshots and rewinds (the policy's ``recovery`` section)."""
        self.recovery.places.events = events  # where a placement decided after attach is said
        self.verdicts = Verdicts(counters, events, self.skip_limits, self.recovery)
        self.applied_versions: dict[int, tuple[weakref.ReferenceType[torch.Tensor], int, bool]] = {}
        """``(weakref to grad, version, held)`` per tensor: a gradient treated and unchanged since is not treated
        again; ``held`` (an explicit boundary's): the optimizer's step pre-hook leaves it alone even if changed
        since (a framework's own clip), until ``seal_explicit`` runs after the optimizer step."""
        self._explicit_marks = False
        self.scaler_skip_at_boundary = False
        """This step's GradScaler skip was already recorded at an explicit boundary (one-shot)."""
        self.known_norms = KnownNorms()  # the last applied step's norms, for the loop's own clip
        self.loss_watch = self.recovery.live.loss = LossWatch(lambda: self.binding.params)  # rewound with the stats
        self.reruns = Reruns()  # the rerun section's
        self.carry = Carry()  # applied steps' figures that came after their read, for the next read (or detach)
        self.fused = FusedUpdate()  # a step whose read waits for a fused optimizer's update

    @without_grad
    def run(self, plan: Plan, context: StepContext) -> bool:
        """Treat the current gradients of ``plan``'s tensors; return False if the step must be skipped.

        Raises [`GradientHalt`][gradguard.GradientHalt] (before the optimizer step) when a halt rule sees NaN or Inf, or
        a skip rule's limits are exceeded; or from ``after_update``, where the read waits for a fused update."""
        self.fused.discard()
        alone = self.micro_batch is None and not self.collective.active() and self.reruns.step is None
        fused = self.fused.takes(plan, context, self.binding.policy, alone=alone)
        begun = self._begin(plan, context, fused)
        if isinstance(begun, bool):
            return begun
        if fused:
            flag = begun.pending.flag(self.fused.read_flag)
            self.fused.wait(context.optimizer, flag, lambda: self._conclude(begun, context))
            return True
        return self._conclude(begun, context)

    def after_update(self, optimizer: Any, otherwise: bool) -> bool:
        """A fused optimizer's update is done: the verdict of the step that waited for it (``otherwise``: none did)."""
        verdict = self.fused.conclude(optimizer)
        return otherwise if verdict is None else verdict

    def _begin(self, plan: Plan, context: StepContext, fused: bool) -> StepWork | bool:
        grads, wrapped = gather(plan, self.applied_versions, context)
        self.last_run_treated = bool(grads)
        if not grads:
            return True
        self.known_norms.clear()

        step = self._begin_step(grads)
        self.recovery.config = self.binding.policy.recovery  # a reload may have changed it
        if self.recovery.active and self.recovery.begin_step(step):
            self.verdicts.clear(context)  # a rewind's window: this update is skipped, its gradients unread
            self.loss_watch.discard()
            return False
        collective = self.collective if self.collective.active() else None
        sharded = collective is not None and bool(wrapped)  # wrapped holds the DTensor (FSDP2) gradients
        pending = Pending(quiet=[] if fused else None)
        work = StepWork(self.binding, plan.names, grads, step, pending, StepOutcome(), collective, sharded, wrapped)
        work.fragile = plan.fragile
        work.statistics = self.statistics
        work.outcome.clipped_before = context.clipped_before
        adopt_fused_scaler(context, work.pending, work.outcome)
        read_found_inf(context, work.pending, work.outcome)
        if self.micro_batch is not None:
            self.micro_batch.report(work)

        everyone = len(plan.params)  # while len(grads) is this, every tensor of the plan has a gradient
        if len(grads) == everyone:
            raw_ids = list(plan.raw_sorted)
        else:
            raw_ids = sorted(index for index in plan.raw_norm_params if index in grads)
        if raw_ids:
            work.raw = watch_raw_norms(work, plan, raw_ids)
        sampled = bool(plan.observers) and observe(plan, work, everyone)
        judged = self.binding.policy.loss
        watched = judged is not None or sampled or self.binding.policy.rerun is not None
        self.loss_watch.begin(work, watched, self.events, judged)
        apply_actions(plan, work, everyone, self.micro_batch)
        if self.provenance is not None:
            self.provenance.report(work)  # last: its reader sees the step's non-finite verdict
        return work

    @without_grad
    def _conclude(self, work: StepWork, context: StepContext) -> bool:
        """The step's one read, and its verdict."""
        grads, wrapped, step = work.grads, work.wrapped, work.step
        late = self.carry.ride(work.pending)  # the last applied step's figures that came after its read
        work.pending.sync()  # the step's one host sync
        self.verdicts.interventions(*late)
        self.recovery.after_read()  # a snapshot's copy to the host goes on in a chunk that ends before the next read
        work.writes.apply()  # the changes the read showed are needed, to those tensors only
        clear_overflows(work, work.fragile)
        if work.pending.quiet is not None:
            self.fused.check(work, self.loss_watch.peek(self.binding.policy.loss, work.outcome.loss))
        outcome = work.outcome
        # A suspect step that cannot be computed again whole is said so, before the verdict.
        self.reruns.settle(self.binding.policy, self.loss_watch, self.events, work, context)
        rerun_or_compare(self, work, context)  # a suspect step may be computed again before anything is said
        if outcome.observed and not outcome.scaler_found_inf:
            self.health.report(outcome.observed, step, outcome.loss)  # the gradient as it arrived, before a verdict
        rules = self.binding.policy.rules
        try:
            if outcome.scaler_found_inf:
                # Seen (not a new step at a second boundary); held where the scaler still calls a fused step().
                held = context.explicit and stepped_when_skipped(context.scaled_optimizers)
                self._explicit_marks |= held
                self._mark_treated(grads, wrapped, held=held)
                self.scaler_skip_at_boundary = context.explicit
                fused = context.optimizer is not None and not context.explicit
                self.record_scaler_skip((), step=step, fused=fused, loss_scale=outcome.loss_scale)
                return True  # the scaler (or the fused kernel it drives) skips the update itself
            loss = self.loss_watch.verdict(self.binding.policy.loss, outcome, step)
            self.verdicts.report(rules, outcome, work.names, step)  # a gradient's halt comes first
            if loss is not None and self.verdicts.loss(loss, step, context):
                return False
            if outcome.skipped_by or outcome.spikes:
                self.verdicts.skip(rules, outcome, work.names, step, context)
                return False
        except RewindRequested as request:
            self.verdicts.rewound(request, context)
            return False
        except GradientHalt:
            self.health.commit(step)  # the run stops here: its figures are the last ones
            # The others were treated (a retry must not treat them again); the offending ones are checked again.
            for index, local in grads.items():
                if index not in outcome.halted_by and index not in outcome.skipped_by:
                    self.applied_versions[index] = (weakref.ref(wrapped.get(index, local)), local._version, False)
            raise
        self.skip_limits.step_applied()
        self.carry.keep(work.carried)
        self.recovery.applied_step(step)  # guard.applied_steps
        self.loss_watch.accept(self.binding.policy.loss, outcome.loss)
        self.known_norms.hold(work, wrapped)
        work.statistics_step.commit()  # only an applied step's norms enter the adaptive statistics
        self.health.commit(step)  # and only its figures are the monitors' current ones
        if self.summary_every and (step + 1) % self.summary_every == 0:
            self.emit_summary()
        self._explicit_marks |= context.explicit
        self._mark_treated(grads, wrapped, held=context.explicit)
        return True

    def _mark_treated(self, grads: dict[int, torch.Tensor], wrapped: dict[int, torch.Tensor], *, held: bool) -> None:
        # A weak reference, not id(): a new gradient may reuse a freed one's id and version. Built with map and zip,
        # which loop in C: this runs for every tensor at every step.
        local = grads.values()
        owners = [wrapped.get(i, grad) for i, grad in grads.items()] if wrapped else local
        entries = zip(map(weakref.ref, owners), map(version_of, local), repeat(held))
        self.applied_versions.update(zip(grads, entries, strict=True))

    def seal_explicit(self) -> None:
        """The optimizer has stepped: gradients treated at an explicit boundary count as treated only while unchanged,
        so the next backward (into them in place, after ``zero_grad(set_to_none=False)``) is treated again."""
        self.known_norms.clear()  # the step's gradients are not held past the update
        if not self._explicit_marks:
            return
        self._explicit_marks = False
        applied, plain = self.applied_versions, torch.Tensor  # locals: a loop per tensor, once per step
        for index, (ref, _, held) in list(applied.items()):
            if held and (grad := ref()) is not None:
                applied[index] = (ref, (grad if type(grad) is plain else local_tensor(grad))._version, False)

    def clipped(self) -> None:
        """The loop's clip has changed the gradients treated at its boundary: that is not a new gradient.

        Their versions are taken again, so a second clip of the step (``clip_grad_value_`` after
        ``clip_grad_norm_``) finds them treated, while the next backward, which changes them again, does not.
        """
        applied, plain = self.applied_versions, torch.Tensor  # locals: a loop per tensor, once per clip
        for index, (ref, _, held) in list(applied.items()):
            if held and (grad := ref()) is not None:
                applied[index] = (ref, (grad if type(grad) is plain else local_tensor(grad))._version, True)

    def rebind(self, binding: Binding, keep: dict[int, int] | None = None) -> None:
        """Switch to a new binding; tensor indices start afresh, or follow ``keep`` (old index -> new)."""
        if binding.policy.recovery != self.binding.policy.recovery:
            self.recovery.reconfigure(binding.policy.recovery)  # what it no longer asks for is given back now
        self.binding = binding
        keep = keep or {}
        self.applied_versions = {keep[i]: seen for i, seen in self.applied_versions.items() if i in keep}
        self._in_step = {keep[i] for i in self._in_step if i in keep}
        self.statistics.forget_missing(binding.rules)

    def _begin_step(self, indices: Iterable[int]) -> int:
        """The 0-based index of the step these tensors' gradients belong to.

        Several optimizers each step their own parameters within one training step; a step begins
        when a tensor already seen in the current step comes again. So the count (and every step
        window) follows training steps, not optimizer calls.
        """
        ids = set(indices)
        if self.reruns.step is not None:
            return self.reruns.step  # the step's second computation is the same step
        if not self._in_step or ids & self._in_step:
            self.step += 1
            self._in_step = set()
            self._scaler_skip_noted = False
            self.scaler_skip_at_boundary = False
        self._in_step |= ids
        return self.step - 1

    def record_scaler_skip(
        self, indices: Iterable[int], *, step: int | None = None, fused: bool = False, loss_scale: float | None = None
    ) -> None:
        """GradScaler found inf/NaN and skipped the step: its business (no halt, no clip); said and counted once
        per training step, however many optimizers the scaler skipped in it."""
        if step is None:
            step = self._begin_step(indices)
        if self._scaler_skip_noted:
            return
        self._scaler_skip_noted = True
        self.counters.add(SCALER_RULE, "skip")
        self.events.emit("info", "scaler_skip", step=step, fused=fused)
        if not self.recovery.skipping(step):  # a skipped step changes no count of the guard
            self.verdicts.scaler_skip(self.binding.policy.rules, step, loss_scale)

    def scaler_skipped(self, plan_of_optimizer: Callable[[], Plan | None], context: StepContext) -> None:
        """The guard's GradScaler skipped an optimizer's step (the optimizer's ``step()`` never ran)."""
        self.seal_explicit()  # no optimizer step ran, so its post-hook did not
        self.recovery.at_step_start(self.step)
        if self.scaler_skip_at_boundary:
            self.scaler_skip_at_boundary = False  # already recorded by guard.step() after unscale_
            return
        plan = plan_of_optimizer()
        if plan is not None:  # a skipped step has no other sync: the optimizer's step never ran
            scale = float(context.loss_scales[0]) if context.loss_scales else None
            try:
                self.record_scaler_skip((entry.index for entry in plan.params), loss_scale=scale)
            except RewindRequested as request:
                self.verdicts.rewound(request, context)

    def release(self) -> None:
        """The guard is removed: give back every tensor it holds across steps (snapshots, staging buffers, adaptive
        statistics, the last step's norms) at once, with no help from the garbage collector. Counters, ``state_dict``
        and ``metrics`` stay readable."""
        self.fused.discard()  # a flag left by a step() that raised must not stop the updates after
        self.known_norms.clear()
        self.recovery.release()
        self.statistics.release()

    def pass_step(self) -> bool:
        """``guard.pass_step()``: the coming step lies in a rewind's window; count it without its gradients."""
        if not self.recovery.pass_step(self.step):
            return False
        self.step += 1
        self._in_step = set()
        return True

    def state_dict(self) -> dict[str, Any]:
        """What decides future steps: the step number, every rule's skip history, every adaptive statistic (and the
        monitors' flags, so a resumed run does not warn again about what is still vanishing or exploding)."""
        return {
            "step": self.step,
            "skips": self.skip_limits.state_dict(self.binding.policy.rules),
            "scaler_skips": self.skip_limits.scaler_skips,
            "statistics": self.statistics.state_dict(),
            "health": self.health.state_dict(),
            "recovery": self.recovery.state_dict(),
        } | ({"loss": self.loss_watch.state_dict()} if self.binding.policy.loss is not None else {})

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        """Take over a saved ``state_dict``; returns the rule names it held that this policy lacks."""
        self.step = int(state["step"])
        self._in_step = set()
        rules = self.binding.policy.rules
        unknown = self.skip_limits.load_state_dict(dict(state.get("skips", {})), rules)
        self.skip_limits.scaler_skips = int(state.get("scaler_skips", 0))
        self.recovery.applied = self.step  # a state without the count of applied updates: the step's
        self.recovery.load_state_dict(dict(state.get("recovery", {})))
        self.loss_watch.load_state_dict(dict(state.get("loss", {})))
        names = [rule.name for rule in rules]
        unknown += self.statistics.load_state_dict(dict(state.get("statistics", {})), names)
        self.health.load_state_dict(list(state.get("health", [])), set(names))
        return sorted(set(unknown))

    def emit_summary(self) -> None:
        """Write the cumulative counters, so the log reproduces counts that are not logged per step."""
        self.events.emit("info", "counters", step=self.step - 1, steps=self.step, counters=self.counters.snapshot())


def gather(
    plan: Plan, applied: dict[int, tuple[weakref.ReferenceType[torch.Tensor], int, bool]], context: StepContext
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """The gradients to treat: ``(index -> local gradient, index -> the DTensor it came from)``; those treated and
    unchanged since (``Enforcer.applied_versions``) are not."""
    grads: dict[int, torch.Tensor] = {}
    wrapped: dict[int, torch.Tensor] = {}  # index -> the gradient itself where it is a DTensor
    seen_at, plain, strided = applied.get, torch.Tensor, torch.strided  # locals: a loop per tensor
    honour_explicit = not context.explicit
    for index, ref in plan.refs:
        param = ref()
        grad = param.grad if param is not None else None
        if grad is None:
            continue
        if type(grad) is plain:
            local = grad
        elif (local := local_tensor(grad)) is not grad:
            wrapped[index] = grad
        if local.layout is not strided:
            raise GuardStateError(
                f"parameter {plan.names[index]!r} has a {local.layout} gradient (e.g. from F.embedding(..., "
                "sparse=True)), which gradguard's actions cannot treat. Exclude it from the policy's rules, "
                "or compute a dense gradient."
            )
        seen = seen_at(index)
        if seen is not None and seen[0]() is grad and (seen[1] == local._version or (honour_explicit and seen[2])):
            continue  # already treated (and unchanged since, or at this step's explicit boundary)
        grads[index] = local
    return grads, wrapped


def apply_actions(plan: Plan, work: StepWork, everyone: int, micro_batch: MicroBatchHooks | None) -> None:
    """Each active rule's actions, in policy order, through their kernels."""
    grads, step = work.grads, work.step
    in_hooks = handled_in_hooks if micro_batch is not None else None
    for position, ((bound, members), member_ids) in enumerate(zip(plan.rules, plan.member_ids, strict=True)):
        if not bound.rule.active_at(step) or all(_passive(kernel_for(a)) for a in bound.actions):
            continue  # inactive, or it only watches (halt/skip: its verdict came with the raw norms) or observes
        ids = _present(member_ids, members, grads, everyone)
        if not ids:
            continue
        for action_index, action in enumerate(bound.actions):
            kernel = kernel_for(action)
            if _passive(kernel) or not plan.acts(position, action, step, in_hooks):
                continue
            work.final = plan.final_ids(position, action_index, ids, step, in_hooks)
            holds = len(work.final) < len(ids) and not work.sharded and kernel.may_hold(action)
            work.held = plan.held_ids(position, action_index, ids, step, in_hooks) if holds else frozenset()
            if not kernel.apply(work, bound, action, ids):
                break
            work.touched.update([i for i in ids if i not in work.held] if work.held else ids)
    work.final = work.held = frozenset()


def observe(plan: Plan, work: StepWork, everyone: int) -> bool:
    """Every observing action (``monitor``) that samples this step, on the gradients as they arrived; whether
    one did."""
    grads, step, sampled = work.grads, work.step, False
    for position, action in plan.observers:
        bound, members = plan.rules[position]
        kernel = kernel_for(action)
        if not bound.rule.active_at(step) or not kernel.samples(action, step):
            continue
        ids = _present(plan.member_ids[position], members, grads, everyone)
        if ids:
            kernel.observe(work, bound, action, ids)
            sampled = True
    return sampled


def _present(
    member_ids: Sequence[int], members: Sequence[GuardedParam], grads: dict[int, torch.Tensor], everyone: int
) -> list[int]:
    """A rule's tensors that have a gradient in this pass: all of them while every tensor of the plan has one."""
    return list(member_ids) if len(grads) == everyone else [entry.index for entry in members if entry.index in grads]


def _passive(kernel: ActionKernel) -> bool:
    """The kernel never acts in policy order: it watches (halt, skip) or observes (monitor)."""
    return kernel.watches or kernel.observes


def rerun_or_compare(enforcer: Enforcer, work: StepWork, context: StepContext) -> None:
    """The ``rerun`` section at a step's verdict: ask for a second computation (``RerunRequested``), or, on the second,
    compare the two and say so; a transient fault under ``transient: halt`` halts here."""
    policy, outcome, reruns, step = enforcer.binding.policy, work.outcome, enforcer.reruns, work.step
    config = policy.rerun
    if config is None or outcome.scaler_found_inf:
        return
    norms = {work.names[index]: value for index, value in work.raw_host.items()}
    if reruns.first is not None and reruns.step == step:
        asked = reruns.asked
        first_loss = reruns.first.loss
        first_norms = reruns.first.norms
        device = next(iter(work.grads.values())).device
        result = reruns.compare(config, Figures(outcome.loss, norms), work.collective, device)
        enforcer.counters.add(RERUN_RULE, result.verdict)
        fields: dict[str, Any] = {"loss_first": first_loss, "loss_second": outcome.loss}
        fields |= {"max_rel_diff": result.max_rel_diff}
        fields |= {"params": result.params, "ranks": result.ranks}
        enforcer.events.emit("warning", "rerun", step=step, verdict=result.verdict, asked=asked, **fields)
        if result.verdict == "reproducible":
            outcome.note = f"computed again, the fault repeated (reproducible; asked by {asked})"
        elif config.transient == "halt":
            # What the first computation held in each parameter that differed: the fault the second one did not
            # repeat (a non-finite norm, else a finite one that came out otherwise).
            kinds: dict[str, str] = {}
            for name in result.params:
                value = first_norms.get(name)
                if value is not None and value != value:
                    kinds[name] = "nan"
                elif value is not None and abs(value) == float("inf"):
                    kinds[name] = "inf"
                else:
                    kinds[name] = "differed"
            second_loss = outcome.loss
            losses = ""
            if first_loss is not None and second_loss is not None:
                losses = f"; loss {first_loss:.6g} then {second_loss:.6g}"
            ranks = f"; on rank(s) {', '.join(map(str, result.ranks))}" if result.ranks else ""
            why = (
                f"the rerun section (transient: halt) computed step {step} again, asked by {asked}, and the second "
                f"computation differed from the first (max relative difference {result.max_rel_diff:.3g}{losses}"
                f"{ranks}): a transient fault, not the model's. The device is suspect: drain the node and resume "
                "from the last checkpoint, or set rerun.transient: continue to go on with the second computation"
            )
            # Not a rewind: the state is sound, the device is not.
            enforcer.counters.add(RERUN_RULE, "halt")
            fields = HaltReport(step, RERUN_RULE, result.params, kinds, "transient", why, None).fields()
            enforcer.events.emit("error", "halt", **fields, counters=enforcer.counters.snapshot())
            enforcer.events.flush()
            raise GradientHalt(step=step, params=result.params, kind="transient", rule=RERUN_RULE, reason=why)
        return
    loss_peek = enforcer.loss_watch.peek(policy.loss, outcome.loss)
    asked = reruns.trigger(config, outcome, loss_peek)
    if asked is None:
        return
    if context.rerunnable:
        reruns.request(step, asked, Figures(outcome.loss, norms))
    if not reruns.noted:
        reruns.noted = True
        why = "the loop has no closure for the guard to run again (optimizer.step(closure), or Lightning's automatic "
        why += f"optimization); the verdict ({asked}) stands"
        enforcer.events.emit("warning", "rerun_unavailable", step=step, why=why)
