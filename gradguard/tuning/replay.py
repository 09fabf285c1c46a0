"""``gradguard replay``: what a policy would have done on a recorded run, step by step.

The run's ``monitor`` recorded each gradient's 2-norm as it arrived, before any action
(``gradguard.tuning.records``): exactly what the guard's actions decide from. ``Replayer`` takes
those norms one step at a time and runs the policy's rules over them as the step engine does
(``gradguard.enforce.step.engine``): the non-finite watch on the raw norms, the spike watch before any
action, then every rule's actions in policy order, each acting on what the earlier ones left (a clip
multiplies a tensor's norm by its coefficient; later actions see the scaled norm). The adaptive
actions decide with the guard's own functions (``zclip_decide``, ``autoclip_decide``,
``spike_decide``) on float64 tensors of the recorded norms, and their statistics change only on steps
the replay applies, as the guard's do: a skipped step, a spike, a non-finite norm never enters them.
The clips decide with ``clip_coefficients`` on float32 norms, as the guard does, in numpy
(``gradguard.tuning.float32``, bitwise torch's): torch is imported only for a policy with an adaptive action or
``agc`` (or, rarely, for a group clip's total within a few ulps of its ``max_norm``), so ``gradguard replay`` and
``gradguard suggest`` start without it. So replaying the
policy a run used, on that run's log, gives the steps of that run's ``intervention``,
``adaptive_clip``, ``spike_skip`` and ``skip`` events.

What a log cannot decide is said, not guessed (``Undecidable``): ``clip_value`` without recorded
``max_abs``, ``agc`` per output unit (the log has norms per tensor) or without ``grad_to_weight``, a
``clip_norm`` of a p-norm other than 2 and inf, a rule that matches no recorded parameter. After a
``clip_value`` the replay keeps the tensor's 2-norm as it was (an upper bound: the clamp's effect on
the norm is not in the log). A halt ends the replay, as it ends the run.

A policy's ``recovery`` section is replayed as the guard's ``Recovery`` decides (``enforce/recovery``):
a snapshot of the replay's own state (the adaptive statistics, the skip histories, the loss section's reference)
at every step that is a multiple of ``snapshot_every`` and lies outside a skip window, the newest ``keep`` held; a
halt (a ``halt_on_nonfinite``, a skip limit, the loss section's) with a snapshot at least ``min_age`` steps older
and fewer than ``max_rewinds`` rewinds so far becomes a rewind (``Rewind``): that state comes back, the newer
snapshots are dropped, and the steps up to ``skip_until`` are skipped (listed as rule ``recovery``, action
``skip``, the guard's counter). Any other halt goes through, with the guard's reason. What the log cannot give is
left out, and the report says so: the weights and the LR after a rewind (``lr_factor``) are the recorded run's,
so the norms recorded after a rewind the recorded run did not make are of a run that went on without it
(``Rewind.recorded_in_window`` counts its steps the log holds inside the window). That bookkeeping is
``gradguard.tuning.replay_recovery``'s; the non-finite and spike watches are ``gradguard.tuning.replay_watches``'s,
and the result types (importable from here too) ``gradguard.tuning.replay_results``'s.

The policy's ``loss`` section is judged on each recorded step's loss (``gradguard.tuning.loss_replay``) with the
guard's own ``LossWatch``, in the guard's order: a gradient's halt first, then the loss's verdict (a loss skip
takes the step before any gradient skip, and keeps it out of every statistic), then the gradient skips. Its
verdicts are listed as rule ``loss``, actions ``spike`` and ``nonfinite`` (the guard's counters). Where the
monitor sampled every ``k`` steps, the reference is the median of the last ``window`` sampled losses.

A policy without adaptive actions is decided a block of steps at a time (``gradguard.tuning.blocks``),
with the same formulas and verdicts. Memory holds one block's norms (``BLOCK_STEPS`` steps), the adaptive
statistics (bounded by their windows) and the steps each action acted on.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

from gradguard.enforce.triggers.loss_reference import LossVerdict
from gradguard.enforce.work.skips import SkipBook
from gradguard.events.counters import LOSS_RULE
from gradguard.policy.document import Policy
from gradguard.policy.patterns import rule_matches
from gradguard.policy.schema import (
    Action,
    AdaptiveGradClip,
    ClipNorm,
    ClipValue,
    HaltOnNonfinite,
    Monitor,
    SkipStepOnNonfinite,
    SkipStepOnSpike,
)
from gradguard.tuning.acting import (
    NO_MAX_ABS,
    NO_WEIGHTS,
    Proposal,
    Stats,
    act,
    init_for,
    never_decidable,
    scope_of,
)
from gradguard.tuning.blocks import (
    BLOCK_STEPS,
    BoundRule,
    as_matrix,
    decide_block,
    decides_in_blocks,
    gradient_actions,
    reads_after,
    windowed,
)
from gradguard.tuning.float32 import F32_MAX, Floats, as_float32
from gradguard.tuning.loss_replay import NO_LOSS, LossReplay
from gradguard.tuning.records import RecordedStep, Recording, recorded_steps
from gradguard.tuning.replay_recovery import HeldState, RecoveryReplay
from gradguard.tuning.replay_results import ActionSteps, Halt, ReplayResult, Rewind, Undecidable
from gradguard.tuning.replay_watches import nonfinite_verdicts, spiked_rules

__all__ = ["ActionSteps", "Halt", "ReplayResult", "Replayer", "Rewind", "Undecidable", "replay_files"]


class Replayer:
    """Runs a policy over recorded steps (``feed``), as the guard's step engine would have."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.rules = list(policy.rules)
        self.names: list[str] = []
        self._index: dict[str, int] = {}
        self.bound = [BoundRule(index, rule) for index, rule in enumerate(self.rules)]
        self.watchers: dict[int, list[int]] = {}
        """Name index -> the rules with a halt or skip action covering it, in policy order."""
        self.entries: dict[tuple[int, int], ActionSteps] = {}
        for index, rule in enumerate(self.rules):
            for position, action in enumerate(rule.actions):
                if not isinstance(action, Monitor):
                    self.entries[(index, position)] = ActionSteps(rule.name, action.action, position)
        self.undecidable: dict[tuple[int, int], str] = {}
        self.stats: dict[tuple[int, int], Stats] = {}
        self.skip_limits = SkipBook()
        self.halt: Halt | None = None
        self.steps = 0
        self.in_blocks = decides_in_blocks(self.rules)
        """Whether steps are decided a block at a time (``feed``); False decides each on its own."""
        self.windowed = windowed(self.rules)
        self.loss = LossReplay(policy.loss)
        self.recovery = None if policy.recovery is None else RecoveryReplay(policy.recovery, self)
        """The ``recovery`` section's snapshots, rewinds and skip windows (None without one)."""
        self._pending: list[RecordedStep] = []
        """Steps gathered for a block (``feed``)."""
        self._activity: tuple[bool, ...] = ()
        """The pending steps' activity of the windowed rules and actions."""
        for index, rule in enumerate(self.rules):
            for position, action in enumerate(rule.actions):
                reason = never_decidable(action)
                if reason is not None:
                    self.undecidable[(index, position)] = reason

    # --- binding ------------------------------------------------------------------------------------

    def _learn(self, names: Iterable[str]) -> None:
        new = [name for name in names if name not in self._index]
        if not new:
            return
        for name in new:
            index = len(self.names)
            self._index[name] = index
            self.names.append(name)
            for bound in self.bound:
                if rule_matches(bound.rule, (name,)):
                    bound.members.append(index)
                    if any(isinstance(a, HaltOnNonfinite | SkipStepOnNonfinite) for a in bound.rule.actions):
                        self.watchers.setdefault(index, []).append(bound.index)
        self._grow_stats()

    def _grow_stats(self) -> None:
        """Per-tensor statistics get a column for each member learned since they were made (or snapshotted)."""
        for (rule_index, position), stats in self.stats.items():
            action = self.rules[rule_index].actions[position]
            if scope_of(action) == "tensor":
                grown = len(self.bound[rule_index].members) - next(iter(stats.tensors.values())).shape[0]
                if grown > 0:
                    import torch  # statistics are torch's: torch is already imported

                    extra = init_for(action)(grown, torch.device("cpu"))
                    stats.tensors = {k: torch.cat([v, extra[k]]) for k, v in stats.tensors.items()}

    # --- steps ------------------------------------------------------------------------------------

    def feed(self, recorded: RecordedStep) -> bool:
        """Take one recorded step, in order; False once the run has halted (later steps would not have happened).

        A policy that keeps no statistics gathers the steps whose norms are all finite and recorded for every
        known name, and decides them a block at a time (``gradguard.tuning.blocks``), with the verdicts one
        step at a time gives: such a step can neither skip nor halt, so the steps a halt stops at are read
        as far as one step at a time reads them. Any other step is decided on its own, after the pending ones.
        So ``steps`` and the actions' steps may lag the steps fed until ``result()``, which decides the rest.
        """
        if self.halt is not None:
            return False
        if self.recovery is not None and not self.recovery.begin_step(recorded.step):
            return True
        verdict = self.loss.judge(recorded)
        if self.in_blocks:
            # Every known name recorded, in order, and every norm finite in float32 (their magnitudes' sum at
            # most float32's largest bounds each one; NaN fails the comparison): no watch can fire. A step whose
            # loss the loss section flags is decided on its own.
            norms = recorded.norm
            if verdict is None and norms and list(norms) == self.names and sum(map(abs, norms.values())) <= F32_MAX:
                self.loss.applied(recorded)  # no watch fires: the step is applied
                activity = tuple(item.active_at(recorded.step) for item in self.windowed)
                if activity != self._activity:
                    self._decide_pending()
                self._pending.append(recorded)
                self._activity = activity
                if len(self._pending) == BLOCK_STEPS:
                    self._decide_pending()
                return True
            self._decide_pending()
        return self._feed_one(recorded, verdict)

    def _decide_pending(self) -> None:
        """The gathered steps, as one matrix under one activity of the rules (none of them can skip or halt)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        raw = as_float32(as_matrix([recorded.norm for recorded in pending]))
        keys, acted = decide_block(self.bound, self.undecidable, raw, pending[0].step)
        for recorded, did in zip(pending, acted, strict=True):
            # What _feed_one does with a step whose norms are all finite: no watch fires, the step is applied.
            self.steps += 1
            self.skip_limits.step_applied()
            for key, changed in zip(keys, did, strict=True):
                if changed:
                    self.entries[key].steps.append(recorded.step)

    def _feed_one(self, recorded: RecordedStep, verdict: LossVerdict | None = None) -> bool:
        self._learn(recorded.norm)
        step = recorded.step
        self.steps += 1
        raw = as_float32([recorded.norm.get(name, math.nan) for name in self.names])
        present = [name in recorded.norm for name in self.names]
        everyone = all(present)
        peaks: Floats | None = None
        if recorded.max_abs and all(name in recorded.max_abs for name in recorded.norm):
            peaks = as_float32([recorded.max_abs.get(name, math.nan) for name in self.names])
        halted_by, skipped_by = nonfinite_verdicts(raw, present, step, self.rules, self.watchers)
        proposals: list[Proposal] = []
        spikes = spiked_rules(raw, present, everyone, step, self.bound, self._state, proposals)
        acted: list[tuple[int, int]] = []
        self._actions(raw, peaks, present, step, recorded, proposals, acted)

        if halted_by:
            offender = min(halted_by)
            rule = self.rules[halted_by[offender]]
            reason = f"non-finite gradient norm of {self.names[offender]!r}"
            if self._halts(Halt(step, rule.name, "halt_on_nonfinite", reason)):
                for rule_index in sorted(set(halted_by.values())):
                    self._record(rule_index, HaltOnNonfinite, step)
                return False
            return True
        if verdict is not None:
            self.loss.given(verdict, step)
            if verdict.action == "halt":
                return not self._halts(Halt(step, LOSS_RULE, verdict.kind, verdict.reason))
            if verdict.action == "skip":
                return True  # the loss section skips the step before any gradient skip: no statistic moves
        if skipped_by or spikes:
            causes: list[tuple[int, type[SkipStepOnNonfinite | SkipStepOnSpike]]]
            causes = [(r, SkipStepOnNonfinite) for r in sorted(set(skipped_by.values()))]
            causes += [(r, SkipStepOnSpike) for r in sorted(set(spikes))]
            for rule_index, cause in causes:
                rule = self.rules[rule_index]
                self._record(rule_index, cause, step)
                why = self.skip_limits.record(rule_index, rule, step, cause)
                if why is not None:
                    kind = "skip_step_on_nonfinite" if cause is SkipStepOnNonfinite else "skip_step_on_spike"
                    return not self._halts(Halt(step, rule.name, kind, f"skip limit exceeded: {why}"))
            return True
        self.skip_limits.step_applied()
        self.loss.applied(recorded)
        for key, cols, tensors, slot in proposals:
            stats = self.stats[key]
            for name, value in tensors.items():
                stats.tensors[name] = value if cols is None else stats.tensors[name].index_copy(0, cols, value)
            stats.slot = slot
        for key in acted:
            self.entries[key].steps.append(step)
        return True

    # --- recovery -----------------------------------------------------------------------------------

    def snapshot_state(self) -> HeldState:
        """The state a ``recovery`` snapshot holds, every step fed so far decided first (``Rewindable``)."""
        self._decide_pending()
        return HeldState(copy.deepcopy(self.stats), copy.deepcopy(self.skip_limits), self.loss.watch.state_dict())

    def restore_state(self, state: HeldState) -> None:
        """A rewind's state back (``Rewindable``), copied: the snapshot may be restored again."""
        self.stats = copy.deepcopy(state.stats)
        self.skip_limits = copy.deepcopy(state.skip_limits)
        self.loss.watch.load_state_dict(state.loss)
        # Names learned since the snapshot have no column in its per-tensor statistics.
        self._grow_stats()

    def _halts(self, halt: Halt) -> bool:
        """Whether ``halt`` ends the run: True without a ``recovery`` section, or where the guard's would let it
        through (with its reason); else the recovery has rewound, as the guard's would."""
        ending = halt if self.recovery is None else self.recovery.ending_halt(halt)
        if ending is None:
            return False
        self.halt = ending
        return True

    def _record(self, rule_index: int, kind: type[Action], step: int) -> None:
        """Note ``step`` under the rule's first active action of type ``kind``."""
        for position, action in enumerate(self.rules[rule_index].actions):
            if isinstance(action, kind) and action.active_at(step):
                steps = self.entries[(rule_index, position)].steps
                if not steps or steps[-1] != step:
                    steps.append(step)
                return

    def _state(self, key: tuple[int, int], action: Action, columns: int) -> Stats:
        stats = self.stats.get(key)
        if stats is None:
            import torch  # only an adaptive action keeps statistics: the guard's own, on torch tensors

            stats = self.stats[key] = Stats(init_for(action)(columns, torch.device("cpu")))
        return stats

    def _actions(
        self,
        raw: Floats,
        peaks: Floats | None,
        present: list[bool],
        step: int,
        recorded: RecordedStep,
        proposals: list[Proposal],
        acted: list[tuple[int, int]],
    ) -> None:
        """Every rule's gradient-changing actions in policy order, on the norms the earlier ones left."""
        current = raw.copy()
        actings = list(gradient_actions(self.bound, self.undecidable, list(present), step))
        for position, acting in enumerate(actings):
            action, key, ids, index = acting.action, acting.key, acting.ids, acting.index
            inf_norm = isinstance(action, ClipNorm) and action.norm_type != 2.0
            if (isinstance(action, ClipValue) or inf_norm) and peaks is None:
                self.undecidable[key] = NO_MAX_ABS
                continue
            if isinstance(action, AdaptiveGradClip) and not all(
                recorded.grad_to_weight.get(self.names[i]) is not None for i in ids
            ):
                self.undecidable[key] = NO_WEIGHTS
                continue
            coef, did = act(
                key,
                action,
                current,
                peaks,
                recorded,
                self.names,
                ids,
                acting.columns,
                proposals,
                lambda width, key=key, action=action: self._state(key, action, width),  # type: ignore[misc]
                len(acting.bound.members),
                reads_after(actings, position),
            )
            if did:
                acted.append(key)
            if coef is not None:
                current[index] = current[index] * coef
                if peaks is not None:
                    peaks[index] = peaks[index] * coef

    def result(self, recording: Recording) -> ReplayResult:
        """What the policy did, per action (the undecidable ones listed apart), the pending steps decided first."""
        self._decide_pending()
        undecidable = dict(self.undecidable)
        for bound in self.bound:
            if not bound.members:
                for position, action in enumerate(bound.rule.actions):
                    if not isinstance(action, Monitor):
                        undecidable[(bound.index, position)] = (
                            f"rule {bound.rule.name!r} matches no parameter the log recorded norms of "
                            f"(patterns {list(bound.rule.match)}); record them with a monitor that matches them"
                        )
        actions = [entry for key, entry in self.entries.items() if key not in undecidable]
        listed = [
            Undecidable(self.rules[r].name, self.rules[r].actions[p].action, reason)
            for (r, p), reason in sorted(undecidable.items())
        ]
        for position, (kind, steps) in enumerate(self.loss.steps.items()):
            if recording.loss_steps:
                actions.append(ActionSteps(LOSS_RULE, kind, position, steps))
            else:
                listed.append(Undecidable(LOSS_RULE, kind, NO_LOSS))
        rewinds: list[Rewind] = []
        window_steps = 0
        if self.recovery is not None:
            self.recovery.list_actions(actions, self.halt.step if self.halt is not None else recording.last_step)
            rewinds, window_steps = list(self.recovery.rewinds), len(self.recovery.window_steps)
        return ReplayResult(
            self.policy.source,
            actions,
            listed,
            self.halt,
            recording,
            list(self.names),
            self.steps,
            rewinds,
            self._not_replayed(),
            window_steps,
        )

    def _not_replayed(self) -> list[str]:
        """What of the policy the log cannot replay, in words (the report and the JSON say it)."""
        left = [] if self.recovery is None else self.recovery.not_replayed()
        if self.policy.rerun is not None:
            left.append(
                "rerun: a log cannot compute a step again; each suspect step gets the policy's own verdict, as a fault "
                "that repeats would (the guard may have found it transient and gone on)"
            )
        return left


def replay_files(policy: Policy, paths: Sequence[Path], recording: Recording | None = None) -> ReplayResult:
    """Replay ``policy`` on the norms recorded in ``paths`` (streamed: at most ``BLOCK_STEPS`` steps in memory)."""
    recording = recording if recording is not None else Recording()
    replayer = Replayer(policy)
    for recorded in recorded_steps(paths, recording):
        if not replayer.feed(recorded):
            break
    return replayer.result(recording)
