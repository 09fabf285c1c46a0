"""A DeepSpeed engine's update, hooked: the one place between the reduction and DeepSpeed's overflow check, clip and
update where the guard's step runs (``UpdateHook``), DeepSpeed's own way to skip it (``skip_update``), and the
parameters a ``drop`` keeps as they are through it (``HeldStill``).

DeepSpeed updates its flat fp32 partitions whole, so a parameter cannot be left out of an update as torch's optimizers
leave out a ``p.grad`` of None: ``HeldStill`` copies what the update would change of it (its weights, its fp32 master
piece, its piece of the optimizer state) before the update and puts them back after.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradguard.enforce.distributed.deepspeed import inner_optimizer, layout

__all__ = ["HaltAfterStep", "HeldStill", "UpdateHook", "skip_update"]


def skip_update(engine: Any) -> None:
    """Drop this boundary's gradients and mark the step skipped; weights, fp32 masters and optimizer state stay.

    This is DeepSpeed's own overflow path minus the loss-scale update (a guard's verdict says nothing about
    fp16 range): ``averaged_gradients`` must be cleared, or a compact bf16/fp32-accumulation buffer is reused
    and the next update adds two steps' gradients. ``overflow`` set True makes the engine count a skipped step
    and hold the LR scheduler (and Hugging Face's ``optimizer_step_was_skipped`` say so). Run it on every rank.
    """
    _drop(engine)
    engine.optimizer.overflow = True


def _drop(engine: Any) -> None:
    opt = engine.optimizer
    kind = layout(engine)
    if kind == "stage3":  # its step()'s own overflow path: the next backward copies into the partitions, not adds
        opt._pre_step()
        opt._partition_all_parameters()
        opt.zero_grad(set_to_none=True)
        opt.averaged_gradients = {}
    elif kind == "zero":
        opt.micro_step_id = -1  # INITIAL_MICRO_STEP_ID, as the top of its step() does
        opt.zero_grad(set_to_none=True)
        opt._release_preflattened_grad_buffers()
        for group in list(opt.averaged_gradients):
            opt.averaged_gradients[group] = None
            opt.all_grad_tensors[group] = None
    elif kind == "bf16":
        opt.clear_hp_grads()
        opt.clear_lp_grads()
    else:
        opt.zero_grad(set_to_none=True)


def _put_back(owner: Any, wrapper: Callable[..., Any], previous: Callable[..., Any] | None) -> None:
    """Give ``owner`` its own ``step`` back (the class method, or what the instance had), unless another wrapper was
    put on top of ``wrapper`` since."""
    if vars(owner).get("step") is wrapper:
        if previous is None:
            del owner.step
        else:
            owner.step = previous


class HaltAfterStep:
    """``engine.step()`` wrapped so that a halt the guard raised inside it (``hold``) is raised once it has finished.

    The guard's halt comes before DeepSpeed counts the micro-step: raised at once, the engine would count one
    micro-step too few, and a loop that catches the halt and goes on would have every later update mix the
    micro-batches of two of its steps. The hook that holds the halt has taken the skip's path (no update), so the
    engine finishes as after a skipped step: the micro-step, the update and the samples counted, the LR scheduler held
    where DeepSpeed holds it for a skip."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.inside = False
        """Whether ``engine.step()`` is running: a halt outside it (a direct ``engine.optimizer.step()``) is raised at
        once."""
        self._held: list[BaseException] = []
        self._previous = vars(engine).get("step")
        inner = engine.step

        def step(*args: Any, **kwargs: Any) -> Any:
            self._held.clear()
            self.inside = True
            try:
                result = inner(*args, **kwargs)
            finally:
                self.inside = False
            if self._held:
                raise self._held.pop()
            return result

        self._wrapper = step
        engine.step = step

    def hold(self, halt: BaseException) -> None:
        self._held.append(halt)

    def remove(self) -> None:
        _put_back(self.engine, self._wrapper, self._previous)


class UpdateHook:
    """Runs ``before()`` once per update, between the reduction and DeepSpeed's overflow check, clip and update.

    ``before`` returning False skips the update (``skip_update``): it must return the same on every rank,
    which is the caller's collective's job. When DeepSpeed's step ran, ``after(overflow)`` says whether it
    skipped the update itself (non-finite gradients under fp16/bf16). An exception from ``before`` (a halt) takes the
    skip's path too, the weights untouched and this boundary's gradients dropped, and inside ``engine.step()`` is
    raised once that step has finished, counted as a skipped one (``HaltAfterStep``).
    """

    def __init__(self, engine: Any, before: Callable[[], bool], after: Callable[[bool], None] | None = None) -> None:
        self.engine = engine
        self.optimizer = opt = engine.optimizer
        self._previous = vars(opt).get("step")
        # A client optimizer (ZeRO 0) has no ``overflow``: the engine reads it only when present.
        self._added_overflow = not hasattr(opt, "overflow")
        self.halts = halts = HaltAfterStep(engine)
        inner = opt.step

        def step(*args: Any, **kwargs: Any) -> Any:
            try:
                go = before()
            except BaseException as halt:
                if not halts.inside:
                    _drop(engine)
                    raise
                skip_update(engine)
                halts.hold(halt)
                return None
            if not go:
                skip_update(engine)
                return None
            if self._added_overflow:
                opt.overflow = False
            result = inner(*args, **kwargs)
            if after is not None:
                after(bool(getattr(opt, "overflow", False)))
            return result

        self._wrapper = step
        opt.step = step

    def remove(self) -> None:
        """Give the optimizer and the engine their own ``step`` back (the class method, or what was there before)."""
        opt = self.optimizer
        _put_back(opt, self._wrapper, self._previous)
        self.halts.remove()
        if self._added_overflow and "overflow" in vars(opt):
            del opt.overflow


class HeldStill:
    """The parameters held as they are through this update (``hold``), put back after DeepSpeed's step (``put_back``).

    What is kept of each: its weights (the whole parameter every rank holds at ZeRO 1/2; at ZeRO 3 this rank's
    partition, and a whole that the step gathered with the update, a persistent parameter's, is released, so that
    the next forward gathers it from the partitions put back; no collective here), the fp32 master
    copy of this rank's piece, and that piece of every optimizer state tensor laid out as the master partition
    (momentum, Adam's moments). A state tensor the update itself made (the first step's) gets zeros there: the
    parameter has no history in it. A state scalar shared by the whole partition (Adam's step count) moves on.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.stage3 = layout(engine) == "stage3"
        self._held: list[tuple[Any, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
        self._masters: list[tuple[torch.Tensor, torch.Tensor, int, dict[str, torch.Tensor]]] = []

    def hold(self, param: Any, weight: torch.Tensor, master: torch.Tensor | None) -> None:
        """Keep ``param`` as it is: ``weight`` is this rank's piece of its weights (``ZeroGradients.weights``),
        ``master`` its fp32 master piece (``ZeroGradients.master``)."""
        whole = None if self.stage3 else param.detach().clone()
        self._held.append((param, weight, weight.clone() if self.stage3 else None, whole))
        if master is None or not master.numel():
            return
        base, offset = self._base(master)
        state = inner_optimizer(self.engine).state.get(base, {})
        slices = {
            key: value.narrow(0, offset, master.numel()).clone()
            for key, value in state.items()
            if isinstance(value, torch.Tensor) and value.shape == base.shape
        }
        self._masters.append((master, master.clone(), offset, slices))

    def _base(self, master: torch.Tensor) -> tuple[torch.Tensor, int]:
        opt = self.engine.optimizer
        kind = layout(self.engine)
        bases = (
            opt.fp32_partitioned_groups_flat
            if kind == "stage3"
            else opt.single_partition_of_fp32_groups
            if kind == "zero"
            else opt.fp32_groups_flat_partition
        )
        for base in bases:
            if base.untyped_storage().data_ptr() == master.untyped_storage().data_ptr():
                return base, master.storage_offset() - base.storage_offset()
        raise RuntimeError("a DeepSpeed master piece lies in none of the optimizer's flat partitions")

    @torch.no_grad()
    def put_back(self) -> None:
        """After DeepSpeed's step: every held parameter as it was before it (local copies: no collective)."""
        held, self._held = self._held, []
        masters, self._masters = self._masters, []
        for param, _, partition, whole in held:
            if partition is not None:  # ZeRO 3: this rank's partition, which later gathers read (found again: DeepSpeed
                # points it at its flat buffer anew after each step)
                param.ds_tensor.data.view(-1).narrow(0, 0, partition.numel()).copy_(partition)
                if param.numel():  # gathered by the step (a persistent parameter): with the update, so released, to
                    param.partition(has_been_updated=False)  # be gathered anew from the partitions (locally)
            if whole is not None:
                param.data.copy_(whole)
        inner = inner_optimizer(self.engine)
        for master, saved, offset, slices in masters:
            master.copy_(saved)
            base, _ = self._base(master)
            for key, value in inner.state.get(base, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == base.shape:
                    piece = value.narrow(0, offset, master.numel())
                    if key in slices:
                        piece.copy_(slices[key])
                    else:
                        piece.zero_()

    def clear(self) -> None:
        """Nothing held (an update that did not run: a halt or a skip leaves everything as it was anyway)."""
        self._held, self._masters = [], []
