"""Each rank's own gradient, before the reduction: which rank made a fault, and which rank is far off the others.

DDP's all-reduce, FSDP2's reduce-scatter and DeepSpeed's reductions average one rank's NaN into every rank's
gradient, so after the reduction every rank sees the same fault and none can say where it was made. A tap where
the engine hands a rank's own gradient to its collective (DDP's communication hook, FSDP2's reduce-scatter, the
point where DeepSpeed reduces) notes the 2-norm of what it hands over (``LocalGradients.note``): one reduction of
gradients the collective reads anyway, queued on the device, never read back by itself. At the step, the notes
become one local 2-norm (``LocalGradients.take``) whose flag rides the step's existing collective (``RankSlots``:
a bit per rank, 24 to a float32 slot, so 10,000 ranks cost 417 floats), and, where the policy's ``ranks`` section
asks for outliers, the norm itself (a slot per rank).

A fault in any micro-batch of an accumulated step counts: the taps run where the accumulated gradient is reduced
(DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``), and a NaN or Inf stays non-finite in a sum;
where an engine reduces every micro-batch (DeepSpeed ZeRO 2), each micro-batch's note is kept and their squares
summed.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["LocalGradients", "RankSlots", "host_name"]

BITS_PER_SLOT = 24
"""Distinct powers of two below 2**24 sum exactly in float32: 24 ranks' flags in one slot of a SUM all-reduce."""


def host_name() -> str:
    """This machine's name, as operators know it (``socket.gethostname()``)."""
    return socket.gethostname()


@dataclass
class LocalGradients:
    """The notes a rank's taps made of its own gradient since the last step, and where they are made."""

    seen: str | None = None
    """Where this rank's own gradient is read (e.g. ``"DDP communication hook"``), or None."""
    unseen: str | None = None
    """Why it cannot be read (a communication hook of the user's own, ...): then no fault is named by rank."""
    closed: bool = False
    """The guard was removed: the taps the engine keeps (DDP's hook cannot be taken back) note nothing more."""
    _notes: list[torch.Tensor] = field(default_factory=list)

    def note(self, gradient: torch.Tensor) -> None:
        """Note the 2-norm of ``gradient``, part of this rank's own gradient as it is handed to the reduction (called
        from the engine's tap, during backward: queued on the device, no host sync)."""
        if gradient.numel() and not self.closed:
            self._notes.append(torch.linalg.vector_norm(gradient, 2, dtype=torch.float32))

    def close(self) -> None:
        """The guard is removed: note nothing more, hold nothing."""
        self.closed, self._notes = True, []

    @property
    def held(self) -> int:
        """How many notes wait for the next step."""
        return len(self._notes)

    def take(self, device: torch.device) -> torch.Tensor | None:
        """The 2-norm of everything noted since the last step (non-finite exactly when some noted part held a NaN or
        Inf, or a norm overflowed float32), as a float32 0-dim tensor on ``device``; None where nothing was noted (no
        tap ran: the gradients were not reduced through a tap this step). Forgets the notes."""
        notes, self._notes = self._notes, []
        if not notes:
            return None
        if len(notes) == 1:
            return notes[0].to(device)
        stacked = torch.stack([n.to(device) for n in notes])
        total: torch.Tensor = torch.linalg.vector_norm(stacked, 2)
        return total

    def forget(self) -> None:
        """Drop the notes (a step the guard did not treat)."""
        self._notes = []


@dataclass(frozen=True)
class RankSlots:
    """Where each rank's flag (and, for outliers, its norm) rides the step's SUM all-reduce."""

    rank: int
    world: int
    norms: bool
    """Every rank's local norm rides too (a slot per rank): the policy's ``ranks.outlier_factor``."""

    @property
    def size(self) -> int:
        flags = math.ceil(self.world / BITS_PER_SLOT)
        return flags + (self.world if self.norms else 0)

    def payload(self, local: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """This rank's slots: its flag's bit where its own gradient was non-finite, its norm in its norm slot (0 where
        nothing was noted); every other slot 0. Built on the device from ``local`` (no host read)."""
        flags = math.ceil(self.world / BITS_PER_SLOT)
        out = torch.zeros(self.size, dtype=torch.float32, device=device)
        if local is None:
            return out
        bad = (~torch.isfinite(local)).float() * float(1 << (self.rank % BITS_PER_SLOT))
        out[self.rank // BITS_PER_SLOT] = bad
        if self.norms:
            out[flags + self.rank] = local
        return out

    def read(self, values: Sequence[float]) -> tuple[list[int], list[float] | None]:
        """The summed slots, read: the ranks whose own gradient was non-finite, and every rank's norm (or None)."""
        flags = math.ceil(self.world / BITS_PER_SLOT)
        norms = list(values[flags : flags + self.world]) if self.norms else None
        return self.ranks_of(values[:flags]), norms

    @property
    def bit_slots(self) -> int:
        """How many float32 slots one bit per rank takes."""
        return math.ceil(self.world / BITS_PER_SLOT)

    def bit(self, set_: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``bit_slots`` floats with this rank's bit where ``set_`` (a 0-dim bool on the device), 0 elsewhere: summed
        over the ranks, ``ranks_of`` reads which set theirs. Built on the device (no host read)."""
        out = torch.zeros(self.bit_slots, dtype=torch.float32, device=device)
        out[self.rank // BITS_PER_SLOT] = set_.float() * float(1 << (self.rank % BITS_PER_SLOT))
        return out

    def bits_of(self, ranks: Iterable[int]) -> list[float]:
        """``bit_slots`` values with the bits of ``ranks`` set (on the host): ``ranks_of`` reads them back."""
        values = [0.0] * self.bit_slots
        for rank in set(ranks):
            values[rank // BITS_PER_SLOT] += float(1 << (rank % BITS_PER_SLOT))
        return values

    def ranks_of(self, values: Sequence[float]) -> list[int]:
        """The ranks whose bit is set in summed ``bit_slots`` values."""
        ranks = []
        for slot, value in enumerate(values):
            bits = int(value)
            while bits:
                low = bits & -bits
                ranks.append(slot * BITS_PER_SLOT + low.bit_length() - 1)
                bits ^= low
        return sorted(r for r in ranks if r < self.world)
