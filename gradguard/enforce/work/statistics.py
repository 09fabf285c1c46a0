"""What the adaptive actions remember across steps: their statistics, kept on the device.

``zclip``, ``autoclip`` and ``skip_step_on_spike`` decide each step from statistics of the norms of
earlier steps. Those live here, one ``Series`` per (rule, action), one column per parameter
(``scope: tensor``) or a single column (``scope: group``), as float64 tensors on the gradients'
device, so reading them never costs a host sync.

A step's kernels compute the statistics the step would leave behind, out of place, and hand them to
``StepStatistics.propose``; the engine commits (``StepStatistics.commit``) them only once the step
is known to be applied, after the step's one host read. So a halted or skipped step, or a step
GradScaler skips, leaves every statistic as it was: one bad step never poisons them.

``Statistics.state_dict`` writes every series as plain floats and ints keyed by rule name, action
position and parameter name (JSON-friendly, float64 exact), and ``Statistics.load_state_dict``
takes them back: a resumed run decides bitwise as the uninterrupted one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gradguard.enforce.work.tensors import device_constant
from gradguard.policy.matching import BoundRule
from gradguard.policy.schema import Action

__all__ = ["Series", "Statistics", "StepStatistics", "pushed"]

STATS_DTYPE = torch.float64
"""Statistics are kept in float64 whatever the gradients' dtype: they are a few numbers per parameter."""

Init = Callable[[int, torch.device], dict[str, torch.Tensor]]
"""Builds a series' empty tensors for a number of columns on a device."""


@dataclass(eq=False)
class Series:
    """One adaptive action's statistics: device tensors whose first dimension is the column."""

    kind: str
    """The action (``zclip``, ``autoclip``, ``skip_step_on_spike``)."""
    shape: tuple[int, ...]
    """What must match for saved statistics to be taken over (e.g. the ring buffer's length)."""
    names: tuple[str, ...]
    """One name per column: the parameters (tensor scope) or the rule (group scope)."""
    tensors: dict[str, torch.Tensor]
    counters: dict[str, int] = field(default_factory=dict)
    """Host integers every column shares (a ring buffer's next slot)."""
    columns: dict[int, int] = field(default_factory=dict)
    """Tensor index -> column (tensor scope), for the binding ``bound`` belongs to."""
    bound: BoundRule | None = None
    """The bound rule the columns were mapped for: a new binding (a rebind, a reload) maps them again."""
    in_order: list[int] = field(default_factory=list)
    """The tensor indices of every column, in column order (tensor scope)."""
    blank: bool = False
    """Its tensors are still as ``init`` made them (nothing carried over, loaded or committed): the host need not
    read them to know them."""
    host: dict[str, Any] | None = None
    """Where the host decides (``actions.zclip``): the values as Python numbers, the series' own in place of
    ``tensors`` until ``materialize`` makes them tensors again; replaced at a commit, never edited (a snapshot holds
    the dict it copied)."""
    derived: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    """What a kernel derived from the statistics (``host``'s lists or ``tensors``), with what it was derived from:
    the same objects (``is``: replaced at a commit, never edited) find it again (zclip's ceilings from its warm-up
    buffer, which stops changing once warm-up is done); never saved."""

    def materialize(self) -> None:
        """``host``'s values back into ``tensors`` (a step the device decides, a carry-over)."""
        if self.host is not None:
            device = next(iter(self.tensors.values())).device
            made = {key: torch.tensor(value, dtype=STATS_DTYPE, device=device) for key, value in self.host.items()}
            self.tensors, self.host, self.blank = {**self.tensors, **made}, None, False

    def map_columns(self, bound: BoundRule) -> None:
        self.bound = bound
        self.in_order = [entry.index for entry in bound.params]
        self.columns = {index: column for column, index in enumerate(self.in_order)}

    def at(self, cols: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Every tensor's rows ``cols`` (``None``: all of them, not copied)."""
        self.materialize()
        return {key: value if cols is None else value.index_select(0, cols) for key, value in self.tensors.items()}

    def ring_slot(self, size: int) -> int:
        """The column of a ring of ``size`` columns the next applied step writes (propose ``slot + 1`` after)."""
        return self.counters.get("slot", 0) % size

    def select(self, ids: list[int]) -> torch.Tensor | None:
        """The columns of ``ids`` as an index tensor, or ``None`` when they are all columns in order."""
        if ids == self.in_order:  # the common case, compared in C
            return None
        device = next(iter(self.tensors.values())).device
        return device_constant(tuple(self.columns[i] for i in ids), torch.int64, device)


@dataclass
class StepStatistics:
    """What this step's kernels propose to remember; committed only if the step is applied."""

    proposals: list[tuple[Series, torch.Tensor | None, dict[str, torch.Tensor], dict[str, int]]] = field(
        default_factory=list
    )
    host: list[tuple[Series, dict[str, Any], dict[str, int]]] = field(default_factory=list)
    """Proposals of Python numbers, for a series the host decides (``Series.host``)."""

    def propose_host(self, series: Series, values: dict[str, Any], counters: dict[str, int]) -> None:
        """After this step, ``series.host`` holds ``values`` (every column) for their keys."""
        self.host.append((series, values, counters))

    def propose(
        self,
        series: Series,
        cols: torch.Tensor | None,
        tensors: dict[str, torch.Tensor],
        counters: dict[str, int] | None = None,
    ) -> None:
        """After this step, ``series`` holds ``tensors`` in columns ``cols`` (``None``: all of them)."""
        self.proposals.append((series, cols, tensors, counters or {}))

    def commit(self) -> None:
        """The step was applied: every proposal becomes the statistics the next step sees."""
        for series, cols, tensors, counters in self.proposals:
            for key, value in tensors.items():
                if cols is None:
                    series.tensors[key] = value
                else:
                    series.tensors[key] = series.tensors[key].index_copy(0, cols, value)
            series.counters.update(counters)
            series.blank = False
        self.proposals.clear()
        for series, values, counters in self.host:
            base = series.host if series.host is not None else {k: v.tolist() for k, v in series.tensors.items()}
            series.host = {**base, **values}
            series.counters.update(counters)
        self.host.clear()


class Statistics:
    """Every adaptive action's ``Series``, by (rule name, position of the action in the rule)."""

    def __init__(self) -> None:
        self.series: dict[tuple[str, int], Series] = {}
        self._saved: dict[tuple[str, int], dict[str, Any]] = {}
        """Loaded statistics not yet placed on a device (that happens at the series' first step)."""

    def series_for(
        self,
        bound: BoundRule,
        action: Action,
        group: bool,
        shape: tuple[int, ...],
        device: torch.device,
        init: Init,
    ) -> Series:
        """The statistics of ``action`` of ``bound``, made (or taken from a loaded state) on first use."""
        position = next(p for p, a in enumerate(bound.actions) if a is action)
        key = (bound.name, position)
        series = self.series.get(key)
        if series is not None and series.bound is bound and series.kind == action.action and series.shape == shape:
            return series  # every step but the first after a (re)binding
        names = (bound.name,) if group else tuple(entry.name for entry in bound.params)
        if series is not None and series.kind == action.action and series.shape == shape and series.names == names:
            series.map_columns(bound)  # same names, maybe new tensor indices
            return series
        fresh = Series(action.action, shape, names, init(len(names), device))
        fresh.map_columns(bound)
        earlier = series if series is not None else self._take_saved(key, device)
        if earlier is not None and earlier.kind == fresh.kind and earlier.shape == shape:
            _carry_over(earlier, fresh)
        else:
            fresh.blank = True
        self.series[key] = fresh
        return fresh

    def forget_missing(self, rules: Sequence[BoundRule]) -> None:
        """After a policy reload: drop the series of rules or actions that are gone or changed."""
        live = {(bound.name, p): a.action for bound in rules for p, a in enumerate(bound.actions)}
        self.series = {key: s for key, s in self.series.items() if live.get(key) == s.kind}

    def state_dict(self) -> dict[str, Any]:
        """Every series as plain numbers (one host read per tensor; call it between steps)."""
        out: dict[str, Any] = {}
        for (rule, position), series in sorted(self.series.items()):
            out.setdefault(rule, {})[str(position)] = _plain(series)
        for (rule, position), saved in self._saved.items():
            out.setdefault(rule, {}).setdefault(str(position), saved)
        return out

    def release(self) -> None:
        """Keep every series as plain numbers and give its device tensors back (the guard is removed): ``state_dict``
        still holds them, and a series used again is taken back onto the device as a loaded one is."""
        for key, series in sorted(self.series.items()):
            self._saved[key] = _plain(series)
        self.series.clear()

    def load_state_dict(self, saved: dict[str, Any], rule_names: Sequence[str]) -> list[str]:
        """Take saved statistics over (placed on the device at their first step); returns unknown rules."""
        self.series = {}
        self._saved = {}
        unknown = []
        for rule, actions in saved.items():
            if rule not in rule_names:
                unknown.append(rule)
                continue
            for position, entry in actions.items():
                self._saved[(rule, int(position))] = dict(entry)
        return unknown

    def _take_saved(self, key: tuple[str, int], device: torch.device) -> Series | None:
        entry = self._saved.pop(key, None)
        if entry is None:
            return None
        tensors = {
            name: torch.tensor(_floats(values), dtype=STATS_DTYPE, device=device)
            for name, values in entry["tensors"].items()
        }
        counters = {name: int(value) for name, value in entry["counters"].items()}
        return Series(str(entry["action"]), tuple(entry["shape"]), tuple(entry["names"]), tensors, counters)


def pushed(ring: torch.Tensor, slot: int, values: torch.Tensor, empty: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of ``ring`` whose column ``slot`` holds ``values`` (``empty`` where one is not finite: non-finite
    norms never enter a ring), and the column it replaced."""
    out = ring.clone()
    evicted = out[:, slot].clone()
    out[:, slot] = torch.where(torch.isfinite(values), values, torch.full_like(values, empty))
    return out, evicted


def _carry_over(earlier: Series, fresh: Series) -> None:
    """Copy the columns ``fresh`` shares by name with ``earlier``; the others start empty."""
    earlier.materialize()
    old = {name: column for column, name in enumerate(earlier.names)}
    pairs = [(column, old[name]) for column, name in enumerate(fresh.names) if name in old]
    if len(pairs) == len(fresh.names):
        fresh.counters.update(earlier.counters)  # shared by every column: only valid if none starts empty
    if not pairs:
        return
    device = next(iter(fresh.tensors.values())).device
    new_cols = torch.tensor([c for c, _ in pairs], device=device)
    old_cols = torch.tensor([c for _, c in pairs], device=device)
    for key, value in fresh.tensors.items():
        if key in earlier.tensors:
            taken = earlier.tensors[key].to(device).index_select(0, old_cols)
            fresh.tensors[key] = value.index_copy(0, new_cols, taken.to(value.dtype))


def _floats(values: Any) -> Any:
    """JSON may have turned NaN/Inf into strings or None; nested lists of numbers come back as floats."""
    if isinstance(values, list):
        return [_floats(value) for value in values]
    if values is None:
        return math.nan
    return float(values)


def _plain(series: Series) -> dict[str, Any]:
    """A series as ``state_dict`` writes it: plain floats and ints."""
    return {
        "action": series.kind,
        "shape": list(series.shape),
        "names": list(series.names),
        "tensors": {
            key: series.host[key] if series.host is not None and key in series.host else value.cpu().tolist()
            for key, value in series.tensors.items()
        },
        "counters": dict(series.counters),
    }
