"""Ranks agree at attach: the same policy, the same guarded parameters and options on every rank.

Every enforcement pass makes the same collectives on every rank, so a guard attached on some ranks
only, or with a different policy on one, would hang the job at its first step (or part the ranks at
the first NaN) with a transport error that says nothing of why. At attach, each rank therefore
writes a fingerprint of its guard into the process group's store and waits, with a timeout, for
every other rank's: a rank that never attaches is named after ``attach_timeout`` seconds, and any
difference is named, with the ranks on each side, on every rank. The store is used rather than a
collective because a store wait can time out on its own, without tearing the process group down.

A rank whose attach raises before it reaches the agreement (a rule that binds nothing on its model, a policy file
missing on its host, a refused option) writes what it raised into its place in the store instead
(``attach_failed``): the others raise ``RankFailed`` naming its rank, host and error as soon as every rank has
arrived, not a "did not attach" at ``attach_timeout``, and the rank raises its own error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from gradguard.enforce.distributed.collective import Collective, RankFailed
from gradguard.enforce.distributed.local import host_name
from gradguard.errors import GuardStateError
from gradguard.policy.document import Policy
from gradguard.policy.matching import Binding

__all__ = ["AttachMark", "agree_at_attach", "attach_begins", "attach_failed", "digest", "fingerprint"]

_ATTACHES: dict[str, int] = {}
"""Per process group, how many guards this process has attached (or failed to): ranks attach in the same order."""

AttachMark = tuple[str, int]
"""Where an attach will agree: its group's tag and the sequence number its agreement takes (``attach_begins``)."""


def _slots(group: Any) -> tuple[list[int], str]:
    """The group's (None: the default group's) global ranks, and its tag in the store's keys."""
    ranks = list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    return ranks, "-".join(map(str, ranks))


def _prefix(tag: str, sequence: int) -> str:
    return f"gradguard/attach/{tag}/{sequence}/"


def attach_begins(group: Any) -> AttachMark | None:
    """A guard's attach begins, to agree over ``group`` (None: the default group): the mark ``attach_failed`` needs,
    or None without an initialised process group of more than one rank (or one this rank is not in)."""
    try:
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1):
            return None
        ranks, tag = _slots(group)
    except Exception:  # not a group the agreement could be made over: its own error comes in the attach
        return None
    return (tag, _ATTACHES.get(tag, 0)) if dist.get_rank() in ranks else None


def attach_failed(mark: AttachMark | None, error: BaseException) -> None:
    """The attach ``mark`` began raised ``error``. Before its agreement (this rank has not written its place in the
    store yet), write the error there: the other ranks, waiting for this rank's place, raise naming it at once. After
    it, nothing: the agreement itself raised it (on every rank), or the others are past it already."""
    if mark is None or _ATTACHES.get(mark[0], 0) != mark[1]:
        return
    tag, sequence = mark
    _ATTACHES[tag] = sequence + 1  # this attach's number is taken, as the others' agreement takes it
    entry = {"host": host_name(), "failed": f"{type(error).__name__}: {error}"}
    with contextlib.suppress(Exception):  # a store gone too: the rank's own error is what matters here
        store = dist.distributed_c10d._get_default_store()
        store.set(_prefix(tag, sequence) + str(dist.get_rank()), json.dumps(entry))


def digest(value: Any) -> str:
    """A short, stable hash of JSON-able ``value`` (keys sorted)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def fingerprint(
    policy: Policy, binding: Binding, per_micro_batch: bool, start_step: int, reload: bool = False, stage: str = ""
) -> dict[str, str]:
    """What every rank's guard must share, as short comparable strings (and the policy's file, shown only).

    ``reload`` is compared too: with it, every enforcement pass makes one more collective. ``stage``: this rank's
    pipeline stage (``"1 of 2"``), where the parameters are compared among the stage's ranks only.
    """
    names = sorted(name for entry in binding.params for name in entry.names)
    options = f"per_micro_batch={per_micro_batch}, start_step={start_step}" + (", reload=True" if reload else "")
    return {
        "policy": f"content {digest(policy.model_dump(mode='json'))}",
        "parameters": f"{len(binding.params)} guarded tensors, names {digest(names)}",
        "options": options,
        "source": policy.source,
    } | (
        {"stage": stage, "unmatched": ",".join(map(str, binding.unmatched)), "guarded": str(len(binding.params))}
        if stage
        else {}
    )


def agree_at_attach(collective: Collective, mine: Mapping[str, str], timeout: float) -> dict[int, dict[str, Any]]:
    """Compare ``mine`` (a ``fingerprint``) across the ranks of ``collective``'s group; raise on a difference.

    Every field must be equal on every rank but ``source`` (the policy's file), which is shown, not
    compared: two paths to the same content agree. A rank that has not attached within ``timeout``
    seconds is named. Does nothing without an initialised process group of more than one rank. Returns every rank's
    fingerprint, by rank (empty where it did nothing).
    """
    if not collective.active():
        return {}
    ranks, tag = _slots(collective.group)
    sequence = _ATTACHES.get(tag, 0)
    _ATTACHES[tag] = sequence + 1
    prefix = _prefix(tag, sequence)
    store = dist.distributed_c10d._get_default_store()
    store.set(prefix + str(dist.get_rank()), json.dumps(dict(mine) | {"host": host_name()}))
    keys = [prefix + str(rank) for rank in ranks]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except RuntimeError:  # the store's timeout (DistStoreError): name who is missing
        present = {rank: key for rank, key in zip(ranks, keys, strict=True) if store.check([key])}
        failure = _failure_of({rank: json.loads(store.get(key)) for rank, key in present.items()})
        missing = [rank for rank in ranks if rank not in present]
        raise failure or GuardStateError(
            f"rank(s) {missing} did not attach a GradGuard within {timeout:g} s (attach_timeout) while "
            f"rank {dist.get_rank()} did: every rank must attach the same guard (its per-step agreement would "
            "otherwise wait forever for them). Attach it on every rank, not under `if rank == 0:`; log from rank 0 "
            "only with audit_log=None or logger=None on the others if you want fewer logs."
        ) from None
    saved = {rank: json.loads(store.get(key)) for rank, key in zip(ranks, keys, strict=True)}
    if (failure := _failure_of(saved)) is not None:
        raise failure
    differences = []
    # Each rank's host, known to every rank from now on: a fault is named with the machine it came from.
    collective.members, collective.index = ranks, ranks.index(dist.get_rank())
    collective.hosts = {rank: str(entry.get("host", "?")) for rank, entry in saved.items()}
    collective.store, collective.failure_key = store, prefix + "failure"
    stages = {rank: str(found.get("stage", "")) for rank, found in saved.items()}
    shown = {"source", "host", "stage", "unmatched", "guarded"}  # a stage's own: ``agree_on_the_mesh`` reads them
    for field in sorted({name for found in saved.values() for name in found} - shown):
        # A pipeline's stages hold different parameters by design: those are compared among a stage's ranks.
        within = field == "parameters" and any(stages.values())
        by_value: dict[str, list[int]] = {}
        for rank, found in saved.items():
            key = str(found.get(field, "(missing)"))
            by_value.setdefault(f"stage {stages[rank]}: {key}" if within else key, []).append(rank)
        if within and len(by_value) > len(set(stages.values())):
            sides = "; ".join(f"ranks {on}: {value}" for value, on in by_value.items())
            differences.append(f"{field} differs within a stage ({sides})")
        elif not within and len(by_value) > 1:
            sides = "; ".join(f"ranks {on}: {value}" for value, on in by_value.items())
            differences.append(f"{field} differs ({sides})")
            if field == "parameters":
                differences[-1] += (
                    " [if this is a pipeline (torch.distributed.pipelining: each rank holds a stage), pass the job's "
                    "DeviceMesh with a 'pp' dimension: GradGuard(stage_or_model_parts, policy, device_mesh=mesh)]"
                )
            if field == "policy":
                files = ", ".join(f"rank {rank}: {entry['source']}" for rank, entry in saved.items())
                differences[-1] += f" [policy files: {files}]"
    if differences:
        raise GuardStateError(
            f"the ranks of this process group do not agree on the guard: {'; and '.join(differences)}. Every "
            "rank must attach the same policy to the same model, with the same options, or the ranks would take "
            "different decisions (or wait for each other forever) at the first step."
        )
    return saved


def _failure_of(saved: Mapping[int, Mapping[str, Any]]) -> RankFailed | None:
    """``RankFailed`` naming the ranks whose attach raised before the agreement (``attach_failed``), or None."""
    failed = {rank: entry for rank, entry in saved.items() if "failed" in entry}
    if not failed:
        return None
    (rank, first), *more = failed.items()
    host, what = str(first.get("host", "?")), str(first["failed"])
    others = "".join(f"; rank {r} (host {e.get('host', '?')}) too: {e['failed']}" for r, e in more)
    return RankFailed(
        f"rank {rank} (host {host}) failed to attach its GradGuard: {what}{others}. Rank {dist.get_rank()} stops "
        "too, at once rather than at attach_timeout: every rank must attach the same guard (the guard's per-step "
        "agreement would wait for that rank forever). Fix what that rank raised and start the job again.",
        rank,
        host,
        what,
        None,
    )
