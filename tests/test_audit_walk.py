"""``benchmarks/audit_walk.py``: a log's lines go through ``gradguard audit`` one way, command -> reader -> one
dispatcher -> the collectors side by side -> the report; nothing calls back up to an earlier stage, and no collector
calls another."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

WALK = Path(__file__).resolve().parents[1] / "benchmarks" / "audit_walk.py"


def load_walk() -> ModuleType:
    spec = importlib.util.spec_from_file_location("audit_walk", WALK)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["audit_walk"] = module
    spec.loader.exec_module(module)
    return module


def test_a_logs_lines_go_through_the_audit_one_way_and_every_collector_hears_from_the_dispatcher_only(
    tmp_path: Path,
) -> None:
    walk_module = load_walk()
    walk = walk_module.walk_of_an_audit(walk_module.write_log(tmp_path))
    assert walk.stages == ["command", "reader", "dispatcher", "collectors", "report"]
    assert walk.back_up == []
    assert walk.across == []
    readers = {callee for (caller, callee) in walk.calls if caller != "command" and callee.startswith("collectors:")}
    assert {caller for (caller, callee) in walk.calls if callee in readers and caller != "command"} == {"dispatcher"}
    assert len(readers) >= 8  # every collector with lines to read heard of them, from the one dispatcher
    assert not [caller for (caller, callee) in walk.calls if callee == "dispatcher" and caller != "command"]
