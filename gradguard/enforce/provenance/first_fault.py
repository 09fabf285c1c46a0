"""The default's way to a first fault's origin: hold every forward (``replay.Replay``), trace none, and when a step's
gradients come out non-finite replay its forwards with the light trace armed, before the verdict is raised; the
figures the replay records are named as the step's own would have been (``Provenance._read``).

Where the model cannot be replayed by the ranks that faulted alone (``replay.unreplayable``: FSDP2, tensor parallel,
ZeRO 3, SyncBatchNorm, a model compiled in place) the light trace runs at every forward instead, as it always did.
``Provenance`` owns the state; this mixin arms the default and names a faulting step's origin by replay.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Final

import torch

from gradguard.enforce.provenance.figures import HeldOutputs
from gradguard.enforce.provenance.light_trace import Tracing
from gradguard.enforce.provenance.origins import ForwardMeta
from gradguard.enforce.provenance.replay import Replay
from gradguard.enforce.work.step_work import StepContext, StepOutcome, StepWork
from gradguard.enforce.work.tensors import stack_on

__all__ = ["NOT_REPLAYED_HINT", "FirstFault"]

NOT_REPLAYED_HINT: Final = "To trace such a fault from its start: GradGuard(..., provenance='always')."
_KEPT: Final = ("spread", "clip", "first_params", "after_reduction", "rank")
"""What a replay that names no module keeps of the origin the step's own figures gave."""


class FirstFault:
    """``first_fault``: the replay's hooks, or the light trace where the model cannot be replayed."""

    mode: str | None
    _tracing: Tracing
    _quick: bool
    _held: HeldOutputs
    _fwd: list[torch.Tensor]
    _fwd_meta: ForwardMeta
    _replay: Replay | None
    _replaying: bool
    unreplayable: str | None
    """Why the default traces every forward of this model instead of replaying a faulting step (None: it replays)."""

    if TYPE_CHECKING:  # Provenance's own

        def _arm_light(self) -> None: ...
        def _disarm_light(self) -> None: ...
        def _reset(self) -> None: ...
        def _fault(self, step: int) -> None: ...
        def _read(self, *args: Any) -> None: ...

    def _arm_first_fault(self) -> None:
        """Hold the forwards where the model can be replayed, else trace each one (the light trace)."""
        replay = self._replay
        if replay is not None:
            replay.arm()
        else:
            self._arm_light()

    @property
    def replaying(self) -> bool:
        """Whether the default's replay hooks hold the forwards now (nothing is traced on a clean step)."""
        return self._replay is not None and bool(self._replay.handles)

    def after_read(self, work: StepWork, context: StepContext) -> None:
        replay = self._replay
        if replay is None or not replay.handles:
            return
        forwards, overflow, whole_step = replay.forwards, replay.overflow, replay.whole_step
        replay.clear()
        replay.whole_step = True
        if not forwards and not overflow and whole_step:
            # A step with gradients and no forward of the model itself: the loop calls its submodules (a training_step
            # of its own), so there is nothing to replay, ever. The light trace at every forward from now on.
            self.unreplayable = "the model's own forward did not run before its step: the loop calls its submodules"
            self._replay = None
            replay.disarm()
            self._arm_light()
        outcome = work.outcome
        if not outcome.nonfinite or outcome.scaler_found_inf:
            return  # a clean step (a GradScaler's inf is its loss-scale search, not a fault)
        made = outcome.ranks or outcome.ranks_after
        if work.collective is not None and made and work.collective.rank not in made:
            return  # received through the reduction: the ranks participant says so; the ranks that made it replay
        step = (outcome, work.step, tuple(work.grads))
        why = replay.refusal(forwards, overflow)
        found = "unknown"
        if why is None:
            found, why, fwd, meta = self._traced_replay(replay, forwards)
        if why is not None:
            self._fault(work.step)  # the full trace is armed: a recurrence is traced
            outcome.origin = _not_replayed(outcome, why)
            return
        values = stack_on(fwd, fwd[0].device).tolist() if fwd else []  # a faulting step only: a second read
        self._read(step, (len(fwd), 0), (meta, [], []), False, work.collective is not None, values)
        if outcome.origin is not None and found in ("transient", "differs"):
            outcome.origin = _not_reproduced(outcome, outcome.origin, found)
        elif outcome.origin is not None:
            outcome.origin["replayed"] = True

    def _traced_replay(
        self, replay: Replay, forwards: list[list[Any]]
    ) -> tuple[str, str | None, list[torch.Tensor], ForwardMeta]:
        """Replay ``forwards`` with the light trace armed, each output reduced in its hook (a replay's outputs are not
        the step's, and a held one's figure would wait for a model hook the replay of a wrapped model does not run)."""
        saved = self._tracing, self._quick, self._held
        self._tracing = dataclasses.replace(saved[0], hold=False, replay=False)
        self._quick, self._held = False, HeldOutputs()
        self._reset()
        replay.disarm()
        self._arm_light()
        self._replaying = True
        try:
            found, why = replay.run(forwards)
        finally:
            self._replaying = False
            self._disarm_light()
            self._tracing, self._quick, self._held = saved
            fwd, meta = self._fwd, self._fwd_meta
            self._reset()
            replay.arm()
        return found, why, fwd, meta


def _kind(outcome: StepOutcome) -> str | None:
    kinds = {kind for kind, _ in outcome.nonfinite.values()}
    return kinds.pop() if len(kinds) == 1 else None


def _not_replayed(outcome: StepOutcome, why: str) -> dict[str, Any]:
    note = f"not replayed: {why}; provenance='first_fault' has armed its module hooks: a recurrence is traced"
    origin = {"phase": "untraced", "module": None, "kind": _kind(outcome), "input_nonfinite": False}
    return origin | {"note": note, "hint": NOT_REPLAYED_HINT, "replayed": False}


def _not_reproduced(outcome: StepOutcome, origin: dict[str, Any], found: str) -> dict[str, Any]:
    """The origin of a step whose replay did not match it: no module is named."""
    if found == "transient":
        phase = "forward"
        note = (
            "the model's output was non-finite in the step and finite when its forward was replayed on the same "
            "inputs, weights and random state: a transient fault (the hardware, a race, or state the replay does not "
            "restore), not one a module makes again"
        )
    else:
        phase = "untraced"
        note = (
            "the replay of the step's forward was not non-finite where the step's own output was: the forward has "
            "side effects, or reads state the replay does not restore; no module is named"
        )
    kept = {key: origin[key] for key in _KEPT if key in origin}
    base = {"phase": phase, "module": None, "kind": _kind(outcome), "input_nonfinite": False}
    return base | kept | {"note": note, "hint": NOT_REPLAYED_HINT, "replayed": True, "transient": found == "transient"}
