"""Counting host syncs: the times the host waits for tensor data (what the guard promises to keep at one
per step).

On the CPU every tensor is the host's, so a read or a tensor made from Python numbers stands for what it would be on
a GPU: a wait for the device, a copy to it. Not so for a tensor made on the host from Python numbers and the tensors
computed from such tensors alone (zclip's warm-up statistics, taken by torch's own reduction from the host's lists):
on a GPU they stay on the host, so reading them waits for nothing. They are told apart here (``_HostMade``): a read
of one is no host sync, and a tensor made from Python data counts once its data meets a tensor of the step's own
(a gradient, a statistic on the device), where on a GPU it would have been copied there.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_LIFTS = (torch.ops.aten.lift_fresh, torch.ops.aten.lift_fresh_copy)
_SCALAR_READ = "aten::_local_scalar_dense"


class _HostMade(TorchDispatchMode):
    """Marks the tensors made from Python data (``torch.tensor(list)``, ``as_tensor``: ``aten.lift_fresh``) and those
    computed from them alone; counts each such tensor whose data meets another tensor's (``met``), and the scalar
    reads of the other tensors (``scalar_reads``: a read of a host-made one waits for nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[int] = set()
        self.met: set[int] = set()
        self.host_scalar_reads = 0
        """``aten._local_scalar_dense`` (item, bool, float of a tensor) of a tensor made here."""

    def made_here(self, tensor: object) -> bool:
        return isinstance(tensor, torch.Tensor) and id(tensor) in self.ids

    def _mark(self, tensor: torch.Tensor) -> None:
        if id(tensor) not in self.ids:
            self.ids.add(id(tensor))
            weakref.finalize(tensor, self.ids.discard, id(tensor))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [leaf for leaf in tree_flatten((args, kwargs or {}))[0] if isinstance(leaf, torch.Tensor)]
        made = [tensor for tensor in tensors if id(tensor) in self.ids]
        if func.overloadpacket is torch.ops.aten._local_scalar_dense:
            self.host_scalar_reads += bool(made)
        elif func.overloadpacket in _LIFTS or (made and len(made) == len(tensors)):
            for leaf in tree_flatten(out)[0]:
                if isinstance(leaf, torch.Tensor):
                    self._mark(leaf)
        elif made:
            self.met.update(id(tensor) for tensor in made)
        return out


class HostReads(TorchFunctionMode):
    """Counts Python-level reads of tensor data by the host (tolist bypasses the profiler's view), but those of a
    tensor made on the host (``_HostMade``)."""

    READS = frozenset({"tolist", "numpy"})

    def __init__(self, host_made: _HostMade) -> None:
        super().__init__()
        self.count = 0
        self.host_made = host_made

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS and not (args and self.host_made.made_here(args[0])):
            self.count += 1
        return func(*args, **(kwargs or {}))


def count_host_syncs(fn: Callable[[], Any]) -> int:
    """Host syncs in fn(): aten::_local_scalar_dense (item, bool, float of a tensor), plus tolist/numpy reads; a
    tensor made on the host from Python numbers (and what is computed from it alone) is read without one."""
    host_made = _HostMade()
    reads = HostReads(host_made)
    with profile(activities=[ProfilerActivity.CPU]) as prof, reads, host_made:
        fn()
    # The profiler sees the reads C++ makes below the dispatch mode too (torch's fused AdamW on the CPU); one the mode
    # sees is recorded twice, nested: only the innermost of each is counted.
    scalar = sum(1 for event in prof.events() if event.name == _SCALAR_READ and not _holds_a_read(event))
    return scalar - host_made.host_scalar_reads + reads.count


def _holds_a_read(event: Any) -> bool:
    """Whether a profiler event holds another scalar read (through the dispatch mode's own event)."""
    return any(child.name == _SCALAR_READ or _holds_a_read(child) for child in event.cpu_children)


def count_python_data_tensors(fn: Callable[[], Any]) -> int:
    """Tensors made from Python data while fn() runs whose data meets another tensor's (on a GPU, a copy from
    pageable host memory, a host sync each); one that only the host computes with and reads is not counted."""
    host_made = _HostMade()
    with host_made:
        fn()
    return len(host_made.met)
