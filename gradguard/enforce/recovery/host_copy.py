"""Host mode's copy to the host, in pieces that each fit between two of the step's reads.

A GPU's copies from device to host go through its copy engines in the order they were queued, whichever stream
queued them: a step's one read (a few hundred bytes to the host) that comes after a 15.8 GiB snapshot copy waits
for all of it (measured on an H200: a 300-float read took 77.7 ms behind a 4 GiB copy on a side stream, pinned or
pageable, and 4.9 ms behind a 256 MiB one). So the copy of a staged snapshot is queued in chunks, one batch after
each of the step's reads, each sized to take about ``SHARE`` of the time between two reads at the bandwidth the
earlier chunks measured (CUDA events on the side stream): the next read finds the copy engine free. A snapshot
counts as copied once its last chunk is; until then a restore (or the next staging) queues the rest at once and the
device, never the host, waits for it.
"""

from __future__ import annotations

from collections import deque
from time import perf_counter
from typing import Any

import torch

__all__ = ["FIRST_CHUNK", "SHARE", "ChunkSizer", "HostCopy"]

FIRST_CHUNK = 64 * 2**20
"""Bytes of the first chunk, before any bandwidth is measured (1.3 ms at an H200's 51 GB/s)."""

_ROUND = 2**20

SHARE = 0.5
"""A chunk is sized to take this share of the time between two reads: the other half is the margin for a step
shorter than the last ones, or a copy slower than measured."""


class ChunkSizer:
    """How many bytes the next chunk may hold: the copy bandwidth the last chunks measured, times ``SHARE`` of the
    shortest of the last three intervals between reads."""

    def __init__(self) -> None:
        self.bandwidth: float | None = None
        """Bytes per second of the last chunk whose events completed."""
        self._read_at: float | None = None
        self._intervals: deque[float] = deque(maxlen=3)

    def read_done(self) -> None:
        """A step's read has just returned (the host clock between two of these is the time a chunk has)."""
        now = perf_counter()
        if self._read_at is not None:
            self._intervals.append(now - self._read_at)
        self._read_at = now

    def measured(self, nbytes: int, seconds: float) -> None:
        if seconds > 0:
            self.bandwidth = nbytes / seconds

    def next_bytes(self) -> int:
        if self.bandwidth is None or not self._intervals:
            return FIRST_CHUNK
        return max(FIRST_CHUNK, int(self.bandwidth * SHARE * min(self._intervals)))


class HostCopy:
    """One staged snapshot's copy to pinned host memory on ``side``: ``pump`` queues the next chunk, ``finish``
    queues the rest; ``event`` is recorded after the last chunk (None until then)."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], side: Any, staged: Any) -> None:
        self._pairs = [(target.view(-1), source.view(-1)) for target, source in pairs]
        self._side = side
        self._staged: Any = staged
        """The compute stream's event after the staging copy: the side stream waits for it before its first chunk."""
        self._at = (0, 0)
        """(pair, element) the next chunk starts at."""
        self._timing: tuple[Any, Any, int] | None = None
        self.event: Any = None

    @property
    def done(self) -> bool:
        return self._at[0] >= len(self._pairs)

    def pump(self, sizer: ChunkSizer) -> None:
        """Learn the bandwidth from the last chunk if its copy is over, then queue the next one."""
        timing = self._timing
        if timing is not None and timing[1].query():
            sizer.measured(timing[2], timing[0].elapsed_time(timing[1]) / 1e3)
            self._timing = None
        if not self.done:
            self._queue(sizer.next_bytes(), sizer if self._timing is None else None)

    def finish(self) -> Any:
        """Queue whatever is left at once; the event after the last chunk (None: there was nothing to copy)."""
        if not self.done:
            self._queue(None, None)
        return self.event

    def _queue(self, budget: int | None, sizer: ChunkSizer | None) -> None:
        side, staged = self._side, self._staged
        with torch.cuda.stream(side):
            if staged is not None:
                side.wait_event(staged)
                self._staged = None
            start = torch.cuda.Event(enable_timing=True) if sizer is not None else None  # type: ignore[no-untyped-call]
            if start is not None:
                start.record(side)
            queued = self._copy_some(budget)
            end = torch.cuda.Event(enable_timing=sizer is not None)  # type: ignore[no-untyped-call]
            end.record(side)
        if start is not None:
            self._timing = (start, end, queued)
        if self.done:
            self.event = end

    def _copy_some(self, budget: int | None) -> int:
        """Queue copies of up to ``budget`` bytes (all that is left for None) from where the last chunk ended."""
        pair, element = self._at
        queued = 0
        while pair < len(self._pairs) and (budget is None or queued < budget):
            target, source = self._pairs[pair]
            size = source.element_size()
            count = source.numel() - element
            if budget is not None:
                wanted = -(-(budget - queued) // _ROUND) * _ROUND  # whole MiB: chunks start aligned
                count = min(count, wanted // size)
            end = element + count
            target[element:end].copy_(source[element:end], non_blocking=True)
            if source.is_cuda:
                source.record_stream(self._side)  # a freed stage is not reused before the side stream read it
            queued += count * size
            pair, element = (pair + 1, 0) if end >= source.numel() else (pair, end)
        self._at = (pair, element)
        return queued
