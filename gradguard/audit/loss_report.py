"""The ``loss`` section in ``gradguard audit``: its spikes and non-finite losses, and what it could not judge.

``LossCollector`` takes the ``loss_spike``, ``loss_nonfinite`` and ``loss_unseen`` events. Each verdict is
counted for the counters' cross-check (``{"loss": {"spike": n, "nonfinite": n}}``), and gathered into one
``LossRow`` per kind and action: how many, at which steps, and for spikes the largest ``loss / reference``
and its step. A skip is also one of the skipped steps (rule ``loss``: the skips section counts it), where that
section names its cause (``loss_skip_causes``); a halt is a ``halt`` event the halts section lists; a non-finite
loss the section let through (``ignore``) is a finding. Loss events have no parameter: ``--param`` does not narrow them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

from gradguard.audit.collector import Collector, Context, Finding, Handler
from gradguard.audit.fields import number_or_none
from gradguard.audit.layout import Section, Table, num, plural, step_list
from gradguard.audit.reader import Record
from gradguard.audit.run_state import RunState
from gradguard.audit.summary import FINDING_LOSS, AuditSummary, LossRow, StepTally
from gradguard.events.counters import LOSS_RULE
from gradguard.events.definitions import Attach, LossNonfinite, LossSpike, LossUnseen

__all__ = ["LossCollector", "loss_findings", "loss_section", "loss_skip_causes"]

KEPT_UNSEEN: Final = 10


class _Verdicts:
    """One kind and action's verdicts being gathered (a ``LossRow`` when done)."""

    def __init__(self, kind: str, action: str) -> None:
        self.row = LossRow(kind, action, steps=StepTally().done())
        self.steps = StepTally()


class LossCollector(Collector):
    """Takes the ``loss`` section's events, and the attach events (whether a run's policy had the section)."""

    def __init__(self, context: Context) -> None:
        self._shown = context.event_filter.shown
        self._verdicts: dict[tuple[str, str], _Verdicts] = {}
        self.unseen_lines: list[str] = []
        """The first ``KEPT_UNSEEN`` ``loss_unseen`` events, in words."""
        self.watched = False
        """Some run's policy had a ``loss`` section (its attach event says so), whether or not it fired."""

    def reads(self) -> Mapping[type[Any], Handler]:
        return {Attach: self.attach, LossSpike: self.spike, LossNonfinite: self.nonfinite, LossUnseen: self.unseen}

    def attach(self, event: Attach, run: RunState, record: Record) -> None:
        self.watched = self.watched or event.loss is not None

    def contribute(self, fields: dict[str, Any]) -> None:
        fields["loss"] = self.rows()
        fields["loss_unseen"] = list(self.unseen_lines)
        fields["loss_watched"] = self.watched

    def findings(self, summary: AuditSummary) -> list[Finding]:
        return [(FINDING_LOSS, words) for words in loss_findings(summary)]

    def _verdict(self, kind: str, action: str, step: int | None) -> LossRow | None:
        """The row the verdict counts in, or ``None`` where the filters hide it."""
        if not self._shown(step, LOSS_RULE):
            return None
        verdicts = self._verdicts.get((kind, action))
        if verdicts is None:
            verdicts = self._verdicts[(kind, action)] = _Verdicts(kind, action)
        verdicts.steps.add(step)
        return verdicts.row

    def spike(self, event: LossSpike, run: RunState, record: Record) -> None:
        if run.replica:
            return
        row = self._verdict("spike", event.action, event.step)
        loss, reference = number_or_none(event.loss), number_or_none(event.reference)
        if row is None or loss is None or reference is None or reference <= 0:
            return
        ratio = loss / reference
        if row.largest_ratio is None or ratio > row.largest_ratio:
            row.largest_ratio, row.largest_step = ratio, event.step
            row.largest_loss, row.largest_reference = loss, reference
            row.factor = number_or_none(event.factor)

    def nonfinite(self, event: LossNonfinite, run: RunState, record: Record) -> None:
        if run.replica:
            return
        row = self._verdict("nonfinite", event.action, event.step)
        if row is None:
            return
        loss = number_or_none(event.loss)
        value = "nan" if loss is None or math.isnan(loss) else ("inf" if loss > 0 else "-inf")
        row.values[value] = row.values.get(value, 0) + 1

    def unseen(self, event: LossUnseen, run: RunState, record: Record) -> None:
        if not run.replica and len(self.unseen_lines) < KEPT_UNSEEN:
            self.unseen_lines.append(f"run {run.run}, rank {run.rank}, step {event.step}: {event.why}")

    def rows(self) -> list[LossRow]:
        """Every kind and action seen: spikes first, then non-finite losses; halts, skips, then ignored."""
        order = {"halt": 0, "skip": 1, "ignore": 2}
        keys = sorted(self._verdicts, key=lambda key: (key[0] != "spike", order.get(key[1], 3), key[1]))
        out = []
        for key in keys:
            verdicts = self._verdicts[key]
            verdicts.row.steps = verdicts.steps.done()
            out.append(verdicts.row)
        return out


def loss_section(summary: AuditSummary) -> Section:
    """``Loss (the loss section)``: a row per kind and action, and what the section could not judge."""
    title = "Loss spikes and non-finite losses (the loss section)"
    rows = []
    for row in summary.loss:
        largest = ""
        if row.largest_ratio is not None:
            largest = (
                f"{row.largest_ratio:.3g}x @ {row.largest_step} "
                f"({num(row.largest_loss)} / {num(row.largest_reference)}, factor {row.factor:g})"
                if row.factor is not None
                else f"{row.largest_ratio:.3g}x @ {row.largest_step}"
            )
        elif row.values:
            largest = ", ".join(f"{value} {n:,}" for value, n in sorted(row.values.items()))
        what = "loss spike" if row.kind == "spike" else "non-finite loss"
        rows.append([what, row.action, f"{row.steps.events:,}", step_list(row.steps), largest])
    lines = [] if rows else ["watched at every step: no spike, no non-finite loss" if summary.loss_watched else "none"]
    if rows:
        lines.append("largest: the largest loss / reference of the spikes at its step (loss / reference, factor)")
    after = [f"not judged: {why}" for why in summary.loss_unseen]
    table = Table(["loss", "action", "count", "steps", "largest"], rows, frozenset({2})) if rows else None
    return Section(title, lines, table, after)


def loss_skip_causes(summary: AuditSummary) -> list[str]:
    """The skipped steps' causes the loss section gave: ``loss spikes (largest 52x at step 30)``, ``non-finite
    losses``."""
    causes = []
    for row in summary.loss:
        if row.action != "skip":
            continue
        if row.kind == "spike":
            at = f" (largest {row.largest_ratio:.3g}x the reference at step {row.largest_step})"
            causes.append(f"loss spikes{at if row.largest_ratio is not None else ''}: {row.steps.events:,}")
        else:
            causes.append(f"non-finite losses: {row.steps.events:,}")
    return causes


def loss_findings(summary: AuditSummary) -> list[str]:
    """A non-finite loss the section let through (``ignore``): the optimizer applied that step."""
    ignored = sum(row.steps.events for row in summary.loss if row.kind == "nonfinite" and row.action == "ignore")
    if not ignored:
        return []
    return [f"{plural(ignored, 'non-finite loss', 'non-finite losses')} applied (loss.nonfinite: ignore)"]
