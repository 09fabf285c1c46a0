"""Counting host syncs: the times the host waits for tensor data (what the guard promises to keep at one
per step).

On the CPU every tensor is the host's, so a read or a tensor made from Python numbers stands for what it would be on
a GPU: a wait for the device, a copy to it. Not so for a tensor made from Python numbers without a device (torch's
default device, the host's) and the tensors computed from such tensors alone (zclip's warm-up statistics, taken by
torch's own reduction from the host's lists): on a GPU they stay on the host, so reading them waits for nothing. They
are told apart here (``_HostMade``): a read of one is no host sync, and one counts as a tensor sent from Python data
once its data meets another tensor (a gradient, a statistic on the device), where on a GPU it would have been copied.
A tensor made from Python numbers for a device (``device=grad.device``) counts as sent where it is made, as any other
(``aten.lift_fresh``).
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
_FROM_PYTHON = (torch.tensor, torch.as_tensor)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


class _HostMade(TorchDispatchMode):
    """The tensors made on the host from Python data and those computed from them alone (``mark``, ``made_here``);
    counts the tensors sent from Python data (``sent``: made for a device, or host-made and met by another tensor's
    data) and the scalar reads of host-made tensors (``host_scalar_reads``), which wait for nothing."""

    def __init__(self) -> None:
        super().__init__()
        self._ids: set[int] = set()
        self._scalars: set[int] = set()
        """Tensors of one Python number given to an op (``aten.scalar_tensor``): no one's data, sent nowhere."""
        self._met: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
        self.lifts = 0
        """Tensors made from Python data (``aten.lift_fresh``), less those ``mark`` took as the host's."""
        self.met = 0
        """Host-made tensors whose data met another tensor's (each once)."""
        self.host_scalar_reads = 0

    @property
    def sent(self) -> int:
        return self.lifts + self.met

    def made_here(self, tensor: object) -> bool:
        return isinstance(tensor, torch.Tensor) and id(tensor) in self._ids

    def mark(self, tensor: torch.Tensor) -> None:
        self._track(self._ids, tensor)

    @staticmethod
    def _track(ids: set[int], tensor: torch.Tensor) -> None:
        if id(tensor) not in ids:
            ids.add(id(tensor))
            weakref.finalize(tensor, ids.discard, id(tensor))

    def _unmark(self, tensor: torch.Tensor) -> None:
        self._ids.discard(id(tensor))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if packet in _LIFTS:
            self.lifts += 1
            return out
        if packet is torch.ops.aten.scalar_tensor:
            # A Python number an op was given (``torch.where(c, x, math.inf)``): the kernel's argument, sent nowhere.
            for tensor in _tensors(out):
                self._track(self._scalars, tensor)
            return out
        inputs = [tensor for tensor in _tensors((args, kwargs or {})) if id(tensor) not in self._scalars]
        made = [tensor for tensor in inputs if id(tensor) in self._ids]
        if packet is torch.ops.aten._local_scalar_dense:
            self.host_scalar_reads += bool(made)
        elif made and len(made) == len(inputs):
            for tensor in _tensors(out):
                self.mark(tensor)
        elif made:
            # Host data meets another tensor's: on a GPU, a copy to the device. What comes out (an in-place write
            # into a host-made tensor included) holds the other tensor's data: no longer the host's alone.
            for tensor in made:
                if tensor not in self._met:
                    self._met.add(tensor)
                    self.met += 1
            for tensor in (*_tensors(out), *(tensor for tensor in made if func._schema.is_mutable)):
                self._unmark(tensor)
        return out


class HostReads(TorchFunctionMode):
    """Counts Python-level reads of tensor data by the host (tolist bypasses the profiler's view), but those of a
    host-made tensor; marks a tensor made from Python data without a device as the host's (``_HostMade``)."""

    READS = frozenset({"tolist", "numpy"})

    def __init__(self, host_made: _HostMade) -> None:
        super().__init__()
        self.count = 0
        self.host_made = host_made

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in self.READS and not (args and self.host_made.made_here(args[0])):
            self.count += 1
        if func in _FROM_PYTHON and kwargs.get("device") is None:
            lifts = self.host_made.lifts
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.device.type == "cpu":
                self.host_made.lifts = lifts  # not sent: the host's, until its data meets another tensor's
                self.host_made.mark(out)
            return out
        return func(*args, **kwargs)


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
    """Tensors sent from Python data while fn() runs (on a GPU, a copy from pageable host memory, a host sync each):
    made for a device, or made on the host and then met by another tensor's data; one that only the host computes
    with and reads is not counted."""
    host_made = _HostMade()
    with HostReads(host_made), host_made:
        fn()
    return host_made.sent
