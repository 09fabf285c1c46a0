"""Where a DeepSpeed engine hands this rank's own gradient to its reduction: a tap that notes it first (issue #48).

DeepSpeed averages one rank's NaN into every rank's gradient, so the guard's step, which runs after the reduction,
cannot say which rank made it. Each engine has one method every reduction of the rank's own gradients goes
through, whatever the configuration, and the tap shadows it with an instance attribute that calls
``LocalGradients.note`` on exactly the tensors it is about to reduce, then the method itself, unchanged:

- **ZeRO 0, and ZeRO 1 under ``BF16_Optimizer``**: ``engine._reduce_non_expert_gradients(grads, ...)``, which
  ``allreduce_gradients`` reaches through ``buffered_allreduce_fallback`` at each accumulation boundary, with the
  accumulated ``p.grad`` of every micro-batch (or ``BF16_Optimizer``'s fp32 accumulation buffers).
- **ZeRO 1 and 2** (``DeepSpeedZeroOptimizer``): ``optimizer.reduce_ipg_grads(comm_dtype)``, which reduces the
  independent-partition gradient buckets: from the backward hooks when a bucket is full, and from the epilogue of
  every backward that reduces (with ``overlap_comm``, ``contiguous_gradients`` and ``reduce_scatter`` on or off, a
  bucket's ``grads`` are the tensors it reduces: views of the contiguous buffer or the gradients themselves). ZeRO 2
  reduces every micro-batch, so each micro-batch is noted; ZeRO 1 reduces the accumulated gradient at the boundary.
- **ZeRO 3** (``DeepSpeedZeroOptimizer_Stage3``): its private ``__reduce_and_partition_ipg_grads(dtype)``, which
  reduce-scatters a bucket of whole gradients (each ``param.grad``, the rank's own) into the partitions: from the
  backward hooks when a bucket is full, and from every backward's epilogue (every micro-batch: ZeRO 3 reduces each).

Noting takes one norm of tensors the reduction reads anyway and changes none of them: a run with a tap is bitwise
the run without. Where the expected method is missing (another DeepSpeed version), ``local.unseen`` says so and
nothing is wrapped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradguard.enforce.distributed.deepspeed import layout
from gradguard.enforce.distributed.local import LocalGradients

__all__ = ["ReductionTap", "tap_reduction"]

_STAGE3_REDUCE = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"
"""ZeRO 3's private ``__reduce_and_partition_ipg_grads`` as Python mangles it: its own calls go through the instance."""


class ReductionTap:
    """The shadowing method on ``owner`` (``remove()`` gives it its own back)."""

    def __init__(self, owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        self.owner, self.name, self.wrapper = owner, name, wrapper
        self._previous = vars(owner).get(name)
        setattr(owner, name, wrapper)

    def remove(self) -> None:
        if vars(self.owner).get(self.name) is not self.wrapper:
            return  # someone wrapped it on top of ours since: theirs stays
        if self._previous is None:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self._previous)


def _note_all(local: LocalGradients, tensors: Any) -> None:
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):  # DeepSpeed's SparseTensor is not (sparse gradients are refused)
            local.note(tensor.detach())


def tap_reduction(engine: Any, local: LocalGradients) -> ReductionTap | None:
    """Note this rank's own gradients of ``engine`` in ``local`` as DeepSpeed hands them to its reduction; None (with
    ``local.unseen`` saying why) where this engine's reduction is not the one expected."""
    stage = int(engine.zero_optimization_stage())
    if layout(engine) == "zero":
        owner, name = engine.optimizer, "reduce_ipg_grads"
    elif layout(engine) == "stage3":
        owner, name = engine.optimizer, _STAGE3_REDUCE
    else:
        owner, name = engine, "_reduce_non_expert_gradients"
    original = getattr(owner, name, None)
    if not callable(original):
        local.seen = None
        local.unseen = (
            f"DeepSpeed's {type(owner).__name__} has no {name}, where gradguard reads each rank's own gradient before "
            "the reduction: another DeepSpeed version. A fault is then not named by rank."
        )
        return None
    if name == "reduce_ipg_grads":
        buckets = getattr(owner, "ipg_buckets", None)
        if not isinstance(buckets, dict):
            local.seen, local.unseen = None, "DeepSpeed's ZeRO optimizer has no ipg_buckets: another DeepSpeed version"
            return None

        def reduce_ipg_grads(comm_dtype: Any = None) -> Any:
            chosen = [comm_dtype] if comm_dtype is not None else list(buckets)
            for dtype in chosen:
                bucket = buckets.get(dtype)
                if bucket is not None:
                    _note_all(local, bucket.grads)  # the rank's own, not reduced yet
            return original(comm_dtype=comm_dtype)

        wrapper: Callable[..., Any] = reduce_ipg_grads
    elif name == _STAGE3_REDUCE:
        found = getattr(owner, "ipg_buckets", None)
        if not isinstance(found, dict):
            local.seen, local.unseen = None, "DeepSpeed's ZeRO 3 optimizer has no ipg_buckets: another version"
            return None
        stage3_buckets: dict[Any, Any] = found

        def reduce_and_partition_ipg_grads(communication_data_type: Any) -> Any:
            bucket = stage3_buckets.get(communication_data_type)
            if bucket is not None:
                _note_all(local, [param.grad for param in bucket.params])  # whole, before the reduce-scatter
            return original(communication_data_type)

        wrapper = reduce_and_partition_ipg_grads
    else:

        def reduce_non_expert_gradients(grads: Any, *args: Any, **kwargs: Any) -> Any:
            _note_all(local, grads)
            return original(grads, *args, **kwargs)

        wrapper = reduce_non_expert_gradients
    local.seen, local.unseen = f"DeepSpeed ZeRO {stage} reduction", None
    return ReductionTap(owner, name, wrapper)
