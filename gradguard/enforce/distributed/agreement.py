"""Ranks agree at attach: the same policy, the same guarded parameters and options on every rank.

Every enforcement pass makes the same collectives on every rank, so a guard attached on some ranks
only, or with a different policy on one, would hang the job at its first step (or part the ranks at
the first NaN) with a transport error that says nothing of why. At attach, each rank therefore
writes a fingerprint of its guard into the process group's store and waits, with a timeout, for
every other rank's: a rank that never attaches is named after ``attach_timeout`` seconds, and any
difference is named, with the ranks on each side, on every rank. The store is used rather than a
collective because a store wait can time out on its own, without tearing the process group down.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from gradguard.enforce.distributed.collective import Collective
from gradguard.enforce.distributed.local import host_name
from gradguard.errors import GuardStateError
from gradguard.policy.document import Policy
from gradguard.policy.matching import Binding

__all__ = ["agree_at_attach", "digest", "fingerprint"]

_ATTACHES: dict[str, itertools.count[int]] = {}
"""Per process group, how many guards this process has attached: ranks attach in the same order."""


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
    } | ({"stage": stage} if stage else {})


def agree_at_attach(collective: Collective, mine: Mapping[str, str], timeout: float) -> None:
    """Compare ``mine`` (a ``fingerprint``) across the ranks of ``collective``'s group; raise on a difference.

    Every field must be equal on every rank but ``source`` (the policy's file), which is shown, not
    compared: two paths to the same content agree. A rank that has not attached within ``timeout``
    seconds is named. Does nothing without an initialised process group of more than one rank.
    """
    if not collective.active():
        return
    group = collective.group
    ranks = list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    tag = "-".join(map(str, ranks))
    sequence = next(_ATTACHES.setdefault(tag, itertools.count()))
    prefix = f"gradguard/attach/{tag}/{sequence}/"
    store = dist.distributed_c10d._get_default_store()
    store.set(prefix + str(dist.get_rank()), json.dumps(dict(mine) | {"host": host_name()}))
    keys = [prefix + str(rank) for rank in ranks]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except RuntimeError:  # the store's timeout (DistStoreError): name who is missing
        missing = [rank for rank, key in zip(ranks, keys, strict=True) if not store.check([key])]
        raise GuardStateError(
            f"rank(s) {missing} did not attach a GradGuard within {timeout:g} s (attach_timeout) while "
            f"rank {dist.get_rank()} did: every rank must attach the same guard (its per-step agreement would "
            "otherwise wait forever for them). Attach it on every rank, not under `if rank == 0:`; log from rank 0 "
            "only with audit_log=None or logger=None on the others if you want fewer logs."
        ) from None
    saved = {rank: json.loads(store.get(key)) for rank, key in zip(ranks, keys, strict=True)}
    differences = []
    # Each rank's host, known to every rank from now on: a fault is named with the machine it came from.
    collective.members, collective.index = ranks, ranks.index(dist.get_rank())
    collective.hosts = {rank: str(entry.get("host", "?")) for rank, entry in saved.items()}
    collective.store, collective.failure_key = store, prefix + "failure"
    stages = {rank: str(found.get("stage", "")) for rank, found in saved.items()}
    for field in sorted({name for found in saved.values() for name in found} - {"source", "host", "stage"}):
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
