"""The step's read after a fused optimizer's update: the verdict handed to the optimizer's kernel as a device flag.

The step's one read drains the device. Made before the optimizer's step, it leaves the device idle while the host
runs the optimizer's own Python (``Adam._init_group`` over every tensor) before the update's kernel: on an H200 that
idle time is most of what the guard costs at 163M parameters (docs/performance.md). ``Adam(fused=True)`` and
``AdamW(fused=True)`` take a ``found_inf`` flag (GradScaler's): set, their kernel changes no weight and no moment, and
the step count it adds is taken back on the device. So, before such an update, the guard queues its whole step with
one more figure, a flag set exactly when its host will have something to do before the update (an alarm: a
non-finite value, a clip or a clamp to make; ``Pending.alarm``), hands it to the optimizer as ``found_inf``, and
reads after the update, in the optimizer's post-hook (``conclude``):

- the flag clear (the common step): the update is done, as the read-first order would have done it; the read only
  reports;
- the flag set: the kernel skipped. The host now treats the step as it would have before the update: a halt raises
  with the weights and the optimizer's state as they were; a skip sets the gradients to None; an applied step makes
  its clips and runs the optimizer's update again, without hooks and with the flag gone: the same kernel on the same
  state, so bitwise the update the read-first order makes.

Only where nothing else needs the host before the update, or sees the update between: a fused Adam or AdamW
(exactly those classes) with its state made (after its first update), stepped without a GradScaler, closure,
per-micro-batch hooks, process group or step hooks but the guard's, and a policy whose every action raises an
alarm for whatever its reader would do (``ActionKernel.alarms``: every action does; a new one must say so), and no
``rerun`` section. A ``loss`` section raises its own (``loss._unjudged``: a non-finite loss, or one above the spike
limit rounded down to float32); a ``recovery`` section's snapshots are staged on the compute stream before the
update, and a rewind restores after the update the flag stopped. Everywhere else the guard reads first, as it
always has.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from gradguard.enforce.actions import kernel_for
from gradguard.enforce.work.participant import Participant
from gradguard.enforce.work.step_work import StepContext, StepPlan, StepWork
from gradguard.errors import GuardStateError

if TYPE_CHECKING:
    from gradguard.enforce.triggers.loss import LossVerdict
    from gradguard.policy.document import Policy

__all__ = ["FusedUpdate"]

_FUSED_CLASSES = (torch.optim.Adam, torch.optim.AdamW)
_SCALER_ATTRIBUTES = ("found_inf", "grad_scale")
_PARAMS = itemgetter("params")


class FusedUpdate(Participant):
    """The one step (at most) whose read waits for a fused optimizer's update.

    As a participant: every boundary forgets a step whose update never came back; a step it ``takes`` queues its
    quiet conditions (``Pending.quiet``) from the first figure on, and its read and verdict wait for the update.
    ``alone``: no per-micro-batch hooks, no process group, no second computation of the step; ``loss``: the
    ``loss`` section's verdict on the step's loss, changing nothing (``LossWatch.peek``), and ``policy``: as it is
    now.
    """

    def __init__(
        self,
        alone: Callable[[], bool] = lambda: True,
        loss: Callable[[StepWork], LossVerdict | None] = lambda work: None,
        policy: Callable[[], Policy | None] = lambda: None,
    ) -> None:
        self._waiting: tuple[Any, torch.Tensor | None, Callable[[], bool]] | None = None
        self._flag = 0.0
        self._alone, self._loss, self._policy = alone, loss, policy
        self._taking = False

    def boundary(self, context: StepContext) -> None:
        if self._waiting is not None:  # the common boundary has nothing to forget: no call
            self.discard()

    def opens(self, step: int, plan: StepPlan, context: StepContext) -> bool:
        if type(context.optimizer) not in _FUSED_CLASSES:
            self._taking = False  # ``takes``' first test, without its calls: every step but a fused Adam's
            return True
        policy = self._policy()
        self._taking = policy is not None and self.takes(plan, context, policy, alone=self._alone())
        return True

    def before_figures(self, work: StepWork, context: StepContext) -> None:
        if self._taking:
            work.pending.quiet = []  # every figure from here on says whether its reader will have work to do

    def defers_read(self, work: StepWork, context: StepContext, conclude: Callable[[], bool]) -> bool:
        if not self._taking:
            return False
        self._taking = False
        self.wait(context.optimizer, work.pending.flag(self.read_flag), conclude)
        return True

    def after_read(self, work: StepWork, context: StepContext) -> None:
        if work.pending.quiet is not None:
            self.check(work, self._loss(work))

    def release(self) -> None:
        self.discard()  # a flag left by a step() that raised must not stop the updates after

    def takes(self, plan: StepPlan, context: StepContext, policy: Policy, *, alone: bool) -> bool:
        """Whether this step's read may wait for ``context.optimizer``'s update (``alone``: no per-micro-batch hooks,
        no process group, no second computation of the step)."""
        optimizer = context.optimizer
        if optimizer is None or type(optimizer) not in _FUSED_CLASSES or context.explicit or context.rerunnable:
            return False
        if context.found_inf or context.clipped_before is not None or context.scaled_optimizers:
            return False
        if any(name in vars(optimizer) for name in _SCALER_ATTRIBUTES) or _raw_step(optimizer) is None:
            return False  # a GradScaler drives this step (its own flag), or the class's step is not torch's wrapper
        if not all(group.get("fused") for group in optimizer.param_groups) or _hooked(optimizer):
            return False
        if not _has_state(optimizer):
            return False  # a stopped update would still make its state (zero moments): not the read-first's
        if not alone or policy.rerun is not None:
            return False
        return all(kernel_for(action).alarms for bound, _ in plan.rules for action in bound.actions)

    def discard(self) -> None:
        """Forget a step whose update never came back (its ``step()`` raised): its flag must not skip the next."""
        if self._waiting is not None:
            optimizer, flag, _ = self._waiting
            self._waiting = None
            if flag is not None and vars(optimizer).get("found_inf") is flag:
                del optimizer.found_inf

    def wait(self, optimizer: Any, flag: torch.Tensor | None, conclude: Callable[[], bool]) -> None:
        """``conclude`` (the step's read and verdict) waits for ``optimizer``'s update, which ``flag`` stops if set."""
        self._waiting = (optimizer, flag, conclude)
        self._flag = 0.0
        if flag is not None:
            optimizer.found_inf = flag

    def read_flag(self, values: list[float]) -> None:
        self._flag = values[0]

    def check(self, work: StepWork, loss: LossVerdict | None) -> None:
        """After the read: a step with something to do before the update (``loss``: the loss section's verdict, made
        later) must have raised its flag, else the update was made without it. Never true by construction; said
        loudly rather than training on silently wrong."""
        outcome = work.outcome
        acts = work.writes.written or outcome.nonfinite or outcome.skipped_by or outcome.halted_by or outcome.spikes
        if not self._flag and (acts or loss is not None):
            raise GuardStateError(
                f"step {work.step}: the read found a change or a verdict due before the fused optimizer's update, "
                "which its flag did not stop. This is a gradguard defect; please report it with your policy."
            )

    def conclude(self, optimizer: Any) -> bool | None:
        """After ``optimizer``'s update: the waiting step's verdict (None: no step waited for this update)."""
        if self._waiting is None or self._waiting[0] is not optimizer:
            return None
        _, flag, conclude = self._waiting
        self._waiting = None
        if flag is not None and vars(optimizer).get("found_inf") is flag:
            del optimizer.found_inf
        proceed = conclude()  # the read: a halt raises here, with the update not made
        if proceed and self._flag:
            # The flag stopped the update; the step is applied after all (its clips made by ``conclude``): the
            # update now, once, without the hooks (they ran for this step()), and with no flag.
            step = _raw_step(optimizer)
            assert step is not None, "checked by takes()"
            step(optimizer)
        return proceed


def _hooked(optimizer: Any) -> bool:
    """Whether step hooks besides the guard's own run around the update: the optimizer's own post-hooks run before
    the guard's (torch runs an optimizer's before the global ones), so they would see the update the flag stopped,
    not the one made after the read; its own pre-hooks, and global ones, may change gradients after the guard's."""
    own = bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks)
    return own or len(_global_optimizer_pre_hooks) > 1 or len(_global_optimizer_post_hooks) > 1


def _has_state(optimizer: Any) -> bool:
    """Whether every parameter with a gradient has its state already (after its first update)."""
    state = optimizer.state
    params = list(chain.from_iterable(map(_PARAMS, optimizer.param_groups)))
    if len(state) >= len(params):
        return True  # every parameter has one (the common case: no loop in Python)
    return all(param in state for param in params if param.grad is not None)


def _raw_step(optimizer: Any) -> Callable[[Any], Any] | None:
    """The class's own ``step``, under the hooks torch's ``Optimizer`` wraps around it (``profile_hook_step``)."""
    wrapped = getattr(type(optimizer).step, "__wrapped__", None)
    return wrapped if callable(wrapped) else None
