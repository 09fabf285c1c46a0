"""DeepSpeed ZeRO 0-3: where the reduced gradient of each parameter lives, and the one place to act on it.

Under ZeRO 1 and 2 no rank ever holds a parameter's whole reduced gradient: after the boundary backward,
each rank holds the averaged gradient of its own flat partition (``engine.optimizer.averaged_gradients``),
a partition boundary may cut a parameter in two, and ``p.grad`` is ``None`` everywhere. DeepSpeed then
clips, updates and all-gathers the weights inside ``engine.optimizer.step()``, called by ``engine.step()``
only at an accumulation boundary. So the guard hooks there (an instance attribute shadowing the bound
method, the only point between the reduction and DeepSpeed's own overflow check, norm, clip and update),
and reads each parameter's piece through DeepSpeed's own offset bookkeeping (``grad_start_offset`` /
``grad_partition_insertion_offset``, which stay right where ``p._hp_mapping`` does not). Every rank gets
an entry for every parameter (empty where it holds none), so per-tensor sums line up for one collective.

ZeRO 3 partitions each parameter on its own: rank ``r`` holds its flat elements from ``r * partition_numel()``
(``param.ds_tensor``; the last rank's partition is padded), each boundary backward reduce-scatters every gradient
into the same places (``averaged_gradients[sub group]``, views of ``grad_partitions_flat_buffer``), and ``step()``
flattens them into ``fp32_partitioned_groups_flat[sub group].grad`` at ``grad_position``'s offsets, clips and
applies them, sub group by sub group: the same hook, the same kind of piece, a piece of every parameter on every
rank that holds real elements of it.

DeepSpeed is optional: nothing here imports it. The engine and its optimizers are recognised by class
name, and whatever this module does not map is refused at attach (``refusal``) with what works instead.

Scale: under fp16 the pieces carry DeepSpeed's loss scale (``loss_scale()``; DeepSpeed divides by it,
together with its global clip, only after the hook); bf16 and fp32 pieces are unscaled. Micro-batches
are already averaged (the engine divides the loss by the accumulation steps) and so are the ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradguard.errors import GuardStateError

__all__ = ["ZeroGradients", "deepspeed_engine", "inner_optimizer", "layout", "loss_scale", "refusal"]

_ZERO = "DeepSpeedZeroOptimizer"
"""ZeRO 1 and 2 (stage_1_and_2.py): partitioned, reduced gradients in ``averaged_gradients``."""
_STAGE3 = "DeepSpeedZeroOptimizer_Stage3"
"""ZeRO 3 (stage3.py): each parameter's own partition of its reduce-scattered gradient in ``averaged_gradients``."""
_BF16 = "BF16_Optimizer"
"""bf16 weights with fp32 gradient accumulation at ZeRO 1: the whole reduced fp32 gradient on every rank."""
_WORKS = "What works: ZeRO stage 0 (fp32), 1, 2 or 3 on a plain DeepSpeedEngine, without offload."


def _class_names(obj: object) -> list[str]:
    return [f"{klass.__module__}.{klass.__qualname__}" for klass in type(obj).__mro__]


def deepspeed_engine(model: object) -> Any | None:
    """``model`` when it is a DeepSpeedEngine (or a subclass), else None; recognised without importing deepspeed."""
    names = _class_names(model)
    if any(name.startswith("deepspeed.") and name.endswith(".DeepSpeedEngine") for name in names):
        return model
    return None


def layout(engine: Any) -> str:
    """``zero`` (ZeRO 1/2), ``stage3``, ``bf16`` (BF16_Optimizer) or ``plain`` (ZeRO 0: the client optimizer)."""
    return {_ZERO: "zero", _STAGE3: "stage3", _BF16: "bf16"}.get(type(engine.optimizer).__name__, "plain")


def _offloaded(config: Any) -> bool:
    device = getattr(config, "device", None) if config is not None else None
    return device is not None and str(getattr(device, "value", device)).lower() != "none"


def refusal(engine: Any) -> str | None:
    """None when the gradients of ``engine`` can be mapped and guarded; else why not, and what works.

    Refused: anything that is not a plain DeepSpeedEngine (PipelineEngine), a ZeRO 3 optimizer other than
    ``DeepSpeedZeroOptimizer_Stage3``, MoE, optimizer or parameter offload, model, tensor or sequence
    parallelism, Muon, ZenFlow, a torch-autocast GradScaler, and at stage 0 DeepSpeed's fp16/bf16 wrappers.
    ``round_robin_gradients`` is mapped: its reordering makes DeepSpeed's fragment map (``p._hp_mapping``,
    ``safe_get_full_grad``) wrong, but not the offset tables and ``params_in_partition`` that ``ZeroGradients``
    reads, which ZeRO builds from the round-robin order itself. DeepSpeed's own clip at stage 0
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
    if stage >= 3 and layout(engine) != "stage3":  # a ZeRO 3 optimizer of another kind (older DeepSpeeds' MiCS)
        return f"{type(optimizer).__name__} partitions ZeRO 3 in a way this adapter does not map. {_WORKS}"
    if getattr(engine, "has_moe_layers", False) or getattr(optimizer, "has_moe_layers", False):
        return f"MoE layers reduce expert gradients over their own expert-data-parallel groups. {_WORKS}"
    zero_config = getattr(getattr(engine, "_config", None), "zero_config", None)
    if (
        bool(engine.zero_cpu_offload())
        or getattr(optimizer, "cpu_offload", False)
        or _offloaded(getattr(zero_config, "offload_optimizer", None))
    ):
        read_point = (
            "each parameter's gradient partition (grad_partitions_flat_buffer) the guard reads at ZeRO 3"
            if stage >= 3
            else "the averaged_gradients the guard reads at ZeRO 1 and 2"
        )
        return (
            "optimizer offload (CPU/NVMe) writes gradients straight into the fp32 partition in host memory during "
            f"backward (or swaps it to NVMe), not into {read_point}. {_WORKS}"
        )
    if _offloaded(getattr(zero_config, "offload_param", None)):
        return (
            "parameter offload keeps ZeRO 3's partitions in host memory or on NVMe, swapped in and out around each "
            f"use, where the guard's reads and a drop's hold would meet them swapped out. {_WORKS}"
        )
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
    if kind in ("zero", "stage3"):
        groups = optimizer.real_dp_process_group if kind == "zero" else optimizer.sub_group_process_groups
        if len({id(group) for group in groups}) > 1:
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
    if layout(engine) not in ("zero", "stage3"):
        return 1.0
    scale = engine.optimizer.loss_scale
    return float(scale.item() if isinstance(scale, torch.Tensor) else scale)


class ZeroGradients:
    """This rank's piece of each parameter's reduced, averaged gradient, read inside the update hook.

    ``pieces()`` returns one 1-D tensor per parameter of ``params`` (the model's parameters by default),
    in that order: a view into DeepSpeed's buffers (in-place edits reach the update), or an empty tensor
    of the same dtype and device where this rank holds none of it; ``starts`` then holds where each piece
    begins in its parameter's flat elements, ``weights()`` the weights at the same places and ``master(i)``
    the fp32 master copy's. With ``whole`` False (ZeRO 1/2/3) the pieces of a parameter on all ranks of
    ``group`` add up to its gradient: sum per-tensor figures across them (sums of squares, non-finite
    counts). With ``whole`` True (ZeRO 0, BF16_Optimizer) every rank holds the whole gradient: summing
    across ranks would count it ``world`` times.
    """

    def __init__(self, engine: Any, params: Sequence[torch.nn.Parameter] | None = None) -> None:
        reason = refusal(engine)
        if reason is not None:
            raise GuardStateError(f"gradguard cannot guard this DeepSpeed engine: {reason}")
        self.engine = engine
        self.params = list(params) if params is not None else list(engine.module.parameters())
        self.layout = layout(engine)
        self.whole = self.layout in ("plain", "bf16")
        opt = engine.optimizer
        if self.layout == "stage3":
            self.group: Any = opt.dp_process_group
        else:
            self.group = opt.real_dp_process_group[0] if self.layout != "plain" else engine.data_parallel_group
        if self.layout in ("zero", "stage3"):
            self.dtype: torch.dtype = opt.gradient_accumulation_dtype
        elif self.layout == "bf16":
            self.dtype = opt.fp32_groups_gradients_flat[0].dtype
        else:
            self.dtype = self.params[0].dtype if self.params else torch.float32
        self.starts: list[int] = [0] * len(self.params)
        self._masters: list[torch.Tensor | None] = [None] * len(self.params)

    def loss_scale(self) -> float:
        """DeepSpeed's current loss scale, which the pieces carry (1.0 without fp16)."""
        return loss_scale(self.engine)

    def shape(self, param: torch.nn.Parameter) -> tuple[int, ...]:
        """The whole parameter's shape (a ZeRO 3 parameter is empty between its forwards)."""
        return tuple(getattr(param, "ds_shape", None) or param.shape)

    def pieces(self) -> list[torch.Tensor]:
        """One 1-D view per parameter (empty where this rank holds none); only between the boundary backward
        and DeepSpeed's step, i.e. inside ``UpdateHook``'s ``before``."""
        index = {id(param): i for i, param in enumerate(self.params)}
        found: list[torch.Tensor | None] = [None] * len(self.params)
        self.starts, self._masters = [0] * len(self.params), [None] * len(self.params)
        opt = self.engine.optimizer
        if self.layout == "plain":
            found = [param.grad for param in self.params]
        elif self.layout == "bf16":
            for group, grads in zip(opt.bf16_groups, opt.fp32_groups_gradients, strict=True):
                for param, grad in zip(group, grads, strict=True):
                    if id(param) in index:
                        found[index[id(param)]] = grad
                        mapping = getattr(param, "_hp_mapping", None)
                        self._masters[index[id(param)]] = mapping.hp_fragment if mapping is not None else None
        elif self.layout == "stage3":
            self._stage3(index, found)
        else:
            self._zero(index, found)
        out = []
        for param, grad in zip(self.params, found, strict=True):
            if grad is None:
                out.append(torch.empty(0, dtype=self.dtype, device=param.device))
            elif not grad.is_contiguous():
                raise GuardStateError("a DeepSpeed gradient buffer is not contiguous: no 1-D view of it exists.")
            else:
                out.append(grad.view(-1))
        return out

    def _held(self, g: int, grads: Any, params: Sequence[Any]) -> Any:
        if grads is None and params:
            raise GuardStateError(
                "DeepSpeed holds no reduced gradients now: pieces() is only valid inside the update hook, "
                "between the backward of an accumulation boundary and DeepSpeed's optimizer step."
            )
        return grads

    def _zero(self, index: dict[int, int], found: list[torch.Tensor | None]) -> None:
        """ZeRO 1/2: the averaged gradients of the partition's parameters, placed by ZeRO's own offset tables."""
        opt = self.engine.optimizer
        for g, params in enumerate(opt.params_in_partition):
            grads = self._held(g, opt.averaged_gradients.get(g), params)
            if grads is None:
                continue
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
                inserted = int(opt.grad_partition_insertion_offset[g][rank][pid])
                length = min(param.numel() - start, size - inserted)
                if grad.numel() != length:
                    raise GuardStateError(
                        f"DeepSpeed's partition bookkeeping disagrees with its gradient buffers ({grad.numel()} "
                        f"elements held, {length} expected): this DeepSpeed version or configuration is not mapped."
                    )
                if id(param) in index:
                    i = index[id(param)]
                    found[i], self.starts[i] = grad, start
                    self._masters[i] = opt.single_partition_of_fp32_groups[g].narrow(0, inserted, length)

    def _stage3(self, index: dict[int, int], found: list[torch.Tensor | None]) -> None:
        """ZeRO 3: each parameter's own partition (``partition_numel`` elements from ``rank * partition_numel`` of
        its flat elements, the last rank's padded): its reduce-scattered gradient in ``averaged_gradients[sub
        group]``, its fp32 master at ``grad_position``'s offset in the sub group's flat master."""
        opt = self.engine.optimizer
        for g, params in enumerate(opt.fp16_groups):
            grads = self._held(g, opt.averaged_gradients.get(g), params)
            if grads is None:
                continue
            rank = dist.get_rank(group=opt._get_sub_group_process_group(g))
            for param, grad in zip(params, grads, strict=True):
                size = int(param.partition_numel())
                start = rank * size
                length = max(0, min(size, int(param.ds_numel) - start))
                if grad.numel() != size or int(opt.grad_position[opt.get_param_id(param)][0]) != g:
                    raise GuardStateError(
                        "DeepSpeed's ZeRO 3 partition bookkeeping disagrees with its gradient buffers: this DeepSpeed "
                        "version or configuration is not mapped."
                    )
                if id(param) in index:
                    i = index[id(param)]
                    found[i], self.starts[i] = grad.narrow(0, 0, length), start
                    offset = int(opt.grad_position[opt.get_param_id(param)][1])
                    self._masters[i] = opt.fp32_partitioned_groups_flat[g].narrow(0, offset, length)

    def weights(self, pieces: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The model's weights at the places of ``pieces`` (this ``pieces()``'s), 1-D: at ZeRO 3 this rank's own
        partition of each parameter, elsewhere a view of the whole parameter every rank holds."""
        out = []
        params: list[Any] = self.params  # ZeRO 3's are DeepSpeed's, with its ds_ attributes
        for param, piece, start in zip(params, pieces, self.starts, strict=True):
            if self.layout == "stage3":
                out.append(param.ds_tensor.detach().view(-1).narrow(0, 0, piece.numel()))
            else:
                out.append(param.detach().view(-1).narrow(0, start, piece.numel()))
        return out

    def master(self, i: int) -> torch.Tensor | None:
        """The fp32 master copy of this rank's piece of parameter ``i`` (a view of the flat master partition that
        the inner optimizer updates), after ``pieces()``; None where this rank's update holds none of it, or at
        ZeRO 0 (the client optimizer steps the model's own parameters)."""
        return self._masters[i]
