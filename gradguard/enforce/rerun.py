"""A suspect step computed again: a fault that does not come back was transient (the policy's ``rerun`` section).

Megatron-LM's rerun state machine re-runs a suspect step's forward and backward on the same batches with the random
number generators restored and compares: a result that differs is a transient (hardware) fault, and training goes
on; one that repeats is the model's. gradguard does it in the loop a user already has, where the guard holds the
step's computation: ``optimizer.step(closure)`` (and Lightning's automatic optimization, always a closure).

- Before the closure first runs, ``ClosureRerun`` keeps the RNG states (the CPU's and every initialised CUDA
  device's: host copies of the generators' seeds and offsets, no host sync).
- When the step's verdict is one the section lists (``on``), the engine does not act on it: it keeps the first
  computation's figures (its loss and per-tensor norms, already read) and raises ``RerunRequested`` before any
  count, event or state changes. The stand-in closure puts the RNG states back, clears the gradients and runs the
  user's closure again; the engine treats the new gradients as the same step.
- The two computations agree when every figure's relative difference is within ``tolerance``. Agree: the fault
  is reproducible, and the verdict stands (the second computation gives it again). Differ: transient; with
  ``transient: continue`` the second computation's gradients are judged as the step's own, with ``halt`` the run
  halts saying the fault was transient. Under a process group the ranks agree on both: the verdict is the same on
  every rank before the re-run (its figures come from collectives), and whether the computations differed is
  summed over the ranks after it, so every rank goes the same way and the ranks that differed are named.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gradguard.enforce.distributed import Collective
from gradguard.enforce.step import StepOutcome
from gradguard.policy.sections import Rerun

__all__ = [
    "ClosureRerun",
    "Figures",
    "RerunRequested",
    "Reruns",
    "in_rerunnable_closure",
    "rng_states",
    "set_rng_states",
]

_closures = threading.local()
"""How deep this thread is in closures the guard can run again (an explicit boundary inside one may ask)."""


def in_rerunnable_closure() -> bool:
    """Whether this thread is running a closure of ``optimizer.step(closure)`` that the guard can run again (so a
    boundary inside it, as Lightning's ``on_before_optimizer_step``, may ask for a second computation)."""
    return bool(getattr(_closures, "depth", 0))


class RerunRequested(Exception):
    """The step's verdict is to be checked: compute the step again."""


@dataclass(frozen=True)
class Figures:
    """One computation of a step, as its read gave it: the loss and each tensor's 2-norm."""

    loss: float | None
    norms: Mapping[str, float]


@dataclass(frozen=True)
class Comparison:
    verdict: str
    """``transient`` or ``reproducible``."""
    max_rel_diff: float
    params: list[str]
    ranks: list[int]


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
    """What the stand-in closure of ``optimizer.step(closure)`` does when the guard asks for a second computation."""

    def __init__(self, params: Callable[[], Iterable[torch.Tensor]]) -> None:
        self.params = params
        self.states: tuple[torch.Tensor, list[torch.Tensor]] | None = None

    def first(self, closure: Callable[[], Any]) -> Any:
        """Keep the generators' states, then run the closure (a boundary inside it may ask for a re-run)."""
        self.states = rng_states()
        return _run(closure)

    def again(self, closure: Callable[[], Any]) -> Any:
        """Put the generators back, clear the gradients (the closure may not zero them) and compute again."""
        assert self.states is not None
        set_rng_states(self.states)
        for param in self.params():
            param.grad = None
        return _run(closure)


def _run(closure: Callable[[], Any]) -> Any:
    _closures.depth = getattr(_closures, "depth", 0) + 1
    try:
        return closure()
    finally:
        _closures.depth -= 1


def _relative(a: float | None, b: float | None) -> float:
    if a is None or b is None:
        return 0.0
    if a == b or (a != a and b != b):
        return 0.0  # equal, infinities of one sign, or NaN both times: the same result
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b))


class Reruns:
    """One guard's re-runs: the first computation's figures while its second runs, and the notes said once."""

    def __init__(self) -> None:
        self.first: Figures | None = None
        self.step: int | None = None
        """The step being computed again (the engine counts the second computation as that step)."""
        self.asked: str | None = None
        self.noted = False
        """A ``rerun_unavailable`` was said."""

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

    def request(self, step: int, asked: str, first: Figures) -> None:
        self.first, self.step, self.asked = first, step, asked
        raise RerunRequested

    def compare(
        self, config: Rerun, second: Figures, collective: Collective | None, device: torch.device
    ) -> Comparison:
        """The two computations of the step, agreed over the ranks; the re-run is over."""
        first = self.first
        assert first is not None
        self.first, self.step = None, None
        diffs = {name: _relative(value, second.norms.get(name)) for name, value in first.norms.items()}
        loss_diff = _relative(first.loss, second.loss)
        largest = max([loss_diff, *diffs.values()])
        differs = largest > config.tolerance
        params = sorted(name for name, diff in diffs.items() if diff > config.tolerance)
        ranks: list[int] = [0] if differs else []
        if collective is not None:
            import torch.distributed as dist

            world, rank = dist.get_world_size(collective.group), dist.get_rank(collective.group)
            flags = torch.zeros(world, dtype=torch.float64, device=device)
            flags[rank] = float(differs)
            both = collective.sum_(flags).tolist()  # only on a re-run: a clean step never gets here
            ranks = [r for r in range(world) if both[r] > 0]
            differs = bool(ranks)
        verdict = "transient" if differs else "reproducible"
        return Comparison(verdict, largest, params, ranks)
