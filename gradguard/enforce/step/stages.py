"""One verdict for a pipeline: a stage that halts or skips takes every other stage with it, before any update.

A NaN made in one stage's weight gradient never reaches another stage (only activation gradients flow back), so each
stage's own verdict sees its own gradients only: a stage that halted while another updated would leave a half-updated
model (and the next schedule step would fail in its send or receive). After each stage's read, before any verdict is
taken, the stages exchange theirs over the mesh's ``pp`` dimension: a bit per stage for a halt, one for a skip, and
the kinds seen, in one SUM all-reduce (one more read per step under a pipeline: the stages' verdicts must be known
on the host before any stage's update). A stage whose own gradients are finite then halts naming the stage, rank and
host that found the fault (with recovery: rewinds with it), or skips with it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec

import torch

from gradguard.enforce.distributed.agreement import agree_at_attach, attach_begins, attach_failed, fingerprint
from gradguard.enforce.distributed.collective import Collective
from gradguard.enforce.distributed.local import RankSlots
from gradguard.enforce.distributed.mesh import MeshLayout, layout_of
from gradguard.enforce.hooks.scaler_view import scaler_view
from gradguard.enforce.recovery.decisions import HaltReport
from gradguard.enforce.step.verdicts import SKIP_CAUSES, SkipCause, Verdicts, skip_causes
from gradguard.enforce.work.participant import Participant, Ruling
from gradguard.enforce.work.step_work import StepContext, StepOutcome, StepWork
from gradguard.errors import GuardStateError
from gradguard.events.counters import STAGES_RULE, Counters
from gradguard.policy.matching import Binding, no_stage_matches

if TYPE_CHECKING:
    from gradguard.policy.document import Policy

__all__ = [
    "STAGES_RULE",
    "UNGUARDED_STAGE_REFUSED",
    "StagesTakingPart",
    "agree_on_the_mesh",
    "failure_told",
    "pipelined",
    "refuse_in_a_pipeline",
    "stage_words",
    "stages_taking_part",
]


def stage_words(layout: MeshLayout, rank: int, host: str) -> str:
    """``rank 1 (stage 1 of 2, dp_shard 0, host node-3)``: a rank by its mesh coordinates."""
    where = [f"stage {layout.coordinates.get(rank, {}).get('pp', 0)} of {layout.stages}"]
    where += [f"{name} {index}" for name, index in layout.coordinates.get(rank, {}).items() if name != "pp"]
    return f"rank {rank} ({', '.join(where)}, host {host})"


class StagesTakingPart(Participant):
    """The pipeline's stages agree on the step: the gradients' own verdicts, exchanged before any is taken."""

    def __init__(
        self, layout: MeshLayout, pipeline: Collective, stage: Collective, verdicts: Verdicts, counters: Counters
    ):
        self.layout = layout
        self.pipeline = pipeline
        """The collective over ``pp``: this rank and the same coordinates on every other stage."""
        self.stage = stage
        self.verdicts = verdicts
        self.counters = counters
        self._slots = RankSlots(layout.stage, layout.stages, norms=False)
        self._makers = RankSlots(0, max(max(ranks) for ranks in layout.stage_ranks) + 1, norms=False)
        """A bit per rank of the job: the ranks a halting stage's own verdict found made the fault (under tensor or
        data parallel, one of the stage's ranks; not the rank of that stage this rank exchanges with)."""

    def before_figures(self, work: StepWork, context: StepContext) -> None:
        # Every stage meets this at its first step, before any exchange: refused together, none left waiting.
        if context.found_inf or context.scaled_optimizers or scaler_view(context.stepped_params()).optimizers:
            raise GuardStateError(SCALER_REFUSED)

    def ruling(self, work: StepWork, context: StepContext) -> Ruling | None:
        outcome, slots = work.outcome, self._slots
        skips = bool(outcome.skipped_by or outcome.spikes)
        # A skip past its rule's limits halts (or rewinds) this stage after the exchange: the others must hear of it.
        halts = bool(outcome.halted_by) or (
            skips and self.verdicts.skip_escalates(work.binding.policy.rules, outcome, work.step)
        )
        skips = skips and not halts
        kinds = {kind for kind, _ in outcome.nonfinite.values()}
        device = next(iter(work.grads.values())).device
        mine = torch.tensor([halts, skips, "nan" in kinds, "inf" in kinds], dtype=torch.bool, device=device)
        bits = slots.bit_slots
        if halts and not outcome.ranks and not self.stage.active():  # a stage of one rank: its own gradient
            outcome.ranks = {self.stage.rank: self.stage.hosts.get(self.stage.rank, "?")}
        rules = work.binding.policy.rules
        own = skip_causes(outcome) if skips else []
        payload = torch.cat(
            [
                slots.bit(mine[0], device),
                slots.bit(mine[1], device),
                mine[2:].float(),
                self._made(halts, outcome, device),
                self._causes(own, len(rules), device),
            ]
        )
        values = self.pipeline.sum_(payload).tolist()  # the stages' verdicts: the step's second read, under a pipeline
        halting = [s for s in slots.ranks_of(values[:bits]) if s != self.layout.stage]
        skipping = [s for s in slots.ranks_of(values[bits : 2 * bits]) if s != self.layout.stage]
        if halts:
            return None  # its own verdict halts it
        causes_at = 2 * bits + 2 + self._makers.bit_slots
        if halting:
            kind = "nan" if values[2 * bits] else "inf" if values[2 * bits + 1] else "spike"
            makers = self._makers.ranks_of(values[2 * bits + 2 : causes_at])
            return Ruling(lambda: self._halt(work.step, halting, makers, kind))
        # The step is skipped under the rules any stage skipped it by: each rule's limits count the model's skips, not
        # this stage's alone (a skip rule of every stage meets the same run of skips, as in one process).
        for slot, value in enumerate(values[causes_at:]):
            cause = (slot % len(rules), SKIP_CAUSES[slot // len(rules)])
            if value and cause not in own:
                self.verdicts.skip_limits.record(cause[0], rules[cause[0]], work.step, cause[1])
        if skipping and not skips:
            self.counters.add(STAGES_RULE, "skip")
            return Ruling(lambda: True)
        return None

    @staticmethod
    def _causes(own: list[tuple[int, SkipCause]], rules: int, device: torch.device) -> torch.Tensor:
        """A slot per (skip kind, rule): 1 where this stage skips the step by that rule (zeros on a step it does not
        skip: built on the device, no host copy)."""
        slots = torch.zeros(len(SKIP_CAUSES) * rules, dtype=torch.float32, device=device)
        for rule_index, cause in own:
            slots[SKIP_CAUSES.index(cause) * rules + rule_index] = 1.0
        return slots

    def _made(self, halts: bool, outcome: StepOutcome, device: torch.device) -> torch.Tensor:
        """The bits of the ranks this stage's verdict found made its fault (zeros on a step it does not halt: built on
        the device, no host copy; the halting step's few ranks are copied)."""
        makers = self._makers
        if not halts or not outcome.ranks:
            return torch.zeros(makers.bit_slots, dtype=torch.float32, device=device)
        return torch.tensor(makers.bits_of(outcome.ranks), dtype=torch.float32, device=device)

    def _halt(self, step: int, stages: list[int], makers: list[int], kind: str) -> bool:
        # The ranks that made it, as the halting stages' verdicts found them; where a stage said none, its rank here.
        named = makers or [self.pipeline.members[s] for s in stages]
        ranks = {rank: self.pipeline.hosts.get(rank, "?") for rank in named}
        where = " and ".join(stage_words(self.layout, rank, host) for rank, host in ranks.items())
        reason = f"the pipeline's stages stop together; {where} found it, and its halt names the parameter"
        origin: dict[str, Any] = {
            "phase": "received",
            "module": None,
            "kind": kind,
            "input_nonfinite": False,
            "rank": self.stage.rank,
            "pipeline": True,
            "note": f"{where} made it, and no gradient flows back from one stage's weights to another's",
        }
        report = HaltReport(step, STAGES_RULE, [], {}, kind, reason, origin, ranks)
        self.verdicts.halt(report, [STAGES_RULE], "halt")
        return False  # not reached: a halt raises (or asks for a rewind)


def agree_on_the_mesh(
    binding: Binding, options: tuple[bool, int, bool], process_group: Any, device_mesh: Any, timeout: float
) -> Collective:
    """The attach agreement, over the job's mesh where one is given; the step's collective (a pipeline stage's ranks,
    holding the collective over the stages, or the whole job's). ``options``: ``per_micro_batch``, ``start_step`` and
    ``reload``, which every rank must share."""
    policy = binding.policy

    def mine(stage: str) -> dict[str, str]:
        return fingerprint(policy, binding, *options, stage=stage)

    if device_mesh is None:
        collective = Collective(process_group)
        agree_at_attach(collective, mine(""), timeout)
        return collective
    if process_group is not None:
        raise ValueError("pass device_mesh or process_group, not both: the mesh names the groups the guard agrees over")
    layout = layout_of(device_mesh)
    job = Collective(None)
    saved = agree_at_attach(job, mine(f"{layout.stage} of {layout.stages}" if layout.pipeline else ""), timeout)
    job.mesh = layout
    if not layout.pipeline:
        return job
    # A rule may match one stage's tensors alone (the embedding, the head): refused only where it matches no stage's,
    # on every rank at once (each reads the same fingerprints).
    lists = [str(found.get("unmatched", "")) for found in saved.values()]
    unmatched = [[int(index) for index in indices.split(",") if index] for indices in lists]
    if (nowhere := no_stage_matches(policy, unmatched, list(binding.all_names))) is not None:
        raise nowhere
    if bare := sorted({int(str(found["stage"]).split()[0]) for found in saved.values() if found.get("guarded") == "0"}):
        raise GuardStateError(UNGUARDED_STAGE_REFUSED.format(stages=", ".join(map(str, bare)), count=layout.stages))
    refuse_in_a_pipeline(policy)
    if options[2]:
        raise GuardStateError(RELOAD_REFUSED)
    stage = Collective(layout.stage_group)
    stage.join(job, layout.stage_ranks[layout.stage])
    stage.pipeline = Collective(layout.pp_group)
    stage.pipeline.join(job, layout.pp_ranks)
    stage.mesh = layout
    return stage


UNGUARDED_STAGE_REFUSED = (
    "the pipeline's stage(s) {stages} (of {count}) hold no tensor the policy guards: such a stage would never take "
    "part in the stages' exchange of verdicts, and the others would wait for it at every step. Match a tensor of every "
    "stage (a 'halt_on_nonfinite' rule on '*', as every shipped policy has)"
)


def pipelined(device_mesh: Any) -> bool:
    """Whether ``device_mesh`` cuts the model into pipeline stages (a ``pp`` dimension of more than one): the model
    given is then one stage's, bound as such (``bind(..., stage=True)``)."""
    names = getattr(device_mesh, "mesh_dim_names", None) or ()
    return "pp" in names and int(device_mesh.size(names.index("pp"))) > 1


_Init = ParamSpec("_Init")


def failure_told(init: Callable[_Init, None]) -> Callable[_Init, None]:
    """``GradGuard.__init__``, telling the other ranks what it raised before the attach agreement (the binding's
    ``PolicyError``, a refused option, anything): they raise naming this rank at once, instead of a "did not attach"
    at ``attach_timeout``; this rank raises its own error. The agreement is over ``process_group``, or the whole job
    where a ``device_mesh`` is given (``agree_on_the_mesh``)."""

    @functools.wraps(init)
    def attach(*args: _Init.args, **kwargs: _Init.kwargs) -> None:
        mark = attach_begins(None if kwargs.get("device_mesh") is not None else kwargs.get("process_group"))
        try:
            init(*args, **kwargs)
        except BaseException as error:
            attach_failed(mark, error)
            raise

    return attach


def stages_taking_part(collective: Collective, verdicts: Verdicts, counters: Counters) -> StagesTakingPart | None:
    """The pipeline's participant, where ``collective`` is a pipeline stage's (``agree_on_the_mesh``)."""
    if collective.pipeline is None or collective.mesh is None:
        return None
    return StagesTakingPart(collective.mesh, collective.pipeline, collective, verdicts, counters)


SCALER_REFUSED = (
    "a GradScaler under pipeline parallel is not built: each stage's scaler decides alone to skip its own update (an "
    "Inf on one stage skips that stage's optimizer step, while the others update and wait for it in the stages' "
    "exchange), and the stages' loss scales move apart. Train the pipeline in bfloat16 autocast without a scaler, as "
    "torchtitan does"
)
RELOAD_REFUSED = (
    "reloading the policy across pipeline stages is not built yet: each stage would switch at its own step (their "
    "agreement is not made over the stages), and the stages would then judge one step by two policies. Start the run "
    "again with the new policy, without reload=True"
)


def refuse_in_a_pipeline(policy: Policy) -> None:
    """The sections a pipeline's stages cannot take part in alike: the loss (the last stage's alone) and the re-run
    (a schedule's step is no closure)."""
    for rule in policy.rules:
        for action in rule.actions:
            if getattr(action, "scope", "tensor") == "group" and action.action != "clip_norm":
                raise GuardStateError(
                    f"rule {rule.name!r}: {action.action} with scope 'group' across pipeline stages is not built yet "
                    "(each stage would judge its own part of the group). Use scope 'tensor' for it, or a clip_norm "
                    "with scope 'group', whose norm is taken over every stage."
                )
    for section, why in (
        ("loss", "the loss is the last stage's alone, so the stages could not agree on its verdict"),
        ("rerun", "a pipeline schedule's step() cannot be run again as a closure"),
    ):
        if getattr(policy, section) is not None:
            raise GuardStateError(
                f"the policy's {section!r} section cannot be used across pipeline stages: {why}. Remove it for a "
                "pipeline run (every gradient action, halt, skip, recovery and monitor works across the stages)."
            )
