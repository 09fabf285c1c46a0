"""A suspect step computed again: a fault that does not come back was transient (the policy's ``rerun`` section).

Megatron-LM's rerun state machine re-runs a suspect step's forward and backward on the same batches with the random
number generators restored and compares: a result that differs is a transient (hardware) fault, and training goes
on; one that repeats is the model's. gradguard does it in the loop a user already has, where the guard holds the
step's computation: ``optimizer.step(closure)`` (and Lightning's automatic optimization, always a closure).

- Before the closure first runs, ``ClosureRerun`` keeps the RNG states (the CPU's and every initialised CUDA
  device's: host copies of the generators' seeds and offsets, no host sync), and what the step had before the
  closure: the gradients an accumulating loop's earlier micro-batches left, and their losses. A gradient that was
  None costs nothing. One that was not gets a tensor hook for the closure's first computation, and is copied only
  where the closure's backward is about to add into it as it was (accumulation): a closure that zeroes its
  gradients first (``zero_grad()``, set to None or in place) copies nothing, and the copies are given back when the
  step ends without a second computation.
- When the step's verdict is one the section lists (``on``), the engine does not act on it: it keeps the first
  computation's figures (its loss and per-tensor norms, already read) and raises ``RerunRequested`` before any
  count, event or state changes. The stand-in closure puts the RNG states back and the gradients and the loss as
  they were before the closure (None where they were None or the closure clears them; a gradient the closure zeroes
  in place is left to it), and runs the user's closure again: the second computation is the whole step again, the
  earlier micro-batches' part as it was and the closure's computed anew. The engine treats it as the same step.
- Where that cannot be had (the guard acts where it holds no closure: a plain loop, Hugging Face's ``Trainer``, the
  loop's own clip inside the closure), ``Reruns.settle`` says so once per reason (``rerun_unavailable``), the
  verdict stands and its halt says the step was not computed again. A fault is never called transient without a
  second computation of the whole step.
- The two computations agree when every figure's relative difference is within ``tolerance``. Agree: the fault
  is reproducible, and the verdict stands (the second computation gives it again). Differ: transient; with
  ``transient: continue`` the second computation's gradients are judged as the step's own, with ``halt`` the run
  halts saying the fault was transient. Under a process group the ranks agree on both: the verdict is the same on
  every rank before the re-run, and whether the computations differed is summed over the ranks after it: every
  rank goes the same way, the ranks that differed are named, and whether the rank that made it made it again.
  Under FSDP2 and tensor parallel the norms compared are the whole tensors', the same on every rank
  (``rerun_figures``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

from gradguard.enforce.distributed.collective import Collective
from gradguard.enforce.triggers.loss import LossWatch
from gradguard.enforce.triggers.rerun_figures import Comparison, Figures, compared
from gradguard.enforce.work.step_work import StepContext, StepOutcome, StepWork
from gradguard.policy.sections import Rerun

if TYPE_CHECKING:
    from gradguard.events.log import EventLog
    from gradguard.policy.document import Policy

__all__ = [
    "NO_CLOSURE",
    "ClosureRerun",
    "RerunRequested",
    "Reruns",
    "current_closure",
    "in_rerunnable_closure",
    "rng_states",
    "set_rng_states",
]

_closures = threading.local()
"""``active``: the closures of ``optimizer.step(closure)`` this thread is in (with their treat), innermost last."""

NO_CLOSURE = (
    "the loop has no closure for the guard to run again (optimizer.step(closure), or Lightning's automatic "
    "optimization; a plain loop or Hugging Face's Trainer has none)"
)


def _active() -> list[ClosureRerun]:
    active: list[ClosureRerun] | None = getattr(_closures, "active", None)
    if active is None:
        active = _closures.active = []
    return active


def current_closure() -> ClosureRerun | None:
    """The innermost closure this thread is running (or treating) that the guard can run again, if any."""
    active = _active()
    return active[-1] if active else None


def in_rerunnable_closure() -> bool:
    """Whether this thread is running a closure of ``optimizer.step(closure)`` that the guard can run again (so a
    boundary inside it, as Lightning's ``on_before_optimizer_step``, may ask for a second computation).

    Asked by such a boundary before it treats anything: what a second computation would start from is settled here,
    while the gradients are still the ones backward left (the treat may clip them in place)."""
    current = current_closure()
    if current is None:
        return False
    current.settle()
    return True


@contextmanager
def _inside(rerun: ClosureRerun) -> Iterator[None]:
    active = _active()
    active.append(rerun)
    try:
        yield
    finally:
        active.pop()


class RerunRequested(Exception):
    """The step's verdict is to be checked: compute the step again."""


def rng_states() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The CPU's and every initialised CUDA device's generator state (host tensors; no host sync)."""
    initialised = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    cuda = torch.cuda.get_rng_state_all() if initialised else []
    return torch.get_rng_state(), cuda


def set_rng_states(states: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


class ClosureRerun:
    """What the stand-in closure of ``optimizer.step(closure)`` does when the guard asks for a second computation.

    The second computation must be the whole step again: an accumulating loop runs ``backward()`` on its earlier
    micro-batches before ``step(closure)`` and the last one inside the closure, so the gradients (and the loss
    roots) the closure adds to are put back as they were before it first ran. What that costs: nothing for a
    gradient that was None before the closure, or that the closure clears or zeroes before its backward; a copy for
    each one its backward adds into (the earlier micro-batches' sum, one gradient's worth of memory in all, held
    from that backward until the step's verdict), and a tensor hook, registered and removed, for each parameter whose
    gradient was not None when the closure began.
    """

    def __init__(self, params: Callable[[], Iterable[torch.Tensor]]) -> None:
        self.params = params
        self.states: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self.loss_watch: LossWatch | None = None
        """The guard's loss watch (told at the verdict): its roots before the closure go back with the gradients."""
        self._kept: dict[int, torch.Tensor] = {}
        """``id(param)`` -> a copy of the gradient the closure's backward added into (the earlier micro-batches')."""
        self._left: set[int] = set()
        """Gradients the closure reset before its backward (zeroed in place, or replaced): it resets them again."""
        self._pending: dict[int, tuple[torch.Tensor, weakref.ReferenceType[torch.Tensor], int]] = {}
        """``id(param)`` -> ``(param, its gradient before the closure, that gradient's version)``, not yet decided.
        Weakly: a closure that clears its gradients (``zero_grad()``) frees them then, as without the guard."""
        self._handles: list[RemovableHandle] = []
        self._losses: list[tuple[LossWatch, torch.Tensor | None, str | None]] = []
        self._settled = True

    def first(self, closure: Callable[[], Any], treat: Callable[[], None]) -> Any:
        """Keep the generators' states and what the step had before the closure, then run it and treat the step (a
        boundary inside the closure may ask for a re-run; ``RerunRequested`` goes to the caller, which calls
        ``again``)."""
        self.states = rng_states()
        self._watch()
        again = False
        try:
            with _inside(self):
                loss = closure()
                self.settle()  # before the treat, which may change the gradients in place
                treat()
        except RerunRequested:
            again = True
            raise
        finally:
            if not again:
                self._drop()
        return loss

    def again(self, closure: Callable[[], Any], treat: Callable[[], None]) -> Any:
        """Put the generators and the step's state before the closure back, and compute the step again."""
        assert self.states is not None
        self.settle()
        set_rng_states(self.states)
        left = self._left
        for param in _unique(self.params()):
            key = id(param)
            if key not in left:
                param.grad = self._kept.pop(key, None)  # the copy itself: no second copy
        self._put_back_loss()
        self._drop()
        with _inside(self):
            loss = closure()
            treat()
        return loss

    def settled(self) -> bool:
        """Whether what a second computation starts from is decided (before anything treated the step)."""
        return self._settled and self.states is not None

    def settle(self) -> None:
        """Decide, for every gradient not decided yet, what a second computation starts from (once, before the
        step is treated); the hooks go."""
        if self._settled:
            return
        self._settled = True
        for handle in self._handles:
            handle.remove()
        self._handles = []
        pending, self._pending = self._pending, {}
        for key, (param, grad, version) in pending.items():
            self._decide(key, param, grad, version)

    def _watch(self) -> None:
        self._settled = False
        self._losses = _loss_roots()
        for param in _unique(self.params()):
            grad = param.grad
            if grad is None:
                continue  # nothing to keep: a second computation starts it from None, as the first did
            key = id(param)
            if type(grad) is not torch.Tensor:
                # A DTensor's (FSDP2) hooks do not fire: its gradient is copied now, whatever the closure does.
                with torch.no_grad():
                    self._kept[key] = grad.clone()
                continue
            self._pending[key] = (param, weakref.ref(grad), grad._version)
            if param.requires_grad:
                self._handles.append(param.register_hook(self._arrives(key)))  # type: ignore[no-untyped-call]

    def _arrives(self, key: int) -> Callable[[torch.Tensor], None]:
        def hook(incoming: torch.Tensor) -> None:
            entry = self._pending.pop(key, None)  # its first gradient of the closure's backward, before it is added
            if entry is not None:
                self._decide(key, *entry)

        return hook

    def _decide(self, key: int, param: torch.Tensor, grad: weakref.ReferenceType[torch.Tensor], version: int) -> None:
        now = param.grad
        if now is None:
            return  # the closure cleared it (zero_grad()): a second computation starts from None
        if now is grad() and now._version == version:
            with torch.no_grad():
                self._kept[key] = now.clone()  # what the earlier micro-batches left, about to be added into
        else:
            self._left.add(key)  # zeroed in place or replaced by the closure, which does it again

    def _put_back_loss(self) -> None:
        watch = self.loss_watch
        for known, root, unseen in self._losses:
            if known is watch:
                known.discard()  # the first computation's roots were taken by its read; this is what came before
                if root is not None:
                    known.saw(root)
                if unseen is not None:
                    known.saw(None, unseen)

    def _drop(self) -> None:
        self.settle()
        self._kept, self._left, self._losses = {}, set(), []


def _unique(params: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    seen: set[int] = set()
    for param in params:
        if id(param) not in seen:
            seen.add(id(param))
            yield param


def _loss_roots() -> list[tuple[LossWatch, torch.Tensor | None, str | None]]:
    """Every live guard's loss roots so far (an accumulating loop's earlier micro-batches'), to put back the owner's.

    ``LossWatch`` adds each root into a new tensor, so the one held here stays what came before the closure."""
    from gradguard.enforce.hooks import torch_hooks  # imported here: torch_hooks imports the loss module this one does

    found: list[tuple[LossWatch, torch.Tensor | None, str | None]] = []
    for guard in torch_hooks._live():
        watch = guard._loss_watch()
        if watch is not None:
            with watch._lock:
                found.append((watch, watch._sum, watch._unseen))
    return found


class Reruns:
    """One guard's re-runs: the first computation's figures while its second runs, and the notes said once."""

    def __init__(self) -> None:
        self.first: Figures | None = None
        self.step: int | None = None
        """The step being computed again (the engine counts the second computation as that step)."""
        self.asked: str | None = None
        self.noted = False
        """A ``rerun_unavailable`` was said."""
        self.origin_ranks: dict[int, str] = {}  # where the first computation's fault was made ({rank: host})
        self._said: set[str] = set()
        """The reasons a ``rerun_unavailable`` gave: each is said once."""

    @staticmethod
    def trigger(config: Rerun | None, outcome: StepOutcome, loss_verdict: Any) -> str | None:
        """Which of the section's ``on`` verdicts the step has, or None."""
        if config is None:
            return None
        if "nonfinite" in config.on and (outcome.halted_by or outcome.skipped_by):
            return "nonfinite"
        if "spike" in config.on and outcome.spikes:
            return "spike"
        if "loss" in config.on and loss_verdict is not None and loss_verdict.action != "ignore":
            return "loss"
        return None

    def settle(
        self, policy: Policy, loss_watch: LossWatch, events: EventLog, work: StepWork, context: StepContext
    ) -> None:
        """Before the engine's ``rerun_or_compare``: a suspect step that cannot be computed again whole is said so
        (``rerun_unavailable``, once per reason), marked not rerunnable, and its halt will say it was not computed
        again; one that can tells its closure whose loss roots to put back."""
        outcome = work.outcome
        config = policy.rerun
        if config is None or outcome.scaler_found_inf or (self.first is not None and self.step == work.step):
            return  # no section, the scaler's skip, or the second computation itself
        asked = self.trigger(config, outcome, loss_watch.peek(policy.loss, outcome.loss))
        if asked is None:
            return
        current = current_closure()
        if context.rerunnable and current is not None and current.settled():
            current.loss_watch = loss_watch
            return
        if current is None:
            why = NO_CLOSURE
        elif context.rerunnable:
            why = "the guard was asked to treat the step before it could keep what the closure adds to"
        else:
            why = (
                "the guard treated the step at the loop's own gradient clip inside the closure, from where it cannot "
                "compute the step again (treat it at the optimizer's step: no clip in the closure, or guard.step() "
                "before the clip)"
            )
        context.rerunnable = False  # the engine keeps the verdict
        outcome.note = f"not computed again (rerun section: {why})"
        self.noted = True  # the engine's own note (no closure) is this one
        if why not in self._said:
            self._said.add(why)
            said = f"{why}; the verdict ({asked}) stands"
            events.emit("warning", "rerun_unavailable", step=work.step, why=said)

    def request(self, step: int, asked: str, first: Figures) -> None:
        self.first, self.step, self.asked = first, step, asked
        raise RerunRequested

    def compare(
        self, config: Rerun, second: Figures, collective: Collective | None, device: torch.device
    ) -> Comparison:
        """The two computations of the step, agreed over the ranks (``rerun_figures.compared``); the re-run is over."""
        first = self.first
        assert first is not None
        self.first, self.step = None, None
        return compared(config, first, second, collective, device)
