"""The "Halts", "Rewinds (recovery)" and "Skipped steps" sections of ``gradguard audit``: the steps the guard
stopped, rewound or skipped, with why and where the NaN started."""

from __future__ import annotations

from gradguard.audit.layout import Section, origin_text, short_path, step_list, steps_range
from gradguard.audit.layout import name_list as _names
from gradguard.audit.layout import plural as _plural
from gradguard.audit.loss_report import loss_skip_causes
from gradguard.audit.run_state import RANKS_RULE
from gradguard.audit.summary import AuditSummary
from gradguard.events.counters import RERUN_RULE

__all__ = ["halts_section", "rewinds_section", "skips_section"]


def halts_section(summary: AuditSummary) -> Section:
    """Each halt: where, on what, why, where it started, and the run's last intervention before it."""
    title = "Halts"
    if not summary.halts_total:
        return Section(title, ["none"])
    lines = []
    for halt in summary.halts:
        where = f" in {_plural(halt.n_params, 'parameter')}: {_names(halt.params, 5, halt.n_params)}"
        what = f"rule {halt.rule!r} halted on {halt.kind}"
        if halt.rule == RERUN_RULE and halt.kind == "transient":
            what = "the rerun section halted on a transient fault (the step computed again differed)"
        lines.append(f"step {halt.step}: {what}" + (where if halt.n_params else ""))
        if halt.reason:
            lines.append(f"    reason: {halt.reason}")
        if halt.restored_to is not None:
            undone = ""
            if halt.step is not None and halt.restored_to < halt.step:
                undone = f": steps {steps_range(halt.restored_to, halt.step - 1)} undone"
            lines.append(
                f"    restored to the recovery snapshot of step {halt.restored_to} before halting (max_rewinds "
                f"reached){undone}"
            )
        if halt.origin:
            lines.append(f"    origin: {origin_text(halt.origin)}")
        who = f"run {halt.run}, rank {halt.rank}"
        if len(halt.ranks) > 1:  # the ranks of a job halt together: one halt, written by each
            who = f"runs {', '.join(halt.runs)}, ranks {', '.join(map(str, halt.ranks))}"
        lines.append(f"    {who}, at {short_path(halt.where)}" + (f", {halt.ts}" if halt.ts else ""))
        if halt.preceded_by:
            lines.append(f"    last intervention before it: {halt.preceded_by}")
    more = summary.halts_total - len(summary.halts)
    if more > 0:
        lines.append(f"and {more:,} more halts")
    return Section(title, lines)


def rewinds_section(summary: AuditSummary) -> Section:
    """Each rewind: the fault, the snapshot it went back to, and the stretch of steps never learned from."""
    unlearned = summary.unlearned_steps
    n = sum(last - first + 1 for first, last in unlearned)
    stretches = ", ".join(steps_range(first, last) for first, last in unlearned[:10])
    more = f" and {len(unlearned) - 10:,} more stretches" if len(unlearned) > 10 else ""
    lines = [
        f"{_plural(summary.rewinds_total, 'rewind')} instead of a halt (the run went on); the batches of "
        f"{_plural(n, 'step')} were never learned from: {stretches or '-'}{more}"
    ]
    for row in summary.rewinds:
        lines.append(f"step {row.step}: rule {row.rule!r} rewound on {row.kind} to the snapshot of step {row.to_step}")
        lines.append(f"    {_stretch_text(row.step, row.to_step, row.skip_until)}")
        if row.n_params:
            lines.append(f"    {_plural(row.n_params, 'parameter')}: {_names(row.params, 5, row.n_params)}")
        if row.reason:
            lines.append(f"    reason: {row.reason}")
        if row.origin:
            lines.append(f"    origin: {origin_text(row.origin)}")
        count = f"rewind {row.rewinds} of the run" if row.rewinds is not None else "rewind"
        scale = f"; LRs now x{row.lr_scale:g}" if row.lr_scale is not None and row.lr_scale != 1.0 else ""
        ranks = ", ".join(map(str, row.ranks))
        runs = ", ".join(row.runs)
        who = f"run {runs}, rank {ranks}" if len(row.runs) == 1 else f"runs {runs}, ranks {ranks}"
        lines.append(f"    {count}{scale}; {who}, at {short_path(row.where)}" + (f", {row.ts}" if row.ts else ""))
    more_rows = summary.rewinds_total - len(summary.rewinds)
    if more_rows > 0:
        lines.append(f"and {more_rows:,} more rewinds")
    return Section("Rewinds (recovery)", lines)


def _stretch_text(step: int | None, to_step: int | None, skip_until: int | None) -> str:
    """``steps 20-27 never learned from: 20-22 undone, 23 the fault (not applied), 24-27 skipped``."""
    if step is None or to_step is None or skip_until is None:
        return f"skipped until step {skip_until}"
    parts = []
    if to_step < step:
        parts.append(f"{steps_range(to_step, step - 1)} undone")
    parts.append(f"{step} the fault (not applied)")
    if skip_until > step + 1:
        parts.append(f"{steps_range(step + 1, skip_until - 1)} skipped")
    return (
        f"steps {steps_range(to_step, skip_until - 1)} never learned from: {', '.join(parts)}; "
        f"applied again from step {skip_until}"
    )


def skips_section(summary: AuditSummary) -> Section:
    """Steps the guard skipped (non-finite gradients, spikes), where they started, and GradScaler's skips."""
    lines = []
    if summary.skips.events:
        rules = ", ".join(f"{rule} {n:,}" for rule, n in summary.skips_by_rule.items())
        why = []
        if summary.skipped_params:
            params = ", ".join(f"{name} ({n:,})" for name, n in list(summary.skipped_params.items())[:8])
            why.append(f"non-finite parameters: {params}")
        if summary.spiked_params:
            params = ", ".join(f"{name} ({n:,})" for name, n in list(summary.spiked_params.items())[:8])
            largest = summary.largest_spike
            at = f" (largest z {largest[0]:.3g} at step {largest[1]})" if largest is not None else ""
            why.append(f"gradient norm spikes{at}: {params}")
        why.extend(loss_skip_causes(summary))
        outliers = summary.skips_by_rule.get(RANKS_RULE, 0)
        if outliers:
            why.append(f"a rank's own gradient norm far above the others' (ranks.on_outlier: skip): {outliers:,}")
        lines.append(
            f"{_plural(summary.skips.events, 'step')} skipped by the guard (rule {rules}) at steps "
            f"{step_list(summary.skips)}" + "".join(f"; {cause}" for cause in why)
        )
    for skip in summary.skip_origins:
        lines.append(f"    step {skip.step} (run {skip.run}, rank {skip.rank}) origin: {origin_text(skip.origin)}")
    lines.extend(_rewind_skip_lines(summary))
    if summary.scaler_skips.events:
        lines.append(
            f"{_plural(summary.scaler_skips.events, 'step')} skipped by GradScaler (its loss-scale search; not a "
            f"finding) at steps {step_list(summary.scaler_skips)}"
        )
    return Section("Skipped steps", lines or ["none"])


def _rewind_skip_lines(summary: AuditSummary) -> list[str]:
    """The steps rewinds took no update at (each fault, then its window), one line per rewind after the total."""
    stretches = summary.rewind_skips
    if not stretches:
        return []
    n = sum(last - first + 1 for first, last in stretches)
    shown = ", ".join(steps_range(first, last) for first, last in stretches[:10])
    more = f" and {len(stretches) - 10:,} more stretches" if len(stretches) > 10 else ""
    lines = [f"{_plural(n, 'step')} without an update after a rewind (never learned from): {shown}{more}"]
    seen: set[tuple[int | None, int | None, str, str]] = set()
    for row in summary.rewinds:
        if (
            row.step is None
            or row.skip_until is None
            or (key := (row.step, row.skip_until, row.rule, row.kind)) in seen
        ):
            continue
        seen.add(key)
        window = (
            f", {steps_range(row.step + 1, row.skip_until - 1)} its window" if row.skip_until > row.step + 1 else ""
        )
        lines.append(f"    step {row.step}: the fault (rule {row.rule!r} rewound on {row.kind}){window}")
    return lines
