"""The audit's collectors stand side by side: each is built from the same context, none from another, and adding a
section is one module and one registration (tests/support/exercise_collector.py)."""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner
from support.exercise_collector import CountersByRank
from support.synthetic_log import LogBuilder

import gradguard.audit.collectors as collectors
from gradguard.audit.collector import Collector, Context
from gradguard.audit.collectors import registered, registered_names
from gradguard.cli import main

AUDIT = Path(collectors.__file__).parent
BUILT_IN = [
    "runs",
    "ranks",
    "interventions",
    "nonfinite",
    "halts_and_skips",
    "health",
    "loss",
    "reruns",
    "counters",
    "other_events",
]


def two_ranks(folder: Path, *, counters_on_rank_one: bool = True) -> list[Path]:
    paths = []
    for rank in (0, 1):
        with LogBuilder(folder / f"rank{rank}.jsonl", run=f"r{rank}", rank=rank) as log:
            log.attach({"clip": 2})
            for step in range(4):
                log.clip(step, "clip", "w", 2.0)
            if rank == 0 or counters_on_rank_one:
                log.counters(3)
        paths.append(log.path)
    return paths


def audit(fmt: str, paths: list[Path]) -> str:
    return CliRunner().invoke(main, ["audit", "--format", fmt, *map(str, paths)]).stdout


def test_a_collector_registered_in_one_line_adds_its_section_json_and_findings(tmp_path: Path) -> None:
    paths = two_ranks(tmp_path, counters_on_rank_one=False)
    assert "counters_by_rank" not in json.loads(audit("json", paths))
    with registered("counters_by_rank", CountersByRank):
        data: dict[str, Any] = json.loads(audit("json", paths))
        text = audit("table", paths)
        markdown = audit("markdown", paths)
    assert data["counters_by_rank"] == {"0": 1, "1": 0}
    assert "ranks without a counters event: [1]" in data["findings"]
    assert "Counters events by rank" in text
    assert "rank 0: 1 counters events" in text
    assert "Counters events by rank" in markdown
    assert data["intervention_count"] == 4  # the other sections as they were: the clips of both ranks once
    assert registered_names() == BUILT_IN


def test_the_built_in_collectors_are_registered_in_one_place_in_the_order_they_take_an_event() -> None:
    assert registered_names() == BUILT_IN


def test_no_collector_is_built_from_another_or_imports_another_collectors_module() -> None:
    """Every factory takes the context alone; no collector module imports a module that defines another."""
    modules = {}
    for path in sorted(AUDIT.glob("*.py")):
        tree = ast.parse(path.read_text())
        defines = {node.name for node in tree.body if isinstance(node, ast.ClassDef) and _is_collector(node)}
        if defines:
            modules[path.stem] = tree
    assert len(modules) >= len(BUILT_IN)
    for name, tree in modules.items():
        imported = {
            node.module.rsplit(".", 1)[-1]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gradguard.audit.")
        }
        assert not imported & (set(modules) - {name}), (name, imported & set(modules))
    for factory in collectors._REGISTRY.values():
        assert isinstance(factory, type)
        assert issubclass(factory, Collector)
        parameters = list(inspect.signature(factory).parameters.values())
        assert [parameter.annotation for parameter in parameters] in (["Context"], [Context]), factory


def _is_collector(node: ast.ClassDef) -> bool:
    return any(isinstance(base, ast.Name) and base.id == "Collector" for base in node.bases)


def test_a_streaks_replica_check_agrees_with_the_one_by_one_check() -> None:
    """A job's clips checked a streak at a time (``Job.streak_replicas``, as the dispatcher hands them) are replicas
    exactly where checked one at a time (``Job.replica``, as with a filter on): the same parameter, rule, action,
    micro-batch mark and group another rank clipped at that step, as often."""
    from gradguard.audit.jobs import Job
    from gradguard.audit.reader import Record
    from gradguard.events.definitions import Intervention

    def clip(rank: int, step: int, param: str, micro: bool = False, params: list[str] | None = None) -> Intervention:
        return Intervention(
            run=f"r{rank}", rank=rank, step=step, rule="clip", action="clip_norm", param=param, params=params,
            before=2.0, after=1.0, micro_batch=micro,
        )  # fmt: skip

    rank0 = [clip(0, 1, "a"), clip(0, 1, "b"), clip(0, 1, "a", micro=True), clip(0, 1, "a", micro=True)]
    rank0 += [clip(0, 1, "c", params=["c", "d"]), clip(0, 2, "a")]
    rank1 = [clip(1, 1, "b"), clip(1, 1, "a", micro=True), clip(1, 1, "a", micro=True), clip(1, 1, "a", micro=True)]
    rank1 += [clip(1, 1, "c"), clip(1, 1, "c", params=["c", "d"]), clip(1, 2, "a"), clip(1, 2, "b"), clip(1, 2, "a")]
    expected = [True, True, True, False, False, True, True, False, False]
    one_by_one, streak = Job(1), Job(1)
    for job in (one_by_one, streak):
        job.join(0, "r0")
        job.join(1, "r1")
        assert [job.replica(event, 0) for event in rank0] == [False] * len(rank0)
    assert [one_by_one.replica(event, 1) for event in rank1] == expected
    parts = streak.streak_replicas([Record(event.step, 1, line, event) for line, event in enumerate(rank1)], 1)
    assert parts == [(3, True), (5, False), (7, True), (9, False)]
    starts = [0, *[end for end, _ in parts[:-1]]]
    marks = [replica for (end, replica), start in zip(parts, starts, strict=True) for _ in range(start, end)]
    assert marks == expected
