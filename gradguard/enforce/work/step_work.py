"""What one pass of the step engine works with: its context, its figures and the one host sync.

Actions queue the device figures they want read into ``Pending`` with a reader that records
what they did into ``StepOutcome``; the engine reads everything back in one transfer.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch

from gradguard.enforce.distributed.collective import Collective, combine_shard_norms
from gradguard.enforce.distributed.local import RankSlots
from gradguard.enforce.distributed.placements import Reduced
from gradguard.enforce.work.context import StepContext, StepPlan
from gradguard.enforce.work.places import Place, weights_at
from gradguard.enforce.work.statistics import Statistics, StepStatistics
from gradguard.enforce.work.tensors import device_constant, norms, stack_on, without_grad
from gradguard.enforce.work.writes import DeferredWrites
from gradguard.policy.matching import Binding
from gradguard.policy.schema import ClipNorm, Monitor

__all__ = [
    "Carried",
    "Carry",
    "Observation",
    "Pending",
    "Spike",
    "StepContext",
    "StepOutcome",
    "StepPlan",
    "StepWork",
]


def _read_rank_slots(slots: RankSlots, collective: Collective, outcome: StepOutcome, values: Sequence[float]) -> None:
    """The summed slots, read (``RankSlots.read``): the ranks where a fault was made, every rank's norm."""
    faulty, rank_norms = slots.read(values)
    outcome.ranks = collective.named(faulty)
    if rank_norms is not None:
        members = collective.members or list(range(len(rank_norms)))
        outcome.rank_norms = dict(zip(members, rank_norms, strict=False))


@dataclass
class Pending:
    """Device tensors to read back in the step's one sync, and how to interpret them."""

    parts: list[torch.Tensor] = field(default_factory=list)
    readers: list[Callable[[list[float]], None]] = field(default_factory=list)
    _spans: list[int] = field(default_factory=list)
    """How many of ``parts`` each reader reads; ``-1 - i``: part ``i`` again (a tensor added before, read once)."""
    raw_stack: tuple[list[torch.Tensor], torch.Tensor] | None = None
    """The raw norms and their stack, so a clip over exactly those norms does not stack them again."""
    quiet: list[torch.Tensor] | None = None
    """Where the read waits for a fused optimizer's update (``fused_update``): device booleans, all true exactly when
    no reader will have anything to do before the update (no non-finite value, no change to make). None: not asked."""

    def quiet_if(self, condition: Callable[[], torch.Tensor]) -> None:
        """The readers queued so far have nothing to do before the update if every element of ``condition()`` is true
        (computed only where asked for): anything else is an alarm."""
        if self.quiet is not None:
            self.quiet.append(condition().reshape(-1))

    def flag(self, reader: Callable[[list[float]], None]) -> torch.Tensor | None:
        """The alarm as one float32 0-dim flag (1.0: some condition is false), read with the rest (by ``reader``); a
        fused kernel's ``found_inf``. None: no condition was given, so no reader will act before the update."""
        quiet = self.quiet or []
        if not quiet:
            return None
        device = quiet[0].device
        joined = torch.cat([condition.to(device) for condition in quiet]) if len(quiet) > 1 else quiet[0]
        flag = torch.rsub(joined.float().amin(), 1.0)  # four launches, however many conditions and tensors
        self.add(flag, reader)
        return flag

    def stack(self, norms: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """``stack_on(norms, device)``, reusing the raw norms' stack when ``norms`` are those tensors."""
        memo = self.raw_stack
        if memo is not None and len(memo[0]) == len(norms) and all(map(operator.is_, memo[0], norms)):
            return memo[1]
        return stack_on(norms, device)

    def add(self, values: torch.Tensor, reader: Callable[[list[float]], None], *more: torch.Tensor) -> None:
        """Read ``values`` (and ``more``, after them: no ``cat`` of its own) in the sync; ``reader`` gets them as
        one flat list."""
        parts = self.parts
        if not more:  # the very tensor a reader before asked for (zclip's norms are the raw norms' stack): read once
            for index, part in enumerate(parts):
                if part is values:
                    self.readers.append(reader)
                    self._spans.append(-1 - index)
                    return
        for tensor in (values, *more):
            parts.append(tensor if tensor.dim() == 1 else tensor.reshape(-1))  # a reshape is a dispatch even as a no-op
        self.readers.append(reader)
        self._spans.append(1 + len(more))

    def sync(self) -> None:
        """The one read (run under ``no_grad``, as the engine is: no part needs detaching)."""
        parts, readers, spans = self.parts, self.readers, self._spans
        if not parts:
            return
        # Let go of the parts and readers before reading: a reader's closure holds the step's work (and so every
        # gradient), and a cycle through it would keep them alive until the garbage collector runs, past the next
        # backward (a gradient's worth of memory at the step's peak).
        self.parts, self.readers, self._spans = [], [], []
        device = parts[0].device
        if len(parts) == 1:
            host = parts[0].to("cpu").tolist()  # one copy without a cat (a kernel of its own on a GPU)
        elif set(map(operator.attrgetter("device"), parts)) == {device}:  # map and a set: no generator step per part
            # Joined on the device first: one device-to-host copy, so one sync (a copy per part would
            # be a sync each on a GPU). cat promotes to the widest part's type exactly, and tolist gives every
            # float as a Python float exactly: no conversion to float64 on the device (a pass of its own).
            host = torch.cat(parts).to("cpu").tolist()
        else:
            host = torch.cat([part.to("cpu", torch.float64) for part in parts]).tolist()
        offset, first = 0, 0
        starts = list(accumulate(map(torch.Tensor.numel, parts), initial=0)) if min(spans) < 0 else []
        for reader, span in zip(readers, spans, strict=True):
            if span < 0:  # a part read again
                reader(host[starts[-1 - span] : starts[-span]])
                continue
            size = parts[first].numel() if span == 1 else sum(part.numel() for part in parts[first : first + span])
            reader(host[offset : offset + size])
            offset += size
            first += span


@dataclass
class Observation:
    """What one ``monitor`` read of the gradients as they arrived, on one step (host floats)."""

    rule: str
    action: Monitor
    scope: str
    names: list[str]
    """Parameter names (tensor), module names (module) or the rule's name (group), in figure order."""
    figures: dict[str, list[float]]
    """Stat -> one value per name, for the stats the monitor logs."""
    norms: list[float] | None
    """The 2-norm per name, for the vanishing/exploding thresholds (None without thresholds)."""


@dataclass
class Spike:
    """A ``skip_step_on_spike`` verdict: a norm far above the recent ones (host floats)."""

    rule_index: int
    params: list[str]
    """The parameter (tensor scope) or every parameter of the rule (group scope) whose norm spiked."""
    norm: float
    mean: float
    std: float
    z: float
    """``(norm - mean) / std``: how many standard deviations above the mean."""
    samples: int
    """How many recent norms the mean and standard deviation were taken over."""
    z_thresh: float


@dataclass
class StepOutcome:
    nonfinite: dict[int, tuple[str, int]] = field(default_factory=dict)
    """Tensor index -> (kind, rule index to report it under)."""
    halted_by: dict[int, int] = field(default_factory=dict)
    """Tensor index -> halt rule index, for non-finite tensors an active halt rule covers."""
    skipped_by: dict[int, int] = field(default_factory=dict)
    """Tensor index -> skip rule index, for non-finite tensors an active skip rule (and no halt rule) covers."""
    scaler_found_inf: bool = False
    """GradScaler (fused optimizer path) found inf/NaN: the optimizer skips this step itself."""
    loss_scale: float | None = None
    """The smallest loss scale of the GradScaler(s) whose flags were read, where known."""
    counts: list[tuple[str, str, int]] = field(default_factory=list)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    observed: list[Observation] = field(default_factory=list)
    """The monitors' figures of the gradients as they arrived (before any action)."""
    spikes: list[Spike] = field(default_factory=list)
    """``skip_step_on_spike`` verdicts: the step is skipped if there is any (and nothing halts)."""
    origin: dict[str, Any] | None = None
    """Where the step's NaN/Inf started (``gradguard.enforce.provenance.provenance``), when it was traced."""
    clipped_before: str | None = None
    """``StepContext.clipped_before``: a clip that ran over these gradients before the guard's step."""
    loss: float | None = None
    """The step's loss, where the policy watches it and the guard saw it (the mean over ranks)."""
    loss_skip: bool = False
    """The ``loss`` section skips this step."""
    note: str | None = None
    """Said with a halt of this step (a re-run found the fault reproducible)."""
    ranks: dict[int, str] = field(default_factory=dict)
    """The ranks whose own gradients, before the reduction, were non-finite: {global rank: host} (``RankSlots``); where
    none were, ``ranks_after`` (the ranks participant puts them here)."""
    ranks_after: dict[int, str] = field(default_factory=dict)
    """Replicas only: the ranks whose reduced gradients were non-finite where the others' were not, so made after the
    reduction on those ranks (``watch_raw_norms``); empty where every rank's or none was."""
    rank_norms: dict[int, float] | None = None
    """Every rank's own gradient 2-norm before the reduction, where the policy's ``ranks.outlier_factor`` asks."""

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
class Carried:
    """Figures a step can only compute after its read (a group clip over changes held for it,
    ``clipping.clip_group_after_read``): read with the next step's read, or at close, and reported then under
    their own step. Only an applied step's are kept (a skipped or halted step's interventions did not happen)."""

    outcome: StepOutcome = field(default_factory=StepOutcome)
    parts: list[tuple[torch.Tensor, Callable[[list[float]], None], tuple[torch.Tensor, ...]]] = field(
        default_factory=list
    )


class Carry:
    """The applied steps' ``Carried`` figures, waiting for a read."""

    def __init__(self) -> None:
        self._waiting: list[Carried] = []

    def keep(self, carried: Carried) -> None:
        if carried.parts:
            self._waiting.append(carried)

    def ride(self, pending: Pending) -> list[StepOutcome]:
        """Queue every waiting figure in ``pending``; what they say is in the outcomes returned once it is read."""
        waiting, self._waiting = self._waiting, []
        for carried in waiting:
            for values, reader, more in carried.parts:
                pending.add(values, reader, *more)
        return [carried.outcome for carried in waiting]

    @without_grad
    def flush(self) -> list[StepOutcome]:
        """Read every waiting figure now (at detach: no step's read is coming)."""
        pending = Pending()
        outcomes = self.ride(pending)
        pending.sync()
        return outcomes


@dataclass
class StepWork:
    """Everything an action needs from the step it acts in (one per enforcement pass)."""

    binding: Binding
    names: dict[int, str]
    """Tensor index -> first name."""
    grads: dict[int, torch.Tensor]
    """Tensor index -> its (local) gradient, for the tensors treated in this pass."""
    step: int
    pending: Pending
    outcome: StepOutcome
    collective: Collective | None
    """The process group ranks agree over, when one is active."""
    sharded: bool
    """Some gradient is an FSDP2 shard: per-tensor norms must be combined across ranks."""
    wrapped: dict[int, torch.Tensor] = field(default_factory=dict)
    """Tensor index -> the DTensor its local gradient came from (FSDP2)."""
    fragile: frozenset[int] = frozenset()
    """``Plan.fragile``: watched tensors an action may make finite."""
    raw: dict[int, torch.Tensor] = field(default_factory=dict)
    """Tensor index -> 2-norm of its gradient as it arrived, where some action asked for it."""
    touched: set[int] = field(default_factory=set)
    """Tensors an earlier action of this pass changed on the device (their raw norms are stale); a change held for
    the read (``held``) is not one yet."""
    raw_peaks: dict[int, torch.Tensor] = field(default_factory=dict)
    """Tensor index -> max-abs of its gradient as it arrived, where the non-finite watch took it (fragile tensors)."""
    raw_versions: dict[int, int] = field(default_factory=dict)
    """Tensor index -> its gradient's version when the raw 2-norm was taken (unsharded steps)."""
    raw_host: dict[int, float] = field(default_factory=dict)
    """Tensor index -> the raw 2-norm's value, once the step's read is done (unsharded steps)."""
    final: frozenset[int] = frozenset()
    """The tensors of the running action whose last change in this step it makes: it may defer it to ``writes``."""
    held: frozenset[int] = frozenset()
    """The tensors of the running action whose one later change is a group clip that is their last
    (``Plan.held_ids``): its change to them waits for the read too, and the group clip checks after it."""
    writes: DeferredWrites = field(default_factory=DeferredWrites)
    """Changes made after the step's one read, where it showed they are needed."""
    statistics: Statistics | None = None
    """The adaptive actions' statistics across steps (read here; changed only through ``statistics_step``)."""
    statistics_step: StepStatistics = field(default_factory=StepStatistics)
    """What this step proposes the statistics become; the engine commits it if the step is applied."""
    carried: Carried = field(default_factory=Carried)
    """Figures to read with the next step's read."""
    sampled: bool = False
    """A ``monitor`` sampled this step (its figures of the gradients as they arrived are queued)."""
    slots: RankSlots | None = None
    """Where each rank's own-gradient flag (and norm) rides the step's collective, where the ranks' own gradients
    are seen (``Collective.local``); None in one process."""
    rank_payload: torch.Tensor | None = None
    """This rank's slots, to ride the step's first SUM all-reduce; None once sent (``take_rank_payload``)."""
    places: dict[int, Place] = field(default_factory=dict)
    """``StepContext.places``: where each piece lies in its parameter (DeepSpeed ZeRO); empty elsewhere."""
    pipeline: Collective | None = None
    """Under pipeline parallel, the collective over the stages: a group clip's norm is the whole model's."""
    shares: dict[int, float] | None = None
    """Tensor index -> its local piece's weight in a sum over the ranks, where some pieces are replicas (tensor
    parallel's Replicate placements, plain tensors beside DTensors: ``distributed.placements``); None: every piece
    counts once (one rank, DDP's replicas are not summed, FSDP2 alone)."""
    reduced: Reduced | None = None
    """The Partial gradients (tensor parallel's) whose reduced copies ``grads`` and ``wrapped`` hold instead."""

    @classmethod
    def begin(
        cls,
        binding: Binding,
        names: dict[int, str],
        fragile: frozenset[int],
        grads: dict[int, torch.Tensor],
        wrapped: dict[int, torch.Tensor],
        step: int,
        collective: Collective,
        context: StepContext,
    ) -> StepWork:
        """A step's work on ``grads`` (``wrapped``: those that came from DTensors, FSDP2's)."""
        active = collective if collective.active() else None
        sharded = active is not None and (bool(wrapped) or context.pieces)  # per-tensor figures combined over ranks
        work = cls(binding, names, grads, step, Pending(), StepOutcome(), active, sharded, wrapped, fragile)
        if sharded and wrapped and active is not None:
            work.shares = active.shares.shares(grads, wrapped, len(active.members) or active.size())
        work.outcome.clipped_before = context.clipped_before
        work.pipeline = collective.pipeline
        work.places = context.places
        collective.step = step  # for a failure's words: a pipeline stage of one rank is not ``active`` but has peers
        if collective.pipeline is not None:
            collective.pipeline.step = step
        if active is not None and active.local.seen is not None:
            device = next(iter(grads.values())).device
            ranks = binding.policy.ranks
            work.slots = active.slots(norms=ranks is not None and ranks.outlier_factor is not None)
            work.rank_payload = work.slots.payload(active.local.take(device), device)
        return work

    def take_rank_payload(self) -> tuple[tuple[torch.Tensor, ...], Callable[[Sequence[float]], None] | None]:
        """This rank's slots, once, for the first SUM all-reduce of the step to carry, and the reader of their sums
        (``(), None``: none, or sent). The reader holds the outcome, not the work (a cycle through the pending read
        would keep the step's gradients alive)."""
        payload, self.rank_payload = self.rank_payload, None
        if payload is None or self.slots is None or self.collective is None:
            return (), None
        return (payload,), functools.partial(_read_rank_slots, self.slots, self.collective, self.outcome)

    @property
    def after_read(self) -> frozenset[int]:
        """The tensors of the running action whose change may wait for the step's read: ``final`` and ``held``."""
        return self.final | self.held if self.held else self.final

    def norms(self, grads: Sequence[torch.Tensor], norm_type: float, ids: Sequence[int]) -> list[torch.Tensor]:
        """Per-tensor norms; under FSDP2 and tensor parallel, of the full tensors (one collective), not of this rank's
        pieces (``ids``: the tensors' indices, for their shares where some pieces are replicas)."""
        local = norms(grads, norm_type)
        if not self.sharded or self.collective is None:
            return local
        shares = self.share_weights(ids, local[0].device) if local else None
        return combine_shard_norms(self.collective, local, norm_type, shares)

    def share_weights(self, ids: Sequence[int], device: torch.device, repeat: int = 1) -> torch.Tensor | None:
        """The shares of ``ids`` (``repeat`` times over) as a float32 device vector made once and reused
        (``device_constant``), or None where every piece counts once."""
        shares = self.shares
        if shares is None:
            return None
        return device_constant(tuple(shares[i] for i in ids) * repeat, torch.float32, device)

    def weights(self, ids: Sequence[int]) -> list[torch.Tensor]:
        """The parameters of ``ids`` where their gradients are (FSDP2's shards, DeepSpeed's pieces at ``places``), for
        the actions that read weights (``agc``, ``grad_to_weight``): taken when asked, so only those actions pay."""
        return weights_at(self.binding.params, self.places, ids)
