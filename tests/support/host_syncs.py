"""Counting host syncs: the times the host waits for tensor data (what the guard promises to keep at one
per step)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode


class HostReads(TorchFunctionMode):
    """Counts Python-level reads of tensor data by the host (tolist bypasses the profiler's view)."""

    READS = frozenset({"tolist", "numpy"})

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def count_host_syncs(fn: Callable[[], Any]) -> int:
    """Host syncs in fn(): aten::_local_scalar_dense (item, bool, float of a tensor), plus tolist/numpy reads."""
    reads = HostReads()
    with profile(activities=[ProfilerActivity.CPU]) as prof, reads:
        fn()
    scalar = sum(1 for event in prof.events() if event.name == "aten::_local_scalar_dense")
    return scalar + reads.count


class PythonDataTensors(TorchDispatchMode):
    """Counts tensors made from Python data (``torch.tensor(list)``, ``as_tensor``: ``aten.lift_fresh``), which on a
    GPU are copies from pageable host memory: a host sync each."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.lift_fresh, torch.ops.aten.lift_fresh_copy):
            self.count += 1
        return func(*args, **(kwargs or {}))


def count_python_data_tensors(fn: Callable[[], Any]) -> int:
    """Tensors made from Python data while fn() runs."""
    mode = PythonDataTensors()
    with mode:
        fn()
    return mode.count
