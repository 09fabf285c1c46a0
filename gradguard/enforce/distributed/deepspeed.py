"""DeepSpeed ZeRO 0/1/2: where the reduced gradient of each parameter lives, and the one place to act on it.

Under ZeRO 1 and 2 no rank ever holds a parameter's whole reduced gradient: after the boundary backward,
each rank holds the averaged gradient of its own flat partition (``engine.optimizer.averaged_gradients``),
a partition boundary may cut a parameter in two, and ``p.grad`` is ``None`` everywhere. DeepSpeed then
clips, updates and all-gathers the weights inside ``engine.optimizer.step()``, called by ``engine.step()``
only at an accumulation boundary. So the guard hooks there (an instance attribute shadowing the bound
method, the only point between the reduction and DeepSpeed's own overflow check, norm, clip and update),
and reads each parameter's piece through DeepSpeed's own offset bookkeeping (``grad_start_offset`` /
``grad_partition_insertion_offset``, which stay right where ``p._hp_mapping`` does not). Every rank gets
an entry for every parameter (empty where it holds none), so per-tensor sums line up for one collective.

DeepSpeed is optional: nothing here imports it. The engine and its optimizers are recognised by class
name, and whatever this module does not map is refused at attach (``refusal``) with what works instead.

Scale: under fp16 the pieces carry DeepSpeed's loss scale (``loss_scale()``; DeepSpeed divides by it,
together with its global clip, only after the hook); bf16 and fp32 pieces are unscaled. Micro-batches
are already averaged (the engine divides the loss by the accumulation steps) and so are the ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradguard.errors import GuardStateError

__all__ = [
    "UpdateHook",
    "ZeroGradients",
    "deepspeed_engine",
    "inner_optimizer",
    "layout",
    "loss_scale",
    "refusal",
    "skip_update",
]

_ZERO = "DeepSpeedZeroOptimizer"
"""ZeRO 1 and 2 (stage_1_and_2.py): partitioned, reduced gradients in ``averaged_gradients``."""
_BF16 = "BF16_Optimizer"
"""bf16 weights with fp32 gradient accumulation at ZeRO 1: the whole reduced fp32 gradient on every rank."""
_WORKS = "What works: ZeRO stage 0 (fp32), 1 or 2 on a plain DeepSpeedEngine, without offload."


def _class_names(obj: object) -> list[str]:
    return [f"{klass.__module__}.{klass.__qualname__}" for klass in type(obj).__mro__]


def deepspeed_engine(model: object) -> Any | None:
    """``model`` when it is a DeepSpeedEngine (or a subclass), else None; recognised without importing deepspeed."""
    names = _class_names(model)
    if any(name.startswith("deepspeed.") and name.endswith(".DeepSpeedEngine") for name in names):
        return model
    return None


def layout(engine: Any) -> str:
    """``zero`` (ZeRO 1/2), ``bf16`` (BF16_Optimizer) or ``plain`` (ZeRO 0: the client optimizer itself)."""
    name = type(engine.optimizer).__name__
    if name in (_ZERO, _BF16):
        return "zero" if name == _ZERO else "bf16"
    return "plain"


def _offloaded(config: Any) -> bool:
    device = getattr(config, "device", None) if config is not None else None
    return device is not None and str(getattr(device, "value", device)).lower() != "none"


def refusal(engine: Any) -> str | None:
    """None when the gradients of ``engine`` can be mapped and guarded; else why not, and what works.

    Refused: anything that is not a plain DeepSpeedEngine (PipelineEngine), ZeRO 3, MoE, offload, model,
    tensor or sequence parallelism, Muon, ZenFlow, a torch-autocast GradScaler, and at stage 0 DeepSpeed's
    fp16/bf16 wrappers. ``round_robin_gradients`` is mapped: its reordering makes DeepSpeed's fragment map
    (``p._hp_mapping``, ``safe_get_full_grad``) wrong, but not the offset tables and ``params_in_partition`` that
    ``ZeroGradients`` reads, which ZeRO builds from the round-robin order itself. DeepSpeed's own clip at stage 0
    (``gradient_clipping``, 1.0 in a config that does not say) is not refused: the guard's step runs before it
    (``hooks.deepspeed_boundary.ClipHook``).
    """
    names = _class_names(engine)
    if deepspeed_engine(engine) is None:
        return f"{type(engine).__name__} is not a DeepSpeedEngine. {_WORKS}"
    if any(name.endswith(".PipelineEngine") for name in names) or getattr(engine, "pipeline_parallelism", False):
        return f"the PipelineEngine splits the model into stages that each hold other parameters. {_WORKS}"
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None:
        return "the engine has no optimizer (inference?): there is no update to guard."
    stage = int(engine.zero_optimization_stage())
    module = getattr(engine, "module", None)
    params = list(module.parameters()) if module is not None else []
    if stage >= 3 or "Stage3" in type(optimizer).__name__ or any(hasattr(p, "ds_id") for p in params):
        return (
            "ZeRO stage 3 partitions the parameters themselves and reduces gradients into buffers this adapter does "
            f"not map. {_WORKS} Or use FSDP2, which the guard supports."
        )
    if getattr(engine, "has_moe_layers", False) or getattr(optimizer, "has_moe_layers", False):
        return f"MoE layers reduce expert gradients over their own expert-data-parallel groups. {_WORKS}"
    zero_config = getattr(getattr(engine, "_config", None), "zero_config", None)
    if (
        bool(engine.zero_cpu_offload())
        or getattr(optimizer, "cpu_offload", False)
        or _offloaded(getattr(zero_config, "offload_optimizer", None))
    ):
        return (
            "optimizer offload (CPU/NVMe) writes gradients straight into the fp32 partition during backward, not "
            f"into averaged_gradients. {_WORKS}"
        )
    if _offloaded(getattr(zero_config, "offload_param", None)):
        return f"parameter offload is a ZeRO 3 feature. {_WORKS}"
    if int(getattr(engine, "mp_world_size", 1) or 1) > 1 or int(getattr(engine, "sequence_parallel_size", 1) or 1) > 1:
        return f"model/tensor or sequence parallelism shards parameters over another group. {_WORKS}"
    inner = getattr(optimizer, "optimizer", optimizer)
    if "Muon" in type(inner).__name__ or any(group.get("use_muon", False) for group in inner.param_groups):
        return f"Muon copies whole matrices to several ranks, so pieces overlap. {_WORKS}"
    if getattr(engine, "zenflow", False):
        return f"ZenFlow updates parameters selectively outside the step this adapter hooks. {_WORKS}"
    if getattr(engine, "torch_autocast_z0_gradscaler", None) is not None:
        return f"torch autocast with a GradScaler steps the optimizer through the scaler. {_WORKS}"
    kind = layout(engine)
    if kind == "zero":
        groups = {id(group) for group in optimizer.real_dp_process_group}
        if len(groups) > 1:
            return f"the parameter groups reduce over different process groups. {_WORKS}"
        return None
    if kind == "bf16":
        return None
    if stage != 0 or optimizer is not getattr(engine, "basic_optimizer", None):
        return (
            f"{type(optimizer).__name__} (DeepSpeed's fp16/bf16 wrapper at stage 0) keeps gradients this adapter "
            f"does not map. {_WORKS} Or ZeRO 1/2 with fp16/bf16."
        )
    return None


def inner_optimizer(engine: Any) -> torch.optim.Optimizer:
    """The torch optimizer that updates: at ZeRO 1/2 (and under BF16_Optimizer) the client optimizer DeepSpeed wraps,
    whose parameters DeepSpeed made this rank's fp32 master partitions; at ZeRO 0 the client optimizer itself."""
    opt = engine.optimizer
    inner: torch.optim.Optimizer = opt.optimizer if layout(engine) != "plain" else opt
    return inner


def loss_scale(engine: Any) -> float:
    """The factor the gradient pieces carry now: DeepSpeed's current fp16 loss scale, else 1.0 (bf16, fp32)."""
    if layout(engine) != "zero":
        return 1.0
    scale = engine.optimizer.loss_scale
    return float(scale.item() if isinstance(scale, torch.Tensor) else scale)


class ZeroGradients:
    """This rank's piece of each parameter's reduced, averaged gradient, read inside the update hook.

    ``pieces()`` returns one 1-D tensor per parameter of ``params`` (the model's parameters by default),
    in that order: a view into DeepSpeed's buffers (in-place edits reach the update), or an empty tensor
    of the same dtype and device where this rank holds none of it. With ``whole`` False (ZeRO 1/2) the
    pieces of a parameter on all ranks of ``group`` add up to its gradient: sum per-tensor figures across
    them (sums of squares, non-finite counts). With ``whole`` True (ZeRO 0, BF16_Optimizer) every rank
    holds the whole gradient: summing across ranks would count it ``world`` times.
    """

    def __init__(self, engine: Any, params: Sequence[torch.nn.Parameter] | None = None) -> None:
        reason = refusal(engine)
        if reason is not None:
            raise GuardStateError(f"gradguard cannot guard this DeepSpeed engine: {reason}")
        self.engine = engine
        self.params = list(params) if params is not None else list(engine.module.parameters())
        self.layout = layout(engine)
        self.whole = self.layout != "zero"
        opt = engine.optimizer
        self.group: Any = opt.real_dp_process_group[0] if self.layout != "plain" else engine.data_parallel_group
        if self.layout == "zero":
            self.dtype: torch.dtype = opt.gradient_accumulation_dtype
        elif self.layout == "bf16":
            self.dtype = opt.fp32_groups_gradients_flat[0].dtype
        else:
            self.dtype = self.params[0].dtype if self.params else torch.float32

    def loss_scale(self) -> float:
        """DeepSpeed's current loss scale, which the pieces carry (1.0 without fp16)."""
        return loss_scale(self.engine)

    def _empty(self, param: torch.nn.Parameter) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=param.device)

    def pieces(self) -> list[torch.Tensor]:
        """One 1-D view per parameter (empty where this rank holds none); only between the boundary backward
        and DeepSpeed's step, i.e. inside ``UpdateHook``'s ``before``."""
        index = {id(param): i for i, param in enumerate(self.params)}
        found: list[torch.Tensor | None] = [None] * len(self.params)
        opt = self.engine.optimizer
        if self.layout == "plain":
            for i, param in enumerate(self.params):
                found[i] = param.grad
        elif self.layout == "bf16":
            for group, grads in zip(opt.bf16_groups, opt.fp32_groups_gradients, strict=True):
                for param, grad in zip(group, grads, strict=True):
                    if id(param) in index:
                        found[index[id(param)]] = grad
        else:
            for g, params in enumerate(opt.params_in_partition):
                grads = opt.averaged_gradients.get(g)
                if grads is None:
                    if not params:
                        continue
                    raise GuardStateError(
                        "DeepSpeed holds no reduced gradients now: pieces() is only valid inside the update hook, "
                        "between the backward of an accumulation boundary and DeepSpeed's optimizer step."
                    )
                rank = dist.get_rank(group=opt.real_dp_process_group[g])
                size = int(opt.partition_size[g])
                # Interleaved padding is flagged; the last rank's trailing pad is not, so pair with the params
                # (DeepSpeed's get_grad_norm_direct does the same).
                real = [grad for grad in grads if not getattr(grad, "_zero_padding", False)]
                if len(real) < len(params):
                    raise GuardStateError("DeepSpeed holds fewer gradient buffers than parameters in its partition.")
                for param, grad in zip(params, real, strict=False):
                    pid = opt.get_param_id(param)
                    start = int(opt.grad_start_offset[g][rank][pid])
                    length = min(param.numel() - start, size - int(opt.grad_partition_insertion_offset[g][rank][pid]))
                    if grad.numel() != length:
                        raise GuardStateError(
                            f"DeepSpeed's partition bookkeeping disagrees with its gradient buffers ({grad.numel()} "
                            f"elements held, {length} expected): this DeepSpeed version or configuration is not mapped."
                        )
                    if id(param) in index:
                        found[index[id(param)]] = grad
        out = []
        for param, grad in zip(self.params, found, strict=True):
            if grad is None:
                out.append(self._empty(param))
            elif not grad.is_contiguous():
                raise GuardStateError("a DeepSpeed gradient buffer is not contiguous: no 1-D view of it exists.")
            else:
                out.append(grad.view(-1))
        return out


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
    if kind == "zero":
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


class UpdateHook:
    """Runs ``before()`` once per update, between the reduction and DeepSpeed's overflow check, clip and update.

    ``before`` returning False skips the update (``skip_update``): it must return the same on every rank,
    which is the caller's collective's job. When DeepSpeed's step ran, ``after(overflow)`` says whether it
    skipped the update itself (non-finite gradients under fp16/bf16). An exception from ``before`` propagates
    with the weights untouched and this boundary's gradients dropped (so a caller that goes on does not fold
    them into its next update); that ``engine.step()`` did not finish, so its counters are not advanced.
    """

    def __init__(self, engine: Any, before: Callable[[], bool], after: Callable[[bool], None] | None = None) -> None:
        self.engine = engine
        self.optimizer = opt = engine.optimizer
        self._previous = vars(opt).get("step")
        # A client optimizer (ZeRO 0) has no ``overflow``: the engine reads it only when present.
        self._added_overflow = not hasattr(opt, "overflow")
        inner = opt.step

        def step(*args: Any, **kwargs: Any) -> Any:
            try:
                go = before()
            except BaseException:
                _drop(engine)
                raise
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
        """Give the optimizer its own ``step`` back (the class method, or what was there before)."""
        opt = self.optimizer
        if vars(opt).get("step") is self._wrapper:
            if self._previous is None:
                del opt.step
            else:
                opt.step = self._previous
        if self._added_overflow and "overflow" in vars(opt):
            del opt.overflow
