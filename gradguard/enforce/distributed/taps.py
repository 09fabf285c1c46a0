"""Where each rank's own gradient is read, before the reduction: DDP's communication hook, FSDP2's reduce-scatter.

A tap hands the flat buffer the engine is about to reduce to ``LocalGradients.note`` (one 2-norm on the device per
bucket or per FSDP2 group, queued, never read back by itself) and then reduces it exactly as the engine would have:
a quiet guarded run stays bitwise the unguarded one (``tests/test_which_rank.py`` holds it).

- **DDP**: a communication hook (``register_comm_hook``) sees each bucket's flat local gradient before its
  all-reduce, after every tensor hook and after accumulation (under ``no_sync`` it runs at the synchronising
  backward, on the accumulated sum). Without a hook of the user's, the tap does what DDP's built-in all-reduce does
  (``x * (1 / world)``, then a sum: bitwise DDP's own). DDP takes one communication hook per model, for good: the
  tap stays registered after the guard is removed (it notes nothing then), a later guard reuses it, and a hook the
  user registers later (``register_comm_hook``, a built-in one) runs inside it. A hook registered before the guard
  cannot be looked into: the attach event says so, and no fault is named by rank.
- **FSDP2**: each ``fully_shard`` group's reduce-scatter (``set_custom_reduce_scatter``'s ``ReduceScatter``) is
  wrapped: its input is the rank's flat unsharded gradients (divided by FSDP2's pre-divide factor where it has
  one, so an outlier's norm is scaled as every rank's is).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradguard.enforce.distributed.local import LocalGradients
from gradguard.errors import GuardWarning

__all__ = ["tap_local_gradients"]

_TAP_NAME = "gradguard_local_gradients"


class _CommTap:
    """The state of the communication hook the guard registers on a DDP model (one per model, for good)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.local: weakref.ReferenceType[LocalGradients] | None = None
        self.inner: Callable[[Any, Any], Any] | None = None
        self.inner_state: Any = None


def _gradguard_local_gradients(tap: _CommTap, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """DDP's communication hook: note the bucket's local gradient, then reduce it as DDP would."""
    local = tap.local() if tap.local is not None else None
    buffer = bucket.buffer()
    if local is not None:
        local.note(buffer)
    if tap.inner is not None:
        return tap.inner(tap.inner_state, bucket)  # type: ignore[no-any-return]
    group = tap.group if tap.group is not None else dist.group.WORLD
    # What DDP's built-in all-reduce does: multiply by 1/world (not divide: the last bit differs), then sum.
    buffer.mul_(1.0 / dist.get_world_size(group))
    future: Any = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    reduced: torch.futures.Future[torch.Tensor] = future.then(lambda done: done.value()[0])
    return reduced


# DDP checks a hook's annotations against its own types, and this module's are strings (``annotations``): no
# annotations, no check of them.
_gradguard_local_gradients.__annotations__ = {}


def _tap_ddp(ddp: Any, local: LocalGradients) -> None:
    taps = [state for hook, state in getattr(ddp, "_comm_hooks", []) if isinstance(state, _CommTap)]
    if taps:  # a guard before this one registered it: take it over
        taps[0].local = weakref.ref(local)
        local.seen = "DDP communication hook"
        return
    registered = _registered_comm_hook(ddp)
    if registered is not None:
        local.unseen = (
            f"the DDP model has a communication hook of its own ({registered}), registered before the guard: each "
            "rank's own gradient is reduced inside it, out of the guard's sight. Attach the guard before registering "
            "it (the guard's hook then runs it), or no fault is named by rank"
        )
        return
    tap = _CommTap(getattr(ddp, "process_group", None))
    tap.local = weakref.ref(local)
    ddp.register_comm_hook(tap, _gradguard_local_gradients)

    def register_comm_hook(state: object, hook: Callable[[Any, Any], Any]) -> None:
        """DDP's ``register_comm_hook``, after the guard's: the user's hook runs inside the guard's tap."""
        tap.inner, tap.inner_state = hook, state
        ddp._comm_hooks.append((hook, state))

    def register_builtin_comm_hook(comm_hook_type: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        builtin = {"ALLREDUCE": default_hooks.allreduce_hook, "FP16_COMPRESS": default_hooks.fp16_compress_hook}
        name = getattr(comm_hook_type, "name", str(comm_hook_type))
        if name not in builtin:
            raise ValueError(f"gradguard's DDP tap cannot run the built-in communication hook {comm_hook_type!r}")
        register_comm_hook(tap.group, builtin[name])

    ddp.register_comm_hook = register_comm_hook
    ddp._register_builtin_comm_hook = register_builtin_comm_hook
    local.seen = "DDP communication hook"


def _registered_comm_hook(ddp: Any) -> str | None:
    """The name of a communication hook already registered on ``ddp`` (a Python one, a built-in one, or DDP's own
    mixed precision's), or None."""
    hooks = getattr(ddp, "_comm_hooks", [])
    if hooks:
        return str(getattr(hooks[0][0], "__qualname__", hooks[0][0]))
    try:
        data = ddp._get_ddp_logging_data()
    except (AttributeError, RuntimeError):
        return None
    name = data.get("comm_hook") if isinstance(data, dict) else None
    return str(name) if name else None


class _ReduceScatterTap:
    """An FSDP2 group's reduce-scatter, with the rank's own flat gradient noted before it is reduced."""

    def __init__(self, inner: Any, local: LocalGradients) -> None:
        self.inner = inner
        self.local = weakref.ref(local)

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)  # type: ignore[no-any-return]

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        local = self.local()
        if local is not None:
            local.note(input_tensor)
        return self.inner(output_tensor, input_tensor, group, op, async_op)


def _tap_fsdp2(model: nn.Module, local: LocalGradients) -> bool:
    groups: list[Any] = []
    for module in model.modules():
        state_of = getattr(module, "_get_fsdp_state", None)
        if state_of is None:
            continue
        groups.extend(getattr(state_of(), "_fsdp_param_groups", []))
    if not groups:
        return False
    for group in groups:
        comm = group._reduce_scatter_comm
        if isinstance(comm, _ReduceScatterTap):
            comm.local = weakref.ref(local)  # a guard before this one wrapped it: take it over
        else:
            group._reduce_scatter_comm = _ReduceScatterTap(comm, local)
    local.seen = "FSDP2 reduce-scatter"
    return True


def tap_local_gradients(model: nn.Module, local: LocalGradients) -> None:
    """Tap ``model``'s reduction (DDP or FSDP2) so that ``local`` sees this rank's own gradient before it; where it
    cannot, ``local.unseen`` says why. (DeepSpeed's engines are tapped by ``distributed.deepspeed``.)"""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        _tap_ddp(model, local)
    elif _tap_fsdp2(model, local) or local.seen is not None or local.unseen is not None:
        return
    elif any(hasattr(param, "placements") for param in model.parameters()):  # DTensors without FSDP2: TP alone
        local.unseen = (
            "tensor parallel without FSDP2: no reduction reaches a weight gradient's shard, so each rank's own pieces "
            "are read after backward and a fault in one names its rank; a fault TP's backward collectives carried "
            "into every rank of the group (an activation gradient's) names every rank of it"
        )
    else:
        local.unseen = (
            "the model is neither DDP- nor FSDP2-wrapped, so the guard cannot see each rank's own gradient before "
            "the reduction (a loop that all-reduces by hand, or the module inside a DDP wrapper: nanoGPT's raw_model, "
            "a LightningModule); pass the DDP or FSDP2 model to GradGuard"
        )
        warnings.warn(
            f"gradguard: {local.unseen}, so no fault can be named with the rank that made it.",
            GuardWarning,
            stacklevel=4,
        )
