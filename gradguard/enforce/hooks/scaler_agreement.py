"""GradScaler under tensor parallel: one found-inf flag for every rank that holds a piece of the gradients.

GradScaler's unscale reduces its found-inf flag over the mesh only where the first gradient of each (device, dtype)
group is not ``Replicate`` (torch's ``found_inf_reduce_handler`` reads that one gradient's placements): under
torchtitan's tensor-parallel plan the first is often a replicated one, so an Inf in one rank's shard sets that rank's
flag alone, its scaler skips the update and the others update (and wait for it in their next collective). Wrapped
around ``GradScaler.unscale_`` (``torch_hooks``), ``agree_found_inf`` takes the flags' maximum over every mesh
dimension whose parameters are neither all sharded there nor all replicated (one small all-reduce each, only on such a
mesh), so every rank's scaler skips the same steps and their loss scales move alike.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim import Optimizer

from gradguard.enforce.distributed.collective import is_sharded

__all__ = ["agree_found_inf"]

_groups: weakref.WeakKeyDictionary[Optimizer, tuple[tuple[int, ...], list[Any]]] = weakref.WeakKeyDictionary()
"""Optimizer -> (its parameters' ids, the process groups its flags are reduced over)."""


def agree_found_inf(scaler: torch.amp.GradScaler, optimizer: Optimizer) -> None:
    """After ``scaler.unscale_(optimizer)``: its found-inf flags made the same on every rank of the mesh."""
    groups = _groups_of(optimizer)
    if not groups:
        return
    state = scaler._per_optimizer_states.get(id(optimizer))
    if state is None:
        return
    for found in state["found_inf_per_device"].values():
        for group in groups:
            torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX, group=group)


def _groups_of(optimizer: Optimizer) -> list[Any]:
    """The groups of the mesh dimensions over which torch's own reduction of the flags may be missing: those where
    some parameter is replicated and some is not (the first of a group decides torch's)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    key = tuple(map(id, params))
    cached = _groups.get(optimizer)
    if cached is not None and cached[0] == key:
        return cached[1]
    by_dim: dict[tuple[int, int], tuple[Any, set[bool]]] = {}
    for param in params:
        if not is_sharded(param):
            continue
        mesh = param.device_mesh
        for dim, placement in enumerate(param.placements):
            if mesh.size(dim) > 1:
                by_dim.setdefault((id(mesh), dim), (mesh, set()))[1].add(placement.is_replicate())
    found = [mesh.get_group(dim) for (_, dim), (mesh, kinds) in by_dim.items() if len(kinds) == 2]
    _groups[optimizer] = (key, found)
    return found
