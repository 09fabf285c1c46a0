"""``GradGuard``: attaches a policy to a model and enforces it at every optimizer step."""

from __future__ import annotations

import os
import threading
import uuid
import warnings
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from gradguard.enforce.hooks.boundaries import explicit_context, stepped_by
from gradguard.enforce.hooks.clips import ClipWatch
from gradguard.enforce.hooks.closures import StepArgs, TreatAfterClosure, closure_of, refuse_reevaluating, with_closure
from gradguard.enforce.hooks.deepspeed_boundary import refuse_under_deepspeed
from gradguard.enforce.hooks.guard_hooks import ClipCall
from gradguard.enforce.hooks.micro_batch import MicroBatchHooks
from gradguard.enforce.hooks.scaler import ScalerWatch, loss_scale_of
from gradguard.enforce.hooks.torch_hooks import enlist, optimizer_steps
from gradguard.enforce.plans.plan_book import PlanBook
from gradguard.enforce.provenance.provenance import attach_provenance, check_mode
from gradguard.enforce.step.engine import Enforcer
from gradguard.enforce.step.known_norms import clip_with_known_norms
from gradguard.enforce.step.ranks import watch_ranks
from gradguard.enforce.step.reload import Reloader
from gradguard.enforce.step.stages import agree_on_the_mesh, failure_told, pipelined
from gradguard.enforce.triggers.loss import LossWatch, watches_loss
from gradguard.enforce.triggers.rerun import ClosureRerun
from gradguard.enforce.work.step_work import StepContext
from gradguard.errors import GuardStateError, GuardWarning
from gradguard.events.counters import Counters
from gradguard.events.log import DEFAULT_LOGGER, EventLog
from gradguard.events.prometheus import ServesMetrics, check_metrics_port
from gradguard.lifecycle import (
    Attachment,
    check_arguments,
    claim_model,
    deepspeed_boundary,
    deepspeed_parts,
    distributed_rank,
    emit_attach,
    forget,
    load_guard_state,
    optimizers_given,
    schedulers_given,
    warn_unexpected_optimizer,
    weak_call,
)
from gradguard.policy.document import Policy
from gradguard.policy.matching import Binding

__all__ = ["GradGuard"]


class GradGuard(ServesMetrics):
    """Enforce a gradient [`Policy`][gradguard.Policy] on a model, at every optimizer step, until removed.

    ``GradGuard(model, policy)`` finds the step boundary by itself: it acts inside the ``step()`` of
    any ``torch.optim`` optimizer that holds guarded parameters, just before the update, on the
    gradient the optimizer will apply (after all backward passes of the step, GradScaler's unscale
    and DDP's averaging), or earlier, when the loop clips those gradients with torch's
    ``clip_grad_norm_`` (or ``clip_grad_value_``, ``get_total_norm``): then just before that clip, so
    the clip cannot spread one NaN to every gradient first. ``optimizer=opt`` limits the optimizers
    to the given one(s); loops without a torch optimizer call [`step`][gradguard.GradGuard.step] themselves before their
    update. Use it as a context manager, or call [`remove`][gradguard.GradGuard.remove].

    Args:
        model: the module whose parameters are guarded (DDP-, torch.compile- and checkpoint-wrapped modules are matched
            by the unwrapped names; a DeepSpeed engine at ZeRO 0-2 by its model's, docs/distributed.md).
        policy: a [`Policy`][gradguard.Policy], or the path of a policy file.
        optimizer: only these optimizers trigger the guard (default: any that holds guarded parameters).
        audit_log: append every event to this JSON-lines file (an existing one is appended to, not replaced:
            ``gradguard audit`` then reports both runs; give each run its own file, or delete the old one).
        logger: a structlog logger for the events; ``None`` for none (default: ``gradguard``'s).
        scaler: the ``GradScaler`` of the loop, so the steps it skips are logged and counted.
        process_group: the group ranks agree over (default: the default group, when initialised).
        device_mesh: the job's ``DeviceMesh`` (torchtitan's dimension names): a pipeline's stages (docs/distributed.md).
        per_micro_batch: treat each backward's contribution with the tensor-scope actions.
        start_step: the step a run resumed from a checkpoint starts at: step windows and the log's steps go on.
        summary_every: write the cumulative counters every this many steps (0: only at the end).
        replace: remove a guard already attached to the model instead of refusing.
        attach_timeout: under ``torch.distributed``, how long attaching waits for every rank of the group to attach
            too (then ``GuardStateError`` names the missing ranks); ranks that attach with a different policy,
            parameters or options are refused at once, on every rank, and a rank whose attach raises is named at once.
        metrics_port: serve live Prometheus metrics on this port (0: any free), at
            [`metrics_url`][gradguard.GradGuard.metrics_url] (docs/live-metrics-and-hot-reload.md).
        metrics_host: the address the metrics are served on.
        reload: look at the policy file (a path) every ``reload_interval`` seconds; a changed one takes over at
            the next step boundary, on every rank at the same step (docs/live-metrics-and-hot-reload.md).
        reload_interval: seconds between two looks at the policy file, with ``reload``.
        provenance: where a NaN starts, named in halts and skips (docs/provenance.md): ``"first_fault"`` (the
            default: a light trace from the start, one figure per output of the model's outer modules, held weakly
            and read at the end of the forward, so the first fault is named; every module's hooks after a fault),
            ``"always"`` (every module's hooks and the gradient flags from the start: a debugging run),
            ``"after_fault"`` (nothing until a first non-finite or skipped step, then what ``"always"`` registers)
            or ``None``.
        before_clip: a call of torch's ``clip_grad_norm_``, ``clip_grad_value_``, ``get_total_norm`` or
            ``clip_grads_with_norm_`` on guarded gradients runs the guard's step first, as ``guard.step()``
            there would (docs/clip-interception.md); ``False`` leaves the step at the optimizer's ``step()``.
        lr_scheduler: the loop's LR scheduler(s): a ``recovery`` rewind takes them back with the weights and
            ``lr_factor`` holds through their later steps (docs/recovery.md).
        averages: averaged copies of the model (an EMA) that a ``recovery`` rewind restores with it (docs/recovery.md).
    """

    @failure_told  # a rank whose attach raises before the agreement tells the others, who raise naming it at once
    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        policy: Policy | str | os.PathLike[str],
        *,
        optimizer: Optimizer | Iterable[Optimizer] | None = None,
        audit_log: str | os.PathLike[str] | None = None,
        logger: Any = DEFAULT_LOGGER,
        scaler: torch.amp.GradScaler | None = None,
        process_group: Any = None,
        device_mesh: Any = None,
        per_micro_batch: bool = False,
        start_step: int = 0,
        summary_every: int = 100,
        replace: bool = False,
        attach_timeout: float = 60.0,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        reload: bool = False,
        reload_interval: float = 2.0,
        provenance: str | None = "first_fault",
        before_clip: bool = True,
        lr_scheduler: Any = None,
        averages: Iterable[nn.Module] = (),
    ) -> None:
        engine, model = deepspeed_parts(model)  # a DeepSpeed engine's own model; torchtitan's model_parts as one
        check_arguments(model, start_step, summary_every, attach_timeout, reload_interval)
        check_metrics_port(metrics_port)
        check_mode(provenance)
        optimizers = optimizers_given(optimizer)
        self._lock = threading.RLock()
        """Held while the guard treats a step, or is removed, reloaded, saved or restored (from any thread)."""
        self._model_ref = weakref.ref(model)
        self.policy = policy if isinstance(policy, Policy) else Policy.load(policy)
        refuse_under_deepspeed(engine, self.policy, per_micro_batch=per_micro_batch, process_group=process_group)
        self._plans = PlanBook(self.policy, model, weak_call(self._rebound), stage=pipelined(device_mesh))
        binding = self._plans.binding
        for opt in optimizers or ():
            if any(id(p) in binding.by_id for group in opt.param_groups for p in group["params"]):
                refuse_reevaluating(opt)
        claim_model(self, model, replace)
        try:
            options = (per_micro_batch, start_step, reload)
            collective = agree_on_the_mesh(binding, options, process_group, device_mesh, attach_timeout)
            self.counters = Counters()
            """Thread-safe intervention counts; ``guard.counters.snapshot()`` gives a plain dict."""
            self.run_id = uuid.uuid4().hex[:12]
            """Identifies this guard's events in a log that several runs append to."""
            self.rank = distributed_rank()
            events = EventLog(audit_log=audit_log, logger=logger, context={"run": self.run_id, "rank": self.rank})
            enforcer = Enforcer(binding, self.counters, events, summary_every=summary_every, collective=collective)
            self._enforcer, enforcer.step = enforcer, start_step
            self._plans.one_plan = collective.pipeline is not None  # one verdict a training step (``PlanBook``)
            self._events, self._expected = events, optimizers
            self._warned_unexpected = False
            self._attachment = Attachment(self._enforcer, events, self._model_ref)
            path = None if isinstance(policy, Policy) else self.policy.file_path
            self._reloader = Reloader(
                path, watch=reload, interval=reload_interval, collective=collective, events=events
            )
            self._attachment.handles.append(self._reloader)
            self._serve_metrics(metrics_host, metrics_port, self._attachment.handles.append, events=events)
            if per_micro_batch:
                _attach_micro_batch_hooks(self)
            self._enforcer.provenance = attach_provenance(model, binding, provenance, self._attachment.handles.append)
            self._clips = ClipWatch(before_clip)
            self._scaler = scaler
            if scaler is not None:
                self._attachment.handles.append(_scaler_watch(scaler, weakref.ref(self)))
            recovery, schedulers = self._enforcer.recovery, schedulers_given(lr_scheduler)
            recovery.track(model, optimizers, scaler, schedulers, self.policy.recovery, start_step, averages)
            self._last_step_skipped = False
            # Every optimizer's steps and clips reach it: with optimizer=, another stepping the model is warned of.
            self._attachment.handles.append(enlist(self))
            self._attachment.handles.extend(deepspeed_boundary(self, engine, model))  # ZeRO 1-3: at its update
            self._finalizer = weakref.finalize(self, self._attachment.collected)
            self._finalizer.atexit = False
            ranks = watch_ranks(self._enforcer, model, engine is not None)  # under torch.distributed
            emit_attach(events, self.policy, model, binding, optimizers, start_step, recovery, ranks, engine=engine)
        except BaseException:
            Attachment.abandon(self.__dict__.get("_attachment"))  # no hook left behind
            forget(self)  # the model is free again
            raise

    # --- public ------------------------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        """Whether the guard still enforces its policy."""
        attachment: Attachment | None = self.__dict__.get("_attachment")  # None: still attaching
        return attachment is not None and attachment.open

    @property
    def step_count(self) -> int:
        """How many steps the guard has treated (the next step's 0-based index)."""
        return self._enforcer.step

    @property
    def audit_log(self) -> Path | None:
        """The JSON-lines audit log's path, if one was given."""
        return self._events.audit_path

    @property
    def guarded(self) -> dict[str, tuple[str, ...]]:
        """``{parameter name: names of the rules that cover it}``, in model order."""
        rules = self.policy.rules
        return {entry.name: tuple(rules[i].name for i in entry.rules) for entry in self._plans.binding.params}

    def metrics(self) -> dict[str, float]:
        """Monitors' last figures, counters, steps and recovery's snapshots, flat (``gradguard/<rule>/<stat>``)."""
        core = self._enforcer
        return core.health.metrics(self.counters.snapshot(), core.step, core.loss_watch.value) | core.recovery.metrics()

    def pass_step(self) -> bool:
        """In a rewind's window: count the coming step as skipped and return True (``if guard.pass_step(): continue``
        skips its forward, backward and update); else False. Once a training step, not a micro-batch (docs/recovery)."""
        with self._lock:
            return self._enforcer.pass_step()

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step the guard saw was skipped by a ``skip_step_on_nonfinite`` rule."""
        return self._last_step_skipped

    @property
    def applied_steps(self) -> int:
        """Updates applied, not skipped nor undone by a rewind: the step number for a scheduler (docs/recovery.md)."""
        return self._enforcer.recovery.applied

    def step(self, optimizer: Optimizer | None = None) -> bool:
        """Enforce the policy now: an explicit step boundary, placed by the loop.

        Call it after the step's last backward, before anything else reads the gradients (the update of a loop without
        a torch optimizer, a clip that is not torch's). They count as treated until the optimizer has stepped: the
        coming ``optimizer.step()`` does not treat them again, whatever changes them between.

        Args:
            optimizer: treat only the guarded gradients this optimizer steps (a skip then clears every
                gradient of the model); default: every guarded gradient of the model.

        Returns ``False`` when a skip rule skipped the step (every gradient of the model was then set to ``None``: do
        not update) or the guard's ``scaler`` found inf/NaN (its ``step()`` skips the update), else ``True``. Raises
        [`GradientHalt`][gradguard.GradientHalt] where a halt rule sees NaN or Inf, and
        [`GuardStateError`][gradguard.GuardStateError] when the guard's ``scaler`` has not unscaled the gradients yet.
        """
        with self._lock:
            return _explicit_boundary(self, optimizer)

    def reload(self, path: str | os.PathLike[str] | None = None) -> bool:
        """Load ``path`` (default: the same file) now, to take over at the next step boundary; False (with a
        ``policy_reload_failed`` event and a warning) if it is invalid or does not bind: the old policy stays."""
        with self._lock:
            self._require_attached()
            error = self._reloader.request(None if path is None else os.fspath(path), self._plans, self._enforcer.step)
        if error is not None:
            warnings.warn(f"policy not reloaded, the old one stays in force: {error}", GuardWarning, stacklevel=2)
        return error is None

    def state_dict(self) -> dict[str, Any]:
        """What decides the guard's future steps: the step number, each skip rule's history, the adaptive statistics,
        recovery's rewinds and any skip window in progress (not its snapshots: a checkpoint holds its own state). Save
        it with the model and the optimizer; [`load_state_dict`][gradguard.GradGuard.load_state_dict] on a new guard
        (same policy) carries the run on: step windows, skip limits and the log's step numbers continue."""
        with self._lock:  # not in the middle of a step
            return {"format": 1, **self._enforcer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take over a guard's [`state_dict`][gradguard.GradGuard.state_dict] (a run resumed from a checkpoint)."""
        with self._lock:
            load_guard_state(self._enforcer, self._events, state)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every event so far is in the audit log (a background thread writes it); False if ``timeout``
        seconds passed first. Halts, [`remove`][gradguard.GradGuard.remove] and interpreter exit flush by themselves."""
        return self._events.flush(timeout)

    def remove(self) -> None:
        """Remove every hook and close the audit log (a guard garbage-collected while attached does it, and warns); safe
        to call more than once, from any thread: a step in flight finishes, the model's later steps are not treated."""
        with self._lock:
            if self._finalizer.detach() is not None:
                self._attachment.close("removed")
        forget(self)

    def __enter__(self) -> GradGuard:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        attaching = "_attachment" not in self.__dict__  # another thread may show a guard still being made
        state = "attaching" if attaching else "attached" if self.attached else "removed"
        steps, params = 0 if attaching else self.step_count, len(self._plans.binding.params)
        return f"<GradGuard {state} policy={self.policy.source!r} params={params} steps={steps}>"

    # --- the process-wide hooks (gradguard.enforce.hooks.torch_hooks) dispatch here, on the step's thread; another
    # training's returns at once, without the lock. Only an enlisted guard is reached, and it has its attachment: its
    # ``open`` is read, not the ``attached`` property (a Python call each, six a step).

    def _on_optimizer_step(self, opt: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> StepArgs | None:
        if not self._attachment.open:
            return None
        if self._plans.steps_none(opt):
            if (recovery := self._enforcer.recovery).active and recovery.unchecked(opt):
                with self._lock:
                    recovery.met_unguarded(opt)
            return None
        return _optimizer_step_begins(self, opt, args, kwargs)

    def _after_optimizer_step(self, optimizer: Optimizer) -> None:
        # Only this model's: another thread's optimizer stepping meanwhile must not make its treated gradients new.
        if not self._attachment.open or self._plans.steps_none(optimizer):
            return
        with self._lock:
            if self._attachment.open and self._plans.for_optimizer(optimizer) is not None:
                self._record(self._enforcer.after_update(optimizer, not self._last_step_skipped))  # a read waited?
                self._enforcer.seal_explicit()
                self._enforcer.recovery.at_step_start(self._enforcer.step)

    def _before_clip(self, call: ClipCall) -> bool:
        if not self._attachment.open or not self._plans.guarded_among(call.tensors, of_grads=call.of_grads):
            return False
        with self._lock:
            return _clip_begins(self, call) if self._attachment.open else False

    def _clip_instead(self, *call: Any) -> Any:  # the loop's clip from this step's norms; None: torch's own runs
        core = self._enforcer  # only where this very clip ran the guard's step: nothing came between
        return clip_with_known_norms(core.known_norms, *call) if core.book.last_run_treated else None

    def _loss_watch(self) -> LossWatch | None:  # where backward's roots go, if the policy watches this step's loss
        core = self._enforcer
        return core.loss_watch if self._attachment.open and watches_loss(self.policy, core.book.step) else None

    def _after_clip(self) -> None:  # the clip's own change to the gradients is not a new gradient
        with self._lock:
            self._enforcer.clipped()

    # --- internals ----------------------------------------------------------------------------------

    def _require_attached(self) -> None:
        if not self.attached:
            raise GuardStateError("this GradGuard was removed; create a new one to guard the model again")

    def _record(self, proceed: bool) -> bool:
        self._last_step_skipped = not proceed
        return proceed

    def _enforce_for(self, optimizer: Optimizer, rerunnable: bool = False) -> None:
        """Treat the gradients ``optimizer`` is about to apply (only its own: others may still be scaled)."""
        with self._lock:
            _optimizer_boundary(self, optimizer, rerunnable)

    def _at_boundary(self) -> bool:
        """A step boundary: a new policy the reloader holds (agreed on by every rank) takes over now, or not."""
        new = self._reloader.at_boundary(self._plans, self._enforcer) if self._reloader.pending() else None
        if new is not None:
            self._plans, self.policy = new, new.policy
            self._rebound(new.binding, None)
        return new is not None

    def _rebound(self, new: Binding, replaced: list[str] | None) -> None:
        """The policy was bound again (``replaced``: the model's parameters were replaced; None: a reload)."""
        _rebound(self, new, replaced)


def _attach_micro_batch_hooks(guard: GradGuard) -> None:
    """The per-micro-batch hooks (``per_micro_batch=True``), at attach and again at a rebind."""
    enforcer = guard._enforcer
    hooks = MicroBatchHooks(guard._plans.binding, lambda: enforcer.step, guard._model_ref())
    enforcer.micro_batch = hooks
    guard._attachment.handles.append(hooks)


def _rebound(guard: GradGuard, new: Binding, replaced: list[str] | None) -> None:
    """GradGuard._rebound, under the guard's lock."""
    if replaced is not None:
        guard._enforcer.rebind(new)
        guard._enforcer.recovery.drop_snapshots()  # they hold the replaced tensors' values
    if guard._enforcer.provenance is not None:
        guard._enforcer.provenance.rebind(new)
    if guard._enforcer.micro_batch is not None:
        guard._enforcer.micro_batch.remove()
        _attach_micro_batch_hooks(guard)
    if replaced is not None:
        guard._events.emit(
            "warning",
            "rebind",
            step=guard._enforcer.step,
            replaced=replaced,
            params=len(new.params),
            rules={bound.name: len(bound.params) for bound in new.rules},
        )


def _optimizer_step_begins(
    guard: GradGuard, optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> StepArgs | None:
    """An optimizer's ``step()`` begins: treat its gradients now, or after its closure computes them."""
    closure = closure_of(args, kwargs)
    if closure is None:
        guard._enforce_for(optimizer)
        return None
    with guard._lock:
        if guard._plans.for_optimizer(optimizer) is None:
            return None  # it steps nothing of the model
    refuse_reevaluating(optimizer)
    guard_ref = weakref.ref(guard)

    def treat() -> None:
        if (alive := guard_ref()) is not None:
            alive._enforce_for(optimizer, rerunnable=True)

    rerun = ClosureRerun(stepped_by(optimizer, guard._model_ref)) if guard.policy.rerun is not None else None
    return with_closure(args, kwargs, TreatAfterClosure(closure, treat, optimizer, rerun))


def _optimizer_boundary(guard: GradGuard, optimizer: Optimizer, rerunnable: bool = False) -> None:
    """``GradGuard._enforce_for``, under the guard's lock."""
    if not guard._attachment.open:
        return
    plan = guard._plans.for_optimizer(optimizer)
    pending = guard._reloader.agrees or guard._reloader.slot.ready  # ``pending()``, without its call at every step
    if plan is not None and pending and guard._at_boundary():  # not for another model's optimizer: maybe on one rank
        plan = guard._plans.for_optimizer(optimizer)
    if plan is None:
        return
    # A skipped step must be skipped by every optimizer of the model, not only this one.
    guard._enforcer.recovery.saw_optimizer(optimizer)
    context = StepContext(
        optimizer=optimizer,
        stepped_params=stepped_by(optimizer, guard._model_ref),
        clipped_before=guard._clips.take_seen(),
        rerunnable=rerunnable,
    )
    proceed = guard._enforcer.run(plan, context)
    if guard._enforcer.book.last_run_treated:
        # A pass that found every gradient already treated (after guard.step(), or a second
        # optimizer's step) says nothing about the step: it must not undo a skip's verdict.
        guard._record(proceed)
    elif guard._last_step_skipped:
        # The step was skipped where this optimizer was not known (at the loop's clip, or at another optimizer's
        # step, which cleared the model's gradients): its parameters outside the model must not move either.
        for param in stepped_by(optimizer, guard._model_ref)():
            param.grad = None
    unexpected = guard._expected is not None and all(optimizer is not opt for opt in guard._expected)
    if unexpected and guard._enforcer.book.last_run_treated and not guard._warned_unexpected:
        guard._warned_unexpected = True
        warn_unexpected_optimizer(guard._events, optimizer, guard._enforcer.step - 1)


def _explicit_boundary(guard: GradGuard, optimizer: Optimizer | None) -> bool:
    """[`GradGuard.step`][gradguard.GradGuard.step], under the guard's lock."""
    guard._require_attached()
    if guard._attachment.inside_deepspeed:  # p.grad holds only this rank's unreduced micro-batches
        raise GuardStateError("remove guard.step() under DeepSpeed ZeRO 1-3: the guard acts inside engine.step()")
    guard._at_boundary()
    plan = guard._plans.current() if optimizer is None else guard._plans.for_optimizer(optimizer)
    if plan is None:
        return True  # the optimizer steps none of the model
    context = explicit_context(optimizer, guard._model_ref, guard._scaler)
    proceed = guard._enforcer.run(plan, context)
    return guard._record(proceed and not guard._enforcer.book.scaler_skip_at_boundary)


def _clip_begins(guard: GradGuard, call: ClipCall) -> bool:
    """The loop clips gradients: if they are the guard's, its step runs first, on the raw gradients, as
    ``guard.step()`` there would (after GradScaler's ``unscale_``: a scaler skip stays the scaler's), and the
    optimizer's coming ``step()`` leaves them alone. True: the guard's ``_after_clip`` follows the clip."""
    if guard._attachment.inside_deepspeed:
        return False  # p.grad holds this rank's unreduced micro-batches: the guard acts in DeepSpeed's update
    boundary = guard._clips.boundary(call, guard._plans)
    if boundary is None:
        return False
    if guard._reloader.agrees or guard._reloader.slot.ready:  # ``pending()``: two flags, no call at every step
        guard._at_boundary()
    plan = guard._plans.for_params(boundary.params)
    if plan is None:
        return False
    if boundary.optimizer is not None:
        guard._enforcer.recovery.saw_optimizer(boundary.optimizer)
    context = StepContext(
        optimizer=None,
        stepped_params=stepped_by(boundary.optimizer, guard._model_ref),
        explicit=True,
        found_inf=boundary.found_inf,
        loss_scales=boundary.loss_scales,
        clipped_before=guard._clips.take_seen(),
        scaled_optimizers=boundary.optimizers,
    )
    proceed = guard._enforcer.run(plan, context)
    if guard._enforcer.book.last_run_treated:
        guard._record(proceed and not guard._enforcer.book.scaler_skip_at_boundary)
    return True


def _scaler_watch(scaler: torch.amp.GradScaler, guard_ref: weakref.ReferenceType[GradGuard]) -> ScalerWatch:
    def on_skip(optimizer: Optimizer) -> None:
        guard = guard_ref()
        if guard is None:
            return
        with guard._lock:
            if guard.attached:
                plans = guard._plans  # the guard's GradScaler skipped this optimizer's step (its step() never ran)
                stepped = stepped_by(optimizer, guard._model_ref)
                context = StepContext(optimizer=optimizer, stepped_params=stepped, loss_scales=loss_scale_of(scaler))
                guard._enforcer.scaler_skipped(lambda: plans.for_optimizer(optimizer), context)

    return ScalerWatch(scaler, optimizer_steps, on_skip)
