"""Host mode's copy to the host in chunks, one after each of the step's reads (gradguard.enforce.recovery.host_copy).

The CUDA stream and events are replaced by stand-ins that record what was queued (on the CPU every copy is done
when queued): what is measured is which bytes each chunk copies, how the chunk is sized from the bandwidth and
the time between reads, and that the copy ends bitwise equal to the staging buffers it reads. On a GPU,
``benchmarks/gpu_check.py`` times it (docs/performance.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gradguard.enforce.recovery import host_copy
from gradguard.enforce.recovery.host_copy import FIRST_CHUNK, SHARE, ChunkSizer, HostCopy

MiB = 2**20


class FakeEvent:
    """A CUDA event whose copy is over when ``over`` says, and took ``seconds``."""

    seconds = 0.01
    over = True

    def __init__(self, enable_timing: bool = False) -> None:
        self.timed = enable_timing
        self.recorded_on: Any = None

    def record(self, stream: Any) -> None:
        self.recorded_on = stream
        stream.log.append(("record", self))

    def query(self) -> bool:
        return FakeEvent.over

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.timed
        assert end.timed
        return FakeEvent.seconds * 1e3


class FakeStream:
    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []

    def wait_event(self, event: Any) -> None:
        self.log.append(("wait", event))


@pytest.fixture(autouse=True)
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    @contextlib.contextmanager
    def stream(side: FakeStream) -> Iterator[None]:
        yield

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    FakeEvent.seconds, FakeEvent.over = 0.01, True


def staged_pairs(*sizes_in_mib: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """Staging buffers of float32 with these sizes, random, and their empty host targets."""
    generator = torch.Generator().manual_seed(0)
    sources = [torch.randn(size * MiB // 4, generator=generator) for size in sizes_in_mib]
    targets = [torch.zeros_like(source) for source in sources]
    return list(zip(targets, sources, strict=True)), targets


class Sizer(ChunkSizer):
    """A sizer whose next chunk is told, and which remembers what it was told to size."""

    def __init__(self, chunk: int) -> None:
        super().__init__()
        self.chunk = chunk

    def next_bytes(self) -> int:
        return self.chunk


def copied_mib(targets: list[torch.Tensor]) -> float:
    return sum(int((target != 0).sum()) * 4 for target in targets) / MiB


def test_each_pump_copies_one_chunk_and_the_copy_ends_bitwise_equal_to_its_stage() -> None:
    pairs, targets = staged_pairs(3, 2)
    side = FakeStream()
    staged = FakeEvent()
    copy = HostCopy(pairs, side, staged)
    sizer = Sizer(2 * MiB)
    seen = []
    while not copy.done:
        copy.pump(sizer)
        seen.append(copied_mib(targets))
    assert seen == [2, 4, 5]  # chunks cross from one buffer into the next; the last one is what is left
    assert all(torch.equal(target, source) for target, source in pairs)
    assert side.log[0] == ("wait", staged)  # the side stream waits for the staging copy, once, before the first chunk
    assert sum(1 for kind, event in side.log if kind == "wait") == 1
    assert copy.event is not None
    assert copy.finish() is copy.event


def test_finish_queues_everything_left_at_once_and_returns_the_event_after_it() -> None:
    pairs, targets = staged_pairs(4, 4)
    side = FakeStream()
    copy = HostCopy(pairs, side, FakeEvent())
    copy.pump(Sizer(1 * MiB))
    assert copied_mib(targets) == 1
    event = copy.finish()
    assert copy.done
    assert copied_mib(targets) == 8
    assert side.log[-1] == ("record", event)
    assert all(torch.equal(target, source) for target, source in pairs)


def test_a_finished_copy_pumped_again_queues_nothing() -> None:
    pairs, _ = staged_pairs(1)
    side = FakeStream()
    copy = HostCopy(pairs, side, FakeEvent())
    copy.finish()
    queued = len(side.log)
    copy.pump(Sizer(MiB))
    assert len(side.log) == queued


def test_the_chunk_is_the_measured_bandwidth_times_a_share_of_the_shortest_recent_interval_between_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = iter([0.0, 0.200, 0.300, 0.550])  # intervals 200 ms, 100 ms, 250 ms
    monkeypatch.setattr(host_copy, "perf_counter", lambda: next(clock))
    sizer = ChunkSizer()
    assert sizer.next_bytes() == FIRST_CHUNK  # nothing measured yet
    for _ in range(4):
        sizer.read_done()
    sizer.measured(64 * MiB, 0.004)  # 16 GiB/s
    assert sizer.next_bytes() == pytest.approx(64 * MiB / 0.004 * SHARE * 0.100, abs=1)


def test_the_bandwidth_is_learned_from_a_chunk_only_once_its_events_say_it_is_over() -> None:
    pairs, _ = staged_pairs(8)
    copy = HostCopy(pairs, FakeStream(), FakeEvent())
    sizer = ChunkSizer()
    sizer.read_done()
    sizer.read_done()
    FakeEvent.over = False
    copy.pump(sizer)  # the first chunk: FIRST_CHUNK bytes is more than 8 MiB, so all of it
    assert copy.done
    assert sizer.bandwidth is None
    FakeEvent.over, FakeEvent.seconds = True, 0.002
    copy.pump(sizer)
    assert sizer.bandwidth == pytest.approx(8 * MiB / 0.002)


def test_chunks_start_on_whole_mebibytes_whatever_the_budget() -> None:
    pairs, targets = staged_pairs(4)
    copy = HostCopy(pairs, FakeStream(), FakeEvent())
    copy.pump(Sizer(MiB + 12_345))
    assert copied_mib(targets) == 2  # rounded up to whole MiB


def test_a_copy_with_nothing_on_the_device_is_done_at_once_and_has_no_event_to_wait_for() -> None:
    side = FakeStream()
    copy = HostCopy([], side, FakeEvent())
    copy.pump(Sizer(MiB))
    assert copy.done
    assert copy.finish() is None
    assert side.log == []  # nothing queued, not even the wait for the staging copy
