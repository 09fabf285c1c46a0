"""Who takes part in the step: the registry of participants, and the ones a guard has.

A participant (``enforce.work.participant.Participant``) is registered once, by name, with a factory that builds it
from the guard's parts (``Parts``) and its policy, or returns None where the policy has no use for it; the order of
registration is the order in which the pipeline calls them at each stage. A guard builds its participants at attach
and again when a reload binds a new policy. A new participant is a new module with one call to ``register``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gradguard.enforce.actions.adaptive import StatisticsTakingPart
from gradguard.enforce.actions.nonfinite import SkipLimits
from gradguard.enforce.hooks.scaler import ScalerFlags
from gradguard.enforce.recovery.participant import AppliedCount, RecoveryTakingPart
from gradguard.enforce.recovery.recovery import Recovery
from gradguard.enforce.step.fused_update import FusedUpdate
from gradguard.enforce.step.known_norms import KnownNorms
from gradguard.enforce.step.summary import CounterSummary
from gradguard.enforce.triggers.health import Health
from gradguard.enforce.triggers.loss import LossVerdict, LossWatch
from gradguard.enforce.triggers.participants import HealthTakingPart, LossTakingPart, RerunTakingPart
from gradguard.enforce.triggers.rerun import Reruns
from gradguard.enforce.work.participant import STAGES, Participant
from gradguard.enforce.work.statistics import Statistics
from gradguard.enforce.work.step_work import StepContext, StepWork
from gradguard.events.counters import Counters
from gradguard.events.log import EventLog

if TYPE_CHECKING:
    from gradguard.policy.document import Policy

__all__ = ["Factory", "Participants", "Parts", "register", "registered", "unregister"]


@dataclass(frozen=True)
class Parts:
    """What a guard's participants are built from: its policy as it is now, its log and counters, and the state it
    keeps across steps."""

    policy: Callable[[], Policy]
    counters: Counters
    events: EventLog
    recovery: Recovery
    skip_limits: SkipLimits
    statistics: Statistics
    loss_watch: LossWatch
    reruns: Reruns
    health: Health
    known_norms: KnownNorms
    fused: FusedUpdate
    judge_loss: Callable[[LossVerdict, int], bool]
    """``Verdicts.loss``: the loss section's verdict counted, logged, and a halt or a skip made."""
    scaler_skip: Callable[[StepWork, StepContext], bool]
    """The guard's record of a step its GradScaler found inf in (the scaler skips it itself)."""
    summary: CounterSummary
    stages: Participant | None = None
    """Under pipeline parallel, the stages' one verdict (``step.stages``)."""


Factory = Callable[[Parts], Participant | None]
_REGISTERED: dict[str, Factory] = {}


def register(name: str, factory: Factory) -> None:
    """Take part in every guard attached from now on (and in a guard attached before, from its next reload), after
    the participants registered before; ``unregister`` takes it out of a guard at its next reload."""
    if name in _REGISTERED:
        raise ValueError(f"a participant named {name!r} is already registered; unregister it first")
    _REGISTERED[name] = factory


def unregister(name: str) -> None:
    _REGISTERED.pop(name, None)


@contextmanager
def registered(name: str, factory: Factory) -> Iterator[None]:
    """``register`` for the guards attached inside the ``with`` block."""
    register(name, factory)
    try:
        yield
    finally:
        unregister(name)


class Participants:
    """A guard's participants, by stage: at each stage only those that take part in it, in registration order."""

    def __init__(self, parts: Parts) -> None:
        self._parts = parts
        self._given: dict[str, Participant | None] = {}
        self.at: dict[str, tuple[Participant, ...]] = {}
        """Stage -> the participants that take part in it, in order (read without a call: it runs at every stage)."""
        self.per_micro_batch = False
        """The per-micro-batch hooks take part: tensor-scope actions then run in hooks, not in the step."""
        self.rebuild()

    def rebuild(self) -> None:
        """Build them again from the policy as it is now (at attach, and after a reload)."""
        self._built = {name: factory(self._parts) for name, factory in _REGISTERED.items() if name not in self._given}
        self._index()

    def give(self, name: str, participant: Participant | None) -> None:
        """Put the guard's own ``participant`` in ``name``'s place (the provenance trace, the per-micro-batch hooks,
        made at attach from the guard's arguments); None takes it out."""
        self._given[name] = participant
        self._index()

    def _index(self) -> None:
        chosen = [self._given[name] if name in self._given else self._built.get(name) for name in _REGISTERED]
        present = [participant for participant in chosen if participant is not None]
        stages = {participant: participant.stages() for participant in present}
        self.at = {stage: tuple(p for p in present if stage in stages[p]) for stage in STAGES}
        self.per_micro_batch = self._given.get("micro_batch") is not None


# The guard's own participants, in the order the step meets them at each stage. The order is part of the behaviour:
# the fused read-after first (its quiet conditions from the step's first figure on), the GradScaler's flags before
# every other figure and its final ruling before the loss's, recovery's ``opens`` before any later one (a window
# declines the step there, and the ``opens`` after it are not asked), the provenance trace last among the device work.
register("fused_update", lambda parts: parts.fused)
register("stages", lambda parts: parts.stages)  # under a pipeline (``step.stages``): its ruling first
register("scaler", lambda parts: ScalerFlags(parts.scaler_skip))
register("micro_batch", lambda parts: None)  # given by the guard in per-micro-batch mode
register("skip_limits", lambda parts: parts.skip_limits)
register("statistics", lambda parts: StatisticsTakingPart(parts.statistics))
register("known_norms", lambda parts: parts.known_norms)
register(
    "recovery",
    lambda parts: (
        AppliedCount(parts.recovery)
        if parts.policy().recovery is None
        else RecoveryTakingPart(parts.recovery, parts.policy)
    ),
)
register("loss", lambda parts: LossTakingPart(parts.loss_watch, parts.policy, parts.events, parts.judge_loss))
register("provenance", lambda parts: None)  # given by the guard: GradGuard(provenance=...)
register("ranks", lambda parts: None)  # given by the guard under torch.distributed (``step.ranks``)
register(
    "rerun",
    lambda parts: (
        None
        if parts.policy().rerun is None
        else RerunTakingPart(parts.reruns, parts.loss_watch, parts.policy, parts.events, parts.counters)
    ),
)
register("health", lambda parts: HealthTakingPart(parts.health))
register("summary", lambda parts: parts.summary)
