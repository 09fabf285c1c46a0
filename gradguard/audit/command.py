"""Running ``gradguard audit``: read (once, or following), summarize, render, plot.

Standard library and click only: auditing a log never imports torch.
"""

from __future__ import annotations

import gc
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import click

from gradguard.audit.filters import Filters
from gradguard.audit.reader import FollowReader, ReadStats, read_batches, read_merged, total_bytes
from gradguard.audit.render import audit_header, audit_sections, audit_title, render, render_json
from gradguard.audit.summarizer import Summarizer
from gradguard.audit.summary import AuditSummary

if TYPE_CHECKING:
    from gradguard.policy.schema import PolicyFields

__all__ = ["PROGRESS_MIN_BYTES", "follow_files", "plot_files", "render_summary", "summarize_files"]

PROGRESS_MIN_BYTES = 4 << 20
"""Smaller logs are read too quickly for a progress bar to help."""


@contextmanager
def _progress(paths: Sequence[Path], show: bool | None) -> Iterator[Callable[[int], None] | None]:
    if show is None:
        show = sys.stderr.isatty() and total_bytes(paths) >= PROGRESS_MIN_BYTES
    if not show:
        yield None
        return
    label = f"reading {len(paths)} log file{'s' if len(paths) > 1 else ''}"
    with click.progressbar(
        length=total_bytes(paths), label=label, file=sys.stderr, show_eta=True, show_percent=True
    ) as bar:
        yield bar.update


def summarize_files(paths: Sequence[Path], filters: Filters, *, progress: bool | None = None) -> AuditSummary:
    """Read every file once (merged in step order) and summarize it."""
    stats = ReadStats()
    summarizer = Summarizer([str(path) for path in paths], stats, filters)
    with _progress(paths, progress) as update, _no_cyclic_gc():
        for batch in read_batches(paths, stats, update):
            summarizer.add_all(batch)
    return summarizer.summary()


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Reading makes millions of short-lived objects and no reference cycle: the cyclic garbage collector, which
    runs every few hundred allocations, would only cost time (about a tenth of the audit's). Reference
    counting frees everything as before; the collector is back on afterwards."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def render_summary(summary: AuditSummary, fmt: str, top: int) -> str:
    return render(fmt, audit_title(summary), audit_header(summary), audit_sections(summary, top), summary.as_json())


def plot_files(
    paths: Sequence[Path],
    filters: Filters,
    summary: AuditSummary,
    out: Path,
    series: int,
    thresholds: PolicyFields | None = None,
) -> None:
    """Read the files again, gathering the most-affected series the summary found, and draw them to ``out``.

    With ``thresholds`` (a policy), each plotted parameter's norm gets the ``max_norm`` that policy clips it at.
    """
    from gradguard.audit.plot import PlotCollector, pick_health, pick_series, policy_thresholds, write_plot

    keys, action = pick_series(summary, series)
    health = pick_health(summary, series)
    collector = PlotCollector(filters, keys, action, health=health)
    if thresholds is not None:
        collector.policy_thresholds = policy_thresholds(thresholds, [name for _, name in health])
    collector.add_all(read_merged(paths, ReadStats()))
    write_plot(out, collector, summary, audit_title(summary))


def follow_files(
    paths: Sequence[Path],
    filters: Filters,
    *,
    fmt: str,
    top: int,
    interval: float,
    timeout: float | None,
    echo: Callable[[str], None],
    clear: Callable[[], None] | None,
) -> AuditSummary:
    """Keep reading lines appended to ``paths``, re-rendering the summary at most every ``interval`` seconds.

    Stops on Ctrl-C (or after ``timeout`` seconds) and returns the final summary, which is rendered
    once more if it changed since it was last shown.
    """
    stats = ReadStats()
    summarizer = Summarizer([str(path) for path in paths], stats, filters)
    reader = FollowReader(paths, stats)
    started = time.monotonic()
    shown_at = -math.inf
    seen = -1

    def show() -> None:
        nonlocal seen, shown_at
        summary = summarizer.summary()
        if fmt == "json":
            text = render_json(summary.as_json(), compact=True)  # one JSON document per line
        else:
            stamp = datetime.now().strftime("%H:%M:%S")
            note = f"following {len(paths)} file{'s' if len(paths) > 1 else ''} (Ctrl-C to stop); updated {stamp}"
            text = note + "\n" + render_summary(summary, fmt, top)
        if clear is not None:
            clear()
        echo(text)
        seen = sum(stats.lines.values())
        shown_at = time.monotonic()

    try:
        while True:
            records = reader.poll()
            summarizer.add_all(records)
            now = time.monotonic()
            changed = sum(stats.lines.values()) != seen
            if changed and not reader.backlog and now - shown_at >= interval:
                show()
            if timeout is not None and now - started >= timeout:
                break
            if not reader.backlog:
                time.sleep(min(interval, 0.2))
    except KeyboardInterrupt:
        pass
    finally:
        reader.close()
    try:
        if sum(stats.lines.values()) != seen:
            show()
    except KeyboardInterrupt:
        pass
    return summarizer.summary()
