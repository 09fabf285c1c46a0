"""What the step engine keeps across steps: ``Enforcer``, one per guard.

It runs once per optimizer step, after every backward pass of the step (so accumulation is treated as one gradient),
after GradScaler's unscale and after DDP's averaging, and before the optimizer reads ``p.grad``; the step itself is
``pipeline.StepPipeline`` (gather, open, device work, one read, verdict, report), with one host sync per step and none
while backward runs. The engine owns what outlasts a step: the step count, which gradients were treated (so a second
boundary of the same step does not treat them again), the skip limits, the adaptive statistics, the participants'
state (``participants``), and ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from gradguard.enforce.actions.nonfinite import SkipLimits
from gradguard.enforce.distributed.collective import Collective, RankFailed
from gradguard.enforce.hooks.micro_batch import MicroBatchHooks
from gradguard.enforce.hooks.scaler import stepped_when_skipped
from gradguard.enforce.plans.plan import Plan
from gradguard.enforce.provenance.provenance import Provenance
from gradguard.enforce.recovery.decisions import RewindRequested
from gradguard.enforce.recovery.recovery import Recovery
from gradguard.enforce.step.book import StepBook
from gradguard.enforce.step.fused_update import FusedUpdate
from gradguard.enforce.step.known_norms import KnownNorms
from gradguard.enforce.step.participants import Participants, Parts
from gradguard.enforce.step.pipeline import StepPipeline
from gradguard.enforce.step.stages import stages_taking_part
from gradguard.enforce.step.summary import CounterSummary
from gradguard.enforce.step.verdicts import Verdicts
from gradguard.enforce.triggers.health import Health
from gradguard.enforce.triggers.loss import LossWatch
from gradguard.enforce.triggers.rerun import RerunRequested, Reruns
from gradguard.enforce.work.statistics import Statistics
from gradguard.enforce.work.step_work import Carry, StepContext, StepWork
from gradguard.errors import GradientHalt
from gradguard.events.counters import SCALER_RULE, Counters
from gradguard.events.log import EventLog
from gradguard.policy.matching import Binding

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
        self.skip_limits = SkipLimits()
        self.health = Health(counters, events)
        """The monitors' figures, warnings and metrics across steps."""
        self.statistics = Statistics()
        """The adaptive actions' statistics across steps (changed only by applied steps)."""
        self.recovery = Recovery(self.statistics, self.skip_limits, counters)
        """Snapshots and rewinds (the policy's ``recovery`` section)."""
        self.recovery.places.events = events  # where a placement decided after attach is said
        self.verdicts = Verdicts(counters, events, self.skip_limits, self.recovery)
        self.known_norms = KnownNorms()  # the last applied step's norms, for the loop's own clip
        self.loss_watch = self.recovery.live.loss = LossWatch(lambda: self.binding.params)  # rewound with the stats
        self.reruns = Reruns()  # the rerun section's
        self.book = StepBook(lambda: self.reruns.step)
        """The step count, and which gradients were treated."""
        self.carry = Carry()  # applied steps' figures that came after their read, for the next read (or detach)
        # a step whose read waits for a fused optimizer's update
        self.fused = FusedUpdate(self._alone, self._loss_peek, lambda: self.binding.policy)
        parts = Parts(
            policy=lambda: self.binding.policy,
            counters=counters,
            events=events,
            recovery=self.recovery,
            skip_limits=self.skip_limits,
            statistics=self.statistics,
            loss_watch=self.loss_watch,
            reruns=self.reruns,
            health=self.health,
            known_norms=self.known_norms,
            fused=self.fused,
            judge_loss=self.verdicts.loss,
            scaler_skip=self._scaler_step,
            summary=CounterSummary(summary_every, self.emit_summary),
            stages=stages_taking_part(self.collective, self.verdicts, counters),
        )
        self.participants = Participants(parts)
        """Who takes part in the step besides the gradients' own actions (``participants``)."""
        self.pipeline = StepPipeline(self.book, self.participants, self.verdicts, self.carry, self.collective)
        self._micro_batch: MicroBatchHooks | None = None
        self._provenance: Provenance | None = None

    @property
    def step(self) -> int:
        """How many steps have begun (the 0-based index of the next step)."""
        return self.book.step

    @step.setter
    def step(self, step: int) -> None:
        self.book.restart(step)

    @property
    def last_run_treated(self) -> bool:
        """Whether the last ``run`` found new gradients to treat."""
        return self.book.last_run_treated

    @property
    def micro_batch(self) -> MicroBatchHooks | None:
        """Set in per-micro-batch mode: tensor-scope actions then run in hooks, not here."""
        return self._micro_batch

    @micro_batch.setter
    def micro_batch(self, hooks: MicroBatchHooks | None) -> None:
        self._micro_batch = hooks
        self.participants.give("micro_batch", hooks)

    @property
    def provenance(self) -> Provenance | None:
        """Where a NaN started: its figures ride the step's one read (``GradGuard(provenance=...)``)."""
        return self._provenance

    @provenance.setter
    def provenance(self, provenance: Provenance | None) -> None:
        self._provenance = provenance
        self.participants.give("provenance", provenance)

    def run(self, plan: Plan, context: StepContext) -> bool:
        """Treat the current gradients of ``plan``'s tensors (``StepPipeline.run``); False: the step must be skipped.

        Raises [`GradientHalt`][gradguard.GradientHalt] (before the optimizer step) when a halt rule sees NaN or Inf, or
        a skip rule's limits are exceeded; or from ``after_update``, where the read waits for a fused update.

        Under ``torch.distributed``, any other exception raised inside the step is written where the other ranks look
        (``Collective.failed``), so that none waits for this rank in the step's collective (a pipeline's other stages
        included, where each stage is one rank): every rank raises ``GuardStateError`` naming it (and writes a
        ``rank_failure`` event)."""
        try:
            return self.pipeline.run(plan, context, self.binding)
        except (GradientHalt, RerunRequested, RewindRequested):
            raise  # every rank halts (or computes the step again, or rewinds) together
        except Exception as error:
            if not self.collective.shared():  # no other rank waits for this one (a stage of one rank's peers do)
                raise
            failure = error if isinstance(error, RankFailed) else self.collective.failed(error)
            collective = self.collective
            rank, host = collective.rank, collective.hosts.get(collective.rank, "?")
            what = f"{type(error).__name__}: {error}"
            if isinstance(failure, RankFailed):
                rank, host, what = failure.failed_rank, failure.host, failure.error
            step = collective.step if collective.step is not None else max(self.book.step - 1, 0)
            self.events.emit("error", "rank_failure", step=step, failed_rank=rank, host=host, error=what)
            self.events.flush()
            if failure is error:
                raise
            raise failure from error

    def after_update(self, optimizer: Any, otherwise: bool) -> bool:
        """A fused optimizer's update is done: the verdict of the step that waited for it (``otherwise``: none did)."""
        verdict = self.fused.conclude(optimizer)
        return otherwise if verdict is None else verdict

    def _alone(self) -> bool:
        """No per-micro-batch hooks, no other rank in the step (a pipeline's stages take one verdict before any update),
        no second computation of the step (``FusedUpdate.takes``)."""
        return self._micro_batch is None and not self.collective.shared() and self.reruns.step is None

    def _loss_peek(self, work: StepWork) -> Any:
        return self.loss_watch.peek(self.binding.policy.loss, work.outcome.loss)

    def _scaler_step(self, work: StepWork, context: StepContext) -> bool:
        """The GradScaler found inf in this step: seen (not a new step at a second boundary), and the scaler's (or the
        fused kernel's it drives) to skip; held where the scaler still calls a fused step()."""
        held = context.explicit and stepped_when_skipped(context.scaled_optimizers)
        self.book.explicit_marks |= held
        self.book.mark_treated(work, held=held)
        self.book.scaler_skip_at_boundary = context.explicit
        fused = context.optimizer is not None and not context.explicit
        self.record_scaler_skip((), step=work.step, fused=fused, loss_scale=work.outcome.loss_scale)
        return True

    def seal_explicit(self) -> None:
        """The optimizer has stepped (``StepBook.seal_explicit``); the step's gradients are not held past it."""
        self.known_norms.clear()
        self.book.seal_explicit()

    def clipped(self) -> None:
        """The loop's clip has changed the gradients treated at its boundary (``StepBook.clipped``)."""
        self.book.clipped()

    def rebind(self, binding: Binding, keep: dict[int, int] | None = None) -> None:
        """Switch to a new binding; tensor indices start afresh, or follow ``keep`` (old index -> new)."""
        if binding.policy.recovery != self.binding.policy.recovery:
            self.recovery.reconfigure(binding.policy.recovery)  # what it no longer asks for is given back now
        self.binding = binding
        self.book.keep(keep or {})
        self.statistics.forget_missing(binding.rules)
        self.participants.rebuild()  # a participant the new policy has no use for takes no part

    def record_scaler_skip(
        self, indices: Iterable[int], *, step: int | None = None, fused: bool = False, loss_scale: float | None = None
    ) -> None:
        """GradScaler found inf/NaN and skipped the step: its business (no halt, no clip); said and counted once
        per training step, however many optimizers the scaler skipped in it."""
        if step is None:
            step = self.book.begin_step(indices)
        if self.book.scaler_skip_noted:
            return
        self.book.scaler_skip_noted = True
        self.counters.add(SCALER_RULE, "skip")
        self.events.emit("info", "scaler_skip", step=step, fused=fused)
        if not self.recovery.skipping(step):  # a skipped step changes no count of the guard
            self.verdicts.scaler_skip(self.binding.policy.rules, step, loss_scale)

    def scaler_skipped(self, plan_of_optimizer: Callable[[], Plan | None], context: StepContext) -> None:
        """The guard's GradScaler skipped an optimizer's step (the optimizer's ``step()`` never ran)."""
        self.seal_explicit()  # no optimizer step ran, so its post-hook did not
        self.recovery.at_step_start(self.step)
        if self.book.scaler_skip_at_boundary:
            self.book.scaler_skip_at_boundary = False  # already recorded by guard.step() after unscale_
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
        for participant in self.participants.at["release"]:
            participant.release()

    def pass_step(self) -> bool:
        """``guard.pass_step()``: the coming step lies in a rewind's window; count it without its gradients."""
        if not self.recovery.pass_step(self.step):
            return False
        self.book.restart(self.step + 1)
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
        self.book.restart(int(state["step"]))
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
