"""What the audit keeps of one guard's life in the log (a ``run`` id): ``RunState``.

Whole-log bookkeeping, never filtered: the run table (``gradguard.audit.runs``) and the
reproduced counters (``gradguard.audit.counters``) are made from it; the dispatcher notes each event's time and
step in it (``gradguard.audit.run_book``), and the counters section counts into it what the guard counted
(``gradguard.audit.counting``).
"""

from __future__ import annotations

from typing import Final

from gradguard.audit.jobs import Job
from gradguard.audit.summary import Counts
from gradguard.events.counters import LOSS_RULE, RERUN_RULE, SCALER_RULE
from gradguard.events.definitions import Intervention

__all__ = [
    "LOSS_KEYS",
    "RANKS_KEYS",
    "RANKS_RULE",
    "RECOMPUTABLE_ACTIONS",
    "RERUN_KEYS",
    "SCALER_KEY",
    "LastIntervention",
    "RunState",
    "recomputable",
    "reproduced_counters",
]

RECOMPUTABLE_ACTIONS: Final = frozenset(
    {
        *("clip_norm", "clip_value", "zclip", "autoclip", "agc", "nan", "inf", "vanishing", "exploding"),
        *("halt_on_nonfinite", "skip_step_on_nonfinite", "skip_step_on_spike", "halt_on_spike", "rewind"),
    }
)
"""Actions whose counts the per-event lines reproduce (``scale``, ``zero`` and ``drop`` are not logged per step)."""
SCALER_KEY: Final = (SCALER_RULE, "skip")
"""The counter of steps GradScaler skipped; one ``scaler_skip`` event each."""
"""The rule name the policy's ``loss`` section counts and logs under."""
LOSS_KEYS: Final = frozenset({(LOSS_RULE, "spike"), (LOSS_RULE, "nonfinite"), (LOSS_RULE, "halt")})
"""The ``loss`` section's counters: one ``loss_spike``, ``loss_nonfinite`` or ``halt`` event each."""
RERUN_KEYS: Final = frozenset({(RERUN_RULE, "transient"), (RERUN_RULE, "reproducible"), (RERUN_RULE, "halt")})
"""The ``rerun`` section's counters: one ``rerun`` event per verdict, one ``halt`` (``transient: halt``) each."""

LastIntervention = tuple[int | None, str, str, str | int, float | None] | Intervention
"""(step, rule, action, parameter or group size, value before) of an intervention, or the ``intervention`` event
of one tensor's clip itself (kept as it is: most lines are one, and few are ever described)."""


RANKS_RULE: Final = "ranks"
"""The rule name the policy's ``ranks`` section counts and logs under (``gradguard.enforce.step.ranks``; the audit
never imports the enforcement)."""
RANKS_KEYS: Final = frozenset(
    {(RANKS_RULE, "outlier"), (RANKS_RULE, "divergence"), (RANKS_RULE, "halt"), (RANKS_RULE, "skip")}
)
"""The ``ranks`` section's counters: one ``rank_outlier`` (a ``skip`` too where it skipped), ``replica_divergence``
or ``halt`` event each."""


def recomputable(key: tuple[str, str]) -> bool:
    """Whether the events reproduce the counter ``key`` = (rule, action)."""
    return (
        key[1] in RECOMPUTABLE_ACTIONS
        or key == SCALER_KEY
        or key in LOSS_KEYS
        or key in RERUN_KEYS
        or key in RANKS_KEYS
    )


class RunState:
    """Whole-log bookkeeping for one run id; never filtered."""

    def __init__(self, run: str, rank: int, job: Job | None = None) -> None:
        self.run = run
        self.rank = rank
        self.job = job if job is not None else Job(0)
        """The runs of the other ranks it trained with (``gradguard.audit.jobs``)."""
        self.replica = False
        """True while the event being read is one another rank of the job already wrote: the run counts it (its
        own counters count it), the audit's tables do not again."""
        self.files: dict[int, None] = {}
        self.model: str | None = None
        self.policy: str | None = None
        self.params: int | None = None
        self.rule_order: list[str] | None = None
        self.rules_matched: dict[str, int] = {}
        self.loss_watched = False
        """The attach event holds a ``loss`` section: the loss was judged at every step."""
        self.snapshot_memory: str | None = None
        """Where recovery's snapshots lived and their bytes, from the attach event."""
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.steps: int | None = None
        self.start_step = 0
        """The step the guard attached at (a resumed run's): its own steps are counted from there."""
        self.attached = False
        """Whether the log holds the run's ``attach`` event (else its first step is its first event's)."""
        self.first_ts: str | None = None
        self.last_ts: str | None = None
        self.events = 0
        self.detach_reason: str | None = None
        self.halted_at: list[int | None] = []
        self.rewinds = 0
        self.rewound: list[tuple[int, int]] = []
        """Each rewind's stretch of steps never learned from, ``[to_step, skip_until)``."""
        self.recomputed: dict[tuple[str, str], int] = {}
        self.snapshot: Counts | None = None
        self.snapshot_event = ""
        self.snapshot_step: int | None = None
        self.snapshots = 0
        self.at_snapshot: dict[tuple[str, str], int] = {}
        self.unverifiable: set[str] = set()
        self.mismatched: set[tuple[str, str]] = set()
        self.watch_step: int | None = None
        self.halting_rules: dict[str, None] = {}
        self.skipping_rules: dict[str, None] = {}

    def count(self, rule: str, action: str, n: int = 1) -> None:
        """Count ``n`` under (rule, action) for this run, and for its job unless the event is a replica."""
        key = (rule, action)
        self.recomputed[key] = self.recomputed.get(key, 0) + n
        if not self.replica:
            counted = self.job.counted
            counted[key] = counted.get(key, 0) + n

    def watch(self, step: int | None) -> None:
        """Start collecting the halting and skipping rules of ``step`` (its non-finite events come first)."""
        if step != self.watch_step:
            self.watch_step = step
            self.halting_rules = {}
            self.skipping_rules = {}


def reproduced_counters(run: RunState) -> tuple[Counts, str, bool]:
    """The run's counters, where they come from, and whether they are complete: its last snapshot (a ``counters``,
    ``halt`` or ``detach`` event carries ``guard.counters.snapshot()`` whole), plus what the events after it add;
    complete where nothing it cannot reproduce (``scale``, ``zero``, ``drop``) may have been counted since."""
    counters: Counts = {}
    if run.snapshot is not None:
        counters = {rule: dict(by_action) for rule, by_action in run.snapshot.items()}
        after = {
            key: n - run.at_snapshot.get(key, 0)
            for key, n in run.recomputed.items()
            if recomputable(key) and n != run.at_snapshot.get(key, 0)
        }
        at = "after" if run.snapshot_event == "detach" else "at"
        source = f"{run.snapshot_event} event {at} step {run.snapshot_step}"
        if after:
            source += f" + {sum(after.values())} counted from the events after it"
        late = run.last_step is not None and (run.snapshot_step is None or run.last_step > run.snapshot_step)
        complete = run.snapshot_event == "detach" or not late
    else:
        after = {key: n for key, n in run.recomputed.items() if recomputable(key) and n}
        source = "events alone (no counters event in the log yet)"
        complete = False
    for (rule, action), n in after.items():
        into = counters.setdefault(rule, {})
        into[action] = into.get(action, 0) + n
        if into[action] == 0:
            del into[action]
            if not into:
                del counters[rule]
    return counters, source, complete
