"""Several files' records merged in step order, a run of one file's records at a time.

Each file's records come in batches (a read chunk's), each file in order; ``merged_batches`` gives them back in the
order of all of them, as ``heapq.merge`` would record by record, but as slices: the file whose next record comes first
gives every record before the next file's, found by bisection (a step of one rank's, in a job's per-rank files).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator
from typing import Any, Protocol, TypeVar

__all__ = ["merged_batches"]


class _Ordered(Protocol):
    def __lt__(self, other: Any, /) -> bool: ...


Item = TypeVar("Item", bound=_Ordered)


def merged_batches(streams: list[Iterator[list[Item]]]) -> Iterator[list[Item]]:
    """The files' batches merged in step order, a run of one file's records at a time (a step of one rank's, in a
    job's per-rank files): the file whose next record comes first gives every record before the next file's, found
    by bisection, not compared one by one as ``heapq.merge`` would (the same order: records compare by
    ``(order, file, line)``)."""
    heads: list[tuple[Item, int]] = []
    batches: dict[int, tuple[list[Item], int]] = {}

    def advance(index: int, stream: Iterator[list[Item]]) -> None:
        for batch in stream:
            if batch:
                batches[index] = (batch, 0)
                heapq.heappush(heads, (batch[0], index))
                return
        batches.pop(index, None)

    for index, stream in enumerate(streams):
        advance(index, stream)
    while heads:
        _, index = heapq.heappop(heads)
        batch, start = batches[index]
        end = bisect.bisect_left(batch, heads[0][0], lo=start) if heads else len(batch)
        yield batch[start:end] if start or end < len(batch) else batch
        if end < len(batch):
            batches[index] = (batch, end)
            heapq.heappush(heads, (batch[end], index))
        else:
            advance(index, streams[index])
