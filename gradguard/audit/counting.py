"""What the guard counts for each event it writes: the rules ``guard.counters`` follows, reproduced from the log.

One function per event kind (``COUNTS``), each adding to its run's counts (``RunState.count``) what the guard added
to its ``guard.counters`` when it wrote that event; the counters section (``gradguard.audit.counters``) checks them
against every snapshot. Kept apart from every report section: which section shows an event does not change what
the guard counted for it (a halt of the ``ranks`` section is ``ranks/halt``, never a ``halt_on_nonfinite``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

from gradguard.audit.fields import Malformed
from gradguard.audit.run_state import RANKS_RULE, SCALER_KEY, RunState
from gradguard.events import definitions as ev
from gradguard.events.counters import LOSS_RULE, RERUN_RULE

__all__ = ["COUNTS", "ESCALATION", "RANKS_KINDS", "Count", "halt", "nonfinites"]

ESCALATION: Final = "skip limit exceeded"
"""How the ``reason`` of a halt (or rewind) starts when a skip rule went past its limits."""
RANKS_KINDS: Final = frozenset({"divergence", "outlier"})
"""The ``kind`` of a halt the ``ranks`` section made (the replicas' weights differ; a rank's own norm far off)."""

Count = Callable[[Any, RunState], None]


def _intervention(event: ev.Intervention, run: RunState) -> None:
    if event.param is not None:
        run.count(event.rule, event.action)
        return
    if event.params is None:
        raise Malformed("gradguard 'intervention' event of a group clip ('param': null) without its 'params'")
    run.count(event.rule, event.action, event.n_params if event.n_params is not None else len(event.params))


def _adaptive_clip(event: ev.AdaptiveClip, run: RunState) -> None:
    """One per clipped parameter: the entries of its lists at ``scope: tensor``, one at group scope."""
    if isinstance(event.before, list):
        if len(event.before) != len(event.params):
            raise Malformed(
                f"gradguard 'adaptive_clip' event whose lists do not have one entry per parameter "
                f"({len(event.params)} params, {len(event.before)} 'before' values)"
            )
        run.count(event.rule, event.action, len(event.params))
    elif event.param is not None:
        run.count(event.rule, event.action)
    else:
        run.count(event.rule, event.action, event.n_params if event.n_params is not None else len(event.params))


def _nonfinite(event: ev.Nonfinite, run: RunState) -> None:
    """Counted under its kind; the step's halting and skipping rules noted for the verdict that follows."""
    run.count(event.rule, event.kind)
    run.watch(event.step)
    if event.halts:
        run.halting_rules[event.rule] = None
    if event.skips:
        run.skipping_rules[event.rule] = None


def nonfinites(events: Sequence[ev.Nonfinite], run: RunState) -> None:
    """``_nonfinite`` of each of a streak's detections, all of one rule and kind (a NaN step's line per tensor), the
    count added at once."""
    if not events:
        return
    rule = events[0].rule
    run.count(rule, events[0].kind, len(events))
    for event in events:
        if event.step != run.watch_step:
            run.watch(event.step)
        if event.halts:
            run.halting_rules[rule] = None
        if event.skips:
            run.skipping_rules[rule] = None


def _flag(event: ev.Vanishing | ev.Exploding, run: RunState) -> None:
    run.count(event.rule, ev.event_name(type(event)))


def halt(event: ev.Halt, run: RunState) -> None:
    rule, params, step, reason, kind = event.rule, event.params, event.step, event.reason, event.kind
    if rule == RANKS_RULE and kind in RANKS_KINDS:
        run.count(rule, "halt")  # the ranks section's: a replica divergence or an outlier rank
    elif rule == LOSS_RULE and not params and kind != "overflow":
        run.count(rule, "halt")  # the loss section's (a rule of that name halts on named parameters)
    elif rule == RERUN_RULE and kind == "transient":
        run.count(rule, "halt")  # the rerun section's (transient: halt): the guard counts it as rerun/halt
    elif kind == "spike":
        run.count(rule, "halt_on_spike")  # skip_step_on_spike past its limits
    elif kind == "overflow":
        run.count(rule, "halt_on_nonfinite")  # GradScaler skipped more than max_scaler_skips steps in a row
    elif reason is not None and reason.startswith(ESCALATION):
        run.count(rule, "halt_on_nonfinite")
        _count_skips_before(run, rule, step)
    else:
        # Every halt rule that covered a non-finite gradient of the step counts it (the reason, if any, is
        # recovery's: no snapshot old enough, or max_rewinds reached).
        halting = run.halting_rules if run.watch_step == step and run.halting_rules else {rule: None}
        for name in halting:
            run.count(name, "halt_on_nonfinite")


def _rewind(event: ev.Rewind, run: RunState) -> None:
    """Recovery turned a halt into a rewind: counted under the halt's rule as ``rewind``."""
    run.count(event.rule, "rewind")
    if event.kind != "spike" and event.reason is not None and event.reason.startswith(ESCALATION):
        _count_skips_before(run, event.rule, event.step)  # as the halt would have: the skip rules before it skipped


def _skip(event: ev.Skip, run: RunState) -> None:
    skipping = run.skipping_rules if run.watch_step == event.step and run.skipping_rules else {event.rule: None}
    for name in skipping:
        run.count(name, "skip_step_on_nonfinite")


def _spike_skip(event: ev.SpikeSkip, run: RunState) -> None:
    run.count(event.rule, "skip_step_on_spike")


def _scaler_skip(event: ev.ScalerSkip, run: RunState) -> None:
    run.count(*SCALER_KEY)


def _loss_spike(event: ev.LossSpike, run: RunState) -> None:
    run.count(LOSS_RULE, "spike")


def _loss_nonfinite(event: ev.LossNonfinite, run: RunState) -> None:
    run.count(LOSS_RULE, "nonfinite")


def _rerun(event: ev.Rerun, run: RunState) -> None:
    run.count(RERUN_RULE, event.verdict)


def _rank_outlier(event: ev.RankOutlier, run: RunState) -> None:
    """Every rank finds the outlier (the norms are gathered) and counts it; ``on_outlier: skip`` skips the step."""
    run.count(RANKS_RULE, "outlier")
    if event.action == "skip":
        run.count(RANKS_RULE, "skip")


def _replica_divergence(event: ev.ReplicaDivergence, run: RunState) -> None:
    run.count(RANKS_RULE, "divergence")


def _count_skips_before(run: RunState, rule: str, step: int | None) -> None:
    """A skip rule went past its limits at ``step``: the skip rules before it (policy order) counted the skip."""
    order = run.rule_order
    if order is None or rule not in order:
        run.unverifiable.add("skip_step_on_nonfinite")
        return
    for name in run.skipping_rules if run.watch_step == step else {}:
        if name in order and order.index(name) < order.index(rule):
            run.count(name, "skip_step_on_nonfinite")


COUNTS: Final[dict[type[Any], Count]] = {
    ev.Intervention: _intervention,
    ev.AdaptiveClip: _adaptive_clip,
    ev.Nonfinite: _nonfinite,
    ev.Vanishing: _flag,
    ev.Exploding: _flag,
    ev.Halt: halt,
    ev.Rewind: _rewind,
    ev.Skip: _skip,
    ev.SpikeSkip: _spike_skip,
    ev.ScalerSkip: _scaler_skip,
    ev.LossSpike: _loss_spike,
    ev.LossNonfinite: _loss_nonfinite,
    ev.Rerun: _rerun,
    ev.RankOutlier: _rank_outlier,
    ev.ReplicaDivergence: _replica_divergence,
}
"""Event type -> what the guard counted when it wrote it."""
