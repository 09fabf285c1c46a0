"""Follow a log's lines through ``gradguard audit``: which stage of the audit each call goes to, and whether any goes
back up (issue 57's measure of an audit whose lines flow one way, as ``benchmarks/step_walk.py`` is the step's).

    python benchmarks/audit_walk.py            # the stages in order, the calls between them, what went back up
    python benchmarks/audit_walk.py --trace    # and every call from one stage (or collector) into another

The log is two ranks' files of a small data-parallel job, written as the guard writes them (clips, a group clip,
non-finite gradients, a skip, a halt, a monitor's stats, counters, detach: every collector has lines to read). The
walk runs ``gradguard audit LOG0 LOG1`` in this process (the command's own code, text report) under a profiler that
sees every call into ``gradguard/``, and gives each file and function its stage:

- **command**: ``cli/``, ``audit/command.py`` and ``audit/summarizer.py`` (which builds the collectors and the
  dispatcher, and gathers their parts): the orchestrators;
- **reader**: ``audit/reader.py``, ``audit/plausible.py`` and ``audit/merging.py``: bytes to typed events;
- **dispatcher**: ``audit/dispatch.py``, ``audit/run_book.py``, ``audit/jobs.py``: each line's run and replica
  bookkeeping, once, then the collectors registered for it;
- **collectors**: the modules of the registered collectors (``audit/collectors.py``; ``audit/counting.py`` is the
  counters collector's), each collector one stage of its own, side by side;
- **report**: ``audit/render.py``, ``audit/stops_report.py``, ``audit/health_report.py``, every ``*_section``
  function and the few others a section is written with beside its collector: the text;
- **shared**: every other file (the data model ``audit/summary.py``, ``audit/run_state.py``, ``audit/layout.py``'s
  words and tables, ``audit/fields.py``, ``audit/filters.py``, ``events/``, ``policy/``): leaves, called from
  anywhere.

Building the collectors and the dispatcher, asking each what it reads, and imports wire the stages before a line is
read: they are counted apart (``wiring``).

A call **goes back up** where a stage calls a stage before it (a collector into the dispatcher or the reader, the
dispatcher into the reader, the report into a collector's reading), and **across** where one collector calls
another's module. The command may call every stage: it is where the flow is wired. The walk passes where nothing goes
back up or across; ``tests/test_audit_walk.py`` holds it there.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from click.testing import CliRunner
from support.synthetic_log import LogBuilder

import gradguard.audit.collectors as registry
from gradguard.cli import main

PACKAGE = Path(registry.__file__).resolve().parent.parent
ORDER = ("command", "reader", "dispatcher", "collectors", "report")
COMMAND = {"audit/command.py", "audit/summarizer.py"}
READER = {"audit/reader.py", "audit/plausible.py", "audit/merging.py"}
DISPATCHER = {"audit/dispatch.py", "audit/run_book.py", "audit/jobs.py"}
REPORT = {"audit/render.py", "audit/stops_report.py", "audit/health_report.py"}
REPORT_FUNCTIONS = {"loss_skip_causes", "most_faults"}
"""Functions of the report kept beside the collector whose section they write (besides every ``*_section``)."""
WIRING = {"__init__", "reads", "<module>"}
"""Calls that wire the stages together before a line is read (building a collector, asking what it reads, an import):
counted apart, not as the lines' flow."""


def collector_files() -> set[str]:
    """The files of the registered collectors."""
    files = set()
    for factory in registry._REGISTRY.values():
        module = sys.modules[factory.__module__]
        files.add(str(Path(str(module.__file__)).resolve().relative_to(PACKAGE)))
    return files


@dataclass
class AuditWalk:
    stages: list[str] = field(default_factory=list)
    """The stages in order of first entry."""
    calls: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(caller's stage, callee's stage) -> calls, between different stages (collectors by file)."""
    back_up: list[str] = field(default_factory=list)
    across: list[str] = field(default_factory=list)
    wiring: int = 0
    """Calls between stages that wire them before the lines flow (``WIRING``)."""


def stage_of(name: str, function: str, collectors: set[str]) -> str:
    """The stage of a call into ``function`` of ``name`` (a file relative to gradguard/)."""
    if name.startswith("cli/") or name in COMMAND:
        return "command"
    if function.endswith("_section") or function in REPORT_FUNCTIONS or name in REPORT:
        return "report"
    if name in READER:
        return "reader"
    if name in DISPATCHER:
        return "dispatcher"
    if name == "audit/counting.py":  # what the guard counted for each event: the counters section's own rules
        name = "audit/counters.py"
    if name in collectors:
        return "collectors:" + name
    return "shared"


def write_log(folder: Path) -> list[Path]:
    """Two ranks of a data-parallel job: what each rank writes (every event, its own counters)."""
    paths = []
    params = ["embed.weight", "body.weight", "head.weight"]
    for rank in (0, 1):
        with LogBuilder(folder / f"rank{rank}.jsonl", run=f"r{rank}", rank=rank) as log:
            log.attach({"clip": 3, "nonfinite": 3, "norms": 3})
            for step in range(6):
                log.stats(step, "norms", {"norm": dict.fromkeys(params, 1.0 + step)})
                if step == 3:
                    log.nonfinite(step, "nonfinite", "body.weight", skips=True)
                    log.skip(step, "nonfinite", ["body.weight"])
                    continue
                log.clip(step, "clip", params[step % 3], 2.0 + step)
                log.group_clip(step, "clip", params, 3.0)
            log.nonfinite(6, "nonfinite", "head.weight", halts=True)
            log.halt(6, "nonfinite", ["head.weight"])
            log.counters(6)
            log.detach(7)
        paths.append(log.path)
    return paths


def walk_of_an_audit(paths: list[Path], trace: list[str] | None = None) -> AuditWalk:
    walk = AuditWalk()
    collectors = collector_files()

    def tracer(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = _stage(frame, collectors)
        if callee is None:
            return
        if frame.f_code.co_name in WIRING:
            walk.wiring += callee not in ("command", "shared")
            return
        caller = _nearest_caller(frame, collectors)
        if caller is None or caller == callee or callee == "shared":
            return
        for stage in (caller.split(":")[0], callee.split(":")[0]):
            if stage not in walk.stages:
                walk.stages.append(stage)
        walk.calls[(caller, callee)] += 1
        words = f"{caller} -> {callee} ({frame.f_code.co_name})"
        if trace is not None:
            trace.append(words)
        up, down = caller.split(":")[0], callee.split(":")[0]
        if up == "collectors" and down == "collectors":
            walk.across.append(words)
        elif up not in ("command", "shared") and ORDER.index(down) < ORDER.index(up):
            walk.back_up.append(words)

    sys.setprofile(tracer)
    try:
        result = CliRunner().invoke(main, ["audit", "--no-progress", *map(str, paths)])
    finally:
        sys.setprofile(None)
    assert result.exit_code == 1, result.output  # the halt and the skip are findings
    return walk


def _stage(frame: FrameType, collectors: set[str]) -> str | None:
    path = Path(frame.f_code.co_filename)
    if PACKAGE not in path.parents:
        return None
    return stage_of(str(path.relative_to(PACKAGE)), frame.f_code.co_name, collectors)


def _nearest_caller(frame: FrameType, collectors: set[str]) -> str | None:
    caller = frame.f_back
    while caller is not None:
        stage = _stage(caller, collectors)
        if stage is not None and stage != "shared":
            return stage
        caller = caller.f_back
    return None


def main_() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", action="store_true", help="every call from one stage into another")
    args = parser.parse_args()
    trace: list[str] | None = [] if args.trace else None
    with tempfile.TemporaryDirectory() as folder:
        paths = write_log(Path(folder))
        lines = sum(len(path.read_text().splitlines()) for path in paths)
        walk = walk_of_an_audit(paths, trace)
    print(f"gradguard audit of {len(paths)} files, {lines} lines: the stages in order of first entry")
    print("  " + " -> ".join(walk.stages))
    print("calls between stages (a collector is a stage of its own):")
    for (caller, callee), n in sorted(
        walk.calls.items(),
        key=lambda item: (ORDER.index(item[0][0].split(":")[0]), ORDER.index(item[0][1].split(":")[0]), item[0]),
    ):
        print(f"  {caller} -> {callee}: {n:,}")
    print(f"wiring before the lines flow (building, registering, importing): {walk.wiring:,} calls")
    print(
        f"calls back up to an earlier stage: {len(walk.back_up)}; calls from one collector into another: "
        f"{len(walk.across)}"
    )
    for words in walk.back_up + walk.across:
        print(f"  {words}")
    if trace is not None:
        print("every call between stages, in order:")
        for words in trace:
            print(f"  {words}")


if __name__ == "__main__":
    main_()
