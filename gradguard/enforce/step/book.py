"""What the step remembers from one boundary to the next: the step's number, and which gradients it treated.

A training step may meet several boundaries (several optimizers, the loop's clip and then the optimizer's step, a
framework's explicit boundary): a gradient treated and unchanged since is not treated again, and a step begins when a
tensor already seen in the current step comes again, so the count follows training steps, not optimizer calls.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from itertools import repeat

import torch

from gradguard.enforce.distributed.collective import local_tensor
from gradguard.enforce.step.gather import Applied, treated_version
from gradguard.enforce.work.step_work import StepContext, StepWork
from gradguard.enforce.work.tensors import version_of

__all__ = ["StepBook"]


class StepBook:
    """The step count and the treated gradients (``rerun_step``: the step being computed again, if one is)."""

    def __init__(self, rerun_step: Callable[[], int | None]) -> None:
        self.step = 0
        """How many steps have begun (the 0-based index of the next step)."""
        self.in_step: set[int] = set()
        self.scaler_skip_noted = False
        """This step's GradScaler skip was said (once per training step)."""
        self.scaler_skip_at_boundary = False
        """This step's GradScaler skip was already recorded at an explicit boundary (one-shot)."""
        self.applied_versions: Applied = {}
        """``(weakref to grad, version, held)`` per tensor: a gradient treated and unchanged since is not treated
        again; ``held`` (an explicit boundary's): the optimizer's step pre-hook leaves it alone even if changed
        since (a framework's own clip), until ``seal_explicit`` runs after the optimizer step."""
        self.explicit_marks = False
        self.last_run_treated = False
        """Whether the last boundary found new gradients to treat."""
        self.began = False
        """Whether a step has begun since attach."""
        self._rerun_step = rerun_step

    def begin_step(self, indices: Iterable[int]) -> int:
        """The 0-based index of the step these tensors' gradients belong to.

        Several optimizers each step their own parameters within one training step; a step begins
        when a tensor already seen in the current step comes again. So the count (and every step
        window) follows training steps, not optimizer calls.
        """
        ids = set(indices)
        self.began = True
        if (again := self._rerun_step()) is not None:
            return again  # the step's second computation is the same step
        if not self.in_step or ids & self.in_step:
            self.step += 1
            self.in_step = set()
            self.scaler_skip_noted = False
            self.scaler_skip_at_boundary = False
        self.in_step |= ids
        return self.step - 1

    def restart(self, step: int) -> None:
        """The count goes on from ``step`` (a loaded state, a step passed in a rewind's window)."""
        self.step = step
        self.in_step = set()

    def treated(self, work: StepWork, context: StepContext) -> None:
        """An applied step's gradients are treated (held where an explicit boundary treated them)."""
        self.explicit_marks |= context.explicit
        self.mark_treated(work, held=context.explicit)

    def mark_treated(self, work: StepWork, *, held: bool) -> None:
        # A weak reference, not id(): a new gradient may reuse a freed one's id and version. Built with map and zip,
        # which loop in C: this runs for every tensor at every step.
        grads, wrapped = work.grads, work.wrapped
        local = grads.values()
        owners = [wrapped.get(i, grad) for i, grad in grads.items()] if wrapped else local
        versions = map(treated_version, owners, local) if wrapped else map(version_of, local)
        entries = zip(map(weakref.ref, owners), versions, repeat(held))
        self.applied_versions.update(zip(grads, entries, strict=True))
        if work.reduced is not None:  # read through reduced copies: the gradients themselves were treated
            for index, (grad, _, _) in work.reduced.copies.items():
                self.applied_versions[index] = (weakref.ref(grad), treated_version(grad, local_tensor(grad)), held)

    def mark_halted(self, work: StepWork) -> None:
        """A halt: the tensors it did not name were treated (a retry must not treat them again); the offending ones
        are checked again."""
        outcome, reduced = work.outcome, work.reduced.copies if work.reduced is not None else {}
        for index, local in work.grads.items():
            if index not in outcome.halted_by and index not in outcome.skipped_by:
                owner = reduced[index][0] if index in reduced else work.wrapped.get(index, local)
                self.applied_versions[index] = (weakref.ref(owner), treated_version(owner, local_tensor(owner)), False)

    def seal_explicit(self) -> None:
        """The optimizer has stepped: gradients treated at an explicit boundary count as treated only while unchanged,
        so the next backward (into them in place, after ``zero_grad(set_to_none=False)``) is treated again."""
        if not self.explicit_marks:
            return
        self.explicit_marks = False
        self._retake_versions(held=False)

    def clipped(self) -> None:
        """The loop's clip has changed the gradients treated at its boundary: that is not a new gradient.

        Their versions are taken again, so a second clip of the step (``clip_grad_value_`` after
        ``clip_grad_norm_``) finds them treated, while the next backward, which changes them again, does not.
        """
        self._retake_versions(held=True)

    def _retake_versions(self, *, held: bool) -> None:
        applied, plain = self.applied_versions, torch.Tensor  # locals: a loop per tensor, once per step
        for index, (ref, _, was_held) in list(applied.items()):
            if was_held and (grad := ref()) is not None:  # a plain gradient's version inline: no call a tensor
                version = grad._version if type(grad) is plain else treated_version(grad, local_tensor(grad))
                applied[index] = (ref, version, held)

    def keep(self, keep: dict[int, int]) -> None:
        """A new binding: tensor indices follow ``keep`` (old index -> new); the others start afresh."""
        self.applied_versions = {keep[i]: seen for i, seen in self.applied_versions.items() if i in keep}
        self.in_step = {keep[i] for i in self.in_step if i in keep}
