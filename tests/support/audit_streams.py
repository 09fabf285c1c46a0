"""Random event streams of data-parallel jobs, written by the guard's own ``EventLog``, whose true totals are known.

A ``Plan`` is a sequence of jobs; each job has its ranks (one per-rank file each, the jobs of a rank appended to
it, each job resumed where the one before ended) and its steps, and at each step one happening: clips, a skip, a
rewind, an outlier skip, or nothing; a job may end in a halt of any kind. Every rank of a job writes every event,
as a data-parallel job's ranks do, and counts it in its own counters as the guard does (``counters`` events every
few steps, ``detach`` at the end). ``expected`` is the account ``gradguard audit`` must give, counted here
independently of the audit's code.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradguard.events.log import EventLog

PARAMS = ("embed.weight", "body.weight", "body.bias", "head.weight")
HAPPENINGS = ("clean", "clips", "skip", "rewind", "outlier_skip")
HALT_KINDS = ("nan", "overflow", "spike", "divergence", "outlier", "loss", "rerun")
HOST = "host-{rank}"


@dataclass(frozen=True)
class JobPlan:
    ranks: int
    steps: list[tuple[str, int, int]]
    """(happening, how many clips (or non-finite tensors, at a skip or rewind), the rank a fault was made on) per
    step."""
    halt: str | None
    """The kind of the halt the job ends in, or None (detached)."""


@dataclass
class Expected:
    totals: dict[str, dict[str, int]] = field(default_factory=dict)
    halts: int = 0
    rewinds: int = 0
    skips: int = 0
    clips: int = 0
    nonfinite: int = 0
    by_rank: dict[int, Counter[str]] = field(default_factory=dict)

    def named(self, rank: int, column: str) -> None:
        self.by_rank.setdefault(rank, Counter())[column] += 1


class _Rank:
    """One rank's guard of one job: its ``EventLog`` and its own counters."""

    def __init__(self, path: Path, run: str, rank: int) -> None:
        self.log = EventLog(audit_log=path, logger=None, context={"run": run, "rank": rank})
        self.counts: dict[str, dict[str, int]] = {}

    def count(self, rule: str, action: str, n: int = 1) -> None:
        by_action = self.counts.setdefault(rule, {})
        by_action[action] = by_action.get(action, 0) + n

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {rule: dict(by_action) for rule, by_action in self.counts.items()}


def _verdict(param: str, origin: int) -> dict[str, Any]:
    return {"params": [param], "kinds": {param: "nan"}, "kind": "nan", "ranks": {str(origin): HOST.format(rank=origin)}}


def write_plan(folder: Path, jobs: list[JobPlan]) -> tuple[list[Path], Expected]:
    """Write every job's ranks' logs into ``folder`` (one file per rank); the files and the true account."""
    expected = Expected()
    paths = [folder / f"rank{rank}.jsonl" for rank in range(max(job.ranks for job in jobs))]
    start = 0
    for number, job in enumerate(jobs):
        ranks = [_Rank(paths[rank], f"job{number}-rank{rank}", rank) for rank in range(job.ranks)]
        end = start + len(job.steps) + (job.halt is not None)  # a halt comes at a step of its own, the last
        for guard in ranks:
            _write(guard, job, start, end)
        counts = ranks[0].counts
        for rule, by_action in counts.items():
            into = expected.totals.setdefault(rule, {})
            for action, n in by_action.items():
                into[action] = into.get(action, 0) + n
        _expect(expected, job)
        for guard in ranks:
            guard.log.close()
        start = end
    return [path for path in paths if path.exists()], expected


def _write(guard: _Rank, job: JobPlan, start: int, end: int) -> None:
    log, count = guard.log, guard.count
    rules = {"clip": len(PARAMS), "nonfinite": len(PARAMS)}
    log.emit("info", "attach", schema=1, policy="p.yaml", model="Net", start_step=start, params=4, rules=rules)
    for step, (happening, clips, origin) in enumerate(job.steps, start):
        param = PARAMS[step % len(PARAMS)]
        if happening == "clips":
            for name in PARAMS[:clips]:
                count("clip", "clip_norm")
                log.emit(
                    "debug",
                    "intervention",
                    step=step,
                    rule="clip",
                    action="clip_norm",
                    param=name,
                    before=2.0,
                    after=1.0,
                    coef=0.5,
                    max_norm=1.0,
                    scope="tensor",
                )
        elif happening in ("skip", "rewind"):
            for name in PARAMS[:clips]:  # a NaN in as many tensors as the step would have clipped: a line each
                count("nonfinite", "nan")
                log.emit(
                    "info",
                    "nonfinite",
                    step=step,
                    rule="nonfinite",
                    param=name,
                    kind="nan",
                    halts=False,
                    skips=happening == "skip",
                )
            if happening == "skip":
                count("nonfinite", "skip_step_on_nonfinite")
                log.emit("warning", "skip", step=step, rule="nonfinite", **_verdict(param, origin))
            else:
                count("nonfinite", "rewind")
                log.emit(
                    "warning",
                    "rewind",
                    step=step,
                    rule="nonfinite",
                    **_verdict(param, origin),
                    to_step=max(start, step - 1),
                    rewinds=1,
                    skip_until=step + 1,
                    lr_scale=1.0,
                )
        elif happening == "outlier_skip":
            count("ranks", "outlier")
            count("ranks", "skip")
            log.emit(
                "warning",
                "rank_outlier",
                step=step,
                ranks={str(origin): HOST.format(rank=origin)},
                norms={"0": 1.0},
                median=1.0,
                outlier_factor=10.0,
                action="skip",
            )
        if (step - start) % 3 == 2:
            log.emit("info", "counters", step=step, steps=step + 1, counters=guard.snapshot())
    if job.halt is not None:
        _halt(guard, job.halt, end - 1, job.steps[-1][2])  # the rank the last step's fault was made on
    log.emit("info", "detach", reason="removed", steps=end, counters=guard.snapshot())


def _halt(guard: _Rank, kind: str, step: int, origin: int) -> None:
    """A halt of ``kind`` at the job's last step, with the events before it and the counts the guard made."""
    log, count = guard.log, guard.count
    named = {str(origin): HOST.format(rank=origin)}
    rule, params, kinds = "nonfinite", ["body.weight"], {"body.weight": "nan"}
    if kind == "nan":
        count("nonfinite", "nan")
        log.emit("info", "nonfinite", step=step, rule=rule, param="body.weight", kind="nan", halts=True, skips=False)
        count(rule, "halt_on_nonfinite")
    elif kind == "overflow":
        params, kinds = [], {}
        count(rule, "halt_on_nonfinite")
    elif kind == "spike":
        rule, kinds = "clip", {}
        count(rule, "halt_on_spike")
    elif kind in ("divergence", "outlier"):
        rule, kinds = "ranks", {}
        params = ["body.weight"] if kind == "divergence" else []
        if kind == "divergence":
            count("ranks", "divergence")
            log.emit("error", "replica_divergence", step=step, ranks=named, params=params, checked=4, action="halt")
        else:
            count("ranks", "outlier")
            log.emit(
                "warning",
                "rank_outlier",
                step=step,
                ranks=named,
                norms={"0": 1.0},
                median=1.0,
                outlier_factor=10.0,
                action="halt",
            )
        count("ranks", "halt")
    elif kind == "loss":
        rule, params, kinds = "loss", [], {}
        count("loss", "spike")
        log.emit("warning", "loss_spike", step=step, loss=9.0, reference=1.0, factor=4.0, action="halt")
        count("loss", "halt")
    elif kind == "rerun":
        rule, params, kinds = "rerun", [], {}
        count("rerun", "transient")
        log.emit(
            "warning", "rerun", step=step, verdict="transient", asked="nonfinite", max_rel_diff=1.0, params=[], ranks=[]
        )
        count("rerun", "halt")
    log.emit(
        "error",
        "halt",
        step=step,
        rule=rule,
        params=params,
        kinds=kinds,
        kind="transient" if kind == "rerun" else kind,
        reason=None,
        ranks=named if kind != "rerun" else {},
        counters=guard.snapshot(),
    )


def _expect(expected: Expected, job: JobPlan) -> None:
    """What the job adds to the audit's account, counted from the plan (each distributed event once)."""
    for happening, clips, origin in job.steps:
        if happening == "clips":
            expected.clips += clips
        elif happening == "skip":
            expected.skips += 1
            expected.nonfinite += clips
            expected.named(origin, "skips")
        elif happening == "rewind":
            expected.rewinds += 1
            expected.nonfinite += clips
            expected.named(origin, "rewinds")
        elif happening == "outlier_skip":
            expected.skips += 1
            expected.named(origin, "outliers")
    if job.halt is None:
        return
    expected.halts += 1
    origin = job.steps[-1][2]
    if job.halt == "nan":
        expected.nonfinite += 1
    if job.halt != "rerun":
        expected.named(origin, "halts")
    if job.halt == "divergence":
        expected.named(origin, "divergences")
    elif job.halt == "outlier":
        expected.named(origin, "outliers")
