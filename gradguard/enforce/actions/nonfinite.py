"""The non-finite watch: ``halt_on_nonfinite`` and ``skip_step_on_nonfinite``.

Neither changes a gradient. Their verdict comes from the 2-norms of the gradients as they arrived
(shared with the clips that can reuse them), read in the step's one sync: on one rank their values say
NaN or Inf themselves; across ranks, NaN/Inf flags summed over the ranks say it, so that every rank agrees.
The engine then halts (before any optimizer state changes) or skips the step.
Skip limits escalate to a halt after too many skips in a row or within a window of steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from gradguard.enforce.actions.base import ActionKernel
from gradguard.enforce.work.participant import Participant
from gradguard.enforce.work.skips import SkipBook, SkipHistory, has_active, joined_kind
from gradguard.enforce.work.step_work import StepOutcome, StepWork
from gradguard.enforce.work.tensors import norms, stack_on, version_of
from gradguard.policy.schema import HaltOnNonfinite, Rule, SkipStepOnNonfinite


class Watched(Protocol):
    """What the non-finite watch needs of a plan (the plan, a room above, builds on the actions)."""

    @property
    def fragile(self) -> frozenset[int]: ...

    @property
    def watchers_by_param(self) -> dict[int, tuple[int, ...]]: ...


__all__ = [
    "HaltKernel",
    "SkipHistory",
    "SkipKernel",
    "SkipLimits",
    "has_active",
    "joined_kind",
    "judge_nonfinite",
    "watch_raw_norms",
]


class HaltKernel(ActionKernel):
    """``halt_on_nonfinite``: raise ``GradientHalt`` before the optimizer step."""

    alarms = True

    schemas = (HaltOnNonfinite,)
    watches = True


class SkipKernel(ActionKernel):
    """``skip_step_on_nonfinite``: skip the whole update, escalating to a halt past its limits."""

    alarms = True

    schemas = (SkipStepOnNonfinite,)
    watches = True


def judge_nonfinite(
    outcome: StepOutcome, rules: Sequence[Rule], watchers: Iterable[int], index: int, kind: str, step: int, under: int
) -> None:
    """Tensor ``index`` was non-finite (``kind``): halted by the first of its ``watchers`` (the rules over it) with an
    active ``halt_on_nonfinite``, else skipped by one with ``skip_step_on_nonfinite``; reported under that rule, or
    ``under`` where none watches it."""
    active = [r for r in watchers if rules[r].active_at(step)]
    halts = [r for r in active if has_active(rules[r].actions, HaltOnNonfinite, step)]
    skips = [r for r in active if has_active(rules[r].actions, SkipStepOnNonfinite, step)]
    if halts:
        outcome.halted_by[index] = halts[0]
    elif skips:
        outcome.skipped_by[index] = skips[0]
    outcome.nonfinite.setdefault(index, (kind, (halts or skips or [under])[0]))


def watch_raw_norms(work: StepWork, plan: Watched, raw_ids: list[int]) -> dict[int, torch.Tensor]:
    """2-norms of the untouched gradients, and the non-finite verdict every rank agrees on."""
    grads, pending, outcome, step, collective = work.grads, work.pending, work.outcome, work.step, work.collective
    gs = [grads[i] for i in raw_ids]
    local = norms(gs, 2.0)
    device = local[0].device
    # Kept in the norms' own type: a float64 norm above float32's range is finite, not Inf (a cast would call it an
    # overflow and clip it twice). Half precision's norms are float32 already.
    stacked = stack_on(local, device)
    pending.raw_stack = (local, stacked)
    evidence = stacked
    fragile = [position for position, index in enumerate(raw_ids) if index in plan.fragile] if plan.fragile else []
    if fragile:
        # A 2-norm can overflow while every element is finite; the max-abs norm cannot. Tensors an
        # action may make finite are judged by it now, the others are re-checked after the sync.
        peaks = norms([gs[k] for k in fragile], float("inf"))
        work.raw_peaks = {raw_ids[k]: peak for k, peak in zip(fragile, peaks, strict=True)}
        # One stack of 0-dim tensors, not an index tensor made from a Python list (a host-to-device copy).
        chosen = list(local)
        for k, peak in zip(fragile, peaks, strict=True):
            chosen[k] = peak
        evidence = stack_on(chosen, device)
    # A NaN or Inf element makes the 2-norm so; a finite tensor whose norm overflowed is the host's to check too.
    pending.quiet_if(lambda: stacked < math.inf)
    count = len(raw_ids)
    binding = work.binding
    rules = binding.policy.rules

    def judge(index: int, kind: str) -> None:
        watchers = plan.watchers_by_param.get(index, ())
        judge_nonfinite(outcome, rules, watchers, index, kind, step, binding.params[index].rules[0])

    def read_evidence(values: list[float]) -> None:
        # The evidence itself, read: NaN or Inf on the host exactly where isnan/isinf on the device would be.
        if math.isfinite(sum(values)):
            return  # nothing non-finite (the common case, without a loop in Python)
        for index, value in zip(raw_ids, values, strict=True):
            if not math.isfinite(value):
                judge(index, "nan" if value != value else "inf")

    def read_norms(values: list[float]) -> None:
        # The norms' values: the loop's own clip after this step can then tell, without another read, that its
        # coefficient is 1 (gradguard.enforce.step.known_norms).
        work.raw_host = dict(zip(raw_ids, values, strict=True))

    if not work.sharded:  # which versions the read norms describe (known_norms: the loop's clip after the step)
        work.raw_versions = dict(zip(raw_ids, map(version_of, gs), strict=True))
    if collective is None:
        # One rank: the evidence's values decide on the host; no flags are made on the device.
        if evidence is stacked:

            def read_both(values: list[float]) -> None:
                read_evidence(values)
                read_norms(values)

            pending.add(stacked, read_both)
        else:
            pending.add(evidence, read_evidence)
            pending.add(stacked, read_norms)
        return dict(zip(raw_ids, local, strict=True))
    flags = torch.stack([torch.isnan(evidence), torch.isinf(evidence)]).float().reshape(-1)
    # Each rank's own-gradient flag (and norm) rides the same collective: which rank made a fault, at no extra cost.
    slots, read_slots = work.take_rank_payload()
    bits = collective.slots(norms=False)
    if work.sharded:
        # One collective: the pieces' squared norms (summed into full norms), every rank's flags, and this rank's bit
        # where its own pieces are non-finite: where no rank's gradient was before the reduction (or no engine's tap
        # reads it: tensor parallel, whose weight-gradient shards no reduction reaches), those ranks made it.
        squares = stacked.square()
        shares = work.share_weights(raw_ids, device)
        own = bits.bit(flags.sum() > 0, device)
        payload = collective.sum_(torch.cat([squares if shares is None else squares * shares, flags, *slots, own]))
        result = list(payload[:count].sqrt().unbind())
        flags = payload[count:]
    else:
        # Replicas hold the same averaged gradient; a NaN injected on one rank must stop them all. This rank's bit says
        # whether its own reduced gradients are non-finite: where some ranks' are and others' not, the fault was made
        # after the reduction, on those (``after_reduction``).
        flags = collective.sum_(torch.cat([flags, *slots, bits.bit(flags.sum() > 0, device)]))
        result = local
    after_slots = bits.bit_slots

    def read(values: list[float]) -> None:
        if after_slots:
            after_reduction(values[-after_slots:])
            values = values[:-after_slots]
        if read_slots is not None:
            read_slots(values[2 * count :])
            values = values[: 2 * count]
        if not any(values):
            return  # every flag is 0: nothing non-finite (the common case, without a loop in Python)
        for position, index in enumerate(raw_ids):
            has_nan, has_inf = values[position] > 0, values[count + position] > 0
            if has_nan or has_inf:
                judge(index, "nan" if has_nan else "inf")

    def after_reduction(values: list[float]) -> None:
        made = bits.ranks_of(values)
        if 0 < len(made) < bits.world:  # on every rank: the reduction, or code every rank runs, made it
            outcome.ranks_after = collective.named(made)

    pending.add(flags, read)
    if not work.sharded:
        pending.add(stacked, read_norms)
    return dict(zip(raw_ids, result, strict=True))


class SkipLimits(SkipBook, Participant):
    """Each skip rule's history of skipped steps, and when it escalates to a halt (``SkipBook``, torch-free, which
    ``gradguard replay`` keeps too). As a participant: an applied step ends every run of skips."""

    def applied(self, work: StepWork) -> None:
        self.step_applied(work.step)
