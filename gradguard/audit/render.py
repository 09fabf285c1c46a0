"""Rendering reports as plain-text tables, Markdown or JSON: no dependency, no terminal tricks.

A report is a list of ``Section`` s (a title, lines of text, an optional ``Table``, more
lines); ``render_text`` and ``render_markdown`` lay the same sections out for a terminal and
for a pull request or a notebook. ``audit_sections`` builds the sections of ``gradguard audit``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

from gradguard.audit.health_report import health_section
from gradguard.audit.layout import Section, Table, num, short_path, step_list, steps_range
from gradguard.audit.layout import name_list as _names
from gradguard.audit.layout import plural as _plural
from gradguard.audit.loss_report import loss_section
from gradguard.audit.ranks_report import ranks_section
from gradguard.audit.rerun_report import rerun_section
from gradguard.audit.stops_report import halts_section, rewinds_section, skips_section
from gradguard.audit.summary import AuditSummary

__all__ = [
    "Section",
    "Table",
    "audit_sections",
    "render",
    "render_json",
    "render_markdown",
    "render_text",
    "short_path",
]

FORMATS = ("table", "json", "markdown")


def render_text(title: str, header: Sequence[str], sections: Iterable[Section]) -> str:
    out = [title, *header]
    for section in sections:
        out.append("")
        out.append(section.title)
        out.extend(f"  {line}" for line in section.lines)
        if section.table is not None:
            out.extend(f"  {line}" for line in _text_table(section.table))
        out.extend(f"  {line}" for line in section.after)
    return "\n".join(line.rstrip() for line in out) + "\n"


def _text_table(table: Table) -> list[str]:
    widths = [len(header) for header in table.headers]
    for row in table.rows:
        for index, cell in enumerate(row):
            widths[index] = max(widths[index], len(cell))

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            cell.rjust(widths[i]) if i in table.right else cell.ljust(widths[i]) for i, cell in enumerate(cells)
        )

    return [line(table.headers), line(["-" * width for width in widths]), *(line(row) for row in table.rows)]


def render_markdown(title: str, header: Sequence[str], sections: Iterable[Section]) -> str:
    out = [f"## {title}", ""]
    out.extend(f"{line}  " for line in header)
    for section in sections:
        out.extend(["", f"### {section.title}", ""])
        out.extend(f"{_md_text(line)}  " for line in section.lines)
        if section.table is not None:
            if section.lines:
                out.append("")
            table = section.table
            out.append("| " + " | ".join(_md_cell(h) for h in table.headers) + " |")
            out.append("|" + "|".join("---:" if i in table.right else "---" for i in range(len(table.headers))) + "|")
            out.extend("| " + " | ".join(_md_cell(cell) for cell in row) + " |" for row in table.rows)
        if section.after:
            out.append("")
            out.extend(f"{_md_text(line)}  " for line in section.after)
    return "\n".join(out) + "\n"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("*", "\\*").replace("_", "\\_") if text else " "


def _md_text(text: str) -> str:
    return text.replace("*", "\\*").replace("_", "\\_")


def render_json(data: Any, *, compact: bool = False) -> str:
    """JSON (indented, or on one line); NaN and infinities are written as the log writes them (``"Infinity"``)."""
    if compact:
        return json.dumps(_json_safe(data), allow_nan=False, separators=(",", ":")) + "\n"
    return json.dumps(_json_safe(data), indent=2, allow_nan=False) + "\n"


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(item) for item in value]
    return value


def render(fmt: str, title: str, header: Sequence[str], sections: Iterable[Section], data: Any) -> str:
    if fmt == "json":
        return render_json(data)
    if fmt == "markdown":
        return render_markdown(title, header, sections)
    return render_text(title, header, sections)


# --- numbers and steps -----------------------------------------------------------------------------


def duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours}h"


def _time_span(start: str | None, end: str | None, seconds: float | None) -> str:
    if not start or not end:
        return ""
    a, b = start.replace("T", " ").rstrip("Z"), end.replace("T", " ").rstrip("Z")
    a, b = a.split(".")[0], b.split(".")[0]
    if a[:10] == b[:10]:
        b = b[11:]
    return f"{a} to {b} UTC" + (f" ({duration(seconds)})" if seconds is not None else "")


# --- gradguard audit -------------------------------------------------------------------------------


def audit_title(summary: AuditSummary) -> str:
    shown = ", ".join(short_path(info.path) for info in summary.files[:3])
    more = len(summary.files) - 3
    return f"gradguard audit of {shown}" + (f" and {more} more files" if more > 0 else "")


def audit_header(summary: AuditSummary) -> list[str]:
    ranks = ", ".join(str(rank) for rank in summary.ranks)
    head = (
        f"{_plural(summary.lines, 'line')}, {_plural(summary.events, 'event')}; "
        f"{_plural(len(summary.runs), 'run')} on rank{'s' if len(summary.ranks) > 1 else ''} {ranks or '-'}"
    )
    if summary.first_step is not None:
        head += f"; steps {steps_range(summary.first_step, summary.last_step)}"
    span = _time_span(summary.start, summary.end, summary.seconds)
    lines = [head + (f"; {span}" if span else "")]
    for job in summary.jobs:
        if len(job.runs) > 1:
            lines.append(
                f"runs {', '.join(job.runs)} (ranks {', '.join(map(str, job.ranks))}) are one job: figures are per "
                "step across its ranks, an event every rank wrote counted once (not summed over ranks)"
            )
    if summary.filters.active:
        lines.append(
            f"filters: {summary.filters.describe()} (runs and counters cover the whole log; the rest is filtered)"
        )
    return lines


def audit_sections(summary: AuditSummary, top: int = 10) -> list[Section]:
    sections = [_runs(summary)]
    sections.append(_interventions(summary))
    sections.append(_offenders(summary, top))
    sections.append(_nonfinite(summary, top))
    sections.append(halts_section(summary))
    if summary.rewinds_total:
        sections.append(rewinds_section(summary))
    sections.append(skips_section(summary))
    if summary.by_rank or any(len(job.runs) > 1 for job in summary.jobs):
        sections.append(ranks_section(summary))
    if summary.loss or summary.loss_unseen or summary.loss_watched:
        sections.append(loss_section(summary))
    if summary.reruns or summary.rerun_notes:
        sections.append(rerun_section(summary))
    if summary.health or summary.health_flags:
        sections.append(health_section(summary, top))
    if summary.other_events:
        sections.append(_other(summary))
    sections.extend(Section(added.title, added.lines or ["none"]) for added in summary.added)
    sections.append(_counters(summary))
    sections.append(_problems(summary))
    verdict = "; ".join(summary.findings) if summary.findings else "none"
    sections.append(
        Section("Findings", [f"{verdict} (exit {summary.exit_code})"] + [f"note: {note}" for note in summary.notes])
    )
    return sections


def _runs(summary: AuditSummary) -> Section:
    rows = []
    for run in summary.runs:
        start = run.start.replace("T", " ").split(".")[0].rstrip("Z") + " UTC" if run.start else ""
        steps = steps_range(run.first_step, run.last_step)
        if run.steps is not None:
            steps += f" ({_plural(run.steps, 'step')})" if steps else _plural(run.steps, "step")
        ended = run.ended
        if run.rewinds:
            unlearned = sum(last - first + 1 for first, last in run.unlearned_steps)
            ended = f"{_plural(run.rewinds, 'rewind')} ({_plural(unlearned, 'step')} never learned from); {ended}"
        rows.append(
            [
                run.run,
                str(run.rank),
                run.model or "?",
                short_path(run.policy) if run.policy else "?",
                steps,
                start,
                duration(run.seconds),
                f"{run.events:,}",
                ended,
            ]
        )
    headers = ["run", "rank", "model", "policy", "steps", "started", "lasted", "events", "ended"]
    table = Table(headers, rows, frozenset({1, 6, 7}))
    after = []
    for run in summary.runs:
        if run.rules_matching_nothing:
            after.append(
                f"run {run.run}: rules that matched no parameter at attach: {', '.join(run.rules_matching_nothing)}"
            )
        if run.snapshot_memory:
            after.append(f"run {run.run}: recovery snapshots in {run.snapshot_memory}")
        if len(run.files) > 1:
            after.append(
                f"run {run.run} is spread over {len(run.files)} files: {', '.join(map(short_path, run.files))}"
            )
    if not rows:
        return Section("Runs", ["no gradguard run in the log"])
    return Section("Runs", [], table, after)


def _interventions(summary: AuditSummary) -> Section:
    title = "Interventions by rule and action"
    if not summary.by_rule_action:
        return Section(title, ["none: no clip changed a gradient"])
    rows = [
        [
            row.rule,
            row.action,
            f"{row.count:,}",
            f"{row.events:,}",
            steps_range(row.first_step, row.last_step),
            num(row.largest_before),
            "" if row.largest_before_step is None else str(row.largest_before_step),
        ]
        for row in summary.by_rule_action
    ]
    lines = [
        f"{_plural(summary.intervention_count, 'gradient')} changed (a group clip counts each of its parameters) "
        f"in {_plural(summary.intervention_events, 'event')}",
        "largest before: the largest norm (clip_norm, zclip, autoclip, agc) or element (clip_value) the guard cut down",
    ]
    headers = ["rule", "action", "count", "events", "steps", "largest before", "at step"]
    return Section(title, lines, Table(headers, rows, frozenset({2, 3, 5, 6})))


def _offenders(summary: AuditSummary, top: int) -> Section:
    title = f"Top offenders (parameters by interventions, top {top})"
    if not summary.by_param:
        return Section(title, ["none"])
    elements = any(row.largest_element is not None for row in summary.by_param[:top])

    def largest(value: float | None, step: int | None) -> str:
        return "" if value is None else f"{num(value)} @ {step}"

    rows = []
    for row in summary.by_param[:top]:
        cells = [
            row.param,
            f"{row.count:,}",
            ", ".join(row.rules),
            steps_range(row.first_step, row.last_step),
            largest(row.largest_norm, row.largest_norm_step),
        ]
        if elements:
            cells.append(largest(row.largest_element, row.largest_element_step))
        rows.append(cells)
    more = len(summary.by_param) - top
    after = [f"and {more:,} more parameters (--top N, or --format json for all)"] if more > 0 else []
    headers = ["parameter", "interventions", "rules", "steps", "largest norm @ step"]
    if elements:
        headers.append("largest element @ step")
    return Section(title, [], Table(headers, rows, frozenset({1, 4, 5})), after)


def _nonfinite(summary: AuditSummary, top: int) -> Section:
    title = "Non-finite gradients (NaN/Inf)"
    lines = []
    steps = summary.nonfinite
    if steps.events:
        kinds = ", ".join(f"{kind} {n:,}" for kind, n in summary.nonfinite_by_kind.items())
        rules = ", ".join(f"{rule} {n:,}" for rule, n in summary.nonfinite_by_rule.items())
        lines.append(
            f"{_plural(steps.events, 'detection')} ({kinds}) in {_plural(steps.distinct_steps, 'step')}: "
            f"{step_list(steps)}; by rule: {rules}"
        )
    if summary.unhalted.events:
        lines.append(
            f"APPLIED BY THE OPTIMIZER (no halt or skip rule covered them) at "
            f"{_plural(summary.unhalted.distinct_steps, 'step')}: {step_list(summary.unhalted)}; parameters: "
            f"{_names(summary.unhalted_params, 8)}"
        )
    if summary.group_norm_nonfinite.events:
        lines.append(
            f"{_plural(summary.group_norm_nonfinite.events, 'group clip')} left undone on a non-finite norm at steps "
            f"{step_list(summary.group_norm_nonfinite)}"
        )
    if not lines:
        return Section(title, ["none"])
    rows = [
        [
            row.param,
            f"{row.count:,}",
            "+".join(row.kinds),
            ", ".join(row.rules),
            steps_range(row.first_step, row.last_step),
        ]
        for row in summary.nonfinite_by_param[:top]
    ]
    after = []
    more = len(summary.nonfinite_by_param) - top
    if more > 0:
        after.append(f"and {more:,} more parameters (--format json lists all)")
    table = Table(["parameter", "detections", "kind", "rule", "steps"], rows, frozenset({1})) if rows else None
    return Section(title, lines, table, after)


def _other(summary: AuditSummary) -> Section:
    rows = [
        [name, f"{steps.events:,}", steps_range(steps.first_step, steps.last_step)]
        for name, steps in summary.other_events.items()
    ]
    return Section("Other events", [], Table(["event", "count", "steps"], rows, frozenset({1})))


def _counters(summary: AuditSummary) -> Section:
    title = "Counters reproduced from the log (= guard.counters.snapshot())"
    runs = summary.runs
    per_run = 1 < len(runs) <= 4
    rows = []
    for rule, by_action in summary.totals.items():
        for action, n in by_action.items():
            row = [rule, action, f"{n:,}"]
            if per_run:
                row.extend(f"{run.counters.get(rule, {}).get(action, 0):,}" for run in runs)
            rows.append(row)
    headers = ["rule", "action", "count"] + ([f"run {run.run}" for run in runs] if per_run else [])
    lines = [f"run {run.run}: from the {run.counters_source}" for run in runs[:8]]
    if any(len(job.runs) > 1 for job in summary.jobs):
        lines.append(
            "count: per step across the ranks of each job (its ranks count the same events: once, not summed "
            "over ranks)" + ("; a run's column is its rank's own guard.counters" if per_run else "")
        )
    if len(runs) > 8:
        lines.append(f"and {len(runs) - 8} more runs (--format json has each run's counters)")
    if summary.mismatches_total:
        after = [
            f"MISMATCH: run {m.run}, {m.rule}/{m.action}: the counters written at step {m.step} "
            f"({short_path(m.where)}) say {m.counters:,}, the events before them give {m.events:,}"
            for m in summary.mismatches[:10]
        ]
        if summary.mismatches_total > 10:
            after.append(f"and {summary.mismatches_total - 10:,} more mismatches")
    elif not any(run.snapshots for run in runs):
        after = ["cross-check: no counters event in the log yet, so nothing to check"]
    else:
        after = [
            "cross-check: the per-event lines reproduce every clip, non-finite, halt and skip count of the "
            "counters events"
        ]
    if not rows:
        return Section(title, [*lines, "no counts"], None, after)
    return Section(title, lines, Table(headers, rows, frozenset(range(2, len(headers)))), after)


def _problems(summary: AuditSummary) -> Section:
    title = "Unreadable lines (skipped)"
    if not summary.bad_lines_total:
        return Section(title, ["none"])
    lines = [
        f"{short_path(bad.path)}:{bad.line}: {bad.reason}" + (f": {bad.excerpt}" if bad.excerpt else "")
        for bad in summary.bad_lines[:20]
    ]
    more = summary.bad_lines_total - min(20, len(summary.bad_lines))
    if more > 0:
        lines.append(f"and {more:,} more (--format json lists the first {len(summary.bad_lines)})")
    return Section(title, lines)
