"""The job's device mesh: which ranks hold the same parameters (a stage), and which hold the pipeline's other stages.

torchtitan names its mesh dimensions ``pp``, ``dp_replicate``, ``dp_shard``, ``cp`` and ``tp`` (and flattened
``dp``, ``dp_shard_cp``, ``dp_cp``). Under pipeline parallel each rank holds one stage (or, under interleaved
schedules, several), so ranks of different stages hold different parameters: the guard's per-tensor figures are
combined over a stage's ranks only (every other mesh dimension: its data-parallel replicas and shards, its
tensor-parallel ranks), and the stages agree on one verdict over ``pp`` (``step.stages``). A mesh without ``pp`` is one
stage over the whole job.

Dimensions the guard is not built for are refused at attach, with what works instead: context parallel (``cp`` of
more than one rank) and expert parallel (``ep``, ``etp``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from gradguard.errors import GuardStateError

__all__ = ["MeshLayout", "ModelParts", "layout_of"]

KNOWN = frozenset({"pp", "dp", "dp_replicate", "dp_shard", "tp", "cp", "dp_shard_cp", "dp_cp"})
"""torchtitan's mesh dimension names, as the guard reads them."""
REFUSED = {
    "cp": "context parallel (cp) shards each sequence over its ranks; the guard is not built for it yet",
    "ep": "expert parallel (ep) gives each rank its own experts; the guard is not built for it yet",
    "etp": "expert tensor parallel (etp) is not built yet",
}


@dataclass
class MeshLayout:
    """Where this rank stands in the job's mesh."""

    stage: int
    """This rank's pipeline stage (its ``pp`` coordinate; 0 without ``pp``)."""
    stages: int
    """How many pipeline stages the job has (1 without ``pp``)."""
    stage_ranks: list[list[int]]
    """Per stage, its ranks (global, in mesh order): the ranks that hold the same parameters."""
    stage_group: Any
    """The process group of this rank's stage (None where the stage is this rank alone)."""
    pp_ranks: list[int]
    """The ranks of this rank's pipeline (one per stage, this rank's coordinates elsewhere), by stage."""
    pp_group: Any
    """Their process group (None without a pipeline)."""
    coordinates: dict[int, dict[str, int]]
    """Global rank -> its coordinate along each named mesh dimension, for the words that name a rank."""

    @property
    def pipeline(self) -> bool:
        return self.stages > 1


def layout_of(mesh: Any) -> MeshLayout:
    """Read ``mesh`` (a ``DeviceMesh`` spanning the job); refuse the dimensions the guard is not built for. Every rank
    calls it (it makes one process group per stage, as ``new_group`` asks of every rank)."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if not names:
        raise GuardStateError(
            "device_mesh needs named dimensions (torchtitan's: pp, dp_replicate, dp_shard, cp, tp): build it with "
            "init_device_mesh(device_type, shape, mesh_dim_names=(...)); a pure pipeline's is 1-D, named 'pp'."
        )
    for name in names:
        refused = REFUSED.get(name)
        if refused is not None and mesh.size(names.index(name)) > 1:
            raise GuardStateError(
                f"device_mesh has a dimension {name!r} of size {mesh.size(names.index(name))}: {refused}. What is "
                "built: data parallel (DDP, FSDP2, HSDP), tensor and sequence parallel, and pipeline parallel, "
                "over the mesh dimensions pp, dp_replicate, dp_shard and tp (docs/distributed.md)."
            )
        if name not in KNOWN and name not in REFUSED:
            raise GuardStateError(
                f"device_mesh has a dimension {name!r} the guard does not know ({', '.join(names)}): name the "
                "dimensions as torchtitan does (pp, dp_replicate, dp_shard, cp, tp; docs/distributed.md)."
            )
    ranks = mesh.mesh
    world = dist.get_world_size()
    if ranks.numel() != world:
        raise GuardStateError(
            f"device_mesh spans {ranks.numel()} ranks but the job has {world}: pass the job's whole mesh (torchtitan's "
            "world mesh), not a part of it."
        )
    me = dist.get_rank()
    coordinates = {
        int(rank): dict(zip(names, map(int, index), strict=True)) for index, rank in _indexed(ranks.tolist(), ())
    }
    if "pp" not in names:
        everyone = sorted(int(rank) for rank in ranks.flatten().tolist())
        return MeshLayout(0, 1, [everyone], None, [], None, coordinates)
    pp = names.index("pp")
    stages = mesh.size(pp)
    stage_ranks = [[int(rank) for rank in ranks.select(pp, stage).flatten().tolist()] for stage in range(stages)]
    stage = coordinates[me]["pp"]
    stage_group = None
    for ranks_of_stage in stage_ranks:  # every rank makes every stage's group, in the same order
        group = dist.new_group(ranks_of_stage)  # of one rank too: the guard's collective is then inactive
        if stage == stage_ranks.index(ranks_of_stage):
            stage_group = group
    pp_group = mesh.get_group("pp") if stages > 1 else None
    pp_ranks = [int(rank) for rank in dist.get_process_group_ranks(pp_group)] if pp_group is not None else [me]
    return MeshLayout(stage, stages, stage_ranks, stage_group, pp_ranks, pp_group, coordinates)


def _indexed(nested: Any, index: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], int]]:
    if isinstance(nested, list):
        for position, item in enumerate(nested):
            yield from _indexed(item, (*index, position))
    else:
        yield index, nested


class ModelParts(nn.Module):
    """The modules one rank holds (torchtitan's ``model_parts``: several stages per rank under interleaved schedules),
    guarded as one model: their parameters and modules under their own names (each part keeps the whole model's names,
    as torchtitan's pipeline split does), none under an index."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def named_modules(
        self, memo: set[nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Module]]:
        memo = set() if memo is None else memo
        for part in self.parts:
            yield from part.named_modules(memo, prefix, remove_duplicate)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("ModelParts only names the parts a guard watches; run the parts (the pipeline's schedule)")
