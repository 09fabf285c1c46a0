"""The "Gradient health" section of ``gradguard audit``: per rule, each monitored figure over the run,
and the names that vanished or exploded, with when."""

from __future__ import annotations

from gradguard.audit.layout import Section, Table, num, steps_range
from gradguard.audit.summary import AuditSummary, FlagRow, HealthRow

__all__ = ["health_section"]

_STAT_ORDER = {"norm": 0, "max_abs": 1, "mean": 2, "std": 3, "grad_to_weight": 4}


def health_section(summary: AuditSummary, top: int) -> Section:
    """One row per (rule, name, stat); per rule the ``top`` names with the largest median norm."""
    rows = _shown_rows(summary.health, top)
    lines = [
        "figures of the gradient as it arrived (before any action); median: exact up to 256 samples, "
        "beyond from a log-scale histogram (within 1.2%)"
    ]
    hidden = len({(r.rule, r.name) for r in summary.health}) - len({(r.rule, r.name) for r in rows})
    table = Table(
        ["rule", "scope", "name", "stat", "samples", "steps", "first", "last", "min", "median", "max"],
        [
            [
                row.rule,
                row.scope,
                row.name if row.scope != "group" else "(group)",
                row.stat,
                f"{row.samples:,}",
                steps_range(row.first_step, row.last_step),
                num(row.first),
                num(row.last),
                num(row.min),
                num(row.median) + ("" if row.median_exact else " ~"),
                num(row.max),
            ]
            for row in rows
        ],
        right=frozenset({4, 6, 7, 8, 9, 10}),
    )
    after = [f"and {hidden:,} more names (--top N, or --format json for all)"] if hidden > 0 else []
    after.extend(_flag_lines(summary.health_flags))
    return Section("Gradient health", lines, table if rows else None, after)


def _shown_rows(rows: list[HealthRow], top: int) -> list[HealthRow]:
    by_rule: dict[str, dict[str, list[HealthRow]]] = {}
    for row in rows:
        by_rule.setdefault(row.rule, {}).setdefault(row.name, []).append(row)
    shown: list[HealthRow] = []
    for names in by_rule.values():

        def loudness(item: tuple[str, list[HealthRow]]) -> float:
            medians = [r.median for r in item[1] if r.stat == "norm" and r.median is not None]
            return -(medians[0] if medians else 0.0)

        for _, series in sorted(names.items(), key=loudness)[:top]:
            shown.extend(sorted(series, key=lambda r: _STAT_ORDER.get(r.stat, 9)))
    return shown


def _flag_lines(flags: list[FlagRow]) -> list[str]:
    if not flags:
        return ["vanishing or exploding: none"]
    lines = ["vanishing or exploding (warned once per episode, until the norm recovered):"]
    for flag in sorted(flags, key=lambda f: (f.kind, f.rule, f.name)):
        episodes = ", ".join(
            f"from step {start}" + (f" to {end}" if end is not None else " (not recovered)")
            for start, end in flag.episodes
        )
        more = flag.times - len(flag.episodes)
        episodes += f" and {more:,} more" if more > 0 else ""
        worst = "smallest" if flag.kind == "vanishing" else "largest"
        lines.append(
            f"  {flag.kind}: {flag.name} (rule {flag.rule!r}, threshold {num(flag.threshold)}, "
            f"{worst} norm {num(flag.worst)}): {episodes}"
        )
    return lines
