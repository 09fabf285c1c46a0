"""The figures of one computation of a suspect step (the ``rerun`` section), and two computations compared.

A computation's figures are its loss and each tensor's raw 2-norm, as the step's read gave them. In one process and
under DDP those are the host values the read took (``StepWork.raw_host``). Under FSDP2 and tensor parallel a rank holds
pieces: the step's one collective summed the pieces' squares into the whole tensors' norms (``watch_raw_norms``), the
same on every rank, which no clean step reads to the host. A suspect step, and its second computation, reads them here
with this rank's pieces' own norms: one host read, on a step being computed again only, and no collective.

Compared (``compared``): the whole tensors' norms and the loss say whether the computations differed, which
parameters, and by how much; under a process group whether they differed is summed over the ranks, with one flag per
rank saying whether its own computation did (its figures; under FSDP2 and tensor parallel its pieces'), so every
rank reaches the same verdict and the ranks whose computation differed are named.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradguard.enforce.distributed.collective import Collective
from gradguard.enforce.work.step_work import StepWork
from gradguard.policy.sections import Rerun

__all__ = ["Comparison", "Figures", "compared"]


@dataclass(frozen=True)
class Figures:
    """One computation of a step, as its read gave it: the loss and each tensor's 2-norm (the whole tensor's)."""

    loss: float | None
    norms: Mapping[str, float]
    pieces: Mapping[str, float] | None = None
    """Under FSDP2 and tensor parallel, this rank's pieces' 2-norms (whether its computation differed); else None."""

    @classmethod
    def of(cls, work: StepWork) -> Figures:
        """The step's figures, once its read is done (a host read of the whole tensors' norms where it holds pieces:
        call it only on a step being computed again)."""
        names, loss, stack = work.names, work.outcome.loss, work.pending.raw_stack
        if not work.sharded or not work.raw or stack is None:
            return cls(loss, {names[index]: value for index, value in work.raw_host.items()})
        ids, whole = list(work.raw), torch.stack(list(work.raw.values()))
        values = torch.cat([whole.double(), stack[1].to(whole.device, torch.float64)]).tolist()
        count = len(ids)
        norms = {names[index]: value for index, value in zip(ids, values[:count], strict=True)}
        return cls(loss, norms, {names[index]: value for index, value in zip(ids, values[count:], strict=True)})


@dataclass(frozen=True)
class Comparison:
    verdict: str  # transient or reproducible
    max_rel_diff: float
    params: list[str]
    ranks: list[int]


def _relative(a: float | None, b: float | None) -> float:
    if a is None or b is None:
        return 0.0
    if a == b or (a != a and b != b):
        return 0.0  # equal, infinities of one sign, or NaN both times: the same result
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b))


def compared(
    config: Rerun, first: Figures, second: Figures, collective: Collective | None, device: torch.device
) -> Comparison:
    """The two computations of a step, agreed over the ranks."""
    tolerance = config.tolerance
    diffs = {name: _relative(value, second.norms.get(name)) for name, value in first.norms.items()}
    largest = max([_relative(first.loss, second.loss), *diffs.values()])
    differs = largest > tolerance
    params = sorted(name for name, diff in diffs.items() if diff > tolerance)
    ranks: list[int] = [0] if differs else []
    if collective is not None:
        own, pieces = differs, second.pieces or {}
        if first.pieces is not None:  # the norms are the whole tensors' (the same on every rank): this rank's pieces
            own = any(_relative(value, pieces.get(name)) > tolerance for name, value in first.pieces.items())
        world, rank = dist.get_world_size(collective.group), dist.get_rank(collective.group)
        flags = torch.zeros(world + 1, dtype=torch.float64, device=device)
        flags[rank], flags[world] = float(own), float(differs)
        summed = collective.sum_(flags).tolist()  # only on a re-run: a clean step never gets here
        ranks = [r for r in range(world) if summed[r] > 0]
        differs = summed[world] > 0 or bool(ranks)
    return Comparison("transient" if differs else "reproducible", largest, params, ranks)
