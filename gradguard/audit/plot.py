"""``gradguard audit --plot FILE.png``: a picture of the run (matplotlib, an optional extra).

Where the ``stats`` events carry the step's loss, a first panel draws it (as the guard saw it), with the
``loss`` section's spikes (and their threshold, ``factor x reference``) and non-finite losses marked. Where
the log has monitors' ``stats``, a panel draws the recorded gradient norm (as it
arrived, before any action) per rule (group scope), per module, or for the loudest parameters, on a
log scale, with the clip thresholds (``max_norm``), the vanishing/exploding thresholds, and the
interventions (ticks), skips and halts marked. Then the gradient norm before (solid, dots) and after
(dashed) the guard, for the most-clipped parameters or group-clipped rules; bottom: interventions per
step by rule, with non-finite detections, skips and halts marked, and each rewind's stretch of steps never
learned from shaded. A log only has a point where the
guard acted, so the lines join the clipped steps. Steps are gathered into at most ``MAX_BINS`` bins per
series (the largest norm of a bin is kept), so memory stays bounded on logs of any length.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from gradguard.audit.fields import Malformed
from gradguard.audit.filters import EventFilter, Filters
from gradguard.audit.reader import AnyEvent, Record
from gradguard.audit.summary import AuditSummary
from gradguard.events import definitions as ev
from gradguard.events.definitions import as_float
from gradguard.policy.patterns import rule_matches
from gradguard.policy.schema import ClipNorm, PolicyFields

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "PLOT_SUFFIXES",
    "PlotCollector",
    "PlotUnavailable",
    "draw_figure",
    "policy_thresholds",
    "require_matplotlib",
    "steps_shown",
    "write_plot",
]

MAX_BINS: Final = 1200
PLOT_SUFFIXES: Final = (".png", ".svg", ".pdf")
INSTALL_HINT: Final = "plotting needs matplotlib: pip install 'gradguard[plot]'"


class PlotUnavailable(Exception):
    """matplotlib is not installed."""


def require_matplotlib() -> None:
    """Raise ``PlotUnavailable`` (with the install command) when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable(INSTALL_HINT) from None


class _Bins:
    """Per step bin: [largest value, its companion value, events]; bins double in width to stay few."""

    def __init__(self) -> None:
        self.width = 1
        self.cells: dict[int, list[float]] = {}

    def add(self, step: int, value: float, companion: float = 0.0) -> None:
        key = step // self.width
        cell = self.cells.get(key)
        if cell is None:
            self.cells[key] = [value, companion, 1.0]
            if len(self.cells) > MAX_BINS:
                self._coarsen()
        else:
            cell[2] += 1
            if value > cell[0]:
                cell[0], cell[1] = value, companion

    def _coarsen(self) -> None:
        self.width *= 2
        merged: dict[int, list[float]] = {}
        for key, cell in self.cells.items():
            into = merged.get(key // 2)
            if into is None:
                merged[key // 2] = cell
            else:
                into[2] += cell[2]
                if cell[0] > into[0]:
                    into[0], into[1] = cell[0], cell[1]
        self.cells = merged

    def points(self) -> tuple[list[float], list[float], list[float], list[float]]:
        """x (bin centre), largest value, its companion, events per step."""
        keys = sorted(self.cells)
        half = (self.width - 1) / 2
        xs = [key * self.width + half for key in keys]
        cells = [self.cells[key] for key in keys]
        return xs, [c[0] for c in cells], [c[1] for c in cells], [c[2] / self.width for c in cells]


class PlotCollector:
    """A second pass over the log that gathers the series to draw, under the same filters as the summary."""

    def __init__(
        self, filters: Filters, series: Iterable[str], action: str, health: Iterable[tuple[str, str]] = ()
    ) -> None:
        self._filter = EventFilter(filters)
        self.health: dict[tuple[str, str], _Bins] = {key: _Bins() for key in health}
        """(rule, name) -> the recorded norm of a monitored series (``name`` is the rule for a group)."""
        self.clip_thresholds: dict[str, float] = {}
        """Rule -> the largest ``max_norm`` its norm clips showed."""
        self.policy_thresholds: dict[str, tuple[str, float]] = {}
        """Parameter name -> (rule, ``max_norm``) a policy given with ``--threshold-policy`` clips it at."""
        self.action = action
        self.series = list(series)
        self._wanted = set(self.series)
        self.norms: dict[str, _Bins] = {key: _Bins() for key in self.series}
        self.per_rule: dict[str, _Bins] = {}
        self.nonfinite = _Bins()
        self.skips = _Bins()
        self.scaler_skips = _Bins()
        self.halts: list[tuple[int, str]] = []
        self.rewinds: list[tuple[int, int, int]] = []
        """(fault step, snapshot step, first step applied again) of the first rewinds."""
        self.loss = _Bins()
        """The step's loss the ``stats`` events carry (finite ones)."""
        self.loss_spikes: list[tuple[int, float, float, str]] = []
        """(step, loss, threshold ``factor x reference``, action) of the first ``loss_spike`` events."""
        self.loss_nonfinite = _Bins()

    def add_all(self, records: Iterable[Record]) -> None:
        for record in records:
            try:
                self._add(record.event)
            except (Malformed, ArithmeticError, LookupError, TypeError, ValueError):
                continue  # malformed: already reported by the summary pass

    def _add(self, event: AnyEvent) -> None:
        step = getattr(event, "step", None)
        if step is None:
            return
        rule = getattr(event, "rule", None)
        if not self._filter.shown(step, rule if isinstance(rule, str) else None):
            return
        if isinstance(event, ev.Stats):
            self._stats(step, event)
            if event.loss is not None:
                loss = as_float(event.loss)
                if math.isfinite(loss):
                    self.loss.add(step, loss)
        elif isinstance(event, ev.LossSpike) and len(self.loss_spikes) < 200:
            loss, threshold = as_float(event.loss), as_float(event.factor) * as_float(event.reference)
            self.loss_spikes.append((step, loss, threshold, event.action))
            if event.action == "skip":
                self.skips.add(step, 0.0)
        elif isinstance(event, ev.LossNonfinite):
            self.loss_nonfinite.add(step, 0.0)
            if event.action == "skip":
                self.skips.add(step, 0.0)
        elif isinstance(event, ev.AdaptiveClip):
            if type(event.before) is list:
                for name, before, after in zip(event.params, event.before, _listed(event.after), strict=False):
                    self._clip(step, event.rule, event.action, None, name, [name], before, after)
            else:
                self._clip(step, event.rule, event.action, None, None, event.params, event.before, event.after)
        elif isinstance(event, ev.Intervention):
            names = [event.param] if event.param is not None else list(event.params or [])
            self._clip(step, event.rule, event.action, event.max_norm, event.param, names, event.before, event.after)
        elif isinstance(event, ev.Nonfinite):
            if self._filter.narrow([event.param]):
                self.nonfinite.add(step, 0.0)
        elif isinstance(event, ev.NonfiniteUnhalted | ev.Skip):
            if self._filter.narrow(event.params):
                (self.nonfinite if isinstance(event, ev.NonfiniteUnhalted) else self.skips).add(step, 0.0)
        elif isinstance(event, ev.ScalerSkip):
            self.scaler_skips.add(step, 0.0)
        elif isinstance(event, ev.Halt) and len(self.halts) < 50 and self._params_shown(event.params):
            self.halts.append((step, event.rule))
        elif (
            isinstance(event, ev.Rewind)
            and len(self.rewinds) < 50
            and self._params_shown(event.params)
            and (step, event.to_step, event.skip_until) not in self.rewinds
        ):
            self.rewinds.append((step, event.to_step, event.skip_until))  # once for all the ranks that made it

    def _clip(
        self,
        step: int,
        rule: str,
        action: str,
        max_norm: Any,
        param: str | None,
        names: list[str],
        before: Any,
        after: Any,
    ) -> None:
        if type(max_norm) is float and len(self.clip_thresholds) < 20:
            self.clip_thresholds[rule] = max(max_norm, self.clip_thresholds.get(rule, 0.0))
        if not self._filter.narrow(names):
            return
        bins = self.per_rule.get(rule)
        if bins is None:
            bins = self.per_rule[rule] = _Bins()
        bins.add(step, 0.0)
        key = param if param is not None else f"{rule} (group)"
        if key in self._wanted and action == self.action and type(before) is float and type(after) is float:
            self.norms[key].add(step, before, after)

    def _params_shown(self, params: list[str]) -> bool:
        """Whether ``--param`` leaves a halt or rewind shown; one without parameters (an overflow) only without it."""
        return self._filter.params is None or bool(self._filter.narrow(params))

    def _stats(self, step: int, event: ev.Stats) -> None:
        norms = event.figures.get("norm")
        if norms is None:
            return
        by_name = {event.rule: norms} if event.scope == "group" else norms
        if not isinstance(by_name, dict):
            return
        for name, value in by_name.items():
            bins = self.health.get((event.rule, name))
            if bins is None or isinstance(value, dict):
                continue
            number = as_float(value)
            if number > 0 and math.isfinite(number):
                bins.add(step, number)


def _listed(values: Any) -> list[Any]:
    return values if type(values) is list else []


def policy_thresholds(policy: PolicyFields, names: Iterable[str]) -> dict[str, tuple[str, float]]:
    """Per name, ``(rule, max_norm)`` of the first rule of ``policy`` that clips it alone (2-norm, tensor scope)."""
    out: dict[str, tuple[str, float]] = {}
    for name in names:
        for rule in policy.rules:
            if not rule_matches(rule, (name,)):
                continue
            clip = next(
                (a for a in rule.actions if isinstance(a, ClipNorm) and a.scope == "tensor" and a.norm_type == 2.0),
                None,
            )
            if clip is not None:
                out[name] = (rule.name, clip.max_norm)
                break
    return out


def pick_health(summary: AuditSummary, count: int) -> list[tuple[str, str]]:
    """The monitored norms to draw: every rule's group, its modules, or its loudest parameters (``count`` in all)."""
    rows = [row for row in summary.health if row.stat == "norm"]
    rank = {"group": 0, "module": 1, "tensor": 2}
    rows.sort(key=lambda row: (rank.get(row.scope, 3), -(row.median or 0.0)))
    return [(row.rule, row.name) for row in rows[:count]]


def pick_series(summary: AuditSummary, count: int) -> tuple[list[str], str]:
    """The most-clipped parameters or group rules, and which action's values to draw (clip_norm first)."""
    norm_rules = {row.rule for row in summary.by_rule_action if row.action == "clip_norm"}
    action = "clip_norm" if norm_rules else "clip_value"
    ranked = sorted(summary.series_counts.items(), key=lambda item: (-item[1], item[0]))
    keep = []
    for key, _ in ranked:
        if key.endswith(" (group)") and key[: -len(" (group)")] not in norm_rules and action == "clip_norm":
            continue
        keep.append(key)
        if len(keep) == count:
            break
    return keep, action


def steps_shown(summary: AuditSummary) -> tuple[int, int] | None:
    """The plot's step axis: the steps the runs ran (the first guard's first step to the last one's last),
    narrowed to ``--since``/``--until``; ``None`` where no step is known."""
    low, high = summary.first_step, summary.last_step
    if low is None or high is None:
        return None
    if summary.filters.since is not None:
        low = max(low, summary.filters.since)
    if summary.filters.until is not None:
        high = min(high, summary.filters.until)
    return (low, high) if low <= high else None


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def write_plot(path: Path, collector: PlotCollector, summary: AuditSummary, title: str) -> None:
    """Draw and save the figure (the format follows the file's suffix)."""
    draw_figure(collector, summary, title).savefig(path, dpi=110)


def draw_figure(collector: PlotCollector, summary: AuditSummary, title: str) -> Figure:
    """The figure ``write_plot`` saves; its panels share the step axis (the last panel's)."""
    from matplotlib.figure import Figure

    health = any(bins.cells for bins in collector.health.values())
    lossy = bool(collector.loss.cells or collector.loss_spikes or collector.loss_nonfinite.cells)
    ratios = [2.0] * lossy + [3.0] * health + [3.0, 1.4]
    figure = Figure(figsize=(12, 7.5 + sum(ratios[:-2])), layout="constrained")
    axes: tuple[Any, ...] = tuple(figure.subplots(len(ratios), 1, sharex=True, height_ratios=ratios))
    top, bottom = axes[-2], axes[-1]
    if lossy:
        _draw_loss(axes[0], collector)
    if health:
        _draw_health(axes[int(lossy)], collector, summary)
    drawn = False
    for index, key in enumerate(collector.series):
        xs, before, after, _ = collector.norms[key].points()
        if not xs:
            continue
        drawn = True
        colour = f"C{index % 10}"
        top.vlines(xs, after, before, color=colour, linewidth=1, alpha=0.45)
        top.plot(xs, before, "o", color=colour, markersize=3.5, label=key)
        top.plot(xs, after, "_", color=colour, markersize=7)
    quantity = "gradient norm" if collector.action == "clip_norm" else "largest |gradient| element"
    if drawn:
        top.set_yscale("log")
        top.legend(
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            fontsize="small",
            title="dot: before, dash: after",
            title_fontsize="small",
        )
    else:
        top.text(0.5, 0.5, "no clip in the log (or the filters)", ha="center", va="center", transform=top.transAxes)
    top.set_ylabel(f"{quantity} at each clip")
    top.set_title(f"{quantity} cut by the guard, before and after: the most-clipped parameters and group rules")

    for index, (rule, bins) in enumerate(sorted(collector.per_rule.items())):
        xs, _, _, rate = bins.points()
        colour = f"C{(index + 3) % 10}"
        bottom.vlines(xs, 0, rate, color=colour, linewidth=1.2, alpha=0.7)
        bottom.plot(xs, rate, ".", color=colour, markersize=3, label=rule)
    xs, _, _, _ = collector.nonfinite.points()
    if xs:
        bottom.plot(xs, [0.0] * len(xs), "x", color="red", markersize=8, clip_on=False, zorder=5, label="non-finite")
    for bins, colour, label in (
        (collector.skips, "darkorange", "skipped step"),
        (collector.scaler_skips, "grey", "GradScaler skip"),
    ):
        xs, _, _, _ = bins.points()
        for position, x in enumerate(xs[:200]):
            for axis in axes:
                axis.axvline(
                    x,
                    color=colour,
                    linestyle="--",
                    linewidth=1,
                    alpha=0.7,
                    label=label if position == 0 and axis is bottom else None,
                )
    for position, (step, _) in enumerate(collector.halts):
        for axis in axes:
            axis.axvline(
                step, color="red", linewidth=1.5, alpha=0.85, label="halt" if position == 0 and axis is bottom else None
            )
    for position, (step, to_step, skip_until) in enumerate(collector.rewinds):
        for axis in axes:
            shaded = "rewind: steps never learned from" if position == 0 and axis is bottom else None
            axis.axvspan(to_step - 0.5, skip_until - 0.5, color="royalblue", alpha=0.15, label=shaded)
            axis.axvline(step, color="royalblue", linewidth=1.2, alpha=0.85)
    for step, rule in collector.halts[:5]:
        top.annotate(
            f"halt @ {step}\n({rule})",
            xy=(step, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(-4, -4),
            textcoords="offset points",
            ha="right",
            va="top",
            color="red",
            fontsize="small",
        )
    bottom.set_ylabel("interventions per step")
    bottom.set_xlabel("step")
    bottom.set_ylim(bottom=0)
    if bottom.get_legend_handles_labels()[0]:
        bottom.legend(
            loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", title="by rule", title_fontsize="small"
        )
    span = steps_shown(summary)
    if span is not None:
        # The axis spans the steps the runs ran, not just those with events (a clean stretch writes none).
        bottom.set_xlim(span[0] - 0.5, span[1] + 0.5)
    interventions = _plural(summary.intervention_count, "intervention")
    figure.suptitle(
        f"{title}: steps {summary.first_step}-{summary.last_step}, {interventions}, "
        f"{_plural(summary.halts_total, 'halt')}, "
        + (f"{_plural(summary.rewinds_total, 'rewind')}, " if summary.rewinds_total else "")
        + f"{_plural(summary.skips.events, 'skip')}, "
        f"{summary.nonfinite.events:,} non-finite",
        fontsize=11,
    )
    return figure


def _draw_loss(axis: Any, collector: PlotCollector) -> None:
    """The step's loss (the largest of each bin), the loss section's spikes and thresholds, non-finite losses."""
    xs, values, _, _ = collector.loss.points()
    if xs:
        axis.plot(xs, values, "-", color="C0", linewidth=1.2, label="loss")
    by_action: dict[str, list[tuple[int, float, float, str]]] = {}
    for spike in collector.loss_spikes:
        by_action.setdefault(spike[3], []).append(spike)
    for action, spikes in sorted(by_action.items()):
        colour = "red" if action == "halt" else "darkorange"
        axis.plot([s[0] for s in spikes], [s[1] for s in spikes], "v", color=colour, label=f"loss spike ({action})")
        axis.plot([s[0] for s in spikes], [s[2] for s in spikes], "_", color=colour, markersize=12)
    if values and min(values) > 0 and all(spike[1] > 0 for spike in collector.loss_spikes):
        axis.set_yscale("log")
    nonfinite, _, _, _ = collector.loss_nonfinite.points()
    if nonfinite:
        axis.plot(
            nonfinite,
            [0.03] * len(nonfinite),
            "x",
            color="red",
            markersize=8,
            transform=axis.get_xaxis_transform(),
            label="non-finite loss",
        )
    axis.set_ylabel("loss")
    axis.set_title("the step's loss as the guard saw it (dash: a spike's threshold, factor x reference)")
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")


def _draw_health(axis: Any, collector: PlotCollector, summary: AuditSummary) -> None:
    """The recorded norms (log scale), clip and vanishing/exploding thresholds, intervention ticks."""
    drawn: set[tuple[str, float]] = set()
    for index, ((rule, name), bins) in enumerate(collector.health.items()):
        xs, norms, _, _ = bins.points()
        if xs:
            label = f"{rule} (group)" if name == rule else f"{rule}: {name}"
            axis.plot(xs, norms, "-", color=f"C{index % 10}", linewidth=1.2, label=label)
        threshold = collector.policy_thresholds.get(name)
        if threshold is not None and threshold not in drawn:  # one line per rule, in its first series' colour
            drawn.add(threshold)
            clip_rule, max_norm = threshold
            axis.axhline(
                max_norm,
                color=f"C{index % 10}",
                linestyle="-.",
                linewidth=1.2,
                label=f"max_norm {max_norm:g} ({clip_rule})",
            )
    axis.set_yscale("log")
    for rule, max_norm in sorted(collector.clip_thresholds.items()):
        axis.axhline(max_norm, color="black", linestyle=":", linewidth=1, alpha=0.6)
        axis.annotate(
            f"clip {rule}: {max_norm:g}",
            xy=(0.0, max_norm),
            xycoords=("axes fraction", "data"),
            fontsize="x-small",
            va="bottom",
        )
    for flag in summary.health_flags[:10]:
        if flag.threshold is not None:
            colour = "purple" if flag.kind == "vanishing" else "firebrick"
            axis.axhline(flag.threshold, color=colour, linestyle="--", linewidth=1, alpha=0.6)
    ticks = sorted({x for bins in collector.per_rule.values() for x in bins.points()[0]})
    if ticks:
        axis.plot(
            ticks,
            [0.02] * len(ticks),
            "|",
            color="black",
            markersize=6,
            alpha=0.6,
            transform=axis.get_xaxis_transform(),
            label="intervention",
        )
    axis.set_ylabel("gradient norm as it arrived")
    axis.set_title("gradient health: the monitors' recorded norms (dotted: clip max_norm; dashed: vanishing/exploding)")
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
