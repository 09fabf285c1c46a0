"""Pipeline parallel scenarios for tests/test_pipeline_parallel.py: torch.distributed.pipelining on real gloo ranks.

Each rank holds one stage of ``support.parallel_models``' decoder (the whole model's names, the other stages' layers
removed, as torchtitan splits it), runs a GPipe or 1F1B schedule over 2 micro-batches of the full batch and then its
optimizer's step, guarded with ``device_mesh``; ``pp_dp`` puts FSDP2 over 2 data-parallel replicas under each stage,
``pp_tp`` torchtitan's tensor-parallel plan over 2 ranks in each stage.
Run as ``python tests/pipeline_scenarios.py NAMES WORLD OUTDIR PORT`` (support.gloo_ranks).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import parallel_scenarios
import torch
import torch.distributed as dist
from support.gloo_ranks import failure_record, keep_failure, main
from support.parallel_models import apply_torchtitan_tp, batch, loss_of, make_decoder, stage_modules, titan_clip
from torch import nn

from gradguard import GradGuard, GradientHalt, GuardStateError, Policy
from gradguard.enforce.step.participants import registered
from gradguard.enforce.work.participant import Participant

STEPS = 3
LR = 0.5
BAD_STEP = 1
POLICIES = ["per_tensor_clip", "group_clip", "monitor", "agc", "clip_value", "default", *parallel_scenarios.LOOP_CLIPS]

SKIP = {"version": 1, "rules": [{"name": "nonfinite", "match": "*", "actions": [{"action": "skip_step_on_nonfinite"}]}]}
HALT = {"version": 1, "rules": [{"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}]}
REWIND = {**HALT, "recovery": {"snapshot_every": 2, "min_age": 1, "skip_steps": 1}}
SKIP_AT_MOST_ONCE = {"action": "skip_step_on_nonfinite", "max_consecutive_skips": 1}
SKIP_ONCE = {"version": 1, "rules": [{"name": "nonfinite", "match": "*", "actions": [SKIP_AT_MOST_ONCE]}]}
SKIP_ONCE_REWIND = {**SKIP_ONCE, "recovery": {"snapshot_every": 2, "min_age": 1, "skip_steps": 0}}
TWIN_STEPS, TWIN_FAULT = 8, 5
TWIN_BATCHES = [0, 1, 2, 3, 7]
"""With a snapshot every 2 steps, min_age 1 and skip_steps 1, a NaN at step 5 rewinds to the snapshot of step 4 and
skips step 6: the batches of 4, 5 and 6 are never learned from."""


class Stage:
    """One rank's stage: its module, its schedule and its optimizer."""

    def __init__(self, layout: str, rank: int, world: int, schedule: str = "gpipe") -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        dp = 1 if layout == "pp_tp" else world // 2
        if layout == "pp_tp":  # torchtitan's PP over TP: each stage's layers split over its 2 tensor-parallel ranks
            self.mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "tp"))
        elif dp > 1:
            self.mesh = init_device_mesh("cpu", (2, dp), mesh_dim_names=("pp", "dp_shard"))
        else:
            self.mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
        self.index = self.mesh["pp"].get_local_rank()
        self.dp_rank = self.mesh["dp_shard"].get_local_rank() if dp > 1 else 0
        self.dp = dp
        if schedule == "interleaved":  # a 4-layer decoder in 4 stages, 2 a rank (torchtitan's model_parts)
            group = self.mesh["pp"].get_group()
            self.parts = [stage_modules(make_decoder(layers=4), s, 4) for s in (self.index, self.index + 2)]
            stages = [
                PipelineStage(p, s, 4, torch.device("cpu"), group=group)
                for p, s in zip(self.parts, (self.index, self.index + 2), strict=True)
            ]
            self.schedule = ScheduleInterleaved1F1B(stages, n_microbatches=2, loss_fn=loss_of)
            self.module = self.parts[0]
            self.opt = torch.optim.SGD([p for part in self.parts for p in part.parameters()], lr=LR)
            return
        self.parts = []
        self.module: nn.Module = stage_modules(make_decoder(), self.index, 2)
        if dp > 1:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.module, mesh=self.mesh["dp_shard"])
        if layout == "pp_tp":
            apply_torchtitan_tp(self.module, self.mesh["tp"])
        stage = PipelineStage(self.module, self.index, 2, torch.device("cpu"), group=self.mesh["pp"].get_group())
        kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        self.schedule = kind(stage, n_microbatches=2, loss_fn=loss_of)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=LR)

    def run(self, step: int) -> None:
        """Forward and backward of ``step``'s batch (this replica's rows) through the schedule."""
        tokens, targets = batch(step)
        rows = slice(self.dp_rank * 4 // self.dp, (self.dp_rank + 1) * 4 // self.dp)
        self.opt.zero_grad()
        if self.index == 0:
            self.schedule.step(tokens[rows])
        else:
            self.schedule.step(target=targets[rows])

    @property
    def guarded(self) -> nn.Module | list[nn.Module]:
        """What the guard is given: the stage, or the rank's parts (interleaved)."""
        return self.parts or self.module

    def weights(self) -> dict[str, torch.Tensor]:
        named = [item for part in self.parts or [self.module] for item in part.named_parameters()]
        return {name: parallel_scenarios.full(p).detach().clone() for name, p in named}

    def parameters(self) -> list[torch.Tensor]:
        return [p for part in self.parts or [self.module] for p in part.parameters()]


def train(layout: str, rank: int, world: int, outdir: Path, policy: str, schedule: str) -> dict[str, Any]:
    stage = Stage(layout, rank, world, schedule)
    log = outdir / f"{policy}-rank{rank}.jsonl"
    norms = []
    guarded = parallel_scenarios.policy_of(policy)
    with GradGuard(stage.guarded, guarded, audit_log=log, logger=None, device_mesh=stage.mesh):
        for step in range(STEPS):
            stage.run(step)
            if policy in parallel_scenarios.LOOP_CLIPS:  # torchtitan's clip over every stage (its pp_mesh)
                clip = parallel_scenarios.LOOP_CLIPS[policy]
                norms.append(float(titan_clip(stage.parameters(), clip, pp_mesh=stage.mesh["pp"])))
            stage.opt.step()
    weights = {name: value.reshape(-1).tolist() for name, value in stage.weights().items()}
    return {"final": weights, "stats": parallel_scenarios.stats_of(log), "norms": norms}


def fault(
    rank: int,
    world: int,
    policy: dict[str, Any],
    steps: int = STEPS,
    layout: str = "fault",
    fused: bool = False,
    bad_steps: tuple[int, ...] = (BAD_STEP,),
    stage_of: dict[int, int] | None = None,
) -> dict[str, Any]:
    """A NaN written into stage 1's ``layers.1.feed_forward.up.weight`` gradient at ``BAD_STEP`` (under ``pp_tp``, into
    the shard of stage 1's last tensor-parallel rank only); ``fused``: each stage steps a fused AdamW (whose update a
    guard alone in its step lets run before its read); ``stage_of``: at each bad step, the stage whose layer's gradient
    gets it (stage 1's by default)."""
    stage = Stage(layout, rank, world)
    if fused:
        stage.opt = torch.optim.AdamW(stage.module.parameters(), lr=1e-2, fused=True)
    poisoned = layout != "pp_tp" or stage.mesh["tp"].get_local_rank() == world // 2 - 1
    out: dict[str, Any] = {"halted": None, "skipped": [], "rewinds": 0, "changed": []}
    with GradGuard(stage.module, Policy.from_dict(policy), logger=None, device_mesh=stage.mesh) as guard:
        for step in range(steps):
            stage.run(step)
            if step in bad_steps and poisoned and (stage_of or {}).get(step, 1) == stage.index:
                grad = stage.module.layers[str(stage.index)].feed_forward.up.weight.grad
                parallel_scenarios.local(grad).view(-1)[0] = float("nan")
            before = stage.weights()
            try:
                stage.opt.step()
            except GradientHalt as halt:
                out["halted"] = {
                    "step": halt.step,
                    "params": list(halt.params),
                    "rule": halt.rule,
                    "ranks": {str(k): v for k, v in halt.ranks.items()},
                    "unchanged": all(torch.equal(before[k], v) for k, v in stage.weights().items()),
                    "message": str(halt),
                }
                break
            if guard.last_step_skipped:
                out["skipped"].append(step)
            out["changed"].append(any(not torch.equal(before[k], v) for k, v in stage.weights().items()))
        out["counters"] = guard.counters.snapshot()
    out["final"] = {name: value.reshape(-1).tolist() for name, value in stage.weights().items()}
    return out


class Optimizers:
    """An optimizer per part of a stage, stepped in turn (torchtitan's ``OptimizersContainer``)."""

    def __init__(self, parts: list[list[nn.Parameter]]) -> None:
        self.optimizers = [torch.optim.SGD(params, lr=LR) for params in parts]

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


def several_optimizers(rank: int, world: int) -> dict[str, Any]:
    """Stage 0 steps two optimizers (its attention's parameters, then the rest), stage 1 one: healthy under the default
    policy, then unguarded (the twin), then a NaN on stage 1 at ``BAD_STEP`` under a halt policy."""
    out: dict[str, Any] = {}
    for name, policy in (("default", Policy.shipped("default")), ("twin", None), ("halt", Policy.from_dict(HALT))):
        stage = Stage("fault", rank, world)
        named = list(stage.module.named_parameters())
        attention = [p for key, p in named if ".attention." in key]
        rest = [p for key, p in named if ".attention." not in key]
        stage.opt = Optimizers([attention, rest]) if stage.index == 0 else Optimizers([[p for _, p in named]])
        guard = GradGuard(stage.module, policy, logger=None, device_mesh=stage.mesh) if policy is not None else None
        run: dict[str, Any] = {"halted": None}
        try:
            for step in range(STEPS):
                stage.run(step)
                if name == "halt" and step == BAD_STEP and stage.index == 1:
                    stage.module.layers["1"].feed_forward.up.weight.grad.view(-1)[0] = float("nan")
                before = stage.weights()
                try:
                    stage.opt.step()
                except GradientHalt as halt:
                    unchanged = all(torch.equal(before[k], v) for k, v in stage.weights().items())
                    run["halted"] = {"step": halt.step, "rule": halt.rule, "unchanged": unchanged}
                    break
        finally:
            if guard is not None:
                guard.remove()
        run["final"] = {key: value.reshape(-1).tolist() for key, value in stage.weights().items()}
        out[name] = run
    return out


def rewind_and_twin(rank: int, world: int) -> dict[str, Any]:
    """The rewind (a NaN on stage 1 at ``TWIN_FAULT``), and the twin that trains only ``TWIN_BATCHES``: each stage's
    weights after both, bit for bit."""
    out: dict[str, Any] = {}
    for name, policy, steps in (("rewound", REWIND, range(TWIN_STEPS)), ("twin", HALT, TWIN_BATCHES)):
        stage = Stage("twin", rank, world)
        with GradGuard(stage.module, Policy.from_dict(policy), logger=None, device_mesh=stage.mesh) as guard:
            for step in steps:
                stage.run(step)
                if step == TWIN_FAULT and stage.index == 1 and name == "rewound":
                    grad = stage.module.layers["1"].feed_forward.up.weight.grad
                    parallel_scenarios.local(grad).view(-1)[0] = float("nan")
                stage.opt.step()
            out[name] = {
                "weights": {key: value.reshape(-1).tolist() for key, value in stage.weights().items()},
                "counters": guard.counters.snapshot(),
            }
    return out


def refused_without_a_mesh(rank: int) -> dict[str, Any]:
    module = stage_modules(make_decoder(), rank, 2)
    try:
        GradGuard(module, Policy.shipped("default"), logger=None, attach_timeout=20).remove()
    except GuardStateError as error:
        return {"error": str(error)}
    return {"error": None}


ATTACH_TIMEOUT = 20.0
"""pp_one_stage_rule's: a stage must hear of the other's failure well before it."""


def one_stage_rule(rank: int, world: int) -> dict[str, Any]:
    """Four attaches on each stage, in turn: a policy with a rule matching the head alone, which only the last stage
    holds (its counters after two steps); one with a rule matching no stage's tensor; one of the head's rule alone
    (stage 0 guards nothing); and one whose attach raises on stage 0 alone before the attach agreement (an invalid
    ``summary_every``). The errors each raised, and how long each took."""
    stage = Stage("pp_gpipe", rank, world)
    head = {"name": "head", "match": "output.*", "actions": [{"action": "clip_norm", "max_norm": 1e-3}]}
    nowhere = {"name": "nowhere", "match": "no_such.*", "actions": [{"action": "clip_norm", "max_norm": 1.0}]}
    found: dict[str, Any] = {}
    with GradGuard(
        stage.module, Policy.from_dict({**HALT, "rules": [*HALT["rules"], head]}), logger=None, device_mesh=stage.mesh
    ) as guard:
        for step in range(2):
            stage.run(step)
            stage.opt.step()
        found["counters"] = guard.counters.snapshot()
    for name, policy, options in (
        ("no_stage", {**HALT, "rules": [*HALT["rules"], nowhere]}, {}),
        ("unguarded_stage", {**HALT, "rules": [head]}, {}),
        ("failed_before", HALT, {"summary_every": -1} if rank == 0 else {}),
    ):
        started = time.monotonic()
        try:
            GradGuard(
                stage.module,
                Policy.from_dict(policy),
                logger=None,
                device_mesh=stage.mesh,
                attach_timeout=ATTACH_TIMEOUT,
                **options,
            ).remove()
        except Exception as error:  # the test asserts the type and the words
            found[name] = failure_record(error, started) | {"timeout": ATTACH_TIMEOUT}
        else:
            found[name] = None
    return found


def refusals(rank: int) -> dict[str, Any]:
    """Every layout that is not built, attached as a user would: the error each rank gets (None: attached)."""
    from torch.distributed.device_mesh import init_device_mesh

    def attempt(module: nn.Module, policy: dict[str, Any] | str, **options: Any) -> str | None:
        chosen = Policy.shipped(policy) if isinstance(policy, str) else Policy.from_dict(policy)
        try:
            GradGuard(module, chosen, logger=None, attach_timeout=20, **options).remove()
        except (GuardStateError, ValueError) as error:
            return f"{type(error).__name__}: {error}"
        return None

    pp = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    stage = stage_modules(make_decoder(), rank, 2)
    group_monitor = {
        "version": 1,
        "rules": [{"name": "m", "match": "*", "actions": [{"action": "monitor", "scope": "group"}]}],
    }
    return {
        name: attempt(module, policy, **options)
        for name, (module, policy, options) in {
            "context_parallel": (
                make_decoder(),
                "default",
                {"device_mesh": init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))},
            ),
            "expert_parallel": (
                make_decoder(),
                "default",
                {"device_mesh": init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))},
            ),
            "unknown_dimension": (
                make_decoder(),
                "default",
                {"device_mesh": init_device_mesh("cpu", (2,), mesh_dim_names=("rows",))},
            ),
            "mesh_and_group": (stage, "default", {"device_mesh": pp, "process_group": dist.group.WORLD}),
            "loss_in_a_pipeline": (stage, {**REWIND, "loss": {"spike": {"factor": 10}}}, {"device_mesh": pp}),
            "group_monitor_in_a_pipeline": (stage, group_monitor, {"device_mesh": pp}),
            "pipeline_with_its_mesh": (stage, "default", {"device_mesh": pp}),
            "reload_in_a_pipeline": (stage, "default", {"device_mesh": pp, "reload": True}),
        }.items()
    } | {"reload_call_in_a_pipeline": reload_call(stage, pp)}


def reload_call(stage: nn.Module, mesh: Any) -> str | None:
    """``guard.reload(path)`` on a pipeline's stage: the warning it gives (None: it reloaded)."""
    import warnings

    shipped = Path(__file__).parent.parent / "gradguard" / "policies" / "per-tensor-clip.yaml"
    guard = GradGuard(stage, Policy.shipped("default"), logger=None, device_mesh=mesh)
    with guard, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reloaded = guard.reload(shipped)
    return None if reloaded else "; ".join(str(warning.message) for warning in caught)


class FailsOnStageOne(Participant):
    """Raises inside the guard's step on stage 1's rank at ``BAD_STEP``, before the stages exchange their verdicts."""

    def before_figures(self, work: Any, context: Any) -> None:
        if work.step == BAD_STEP and dist.get_rank() == 1:
            raise ValueError("the device returned garbage")


def failure(rank: int, world: int, outdir: Path) -> None:
    """Stage 1's step raises while stage 0 waits in the stages' exchange: every rank must raise ``GuardStateError``
    naming rank 1 within seconds, not at the process group's timeout. The failed rank lives on a while (a loop that
    catches to save a checkpoint): the others learn of it from the store, not from its transport closing."""
    result: dict[str, Any] = {"rank": rank, "error": None}
    with registered("fails_on_stage_one", lambda parts: FailsOnStageOne()):
        stage = Stage("pp_gpipe", rank, world)
        log = outdir / f"audit-rank{rank}.jsonl"
        guard = GradGuard(stage.module, Policy.from_dict(HALT), audit_log=log, logger=None, device_mesh=stage.mesh)
        train_until_refused(stage, result)
        result["steps"] = guard.step_count  # the guard stays referenced (and attached) until here
    keep_failure(result, log, outdir, rank)
    if rank == 1:
        time.sleep(3)
    os._exit(0)  # the group is unusable now: no barrier, no clean leave


def train_until_refused(stage: Stage, result: dict[str, Any]) -> None:
    """``STEPS`` steps, or until one raises ``GuardStateError``: kept in ``result["error"]``, with how long its
    optimizer step took to raise it."""
    started = time.monotonic()
    try:
        for step in range(STEPS):
            stage.run(step)
            started = time.monotonic()
            stage.opt.step()
    except GuardStateError as error:
        result["error"] = failure_record(error, started)


def frozen_stage(rank: int, world: int, outdir: Path) -> None:
    """Stage 1's parameters are all frozen (its optimizer steps nothing): it has no verdict to give, and stage 0 would
    wait for it in the stages' exchange. Refused on stage 1 at its first step; stage 0 hears of it from the store."""
    result: dict[str, Any] = {"rank": rank, "error": None}
    stage = Stage("pp_gpipe", rank, world)
    if stage.index == 1:
        stage.module.requires_grad_(False)
    log = outdir / f"audit-rank{rank}.jsonl"
    guard = GradGuard(stage.module, Policy.from_dict(HALT), audit_log=log, logger=None, device_mesh=stage.mesh)
    train_until_refused(stage, result)
    result["steps"] = guard.step_count
    keep_failure(result, log, outdir, rank)
    time.sleep(1)
    os._exit(0)  # the group is unusable now: no barrier, no clean leave


def scaled(rank: int, world: int) -> dict[str, Any]:
    """Each stage steps through its own GradScaler (every stage makes its scale; the last scales its loss): refused
    on every stage at the first step, before the stages exchange anything."""
    stage = Stage("fault", rank, world)
    scaler = torch.amp.GradScaler("cpu")
    out: dict[str, Any] = {"error": None, "step": None}
    started = time.monotonic()
    with GradGuard(stage.module, Policy.from_dict(HALT), logger=None, device_mesh=stage.mesh):
        try:
            for step in range(STEPS):
                stage.run(step)
                scaler.scale(torch.zeros(()))
                out["step"] = step
                scaler.step(stage.opt)
                scaler.update()
        except GuardStateError as error:
            out["error"] = failure_record(error, started)
    return out


def scenario(name: str, rank: int, world: int, outdir: Path) -> dict[str, Any]:
    if name in ("pp_gpipe", "pp_1f1b", "pp_dp", "pp_interleaved", "pp_tp"):
        schedule = {"pp_1f1b": "1f1b", "pp_interleaved": "interleaved"}.get(name, "gpipe")
        runs: dict[str, Any] = {policy: train(name, rank, world, outdir, policy, schedule) for policy in POLICIES}
        return runs | {"layers": 4 if schedule == "interleaved" else 2}
    if name == "pp_faults":
        halt_policy = {"version": 1, "rules": REWIND["rules"]}
        return {
            "halt": fault(rank, world, halt_policy),
            "skip": fault(rank, world, SKIP),
            "rewind": fault(rank, world, REWIND, 5),
            "halt_fused": fault(rank, world, halt_policy, fused=True),
            "scaled": scaled(rank, world),
            "skip_limit": fault(rank, world, SKIP_ONCE, 4, bad_steps=(1, 2)),
            "skip_limit_rewind": fault(rank, world, SKIP_ONCE_REWIND, 4, bad_steps=(1, 2)),
            "skip_limit_across": fault(rank, world, SKIP_ONCE, 4, bad_steps=(1, 2), stage_of={1: 1, 2: 0}),
            "several_optimizers": several_optimizers(rank, world),
        }
    if name == "pp_tp_faults":
        halt_policy = {"version": 1, "rules": REWIND["rules"]}
        return {
            "halt": fault(rank, world, halt_policy, layout="pp_tp"),
            "skip": fault(rank, world, SKIP, layout="pp_tp"),
        }
    if name == "pp_failure":
        failure(rank, world, outdir)
    if name == "pp_frozen_stage":
        frozen_stage(rank, world, outdir)
    if name == "pp_without_mesh":
        return refused_without_a_mesh(rank)
    if name == "refusals":
        return refusals(rank)
    if name == "pp_one_stage_rule":
        return one_stage_rule(rank, world)
    if name == "pp_rewind_twin":
        return rewind_and_twin(rank, world)
    raise ValueError(name)


if __name__ == "__main__":
    main(scenario, sys.argv[1:])
