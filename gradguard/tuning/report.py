"""``gradguard replay``'s text report: one line per action, the undecidable ones, and the halt."""

from __future__ import annotations

import json
from typing import Final

from gradguard.tuning.replay import ReplayResult

__all__ = ["replay_json", "replay_text"]

_SHOWN: Final = 10


def replay_text(result: ReplayResult) -> str:
    """The replay as aligned text: rule, action, how many steps, the first of them."""
    recording = result.recording
    windows = result.window_steps
    in_windows = f", {windows:,} more inside rewind windows (skipped)" if windows else ""
    lines = [
        f"gradguard replay: {result.policy} on {result.steps_replayed:,} recorded steps "
        f"({recording.first_step}-{recording.last_step}){in_windows}, {len(result.params)} parameters",
    ]
    rows = [("rule", "action", "steps", "on steps")]
    for entry in result.actions:
        shown = ", ".join(str(step) for step in entry.steps[:_SHOWN])
        if len(entry.steps) > _SHOWN:
            shown += f", ... ({len(entry.steps) - _SHOWN} more)"
        rows.append((entry.rule, entry.action, f"{len(entry.steps):,}", shown or "-"))
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    for row in rows:
        lines.append("  " + "".join(cell.ljust(width + 2) for cell, width in zip(row, widths, strict=False)) + row[3])
    if result.undecidable:
        lines.append("undecidable from this log:")
        lines += [f"  {entry.rule} / {entry.action}: {entry.reason}" for entry in result.undecidable]
    for rewind in result.rewinds:
        halt, window = rewind.halt, f"{rewind.halt.step + 1}-{rewind.skip_until - 1}"
        lines.append(
            f"rewind at step {halt.step}: rule {halt.rule!r} ({halt.action}): {halt.reason}; the recovery section "
            f"goes back to the snapshot of step {rewind.to_step} and skips steps {window} (rewind {rewind.rewinds}); "
            f"the replay goes on at step {rewind.skip_until}"
        )
    if result.halt is not None:
        halt = result.halt
        where = f"halt at step {halt.step}: rule {halt.rule!r} ({halt.action})"
        lines.append(f"{where}: {halt.reason}; the replay stops there, as the run would")
    if result.not_replayed:
        lines.append("not replayed:")
        lines += [f"  {what}" for what in result.not_replayed]
    return "\n".join(lines) + "\n"


def replay_json(result: ReplayResult) -> str:
    """The replay as JSON: top-level fields one per line, each action (with its steps) on one line."""
    data = result.as_json()
    lines = []
    for key, value in data.items():
        if isinstance(value, list) and value:
            items = ",\n".join(f"    {json.dumps(item)}" for item in value)
            lines.append(f"  {json.dumps(key)}: [\n{items}\n  ]")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"
