"""Where recovery's snapshots live (the policy's ``recovery.memory``), and how their copies get there.

- ``device``: in buffers on the parameters' device, allocated at the first snapshot and reused; a snapshot is one
  ``torch._foreach_copy_`` device to device on the current (compute) stream, the floor of what a copy costs.
- ``host``: in pinned host memory. On CUDA (when one snapshot fits on the device) the compute stream copies device
  to device into one staging buffer, then a side stream copies the staging buffer to the host in chunks, one after
  each of the next steps' reads (``host_copy``: a read queued behind a whole snapshot's copy waits for all of it):
  the step waits for the device copy only. CUDA events order it: the side stream waits for the staging copy; the
  next staging waits for the side stream's copy (so the staging buffer is not overwritten while it is read); a
  restore waits for the copy of the snapshot it reads. A fault before that copy completes rewinds to that snapshot
  all the same: the rest of its chunks are queued at once and the restore's copies behind them, so the device
  (never the host) waits for the rest of one copy, once per rewind. Without staging room the copy runs on the
  compute stream.
- ``auto``: decided at the first snapshot, which is taken at the first step's boundary, after its forward and
  backward: ``device`` when ``keep`` snapshots fit beside the run's measured peak (the allocator's peak, the
  optimizer state still to come, and ``ALLOCATOR_SLACK`` of the device for fragmentation), else ``host``
  (``place_from_peak``). At attach, where no step has run, it is estimated from the free memory and a margin of
  ``MEMORY_MARGIN`` for the activations, and said to be provisional. A snapshot whose allocation on the device fails
  goes to the host instead, whatever the mode, and the run goes on (a ``snapshot_fallback`` event).

Each list of tensors is copied into one flat buffer per (device, dtype) (views keep the shapes), so a copy to the
host is a few large copies, not one per tensor. On the CPU every mode is a copy in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradguard.enforce.distributed.collective import local_tensor
from gradguard.enforce.recovery.host_copy import ChunkSizer, HostCopy
from gradguard.errors import GuardStateError

__all__ = [
    "ALLOCATOR_SLACK",
    "HOST",
    "MEMORY_MARGIN",
    "Flat",
    "Placement",
    "Stager",
    "choose_placement",
    "copy_into",
    "device_memory",
    "fallen_back",
    "measured_peak",
    "memory_text",
    "memory_where",
    "place_from_peak",
    "readable_bytes",
    "state_to_come",
    "tensor_nbytes",
    "wait_for",
]

MEMORY_MARGIN = 0.25
"""``auto`` (and host mode's staging buffer) leaves this share of the device's total memory free: the step's
activations, which nothing at attach can measure, and the allocator's fragmentation."""

ALLOCATOR_SLACK = 0.03
"""``auto`` at the first snapshot leaves this share of the device's total memory beside the run's measured peak: the
caching allocator's rounding and fragmentation, which its peak of allocated bytes does not show."""

_ALIGN = 64
"""Each copy starts at a multiple of 64 bytes in its flat buffer (vectorised copies need aligned starts)."""

_STATE_PER_PARAM = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adadelta": 2, "Rprop": 2}
_STATE_PER_PARAM |= {"Adagrad": 1, "RMSprop": 1, "SGD": 1, "ASGD": 1}
_UNKNOWN_STATE = 2
"""State tensors per parameter assumed for an optimizer not known (Adam's two moments)."""


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """``(free, total)`` bytes of ``device``'s memory, or None where unknown (the CPU). Free counts what torch's
    caching allocator holds without using it. Tests replace this function to fake a device's figures."""
    if device.type != "cuda":
        return None
    try:
        free, total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    except RuntimeError:
        return None
    return int(free) + max(int(cached), 0), int(total)


PROVISIONAL = " (provisional: decided at the first snapshot from the run's measured peak)"


def measured_peak(device: torch.device) -> tuple[int, int] | None:
    """``(peak, allocated)``: the most bytes torch's allocator has held at once on ``device`` (since the process
    began or its statistics were last reset: never less than the run's own peak), and what it holds now; None where
    unknown (the CPU). Tests replace this function to fake a run's figures."""
    if device.type != "cuda":
        return None
    try:
        return int(torch.cuda.max_memory_allocated(device)), int(torch.cuda.memory_allocated(device))
    except RuntimeError:
        return None


def place_from_peak(device: torch.device, keep: int, per_snapshot: int, to_come: int, held: int) -> Placement | None:
    """``auto`` at the first snapshot, from what the run was measured to use (None where nothing is measured): the
    device when ``keep`` snapshots of ``per_snapshot`` bytes fit beside the run's peak, the optimizer state still to
    come (``to_come``) and ``ALLOCATOR_SLACK``; ``held``: the guard's own device bytes counted in that peak (a staging
    buffer), freed by the choice."""
    figures, measured = device_memory(device), measured_peak(device)
    if figures is None or measured is None:
        return None
    _, total = figures
    peak, allocated = measured
    needed = keep * per_snapshot
    slack = int(total * ALLOCATOR_SLACK)
    room = total - slack - max(peak, allocated) - to_come + held
    told = (
        f"{keep} snapshots need {readable_bytes(needed)} on {device} ({readable_bytes(total)}), beside the run's "
        f"measured peak of {readable_bytes(peak)}, {readable_bytes(to_come)} of optimizer state still to come and "
        f"{readable_bytes(slack)} for the allocator"
    )
    if needed <= room:
        return Placement("auto", "device", device, needed=needed, total=total, why=f"auto: {told}: they fit")
    staged = per_snapshot <= room
    why = f"auto: {told}: they do not fit; pinned host memory, {_host_copy(staged, per_snapshot)}"
    return Placement("auto", "host", device, staged, needed, total=total, why=why)


def _host_copy(staged: bool, per_snapshot: int) -> str:
    """How host mode's copies get there, in words."""
    if staged:
        buffer = readable_bytes(per_snapshot)
        return f"staged through one device buffer of {buffer} and copied to the host on a side stream"
    return "copied on the compute stream (no room for a staging buffer: the step waits for the copy)"


def fallen_back(placement: Placement, error: BaseException) -> Placement:
    """Where snapshots go after allocating one on the device failed: pinned host memory, copied directly (a staging
    buffer would be device memory too)."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    why = (
        f"{placement.memory}: allocating a snapshot on {placement.device} failed ({first}); this and later snapshots "
        "go to pinned host memory, copied on the compute stream, and the run goes on"
    )
    return Placement(
        placement.memory, "host", placement.device, False, placement.needed, total=placement.total, why=why
    )


def readable_bytes(n: int) -> str:
    size, unit = float(n), "bytes"
    for name in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, name
    return f"{n:,} bytes" if unit == "bytes" else f"{size:.3g} {unit} ({n:,} bytes)"


def state_to_come(optimizers: Sequence[torch.optim.Optimizer] | None, params: Sequence[torch.Tensor]) -> int:
    """Bytes of optimizer state not made yet (Adam makes its moments at its first step): for each parameter
    without state, its bytes times the state tensors its optimizer keeps; ``None`` (not given): Adam's two."""
    if optimizers is None:
        return sum(_UNKNOWN_STATE * tensor_nbytes(p) for p in params if p.requires_grad)
    total = 0
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            per = _STATE_PER_PARAM.get(type(optimizer).__name__, _UNKNOWN_STATE)
            if type(optimizer).__name__ == "SGD" and not group.get("momentum"):
                per = 0
            per += bool(group.get("amsgrad")) + bool(group.get("centered"))
            total += sum(per * tensor_nbytes(p) for p in group["params"] if p not in optimizer.state)
    return total


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements on this rank (a shard's under FSDP2)."""
    t = local_tensor(t)
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class Placement:
    """Where a guard's snapshots live, and why (the attach event's ``recovery`` says it)."""

    memory: str
    """What the policy asked: ``device``, ``host`` or ``auto``."""
    where: str
    """``device`` or ``host``."""
    device: torch.device
    """The parameters' device."""
    staged: bool = False
    """Host memory reached through one staging buffer on the device and a side stream (else the copy is direct)."""
    needed: int = 0
    """Bytes ``keep`` snapshots will hold, with the optimizer state still to come."""
    free: int | None = None
    total: int | None = None
    why: str = ""

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer for copies of tensors of ``device``: on it (``device``), or in (pinned) host memory."""
        if self.where == "device":
            return torch.empty(numel, dtype=dtype, device=device)
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=device.type == "cuda")

    def fields(self) -> dict[str, Any]:
        """The attach event's part: where, on which device, the bytes needed and free, and why."""
        return {
            "where": self.where,
            "device": str(self.device),
            "staged": self.staged,
            "needed_bytes": self.needed,
            "free_bytes": self.free,
            "why": self.why,
        }


HOST = Placement("host", "host", torch.device("cpu"), why="copies the guard keeps beside its snapshots")
"""Host memory, copied directly (pinned for a CUDA tensor, ``non_blocking`` on the current stream)."""


def choose_placement(
    memory: str, device: torch.device, keep: int, per_snapshot: int, to_come: int, held: int = 0
) -> Placement:
    """Where ``keep`` snapshots of ``per_snapshot`` bytes go on ``device``, which will still allocate ``to_come``
    bytes (gradients, optimizer state); ``held``: bytes of the guard's own on the device now, freed by a new choice.

    Raises ``GuardStateError`` naming the bytes needed and free when ``device`` is asked for and does not fit.
    """
    needed = keep * per_snapshot
    figures = device_memory(device)
    if figures is None:
        where = "device" if memory == "device" or (memory == "auto" and device.type == "cpu") else "host"
        why = "on the CPU every snapshot is a copy in memory" if device.type == "cpu" else "free memory unknown"
        return Placement(memory, where, device, needed=needed, why=f"{memory}: {why}")
    free, total = figures
    room = free + held - to_come
    margin = int(total * MEMORY_MARGIN)
    told = (
        f"{keep} snapshots need {readable_bytes(needed)} on {device}, which has {readable_bytes(free + held)} free, "
        f"less {readable_bytes(to_come)} the gradients and optimizer state will still take"
    )
    if memory == "device":
        if needed > room:
            raise GuardStateError(
                f"recovery.memory is 'device', but {told}: {readable_bytes(max(room, 0))} left for them. Use "
                "memory: host (pinned host memory, copied beside the next steps) or auto, or a smaller keep, or "
                "free device memory"
            )
        return Placement(memory, "device", device, needed=needed, free=free, total=total, why=f"device: {told}")
    fits = needed <= room - margin
    if memory == "auto" and fits:
        why = f"auto: {told} and a margin of {readable_bytes(margin)}: they fit{PROVISIONAL}"
        return Placement(memory, "device", device, needed=needed, free=free, total=total, why=why)
    staged = per_snapshot <= room - margin
    how = _host_copy(staged, per_snapshot)
    head = f"auto: {told} and a margin of {readable_bytes(margin)}: they do not fit" if memory == "auto" else "host"
    head += PROVISIONAL if memory == "auto" else ""
    return Placement(memory, "host", device, staged, needed, free, total, f"{head}; pinned host memory, {how}")


def memory_text(memory: str, keep: int, per_snapshot: int | None) -> str:
    """``gradguard explain``'s line: where ``keep`` snapshots of ``per_snapshot`` bytes (if known) will live."""
    held = f" ({readable_bytes(keep * per_snapshot)} for {keep})" if per_snapshot is not None else ""
    host = (
        f"memory: host: pinned host memory{held}; on CUDA each snapshot is staged through one device buffer"
        + (f" ({readable_bytes(per_snapshot)})" if per_snapshot is not None else "")
        + " and copied to the host on a side stream, beside the next steps"
    )
    if memory == "host":
        return host
    device = f"preallocated buffers on the parameters' device{held}, copied device to device"
    if memory == "device":
        return f"memory: device: {device}; attaching fails, naming the bytes needed and free, if they do not fit"
    return (
        f"memory: auto: {device}, when they fit beside the run's peak measured at the first snapshot (after the "
        f"first step's forward and backward), the optimizer state still to come and {ALLOCATOR_SLACK:.0%} of the "
        f"device; else {host.removeprefix('memory: host: ')}"
    )


def memory_where(memory: str) -> str:
    """Where snapshots of a ``memory`` mode live, in a few words (``explain --format json``)."""
    return {"device": "device", "host": "host (pinned)"}.get(memory, "device if they fit with the margin, else host")


class Flat:
    """Copies of a list of tensors in one buffer per (device, dtype): ``views`` in the tensors' order and shapes."""

    def __init__(
        self,
        sources: Sequence[torch.Tensor],
        kind: str,
        empty: Callable[[int, torch.dtype, torch.device], torch.Tensor],
    ) -> None:
        self.kind = kind
        self.layout = [(s.shape, s.dtype, s.device) for s in sources]
        sizes: dict[tuple[torch.device, torch.dtype], int] = {}
        starts = []
        for source in sources:
            key = (source.device, source.dtype)
            starts.append(sizes.get(key, 0))
            step = max(1, _ALIGN // source.element_size())
            sizes[key] = starts[-1] + -(-source.numel() // step) * step
        self.storage = {key: empty(size, key[1], key[0]) for key, size in sizes.items()}
        self.views = [
            self.storage[(s.device, s.dtype)][start : start + s.numel()].view(s.shape)
            for s, start in zip(sources, starts, strict=True)
        ]

    def fits(self, sources: Sequence[torch.Tensor], kind: str) -> bool:
        return kind == self.kind and self.layout == [(s.shape, s.dtype, s.device) for s in sources]


def copy_into(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    if targets:
        # Non-blocking only matters across devices (device to pinned host, pinned host to device).
        torch._foreach_copy_(targets, sources, non_blocking=True)


class Stager:
    """Host mode on a device: one snapshot's copies are queued (``add``), then ``flush`` copies them device to device
    into staging buffers on the compute stream and returns their copy to the host (a ``HostCopy``, on a side stream),
    which ``pump`` moves on a chunk after each of the step's reads."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stages: list[Flat] = []
        self._queued: list[tuple[Flat, list[torch.Tensor]]] = []
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self._copy: HostCopy | None = None
        """The last snapshot's copy to the host (CUDA): the next staging waits for all of it."""
        self._sizer = ChunkSizer()

    def add(self, host: Flat, sources: Sequence[torch.Tensor]) -> None:
        self._queued.append((host, list(sources)))

    @property
    def nbytes(self) -> int:
        return sum(tensor_nbytes(view) for stage in self.stages for view in stage.views)

    def flush(self) -> HostCopy | None:
        """Copy what was queued into the staging buffers; their copy to the host (None off CUDA: already done)."""
        queued, self._queued = self._queued, []
        old = self.stages
        self.stages = [
            old[i] if i < len(old) and old[i].fits(sources, "stage") else Flat(sources, "stage", _on_device)
            for i, (_, sources) in enumerate(queued)
        ]
        side = self._side
        if side is not None and self._copy is not None:
            # The stage's last reader: the rest of the previous snapshot's copy is queued now, and waited for.
            wait_for(self._copy, self.device)
        copy_into([v for stage in self.stages for v in stage.views], [s for _, sources in queued for s in sources])
        pairs = [
            (host.storage[key], stage.storage[key])
            for (host, _), stage in zip(queued, self.stages, strict=True)
            for key in host.storage
        ]
        on_device = [(target, source) for target, source in pairs if source.device.type == "cuda"]
        for target, source in pairs:
            if side is None or source.device.type != "cuda":
                target.copy_(source)  # off CUDA, or state kept on the host (a for-loop AdamW's step counts)
        if side is None:
            return None
        staged = torch.cuda.Event()  # type: ignore[no-untyped-call]
        staged.record(torch.cuda.current_stream(self.device))
        self._copy = HostCopy(on_device, side, staged)
        return self._copy

    def release(self) -> None:
        """Give the staging buffers back at once (the guard is removed). A copy to the host still in flight is
        finished and waited for first: its side stream reads the buffers, and pinned memory under a copy must not
        be reused."""
        copy, self._copy = self._copy, None
        event = copy.finish() if copy is not None else None
        if event is not None:
            event.synchronize()
        self.stages, self._queued = [], []

    def pump(self) -> None:
        """The step's read is done: queue the next chunk of the copy in flight (it has until the next read)."""
        self._sizer.read_done()
        if self._copy is not None:
            self._copy.pump(self._sizer)


def _on_device(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=device)


def wait_for(copy: HostCopy | None, device: torch.device) -> None:
    """Queue the current stream's next work behind ``copy`` (a host copy in flight, the rest of it queued now): the
    device waits, not the host."""
    event = copy.finish() if copy is not None and device.type == "cuda" else None
    if event is not None:  # None: nothing of it was on the device (no chunk to wait for)
        torch.cuda.current_stream(device).wait_event(event)
