"""What a rewind restores: copies of a training's state, taken between steps and put back in place.

A ``Snapshot`` holds the model's parameters and buffers, every known optimizer's per-parameter state
and param groups' hyper-parameters, the GradScaler's scale, the LR schedulers' state and the guard's
own statistics (adaptive series, skip histories). Tensors go into buffers the snapshot owns: pinned
host memory for CUDA tensors, copied with ``non_blocking=True`` on the current stream, so taking one
adds no host sync (stream order puts the copy before the optimizer's later writes, and a restore's
copies back after it); plain copies on the CPU. A slot's buffers are reused by the next snapshot
that takes its place, so a run allocates them once.

Restoring copies *into* the live tensors (``torch._foreach_copy_``): parameters, optimizer state and
the scaler's tensors keep their identity, so fused optimizers, ``torch.compile`` and references the
loop holds stay valid, and the snapshot itself is never handed out (a second rewind to the same
snapshot finds it as it was taken). State an optimizer made after the snapshot (its first step) is
removed, as a snapshot of a fresh optimizer holds none.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from gradguard.enforce.actions.nonfinite import SkipLimits
from gradguard.enforce.distributed.collective import local_tensor
from gradguard.enforce.recovery.host_copy import HostCopy
from gradguard.enforce.recovery.schedulers import scale_scheduler_lrs
from gradguard.enforce.recovery.snapshot_memory import HOST, Flat, Placement, Stager, copy_into, wait_for
from gradguard.enforce.work.statistics import Series, Statistics
from gradguard.errors import GuardStateError

__all__ = [
    "LR_KEYS",
    "LiveState",
    "Snapshot",
    "TensorCopies",
    "detached_copy",
    "restore_groups",
    "scale_lrs",
    "scheduler_optimizer",
]

LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr", "swa_lr")
"""A param group's learning rates: the LR itself and what schedulers compute it from (``OneCycleLR``, ``SWALR``)."""


class TensorCopies:
    """Copies of a list of tensors, in flat buffers reused while shapes, dtypes and placement stay the same."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self._flat: Flat | None = None

    def take(self, sources: Sequence[torch.Tensor], where: Placement = HOST, stager: Stager | None = None) -> None:
        """Copy ``sources`` into buffers ``where`` says; with ``stager``, queue the copy (its ``flush`` does it)."""
        flat = self._flat
        if flat is None or not flat.fits(sources, where.where):
            flat = Flat(sources, where.where, where.empty)
        self._flat, self.buffers = flat, flat.views
        if stager is not None:
            stager.add(flat, sources)
        else:
            copy_into(flat.views, list(sources))

    def restore(self, targets: Sequence[torch.Tensor]) -> None:
        buffers = self.buffers
        if len(targets) != len(buffers) or any(not _fits(t, b) for t, b in zip(targets, buffers, strict=True)):
            raise GuardStateError(
                "the model's parameters or buffers changed shape or number since the recovery snapshot was "
                "taken, so it cannot be restored into them; the run halts here as without recovery"
            )
        copy_into(list(targets), buffers)

    @property
    def nbytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self.buffers)

    @property
    def layout(self) -> list[tuple[torch.Size, torch.dtype, torch.device]]:
        """Each copied tensor's shape, dtype and device when it was taken (what a restore's target must match)."""
        return [] if self._flat is None else list(self._flat.layout)


@dataclass
class _OptimizerCopy:
    """One optimizer: each parameter's state (by position in its groups) and each group's hyper-parameters."""

    ref: weakref.ReferenceType[Optimizer]
    state: list[dict[str, Any] | None] = field(default_factory=list)
    """Per parameter, in group order: its state with tensors replaced by their position in ``tensors``."""
    groups: list[dict[str, Any]] = field(default_factory=list)
    tensors: TensorCopies = field(default_factory=TensorCopies)
    outside: TensorCopies = field(default_factory=TensorCopies)
    """Its parameters outside the model (a temperature, another module's), which it alone moves."""

    def take(
        self, optimizer: Optimizer, model_ids: set[int], where: Placement = HOST, stager: Stager | None = None
    ) -> None:
        self.outside.take(_outside(optimizer, model_ids), where, stager)
        sources: list[torch.Tensor] = []
        self.state = []
        for param in _params_of(optimizer):
            entry = optimizer.state.get(param)
            if entry is None:
                self.state.append(None)
                continue
            saved: dict[str, Any] = {}
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    saved[key] = _Slot(len(sources))
                    sources.append(local_tensor(value))
                else:
                    saved[key] = copy.deepcopy(value)
            self.state.append(saved)
        self.groups = [
            {key: detached_copy(value) for key, value in group.items() if key != "params"}
            for group in optimizer.param_groups
        ]
        self.tensors.take(sources, where, stager)

    def restore(self, optimizer: Optimizer, model_ids: set[int]) -> None:
        self.outside.restore(_outside(optimizer, model_ids))
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        buffers = self.tensors.buffers
        for position, param in enumerate(_params_of(optimizer)):
            saved = self.state[position] if position < len(self.state) else None
            if saved is None:
                optimizer.state.pop(param, None)  # made after the snapshot: a fresh optimizer holds none
                continue
            live = optimizer.state[param]
            for key in [key for key in live if key not in saved]:
                del live[key]
            for key, value in saved.items():
                current = live.get(key)
                if not isinstance(value, _Slot):
                    live[key] = copy.deepcopy(value)
                elif isinstance(current, torch.Tensor) and _fits(local_tensor(current), buffers[value.index]):
                    targets.append(local_tensor(current))
                    sources.append(buffers[value.index])
                else:  # gone or reshaped since: a copy of ours, never the snapshot's own buffer
                    device = _device_of(param)
                    live[key] = buffers[value.index].to(device, copy=True)
        copy_into(targets, sources)
        restore_groups(optimizer.param_groups, self.groups)

    @property
    def nbytes(self) -> int:
        return self.tensors.nbytes + self.outside.nbytes


def _outside(optimizer: Optimizer, model_ids: set[int]) -> list[torch.Tensor]:
    return [local_tensor(p.detach()) for p in _params_of(optimizer) if id(p) not in model_ids]


@dataclass(frozen=True)
class _Slot:
    index: int


@dataclass
class Snapshot:
    """The state of a training at the start of step ``step``, before that step's update."""

    step: int = -1
    lr_scale: float = 1.0
    """The product of the ``lr_factor`` of every rewind before this snapshot was taken (its LRs include it)."""
    applied: int = 0
    """``Recovery.applied`` when it was taken: the updates applied before its step."""
    model: TensorCopies = field(default_factory=TensorCopies)
    """The model's parameters."""
    buffers: TensorCopies = field(default_factory=TensorCopies)
    """The model's buffers (BatchNorm's running statistics) at the start of the step, before its forward."""
    optimizers: list[_OptimizerCopy] = field(default_factory=list)
    averages: TensorCopies = field(default_factory=TensorCopies)
    """The averaged copies' parameters and buffers (``GradGuard(averages=...)``: an EMA of the weights)."""
    scaler: dict[str, torch.Tensor | None] = field(default_factory=dict)
    schedulers: list[dict[str, Any]] = field(default_factory=list)
    statistics: dict[tuple[str, int], Series] = field(default_factory=dict)
    saved_statistics: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    skips: SkipLimits = field(default_factory=SkipLimits)
    loss: dict[str, Any] = field(default_factory=dict)
    """The loss section's reference and skip history (``LossWatch.state_dict``)."""
    where: Placement = HOST
    """Where its tensors live (the policy's ``recovery.memory``, as chosen at attach)."""
    copied: HostCopy | None = None
    """Host mode on CUDA: its copy to the host (in chunks), whose end a restore's copies wait for (on the device)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors it holds (the guard's statistics, on the device, are not counted)."""
        return self.model.nbytes + self.buffers.nbytes + self.averages.nbytes + sum(o.nbytes for o in self.optimizers)

    def take(
        self,
        step: int,
        lr_scale: float,
        live: LiveState,
        buffers: TensorCopies | None = None,
        where: Placement = HOST,
        stager: Stager | None = None,
    ) -> TensorCopies | None:
        """Copy the live state ``where`` says (through ``stager``: host mode's side stream); ``buffers``: the model's
        buffers taken at the start of the step (before its forward), used instead of the live ones. Returns the
        buffers object it replaced, for reuse."""
        self.step, self.lr_scale, self.where = step, lr_scale, where
        self.model.take(live.params(), where, stager)
        replaced = None
        if buffers is not None:
            replaced, self.buffers = self.buffers, buffers
        else:
            self.buffers.take(live.buffers(), where)
        kept = {id(opt.ref()): opt for opt in self.optimizers}
        self.optimizers = []
        for optimizer in live.optimizers():
            self.add_optimizer(optimizer, live.model_ids(), kept.get(id(optimizer)), stager)
        self.averages.take(live.average_tensors(), where, stager)
        self.copied = stager.flush() if stager is not None else None
        self.scaler = {key: detached_copy(value) for key, value in live.scaler_tensors().items()}
        self.schedulers = [copy.deepcopy(scheduler.state_dict()) for scheduler in live.schedulers]
        self.statistics = {key: _series_copy(series) for key, series in live.statistics.series.items()}
        self.saved_statistics = copy.deepcopy(live.statistics._saved)
        self.skips = copy.deepcopy(live.skip_limits)
        self.loss = live.loss.state_dict() if live.loss is not None else {}
        return replaced

    def add_optimizer(
        self,
        optimizer: Optimizer,
        model_ids: set[int],
        reuse: _OptimizerCopy | None = None,
        stager: Stager | None = None,
    ) -> None:
        entry = reuse if reuse is not None else _OptimizerCopy(weakref.ref(optimizer))
        entry.ref = weakref.ref(optimizer)
        entry.take(optimizer, model_ids, self.where, stager)
        self.optimizers.append(entry)

    def holds(self, optimizer: Optimizer) -> bool:
        return any(entry.ref() is optimizer for entry in self.optimizers)

    def restore(self, live: LiveState) -> None:
        """Put every copy back into the live objects, in place (after its copy to the host, on the device's queue)."""
        wait_for(self.copied, self.where.device)
        self.model.restore(live.params())
        self.buffers.restore(live.buffers())
        model_ids = live.model_ids()
        for entry in self.optimizers:
            optimizer = entry.ref()
            if optimizer is not None:
                entry.restore(optimizer, model_ids)
        self.averages.restore(live.average_tensors())  # after the buffers: an EMA inside the model holds its own
        self.restore_scaler(live)
        self.restore_schedulers(live)
        live.statistics.series = {key: _series_copy(series) for key, series in self.statistics.items()}
        live.statistics._saved = copy.deepcopy(self.saved_statistics)
        live.skip_limits.history = copy.deepcopy(self.skips.history)
        live.skip_limits.scaler_skips = self.skips.scaler_skips
        live.skip_limits.applied_at = self.skips.applied_at
        if live.loss is not None and self.loss:
            live.loss.load_state_dict(self.loss)

    def restore_scaler(self, live: LiveState) -> None:
        scaler = live.scaler
        for key, value in self.scaler.items():
            current = getattr(scaler, key, None)
            if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
                current.copy_(value)
            elif scaler is not None:
                setattr(scaler, key, detached_copy(value))

    def restore_schedulers(self, live: LiveState) -> None:
        for scheduler, saved in zip(live.schedulers, self.schedulers, strict=False):
            scheduler.load_state_dict(copy.deepcopy(saved))


@dataclass
class LiveState:
    """The live objects a snapshot copies and a rewind restores."""

    model: weakref.ReferenceType[nn.Module]
    statistics: Statistics
    skip_limits: SkipLimits
    loss: Any = None
    """The guard's ``LossWatch`` (its reference is rewound with the statistics), where known."""
    known_optimizers: list[weakref.ReferenceType[Optimizer]] = field(default_factory=list)
    scaler: torch.amp.GradScaler | None = None
    schedulers: list[Any] = field(default_factory=list)
    """``torch.optim.lr_scheduler.LRScheduler`` (or anything with ``state_dict``/``load_state_dict``)."""
    averages: list[weakref.ReferenceType[nn.Module]] = field(default_factory=list)
    """Averaged copies of the model (``GradGuard(averages=...)``: an EMA), snapshotted and rewound with it."""

    def optimizers(self) -> list[Optimizer]:
        return [opt for ref in self.known_optimizers if (opt := ref()) is not None]

    def params(self) -> list[torch.Tensor]:
        """The model's parameters (their local shards under FSDP2)."""
        model = self.model()
        return [] if model is None else [local_tensor(p.detach()) for p in model.parameters()]

    def buffers(self) -> list[torch.Tensor]:
        model = self.model()
        return [] if model is None else [local_tensor(b.detach()) for b in model.buffers() if b is not None]

    def model_ids(self) -> set[int]:
        model = self.model()
        return set() if model is None else {id(p) for p in model.parameters()}

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a snapshot copies: parameters, buffers, the optimizers' outside the model, the averages'."""
        model_ids = self.model_ids()
        outside = [t for opt in self.optimizers() for t in _outside(opt, model_ids)]
        return [*self.params(), *self.buffers(), *outside, *self.average_tensors()]

    def average_tensors(self) -> list[torch.Tensor]:
        """The averages' parameters and buffers (``AveragedModel``'s ``n_averaged`` too), each average's in order."""
        averages = [average for ref in self.averages if (average := ref()) is not None]
        return [local_tensor(t.detach()) for a in averages for t in (*a.parameters(), *a.buffers()) if t is not None]

    def scaler_tensors(self) -> dict[str, torch.Tensor | None]:
        scaler = self.scaler
        if scaler is None or not scaler.is_enabled():
            return {}
        return {key: getattr(scaler, key, None) for key in ("_scale", "_growth_tracker")}


def scheduler_optimizer(scheduler: Any) -> Optimizer | None:
    optimizer = getattr(scheduler, "optimizer", None)
    return optimizer if isinstance(optimizer, Optimizer) else None


def scale_lrs(optimizers: Iterable[Optimizer], schedulers: Iterable[Any], factor: float) -> None:
    """Multiply every learning rate the optimizers and schedulers hold by ``factor``.

    The groups' LRs, and what schedulers recompute them from (``base_lrs`` for ``LambdaLR`` and HF's
    schedules, ``max_lr``/``initial_lr``/``min_lr`` in the groups for ``OneCycleLR``, ``eta_min`` for the
    cosine ones), so the factor holds through every later ``scheduler.step()``.
    """
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for key in LR_KEYS:
                value = group.get(key)
                if isinstance(value, torch.Tensor):
                    value.mul_(factor)
                elif isinstance(value, int | float) and not isinstance(value, bool):
                    group[key] = value * factor
    scale_scheduler_lrs(schedulers, factor)  # each once, a composite's parts too (recovery/schedulers.py)


def _params_of(optimizer: Optimizer) -> list[torch.Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]


def _device_of(param: torch.Tensor) -> torch.device:
    return local_tensor(param).device


def _fits(live: torch.Tensor, buffer: torch.Tensor) -> bool:
    return live.shape == buffer.shape and live.dtype == buffer.dtype


def restore_groups(groups: Sequence[dict[str, Any]], saved: Sequence[dict[str, Any]]) -> None:
    """Put saved hyper-parameters back into param groups: into a tensor in place (a compiled step holds it)."""
    for group, values in zip(groups, saved, strict=False):
        for key, value in values.items():
            current = group.get(key)
            if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
                current.copy_(value)
            else:
                group[key] = detached_copy(value)


def detached_copy(value: Any) -> Any:
    """A copy of ``value`` that shares no tensor with it."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return copy.deepcopy(value)


def _series_copy(series: Series) -> Series:
    """A copy of ``series`` whose tensors and counters are its own (a commit replaces them, never edits)."""
    return dataclasses.replace(
        series,
        tensors={key: value.clone() for key, value in series.tensors.items()},
        counters=dict(series.counters),
        columns=dict(series.columns),
        in_order=list(series.in_order),
        derived={},
    )
