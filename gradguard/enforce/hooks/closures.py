"""``optimizer.step(closure)``: the guard acts after the closure has computed the step's gradients.

A step pre-hook runs before the closure, so it would see the previous step's gradients (or none).
The pre-hook therefore hands the optimizer a stand-in closure that runs the user's, then treats what
it produced, before the optimizer reads ``p.grad``. An optimizer that evaluates its closure several
times per step (LBFGS's iterations and line search) has no single gradient to treat and is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from gradguard.enforce.triggers.rerun import ClosureRerun, RerunRequested
from gradguard.errors import UnsupportedOptimizerError

__all__ = ["TreatAfterClosure", "closure_of", "refuse_reevaluating", "with_closure"]

StepArgs = tuple[tuple[Any, ...], dict[str, Any]]
"""A step pre-hook's view of ``optimizer.step(*args, **kwargs)``: ``args[0]`` is the optimizer."""


def closure_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], Any] | None:
    """The closure of a ``step()`` call, passed by keyword or positionally, or ``None``."""
    if "closure" in kwargs:
        closure: Callable[[], Any] | None = kwargs["closure"]
        return closure
    return args[1] if len(args) > 1 else None


def with_closure(args: tuple[Any, ...], kwargs: dict[str, Any], closure: Callable[[], Any]) -> StepArgs:
    """The same ``step()`` call with ``closure`` in place of the one it was given."""
    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure}
    return (args[0], closure, *args[2:]), kwargs


class TreatAfterClosure:
    """Stands in for the closure of ``optimizer.step(closure)``: runs it once, then ``treat()`` (and, where the guard
    asks, once more with the random number generators put back: ``gradguard.enforce.triggers.rerun``)."""

    def __init__(
        self, closure: Callable[[], Any], treat: Callable[[], None], optimizer: Optimizer, rerun: ClosureRerun | None
    ) -> None:
        self.closure = closure
        self.treat = treat
        self.optimizer_name = type(optimizer).__name__
        self.calls = 0
        self.rerun = rerun
        """Where the policy has a ``rerun`` section: the RNG states, gradients and loss roots kept before the closure,
        to compute the whole step again."""

    def __call__(self) -> Any:
        self.calls += 1
        if self.calls > 1:
            raise UnsupportedOptimizerError(
                f"{self.optimizer_name} evaluated its closure a second time within one step(); "
                "the parameters may already have moved once, on the gradients of the first evaluation, which "
                "the guard treated. gradguard cannot treat a step that makes several gradients: use an optimizer "
                "that evaluates the closure once per step, or leave its parameters out of the guarded model."
            )
        if self.rerun is None:
            loss = self.closure()
            self.treat()
            return loss
        try:
            return self.rerun.first(self.closure, self.treat)
        except RerunRequested:  # at the treat, or at a boundary inside the closure (Lightning's)
            # The same batch, the same random numbers, from what the step had before the closure: the whole step again.
            return self.rerun.again(self.closure, self.treat)


def refuse_reevaluating(optimizer: Optimizer) -> None:
    """Refuse an optimizer that evaluates its closure several times in one step (LBFGS's iterations)."""
    if not isinstance(optimizer, torch.optim.LBFGS):
        return
    for group in optimizer.param_groups:
        if group["max_iter"] > 1 or group["line_search_fn"] is not None:
            raise UnsupportedOptimizerError(
                f"LBFGS(max_iter={group['max_iter']}, line_search_fn={group['line_search_fn']!r}) steps guarded "
                "parameters, and it evaluates its closure several times per step(), moving the parameters between "
                "evaluations: there is no single gradient for the guard to treat before the update. Use "
                "LBFGS(max_iter=1, line_search_fn=None) (one evaluation, treated like any step), or a first-order "
                "optimizer."
            )
