"""A DeepSpeed engine's update as the guard's boundary: ZeRO 1, 2 and 3 (and bf16 with fp32 accumulation).

``GradGuard(engine, policy)`` guards ``engine.module`` (the model's own names, no ``module.`` prefix). At ZeRO 1, 2
and 3 no ``p.grad`` holds the gradient the update applies: each rank holds its partition of the reduced gradients, and
DeepSpeed clips and applies them inside ``engine.optimizer.step()`` (``enforce.distributed.deepspeed``). So the
guard's step runs there, once per update (after every micro-batch of an accumulation), on this rank's piece of each
gradient (``StepContext.gradients``); its per-tensor figures are combined over the ranks in one collective, as under
FSDP2, so every rank reaches the same verdict. A skip takes DeepSpeed's own overflow path without touching its loss
scale; a halt raises before DeepSpeed's update. At ZeRO 0 the client optimizer steps the model's own gradients, and
the guard's usual optimizer hooks treat them; where DeepSpeed clips them first (``gradient_clipping``, which it sets to
1.0 when a config does not say), ``ClipHook`` runs the guard's step before that clip, as the loop's own
``clip_grad_norm_`` does in a plain loop, so the policy meets the raw gradients.

Under fp16 the pieces carry DeepSpeed's loss scale: a step with a non-finite piece on any rank is DeepSpeed's to skip
(its loss-scale search), counted once as a ``scaler_skip`` as under torch's GradScaler, and a persisting overflow
halts as it does there (``halt_on_nonfinite``'s ``min_loss_scale``, skips in a row). The policy meets the unscaled
gradients: fp32 copies of the pieces divided by the scale (known at the step as a host float), written back times it
(bitwise the piece where nothing changed it: an fp16 value divided and multiplied back in fp32 rounds to itself), and
the ``loss`` section the unscaled loss (``LossScaleHook``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradguard.enforce.distributed.deepspeed import ZeroGradients, inner_optimizer, layout, refusal
from gradguard.enforce.distributed.deepspeed_update import HaltAfterStep, HeldStill, UpdateHook
from gradguard.enforce.hooks.torch_hooks import note_scaled_root
from gradguard.enforce.work.places import Place
from gradguard.enforce.work.step_work import StepContext, StepPlan
from gradguard.errors import GuardStateError
from gradguard.policy.document import Policy

__all__ = [
    "ClipHook",
    "DeepSpeedBoundary",
    "LossScaleHook",
    "boundary_name",
    "clips_before_step",
    "needs_update_hook",
    "refuse_under_deepspeed",
]


def refuse_under_deepspeed(
    engine: Any | None, policy: Policy, *, per_micro_batch: bool, process_group: Any = None
) -> None:
    """What the guard cannot do on this engine (None: not one), refused at attach with why and what works."""
    if engine is None:
        return
    reason = refusal(engine)
    if reason is not None:
        raise GuardStateError(f"gradguard cannot guard this DeepSpeed engine: {reason}")
    if process_group is not None and dist.is_initialized():
        ours, theirs = _ranks(process_group), _ranks(_dp_group(engine))
        if ours != theirs:
            raise GuardStateError(
                f"process_group holds ranks {ours}, but DeepSpeed reduces the gradients over ranks "
                f"{theirs}: the guard's per-tensor sums must be taken over DeepSpeed's data-parallel group. "
                "Leave process_group out (the default group) or pass that group."
            )
    where = f"policy {policy.source!r}"
    fp16 = bool(getattr(engine, "fp16_enabled", lambda: False)())
    if policy.recovery is not None and fp16:
        raise GuardStateError(
            f"{where} has a recovery section, which gradguard does not support under DeepSpeed's fp16: its dynamic "
            "loss scaler is not in the guard's snapshots, so a rewind would not be exact. Train in bf16 (recommended), "
            "or remove the section and resume from DeepSpeed's checkpoints (engine.save_checkpoint)."
        )
    if policy.ranks is not None and policy.ranks.check_replicas_every is not None and layout(engine) == "stage3":
        raise GuardStateError(
            f"{where}: ranks.check_replicas_every compares data-parallel replicas' weights, but ZeRO 3 partitions the "
            "parameters: no two ranks hold the same weights to compare. Remove check_replicas_every at ZeRO 3; it "
            "works at ZeRO 0, 1 and 2."
        )
    if per_micro_batch:
        raise GuardStateError(
            "per_micro_batch=True is not supported under DeepSpeed: the micro-batches' gradients are reduced into "
            "DeepSpeed's partitions, not into p.grad. Leave it False: the guard acts once per update."
        )


def _ranks(group: Any) -> list[int]:
    """The global ranks of ``group`` (none where this rank is not one of them)."""
    try:
        return sorted(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError, AttributeError):
        return []


def _dp_group(engine: Any) -> Any:
    group = ZeroGradients(engine).group
    return group if group is not None else dist.group.WORLD


def clips_before_step(engine: Any) -> bool:
    """Whether DeepSpeed clips the model's gradients before the client optimizer's step (ZeRO 0 with
    ``gradient_clipping``): the guard's step must then come before that clip (``ClipHook``)."""
    return layout(engine) == "plain" and float(engine.gradient_clipping()) > 0.0


def boundary_name(engine: Any) -> str:
    """Where the guard's step runs on ``engine``, as the ``attach`` event says it."""
    stage, kind = int(engine.zero_optimization_stage()), layout(engine)
    where = f"DeepSpeed ZeRO {stage}" + (" (BF16_Optimizer)" if kind == "bf16" else "")
    if kind != "plain":
        return f"{where}: inside engine.step(), after the reduction, before DeepSpeed's overflow check, clip and update"
    client = type(inner_optimizer(engine)).__name__
    if clips_before_step(engine):
        return f"{where}: inside engine.step(), before DeepSpeed's gradient_clipping and the {client}'s step"
    return f"{where}: the {client}'s step inside engine.step()"


class _Wrapped:
    """A method of one object shadowed by an instance attribute (DeepSpeed's engine and optimizer look their methods
    up on the instance), and put back at removal unless another wrapper has been put on top of ours since."""

    def __init__(self, owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        self.owner, self.name, self._wrapper = owner, name, wrapper
        self._previous = vars(owner).get(name)
        setattr(owner, name, wrapper)

    def remove(self) -> None:
        owner, name = self.owner, self.name
        if vars(owner).get(name) is not self._wrapper:
            return  # wrapped again on top of ours since: that wrapper stays
        if self._previous is None:
            delattr(owner, name)
        else:
            setattr(owner, name, self._previous)


class ClipHook(_Wrapped):
    """At ZeRO 0, runs ``before()`` (the guard's step) where DeepSpeed is about to clip (``clip_fp32_gradients``),
    then DeepSpeed's clip. ``before`` returning False (a skip: the gradients are gone) leaves the clip out, which would
    fail on no gradients; the client optimizer's step then has nothing to apply. The guard's step counts its
    gradients as treated until that step, so the clip's change does not make them new to it. A halt drops the
    gradients as a skip does and is raised once ``engine.step()`` has finished (``HaltAfterStep``), so the engine
    counts the micro-step and a loop that goes on keeps its accumulation aligned."""

    def __init__(self, engine: Any, before: Callable[[], bool]) -> None:
        original = engine.clip_fp32_gradients
        self.halts = halts = HaltAfterStep(engine)

        def clip() -> Any:
            try:
                go = before()
            except BaseException as halt:
                if not halts.inside:
                    raise
                engine.optimizer.zero_grad(set_to_none=True)  # the client optimizer's step then applies nothing
                halts.hold(halt)
                return None
            return original() if go else None

        super().__init__(engine, "clip_fp32_gradients", clip)

    def remove(self) -> None:
        super().remove()
        self.halts.remove()


class LossScaleHook(_Wrapped):
    """Under DeepSpeed's fp16 the loss reaches backward times its loss scale (``optimizer.scale_if_loss``): each scaled
    loss is handed to the guards' loss section as the loss it scaled, as after ``GradScaler.scale``."""

    def __init__(self, engine: Any) -> None:
        original = engine.optimizer.scale_if_loss

        def scale_if_loss(loss: Any) -> Any:
            scaled = original(loss)
            if isinstance(scaled, torch.Tensor) and isinstance(loss, torch.Tensor) and scaled is not loss:
                note_scaled_root(scaled, loss)
            return scaled

        super().__init__(engine.optimizer, "scale_if_loss", scale_if_loss)


def needs_update_hook(engine: Any) -> bool:
    """Whether the guard's step must run inside DeepSpeed's update (ZeRO 1-3, bf16 with fp32 accumulation), not at
    the client optimizer's step (ZeRO 0)."""
    return ZeroGradients(engine).layout != "plain"


class DeepSpeedBoundary:
    """Treats each update of a ZeRO 1/2 engine through ``treat`` (the guard's step on a context), and says when
    DeepSpeed skipped an update on its own (``skipped``, with its loss scale under fp16: a non-finite gradient the
    guard let through, or DeepSpeed's own overflow check on its global norm). The guard has then already taken the
    step as applied (its statistics, ``applied_steps``): DeepSpeed's check comes after the guard's verdict."""

    def __init__(
        self,
        engine: Any,
        params: Sequence[torch.nn.Parameter],
        treat: Callable[[StepContext], bool],
        skipped: Callable[[float | None], None],
    ) -> None:
        self._gradients = ZeroGradients(engine, params)
        self._params = list(params)
        self._held = HeldStill(engine)
        self._treat, self._skipped = treat, skipped
        self._fp16 = bool(getattr(engine, "fp16_enabled", lambda: False)())
        self._hook = UpdateHook(engine, self._before, self._after)
        scales_loss = self._fp16 and hasattr(engine.optimizer, "scale_if_loss")
        self._loss_hook = LossScaleHook(engine) if scales_loss else None

    @property
    def sharded(self) -> bool:
        """Whether each rank holds a piece of each gradient (ZeRO 1/2), not all of it (bf16 with fp32 accumulation)."""
        return not self._gradients.whole

    def _before(self) -> bool:
        self._held.clear()
        source = self._gradients
        pieces = source.pieces()
        scale = source.loss_scale() if self._fp16 else None
        treated = pieces
        if scale is not None and scale != 1.0:  # the policy's thresholds are for the unscaled gradients
            treated = [piece.to(torch.float32, copy=True).div_(scale) for piece in pieces]
        weights = source.weights(pieces)
        by_id = {id(param): k for k, param in enumerate(self._params)}
        context: StepContext

        def gradients(plan: StepPlan) -> dict[int, torch.Tensor]:
            found = {}
            for entry in plan.params:
                param = entry.ref()
                # A frozen parameter has no gradient (as p.grad is None in plain torch): not a zero one. The same on
                # every rank, so the collectives still line up.
                if param is not None and param.requires_grad and id(param) in by_id:
                    k = by_id[id(param)]
                    found[entry.index] = treated[k]
                    hold = functools.partial(self._held.hold, param, weights[k], source.master(k))
                    context.places[entry.index] = Place(source.starts[k], source.shape(param), weights[k], hold)
            return found

        found_inf = (self._overflow(pieces),) if self._fp16 else ()
        context = StepContext(
            optimizer=None,
            stepped_params=tuple,  # DeepSpeed's skip drops its partitions; no p.grad holds them
            explicit=True,
            found_inf=found_inf,
            loss_scale=scale,
            gradients=gradients,
            pieces=self.sharded,
        )
        proceed = self._treat(context)
        if proceed and treated is not pieces:
            assert scale is not None
            for piece, unscaled in zip(pieces, treated, strict=True):
                piece.copy_(unscaled.mul_(scale))  # what the policy changed, scaled again for DeepSpeed's step
        return proceed

    def _overflow(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """1.0 where a piece on any rank holds NaN or Inf (the loss-scale search's overflow), on the device."""
        present = [piece for piece in pieces if piece.numel()]
        device = pieces[0].device if pieces else torch.device("cpu")
        flag = torch.zeros((), device=device)
        if present:
            peaks = torch._foreach_norm(present, float("inf"))
            flag = torch.stack(peaks).float().isfinite().logical_not().any().float()
        if not self._gradients.whole and dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._gradients.group)
        return flag

    def _after(self, overflow: bool) -> None:
        self._held.put_back()  # what a drop held still, as it was before the update
        if overflow:  # DeepSpeed skipped an update the guard let through (fp16: counted once already)
            self._skipped(self._gradients.loss_scale() if self._fp16 else None)

    def remove(self) -> None:
        self._hook.remove()
        if self._loss_hook is not None:
            self._loss_hook.remove()
