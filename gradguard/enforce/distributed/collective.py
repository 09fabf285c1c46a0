"""One verdict on every rank: the guard's collectives under ``torch.distributed``.

A guard that decides per rank either hangs the job (one rank halts, the others wait in the next
collective until the timeout) or desynchronises the replicas. So, whenever the default process group
(or the one given) has more than one rank, every enforcement pass makes the same collectives on
every rank, unconditionally, in the same order:

- one ``all_reduce(SUM)`` of the non-finite flags of every watched tensor (NaN and Inf counted
  separately), so a NaN injected on a single rank halts or skips every rank. Under DDP it is
  redundant only for a NaN/Inf made before DDP's all-reduce (which carries it to every rank: checked
  by ``tests/test_distributed.py``, scenario ``ddp_agreement``); one made on a rank after it (user
  code between ``backward()`` and ``step()``) or inside ``no_sync()`` reaches no other rank, and the
  step cannot tell which it is, so the collective stays;
- with FSDP2 (gradients are sharded ``DTensor``s), norms are computed on each rank's shard and
  combined (sum of p-th powers, or max for the inf-norm) before anything is decided, so per-tensor,
  group and global norms are those of the full, unsharded gradient. The non-finite flags ride in
  the same collective as the first norms.

Single-process use makes no collective at all.

No rank is left waiting: a rank whose step raises writes its error into the process group's store
(``Collective.failed``) before it raises, and every collective of the guard's step waits for its peers with an eye
on that store (``Collective.settle``): a rank still waiting learns which rank failed and why within a fraction of a
second, and raises ``GuardStateError`` naming it, instead of waiting for the process group's timeout (or dying on a
transport error that names neither the rank nor the cause when the failed process exits).
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradguard.enforce.distributed.local import LocalGradients, RankSlots, host_name
from gradguard.enforce.distributed.mesh import MeshLayout
from gradguard.enforce.distributed.placements import ShareBook
from gradguard.errors import GradGuardError, GuardStateError

__all__ = ["Collective", "RankFailed", "is_sharded", "local_tensor"]

POLL_SECONDS = 0.2
"""How often a rank waiting in the guard's collective looks in the store for a peer's failure."""
LEFT_GRACE_SECONDS = 3.0
"""A peer's process that left mid-collective wrote its failure before it raised: how long to look for it."""


class RankFailed(GuardStateError):
    """An exception inside the guard's step on one rank, raised on every rank (``failed_rank``, ``host``, ``error``)."""

    def __init__(self, message: str, failed_rank: int, host: str, error: str, step: int | None) -> None:
        super().__init__(message)
        self.failed_rank = failed_rank
        self.host = host
        self.error = error
        self.step = step


_DISTRIBUTED = dist.is_available()
"""Whether torch was built with torch.distributed (without it, ``dist`` has no process group to ask about)."""

_DTENSOR: type | None = None


def _dtensor_type() -> type | None:
    """``DTensor``, once something has imported it (no DTensor exists before): importing it costs half a second,
    so the guard, the audit and ``gradguard replay`` do not do it for runs that never shard."""
    global _DTENSOR
    if _DTENSOR is None:
        module = sys.modules.get("torch.distributed.tensor")
        _DTENSOR = getattr(module, "DTensor", None) if module is not None else None
    return _DTENSOR


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (FSDP2's sharded parameters and gradients)."""
    dtensor = _DTENSOR if _DTENSOR is not None else _dtensor_type()
    return dtensor is not None and isinstance(tensor, dtensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds (in-place changes to it change the DTensor), or the tensor itself."""
    if is_sharded(tensor):
        local: torch.Tensor = tensor.to_local()  # type: ignore[attr-defined]
        return local
    return tensor


class Collective:
    """The process group the guard agrees over, or nothing when there is one rank."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.local = LocalGradients()
        """This rank's own gradient before the reduction, as the engine's tap notes it (``distributed.taps``)."""
        self.shares = ShareBook()
        """Each tensor's share of a sum over the ranks, where some pieces are replicas (``placements``)."""
        self.pipeline: Collective | None = None
        """Under pipeline parallel, the collective over the mesh's ``pp``: a group clip's norm is every stage's."""
        self.mesh: MeshLayout | None = None
        """Where this rank stands in the job's device mesh, where one was given (``GradGuard(device_mesh=)``)."""
        self.members: list[int] = []
        """The group's ranks (global ranks), in group order; set at attach (``agreement.agree_at_attach``)."""
        self.hosts: dict[int, str] = {}
        """Global rank -> its host's name; set at attach."""
        self.index = 0
        """This rank's place in ``members``."""
        self.store: Any = None
        """The process group's store, where a failed step is written (set at attach), or None."""
        self.failure_key: str | None = None
        """This guard's key in ``store`` for a failed step (one per attach: a later guard's run is not told)."""
        self.step: int | None = None
        """The step being treated, for the failure's words."""
        self._inflight: list[Any] = []
        self._sized: tuple[Any, bool] | None = None
        """The default group ``active`` last found, and whether the group has more than one rank under it."""

    @property
    def rank(self) -> int:
        """This rank's global rank."""
        return self.members[self.index] if self.members else 0

    def join(self, job: Collective, ranks: list[int]) -> None:
        """Take the agreement ``job`` made at attach (the hosts, the store where a failed step is written) for this
        collective, whose group is ``ranks`` (a pipeline stage's ranks, or a pipeline's stages)."""
        self.members, self.index = ranks, ranks.index(job.rank)
        self.hosts, self.store, self.failure_key = job.hosts, job.store, job.failure_key

    def slots(self, norms: bool) -> RankSlots:
        """Where this rank's flag (and norm) rides the step's SUM all-reduce."""
        return RankSlots(self.index, max(len(self.members), 1), norms)

    def named(self, group_indices: Sequence[int]) -> dict[int, str]:
        """Group indices -> {global rank: host}."""
        out = {}
        for position in group_indices:
            rank = self.members[position] if position < len(self.members) else position
            out[rank] = self.hosts.get(rank, "?")
        return out

    def active(self) -> bool:
        """Whether collectives are needed: torch.distributed is initialised with more than one rank."""
        # Asked at every step: 3 Python calls where it was 5 (10 with the size). Whether torch was built with
        # torch.distributed cannot change; whether a process group is initialised can at any time, so it is asked
        # every time (``GroupMember.WORLD``: ``is_initialized`` less its own call). A group's size cannot change
        # while its default group lives: the answer is kept for that default group, the one object, and asked again
        # when another replaces it (destroyed and initialised again).
        if not _DISTRIBUTED:
            return False
        world = dist.GroupMember.WORLD
        if world is None:
            self._sized = None  # a destroyed default group is not kept alive here
            return False
        sized = self._sized
        if sized is not None and sized[0] is world:
            return sized[1]
        many = bool(dist.get_world_size(self.group) > 1)
        self._sized = (world, many)
        return many

    def shared(self) -> bool:
        """Whether another rank takes part in this guard's step: a process group of several ranks (``active``), or a
        pipeline's stages, which exchange their verdicts even where each stage is one rank (its own group of one)."""
        return self.pipeline is not None or self.active()

    def size(self) -> int:
        """How many ranks the group has (1 without a process group)."""
        return int(dist.get_world_size(self.group)) if _DISTRIBUTED and dist.is_initialized() else 1

    def sum_(self, values: torch.Tensor) -> torch.Tensor:
        """All-reduce ``values`` in place by sum; one collective."""
        return self._reduce(values, dist.ReduceOp.SUM)

    def max_(self, values: torch.Tensor) -> torch.Tensor:
        """All-reduce ``values`` in place by max; one collective."""
        return self._reduce(values, dist.ReduceOp.MAX)

    def _reduce(self, values: torch.Tensor, op: Any) -> torch.Tensor:
        if self.store is None:  # no store to learn of a failure from: wait as torch does
            dist.all_reduce(values, op=op, group=self.group)
            return values
        try:
            work = dist.all_reduce(values, op=op, group=self.group, async_op=True)
        except RuntimeError as error:  # a transport error at once: a peer has gone
            raise self._peer_left(error) from error
        if values.device.type == "cpu":
            self._wait(work)  # the host computes with the result next: it must be there
        else:
            work.wait()  # ordered on the device's stream; the step's read waits for it (``settle``)
            self._inflight.append(work)
        return values

    def _wait(self, work: Any) -> None:
        """Wait for ``work``, looking in the store for a peer's failure every ``POLL_SECONDS``."""
        done = threading.Event()
        future = work.get_future()
        future.add_done_callback(lambda _: done.set())
        while not done.wait(POLL_SECONDS):
            self._raise_if_failed()
        try:
            work.wait()
        except RuntimeError as error:  # gloo's "Connection closed by peer": say who and why, where known
            raise self._peer_left(error) from error

    def settle(self) -> None:
        """Before the step's read: wait for the device collectives in flight, looking in the store for a peer's
        failure meanwhile (the read itself would wait without looking)."""
        inflight, self._inflight = self._inflight, []
        for work in inflight:
            while not work.is_completed():
                self._raise_if_failed()
                time.sleep(0.0005)

    def failed(self, error: BaseException) -> GradGuardError:
        """This rank's step raised ``error``: write it where the other ranks look, and return what to raise here."""
        what = f"{type(error).__name__}: {error}"
        host = self.hosts.get(self.rank, host_name())
        if self.store is not None and self.failure_key is not None:
            # A store gone too: the other ranks learn of it from the transport.
            with contextlib.suppress(RuntimeError):
                self.store.set(self.failure_key, f"{self.rank}\t{host}\t{self.step}\t{what}")
        if isinstance(error, GradGuardError):
            return error  # already the guard's own words
        return RankFailed(
            f"rank {self.rank} (host {host}) failed inside the guard's step {self.step}: {what}. Every rank of the "
            "process group stops with this error; the process group cannot be used for further collectives.",
            self.rank,
            host,
            what,
            self.step,
        )

    def _raise_if_failed(self) -> None:
        try:
            failed = self.failure_key is not None and self.store.check([self.failure_key])
        except RuntimeError:
            return  # the store went with its host: the transport will say so
        if failed:
            raise self._failure()

    def _failure(self) -> RankFailed:
        text = self.store.get(self.failure_key).decode("utf-8", "replace")
        rank_text, host, step_text, what = [*text.split("\t", 3), "", "", ""][:4]
        rank = int(rank_text) if rank_text.isdigit() else -1
        step = int(step_text) if step_text.isdigit() else self.step
        return RankFailed(
            f"rank {rank} (host {host}) failed inside the guard's step {step}: {what}. Rank {self.rank} stops too "
            "rather than wait in the guard's collective for it; the process group cannot be used for further "
            "collectives.",
            rank,
            host,
            what,
            step,
        )

    def _peer_left(self, error: BaseException) -> GuardStateError:
        """A collective failed under us: the rank that failed, where it wrote why in time, else the transport's."""
        deadline = time.monotonic() + LEFT_GRACE_SECONDS
        while self.failure_key is not None and time.monotonic() < deadline:
            try:
                if self.store.check([self.failure_key]):
                    return self._failure()
            except RuntimeError:
                break  # the store went with the peer
            time.sleep(0.05)
        return GuardStateError(
            f"a peer rank left during the guard's collective at step {self.step} (rank {self.rank} waited): {error}. "
            "No rank wrote a failure of the guard's step: look at the other ranks' logs for why their process ended."
        )


def combine_shard_norms(
    collective: Collective, norms: Sequence[torch.Tensor], norm_type: float, shares: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Turn per-shard norms into norms of the full tensors, with one collective (``shares``: each piece's weight in
    the sum, where some are replicas: ``distributed.placements``)."""
    if not norms:
        return []
    stacked = torch.stack([norm.float() for norm in norms])
    if math.isinf(norm_type):
        return list(collective.max_(stacked).unbind())
    powered = stacked.abs().pow(norm_type)
    powered = collective.sum_(powered if shares is None else powered * shares)
    return list(powered.pow(1.0 / norm_type).unbind())
