"""The ranks watched against each other: where a fault was made, a rank far off the others, replicas that drift.

- **Where a fault was made** (no option): each rank's own gradient, before the reduction, is noted by the engine's
  tap (``distributed.taps``) and its flag rides the step's one collective (``RankSlots``); the step's outcome then
  names the ranks (``StepOutcome.ranks``), and a rank that only received the fault through the reduction says so in
  its origin (phase ``received``), whatever the ``provenance`` setting.
- **Outliers** (``ranks.outlier_factor``): every rank's own gradient norm rides the same collective; a rank above
  the factor times the median of the ranks' is named (``rank_outlier``) and warned of, skipped or halted on.
- **Replicas that drift** (``ranks.check_replicas_every``): every N steps, before the update, each rank takes a
  bitwise fingerprint of every parameter on the device (two integer sums of its bits: exact, so the same on every
  rank for the same bits, whatever the reduction order), the ranks compare them in one MAX all-reduce riding the
  step's read, and only where they differ (every rank sees the same) gather them to name the replicas outside the
  majority and the parameters that differ (``replica_divergence``).
"""

from __future__ import annotations

import math
import statistics
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradguard.enforce.distributed.collective import Collective, is_sharded
from gradguard.enforce.distributed.taps import tap_local_gradients
from gradguard.enforce.recovery.decisions import HaltReport, ranks_field
from gradguard.enforce.step.engine import Enforcer
from gradguard.enforce.step.verdicts import Verdicts
from gradguard.enforce.work.participant import Participant, Ruling
from gradguard.enforce.work.step_work import StepContext, StepWork
from gradguard.errors import GuardStateError, GuardWarning, ranks_words
from gradguard.events.counters import RANKS_RULE, Counters
from gradguard.events.log import EventLog
from gradguard.policy.document import Policy
from gradguard.policy.matching import canonical_name

__all__ = [
    "RANKS_RULE",
    "RanksTakingPart",
    "fingerprints",
    "model_parameters",
    "ranks_at_attach",
    "received_origin",
    "refuse_sharded_replicas",
    "watch_ranks",
]


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprints(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(len(params), 2)`` int64: per parameter, the wrapping sum of its elements' bits read as integers, and of those
    bits mixed with themselves shifted (so two changes that cancel in one sum do not in both). Integer sums are exact
    in any order: the same bits give the same fingerprint on every rank and device. One ulp changes both."""
    rows = []
    for param in params:
        flat = param.detach().reshape(-1)
        bits = flat.view(_INT_OF_SIZE[flat.element_size()])
        shift = 4 * flat.element_size()
        mixed = bits ^ (bits >> shift)
        rows.append(torch.stack([bits.sum(dtype=torch.int64), mixed.sum(dtype=torch.int64)]))
    return torch.stack(rows)


def received_origin(rank: int, ranks: dict[int, str], kind: str | None, after: bool = False) -> dict[str, Any]:
    """The origin on a rank whose own gradient was finite: the fault came in through the reduction (``after``: it was
    made after the reduction on ``ranks``, and only the step's verdict came in; this rank's gradients are finite)."""
    how = "after the reduction; every rank stops together" if after else "and the reduction carried it in"
    origin = {
        "phase": "received",
        "module": None,
        "kind": kind,
        "input_nonfinite": False,
        "rank": rank,
        "note": f"not made on this rank: {ranks_words(ranks)} made it {how}",
    }
    return origin | {"after_reduction": True} if after else origin


def ranks_at_attach(collective: Collective, policy: Policy) -> dict[str, Any]:
    """The attach event's ``ranks``: how many, where each rank's own gradient is seen (or why not), the section."""
    local = collective.local
    section = policy.ranks.model_dump(mode="json") if policy.ranks is not None else {}
    return {"world": len(collective.members) or None, "seen": local.seen, "unseen": local.unseen} | section


class RanksTakingPart(Participant):
    """The policy's ``ranks`` section, and the origin a rank that received a fault gives."""

    def __init__(
        self,
        collective: Collective,
        policy: Callable[[], Policy],
        parameters: Callable[[], list[tuple[str, torch.Tensor]]],
        verdicts: Verdicts,
        events: EventLog,
        counters: Counters,
    ) -> None:
        self.collective = collective
        self._policy = policy
        self._parameters = parameters
        self.verdicts = verdicts
        self.events = events
        self.counters = counters
        self._checked: tuple[list[str], torch.Tensor] | None = None
        self._agreed = True
        self._diverged: tuple[dict[int, str], list[str]] | None = None
        self._outliers: dict[int, str] = {}
        self._outlier_words = ""
        """The last outliers' norms against the others' median, in words (a halt's reason)."""
        self._divergence_words = ""
        """The last divergence's extent, in words (a halt's reason)."""

    def release(self) -> None:
        self.collective.local.close()  # the engine keeps its tap (DDP's hook stays): it must not grow a list for ever

    def passed(self, context: StepContext) -> None:
        self.collective.local.forget()  # a step skipped unread (a rewind's window): its gradients are not this step's

    def beside_actions(self, work: StepWork) -> None:
        ranks = self._policy().ranks
        if ranks is None or work.collective is None:
            return
        payload, read_slots = work.take_rank_payload()
        if read_slots is not None and ranks.outlier_factor is not None:  # no non-finite watch carried them
            summed = work.collective.sum_(payload[0])
            work.pending.add(summed, read_slots)
        if ranks.check_replicas_every is not None and work.step % ranks.check_replicas_every == 0:
            self._queue_check(work)

    def _queue_check(self, work: StepWork) -> None:
        named = self._parameters()
        if any(is_sharded(param) for _, param in named):
            return  # refused at attach; a reload cannot shard
        device = named[0][1].device
        mine = fingerprints([param for _, param in named]).to(device)
        both = self.collective.max_(torch.cat([mine, ~mine]))  # the participant's group is the step's
        count = len(named)
        agree = torch.eq(both[:count], ~both[count:]).all().float().reshape(1)
        self._checked, self._agreed = ([name for name, _ in named], mine), True

        def read(values: list[float]) -> None:
            self._agreed = values[0] == 1.0

        work.pending.add(agree, read)

    def after_read(self, work: StepWork, context: StepContext) -> None:
        outcome, collective = work.outcome, self.collective
        after = bool(outcome.nonfinite) and not outcome.ranks and bool(outcome.ranks_after)
        if after:  # no rank's own gradient was non-finite; some ranks' reduced gradients were, not all: made there
            outcome.ranks = outcome.ranks_after
        if outcome.nonfinite and outcome.ranks and collective.rank not in outcome.ranks:
            kinds = {kind for kind, _ in outcome.nonfinite.values()}
            kind = kinds.pop() if len(kinds) == 1 else None
            outcome.origin = received_origin(collective.rank, outcome.ranks, kind, after)
        elif after and outcome.origin is not None:  # this rank made it: its own account, said to be after the reduction
            outcome.origin = outcome.origin | {"after_reduction": True, "rank": collective.rank}
        elif outcome.nonfinite and not outcome.ranks and outcome.origin is not None and collective.local.unseen:
            # No rank's own gradient was seen: this rank's account is of the reduced gradient, which may be another's.
            outcome.origin = outcome.origin | {"unseen": collective.local.unseen}
        self._outliers = self._find_outliers(work) if outcome.rank_norms is not None else {}
        self._diverged = None
        if self._checked is not None:
            names, mine = self._checked
            self._checked = None
            if not self._agreed:
                self._diverged = self._divergence(work.step, names, mine)

    def _find_outliers(self, work: StepWork) -> dict[int, str]:
        ranks = self._policy().ranks
        norms = work.outcome.rank_norms or {}
        if ranks is None or ranks.outlier_factor is None or len(norms) < 2:
            return {}
        # Each rank against the median of the others (with two ranks, the other's): a rank's own norm does not pull
        # its reference up, and two ranks can be told apart at all (the median of both is at most half the larger).
        far, references = [], {}
        for rank, value in norms.items():
            others = [v for r, v in norms.items() if r != rank and math.isfinite(v)]
            if not others or not math.isfinite(value):
                continue
            references[rank] = reference = statistics.median(others)
            if reference > 0 and value > ranks.outlier_factor * reference:
                far.append(rank)
        if not far:
            return {}
        self._outlier_words = (
            "; ".join(
                f"rank {rank}'s own gradient norm {norms[rank]:.4g} is {norms[rank] / references[rank]:.3g} x the "
                f"other ranks' median {references[rank]:.4g}"
                for rank in far
            )
            + f" (outlier_factor {ranks.outlier_factor:g}; norms by rank: {_norms_words(norms)})"
        )
        median = min(references[rank] for rank in far)
        named = {rank: self.collective.hosts.get(rank, "?") for rank in far}
        self.counters.add(RANKS_RULE, "outlier")
        fields: dict[str, Any] = {"ranks": ranks_field(named), "norms": ranks_field(norms)}
        fields |= {"median": median, "outlier_factor": ranks.outlier_factor, "action": ranks.on_outlier}
        self.events.emit("warning", "rank_outlier", step=work.step, **fields)
        if ranks.on_outlier == "warn":
            warnings.warn(
                f"gradguard: at step {work.step} {ranks_words(named)} had its own gradient norm above "
                f"{ranks.outlier_factor:g} x the ranks' median ({median:.4g}): look at that machine",
                GuardWarning,
                stacklevel=2,
            )
        return named

    def _divergence(self, step: int, names: list[str], mine: torch.Tensor) -> tuple[dict[int, str], list[str]]:
        """Every rank found the fingerprints differ: gather them (one collective, on every rank) and name the
        replicas outside the majority (a tie: the side of the lowest rank is the reference) and the parameters."""
        collective = self.collective
        gathered = [torch.empty_like(mine) for _ in range(max(len(collective.members), 1))]
        dist.all_gather(gathered, mine, group=collective.group)
        rows = [tensor.cpu().tolist() for tensor in gathered]
        members = collective.members or list(range(len(rows)))
        deviants: set[int] = set()
        params = []
        for position, name in enumerate(names):
            by_value: dict[tuple[int, ...], list[int]] = {}
            for index, row in enumerate(rows):
                by_value.setdefault(tuple(row[position]), []).append(index)
            if len(by_value) == 1:
                continue
            params.append(name)
            reference = max(by_value.values(), key=lambda indices: (len(indices), -min(indices)))
            deviants.update(index for index in range(len(rows)) if index not in reference)
        named = collective.named(sorted(deviants))
        agreeing = len(members) - len(named)
        self._divergence_words = (
            f"{len(names)} parameters compared; {agreeing} of the {len(members)} ranks agree, the rank(s) named hold "
            "another copy: drain them, or look for code or data only they ran"
        )
        ranks = self._policy().ranks
        action = ranks.on_divergence if ranks is not None else "halt"
        self.counters.add(RANKS_RULE, "divergence")
        self.events.emit(
            "error",
            "replica_divergence",
            step=step,
            ranks=ranks_field(named),
            params=params,
            checked=len(names),
            action=action,
        )
        if action == "warn":
            shown = ", ".join(params[:8]) + (f" and {len(params) - 8} more" if len(params) > 8 else "")
            warnings.warn(
                f"gradguard: at step {step} the data-parallel replicas' weights differ bitwise in {len(params)} "
                f"parameter(s) ({shown}): {ranks_words(named)} differ from the majority of the {len(members)} ranks",
                GuardWarning,
                stacklevel=2,
            )
        return named, params

    def ruling(self, work: StepWork, context: StepContext) -> Ruling | None:
        ranks = self._policy().ranks
        if ranks is None:
            return None
        step, diverged, outliers = work.step, self._diverged, self._outliers
        if diverged is not None and ranks.on_divergence == "halt":
            named, params = diverged
            why = self._divergence_words
            report = HaltReport(step, RANKS_RULE, params, {}, "divergence", why, None, named)
            return Ruling(lambda: self._halt(report))
        if outliers and ranks.on_outlier in ("skip", "halt"):
            if ranks.on_outlier == "skip":
                self.counters.add(RANKS_RULE, "skip")
                return Ruling(lambda: True)
            why = self._outlier_words
            report = HaltReport(step, RANKS_RULE, [], {}, "outlier", why, None, outliers)
            return Ruling(lambda: self._halt(report))
        return None

    def _halt(self, report: HaltReport) -> bool:
        self.verdicts.halt(report, [RANKS_RULE], "halt")
        return False  # not reached: a halt raises (or asks for a rewind)


def model_parameters(model: nn.Module) -> Callable[[], list[tuple[str, torch.Tensor]]]:
    """Every parameter of ``model`` by name (tied ones once), held weakly: what the replicas compare."""
    ref = weakref.ref(model)
    strip = isinstance(model, nn.parallel.DistributedDataParallel)

    def named() -> list[tuple[str, torch.Tensor]]:
        module = ref()
        if module is None:
            return []
        return [(canonical_name(name, strip_module_prefix=strip), param) for name, param in module.named_parameters()]

    return named


def refuse_sharded_replicas(policy: Policy, model: nn.Module) -> None:
    """``check_replicas_every`` compares replicas: where the parameters are sharded (FSDP2), there are none."""
    ranks = policy.ranks
    if ranks is None or ranks.check_replicas_every is None:
        return
    if any(is_sharded(param) for param in model.parameters()):
        raise GuardStateError(
            f"{policy.source}: ranks.check_replicas_every compares data-parallel replicas' weights, but this model's "
            "parameters are sharded (FSDP2, tensor parallel): no two ranks hold the same weights to compare. Remove "
            "check_replicas_every for a sharded model (FSDP2's shards are checked by nothing of the guard's); it "
            "works under DDP and DeepSpeed ZeRO 0-2."
        )


def refuse_unseen_outliers(policy: Policy, seen: str | None, unseen: str | None) -> None:
    """``outlier_factor`` compares each rank's own gradient norm, before the reduction: where the guard cannot see it,
    the check could never fire (refused, not accepted and inert)."""
    ranks = policy.ranks
    if ranks is None or ranks.outlier_factor is None or seen is not None or unseen is None:
        return
    raise GuardStateError(
        f"{policy.source}: ranks.outlier_factor compares each rank's own gradient norm before the reduction, but "
        f"here {unseen}: no rank's norm would be compared, and no outlier ever named. Remove outlier_factor, or "
        "pass the guard the DDP or FSDP2 model of a data-parallel job (under tensor parallel alone no two ranks "
        "hold the same gradient to compare)."
    )


def watch_ranks(enforcer: Enforcer, model: nn.Module, deepspeed: bool) -> dict[str, Any] | None:
    """Under ``torch.distributed``: tap each rank's own gradient (DeepSpeed's engines are tapped with their boundary),
    and take part in the step (``RanksTakingPart``); the attach event's ``ranks``. None in one process."""
    collective = enforcer.collective
    if not collective.active():
        return None
    policy = enforcer.binding.policy
    if not deepspeed:
        tap_local_gradients(model, collective.local)
        refuse_unseen_outliers(policy, collective.local.seen, collective.local.unseen)
    refuse_sharded_replicas(policy, model)
    taking_part = RanksTakingPart(
        collective,
        lambda: enforcer.binding.policy,
        model_parameters(model),
        enforcer.verdicts,
        enforcer.events,
        enforcer.counters,
    )
    enforcer.participants.give("ranks", taking_part)
    return ranks_at_attach(collective, policy)


def _norms_words(norms: dict[int, float]) -> str:
    """``0: 1.2, 1: 250`` (every rank's norm, at most eight shown)."""
    shown = [f"{rank}: {value:.4g}" for rank, value in sorted(norms.items())]
    return ", ".join(shown[:8]) + (f" and {len(shown) - 8} more" if len(shown) > 8 else "")
