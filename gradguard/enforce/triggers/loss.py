"""The loss as a trigger: the policy's ``loss`` section, judged on the step's loss at the step boundary.

The guard learns the loss with no change to the loop: while it is attached, every ``backward()`` of the
process passes its root through ``gradguard.enforce.hooks.torch_hooks``, which hands it to the guards whose policy
has a ``loss`` section (``LossWatch.saw``). A root ``GradScaler.scale`` made is replaced by the loss it
scaled; the roots of one step (an accumulating loop's micro-batches, each already divided by their number)
are summed on the device. At the boundary the sum joins the step's one read (``LossWatch.read``); under a
process group every rank adds its own and the mean over the ranks that saw one is judged, so every rank
takes the same verdict.

A NaN/Inf loss is ``loss.nonfinite``'s to act on; a loss above ``factor`` x the median of the last
``window`` applied steps' losses is a spike. Spiked, skipped and rewound steps never enter the median.
The judgement itself, on plain floats, is ``LossReference``'s (``gradguard.enforce.triggers.loss_reference``),
which ``gradguard replay`` uses too without importing torch.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import torch

from gradguard.enforce.triggers.loss_reference import LossReference, LossVerdict
from gradguard.enforce.work.step_work import StepOutcome, StepWork
from gradguard.events.log import EventLog
from gradguard.policy.matching import GuardedParam
from gradguard.policy.schema import Loss, Monitor, PolicyFields, Rule

__all__ = ["PROBES", "LossVerdict", "LossWatch", "watches_loss"]

PROBES = 16
"""How many of a model's parameters are looked at to tell whether a backward reached it (spread over the model: a
backward that reaches none of 16 of them is another model's)."""


def watches_loss(policy: PolicyFields, step: int) -> bool:
    """Whether a guard under ``policy`` learns the loss of ``step`` (the step whose backward runs now): to judge it (a
    ``loss`` section), to compare a step's two computations (``rerun``), at every step; to record it beside the norms
    a ``monitor`` writes (``stats`` events), at the steps a monitor samples. A step no one watches leaves its roots
    alone (no op, no probe of the gradients): the default's monitor samples every 10th step."""
    # Asked at every backward: the policy last asked about is answered without hashing it (pydantic hashes every
    # section, 7 calls), and again for the same step without a call; a policy is immutable, so the same object has the
    # same watchers. One tuple, swapped whole, so that a thread reads a policy with its own answer.
    global _last_asked
    last_policy, watchers, last_step, last_answer = _last_asked
    if policy is last_policy and step == last_step:
        return last_answer
    always, monitors = watchers if policy is last_policy else _loss_watchers(policy)
    answer = always or any(rule.active_at(step) and monitor.samples(step) for rule, monitor in monitors)
    _last_asked = (policy, (always, monitors), step, answer)
    return answer


_Watchers = tuple[bool, tuple[tuple[Rule, Monitor], ...]]
_last_asked: tuple[PolicyFields | None, _Watchers, int, bool] = (None, (False, ()), -1, False)


@lru_cache(maxsize=32)
def _loss_watchers(policy: PolicyFields) -> _Watchers:
    """Whether ``policy`` watches the loss at every step, and the monitors (with their rules) that sample it."""
    monitors = tuple((rule, action) for rule in policy.rules for action in rule.actions if isinstance(action, Monitor))
    return policy.loss is not None or policy.rerun is not None, monitors


class LossWatch(LossReference):
    """One guard's view of the loss: the roots seen since the last step, and the reference across steps (judged as
    ``LossReference`` judges: ``judge``, ``peek``, ``accept``, ``spike_limit``)."""

    def __init__(self, params: Callable[[], Sequence[GuardedParam]] = tuple) -> None:
        super().__init__()
        self._params = params
        """The guarded parameters (the binding's, as it is now): a backward is this guard's if it reaches them."""
        self._lock = threading.Lock()
        self._sum: torch.Tensor | None = None
        self._unseen: str | None = None
        self.warned = False
        """A ``loss_unseen`` event was written (once per guard)."""
        self.value: float | None = None
        """The last step's loss as read (for ``stats`` and ``guard.metrics()``)."""
        self.first_step: int | None = None
        """The first step this guard watched (a guard attached after that step's backward saw no root of it)."""

    # --- the roots of backward (any thread) -----------------------------------------------------------

    def probe(self) -> list[tuple[torch.Tensor, torch.Tensor | None, int]]:
        """Up to ``PROBES`` guarded parameters spread over the model, with their gradients as they are now."""
        params = [entry for entry in self._params() if (param := entry.ref()) is not None and param.requires_grad]
        picks = params[:: max(1, len(params) // PROBES)][:PROBES]
        out: list[tuple[torch.Tensor, torch.Tensor | None, int]] = []
        for entry in picks:
            param = entry.ref()
            if param is not None:
                grad = param.grad
                out.append((param, grad, -1 if grad is None else grad._version))
        return out

    @staticmethod
    def reached(probe: list[tuple[torch.Tensor, torch.Tensor | None, int]]) -> bool:
        """Whether a backward changed a probed gradient (made it, or added into it); no probe: assume it did."""
        if not probe:
            return True
        for param, grad, version in probe:
            now = param.grad
            if now is not grad or (now is not None and now._version != version):
                return True
        return False

    def saw(self, root: torch.Tensor | None, why: str | None = None) -> None:
        """A ``backward()`` of ``root`` (the unscaled loss), or of something that is not a loss (``why``)."""
        if root is None:
            with self._lock:
                self._unseen = self._unseen or why
            return
        value = root.detach().reshape(()).float()
        with self._lock:
            self._sum = value if self._sum is None else self._sum + value

    def discard(self) -> None:
        """The step is not judged (a skip window, a scaler skip): its roots are forgotten."""
        with self._lock:
            self._sum, self._unseen = None, None

    def begin(self, work: StepWork, watched: bool, events: EventLog, judged: Loss | None = None) -> None:
        """Queue the step's loss into the step's read (it lands in ``work.outcome.loss``) where it is ``watched``: a
        ``loss`` section (``judged``) judges it, or a ``monitor`` samples this step and records it.

        Under a process group every rank takes part every step (a collective run by some ranks only hangs
        the others): the sum of the ranks' losses and how many ranks had one; the mean is judged.
        """
        if not watched:
            self.discard()  # the loss is neither judged nor recorded at this step
            return
        with self._lock:
            total, unseen = self._sum, self._unseen
            self._sum, self._unseen = None, None
        first, self.first_step = self.first_step is None, work.step if self.first_step is None else self.first_step
        if total is None and unseen is None and not first and judged is not None:
            unseen = (
                "no backward() was seen for this step (a backward called through a name bound before the guard "
                "attached, torch.func, or a framework's own autograd)"
            )
        if unseen is not None and not self.warned:
            self.warned = True
            events.emit("warning", "loss_unseen", step=work.step, why=f"{unseen}: such steps' losses are not judged")
        if work.collective is not None:
            device = next(iter(work.grads.values())).device
            if total is None:
                mine = torch.zeros(2, device=device)
            else:
                mine = torch.stack([total.to(device), torch.ones((), device=device)])
            total = work.collective.sum_(mine)  # the ranks' losses and how many ranks had one
        elif total is not None:
            if judged is not None:  # where the read waits for a fused update: is the verdict sure to be "fine"?
                work.pending.quiet_if(functools.partial(_unjudged, total, self.spike_limit(judged)))
            total = torch.stack([total, torch.ones_like(total)])
        if total is None:
            return
        outcome = work.outcome

        def take(values: list[float]) -> None:
            outcome.loss = values[0] / values[1] if values[1] else None  # the mean over the ranks that saw one

        work.pending.add(total, take)

    # --- the verdict (the step's thread, after the read) ----------------------------------------------

    def verdict(self, config: Loss | None, outcome: StepOutcome, step: int) -> LossVerdict | None:
        """The section's verdict on the step's loss (``outcome.loss_skip`` set for a skip), or None: it is fine."""
        self.value = outcome.loss
        if config is None or outcome.loss is None:
            return None
        verdict = self.judge(config, outcome.loss, step)
        outcome.loss_skip = verdict is not None and verdict.action == "skip"
        return verdict


def _unjudged(loss: torch.Tensor, limit: float | None) -> torch.Tensor:
    """The loss section's verdict is sure to be "fine": a finite loss, at most ``limit`` where spikes are looked for."""
    finite = loss.abs() < math.inf
    return finite if limit is None else finite & (loss <= limit)


def root_of(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[torch.Tensor | None, str | None]:
    """The loss of a ``torch.autograd.backward(tensors, grad_tensors, ...)`` call, or why it is not one."""
    tensors = args[0] if args else kwargs.get("tensors")
    given = args[1] if len(args) > 1 else kwargs.get("grad_tensors")
    if isinstance(tensors, Sequence) and not isinstance(tensors, torch.Tensor):
        if len(tensors) != 1:
            return None, f"a backward() of {len(tensors)} roots at once"
        tensors = tensors[0]
    if not isinstance(tensors, torch.Tensor):
        return None, None  # not ours to judge (torch says what is wrong)
    if tensors.numel() != 1:
        return None, f"a backward() of a tensor of shape {tuple(tensors.shape)}, not a scalar loss"
    if given is not None:
        grad = given[0] if isinstance(given, Sequence) and not isinstance(given, torch.Tensor) else given
        if isinstance(grad, torch.Tensor) and grad.numel() == 1:
            return tensors.detach() * grad.detach().reshape(tensors.shape).to(tensors.dtype), None
    return tensors, None
