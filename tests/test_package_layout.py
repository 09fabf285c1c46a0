"""The package's rooms: no import cycle, and each room imports only the rooms beneath it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gradguard"

# Which rooms each room may import (besides itself and the top-level errors module).
ALLOWED = {
    "policy": set(),
    "events": set(),
    "enforce": {"policy", "events"},
    # the pattern language (policy.patterns) and the event definitions (events.definitions: msgspec only, no
    # structlog, no torch), which the writer's tests, the audit and tuning share; no torch
    "audit": {"policy", "events"},
    "lifecycle": {"policy", "events", "enforce"},
    "guard": {"policy", "events", "enforce", "lifecycle"},
    # learns and replays policies on recorded norms (read into events.definitions' typed events), with enforce's maths
    "tuning": {"policy", "events", "enforce", "audit"},
    "cli": {"policy", "events", "enforce", "audit", "guard", "lifecycle", "tuning"},
    "integrations": {"guard", "enforce"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, type_checking: bool = False) -> set[str]:
    """gradguard modules imported when ``path`` is imported (module level; under TYPE_CHECKING too if asked)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) and not type_checking:
            continue
        for child in ast.walk(node) if not isinstance(node, ast.FunctionDef | ast.ClassDef) else ():
            if isinstance(child, ast.ImportFrom) and child.module and child.module.startswith("gradguard"):
                found.add(child.module)
            elif isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names if alias.name.startswith("gradguard"))
    return found


def _every_import(source: str) -> set[str]:
    """gradguard modules a module's source names anywhere: module level, TYPE_CHECKING, inside functions and classes.

    ``from gradguard.events import definitions`` names both ``gradguard.events`` and ``gradguard.events.definitions``
    (the graph keeps whichever is a module), so a submodule imported by its package's name is seen too.
    """
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gradguard"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("gradguard"))
    return found


def _graph(type_checking: bool = False, everywhere: bool = False) -> dict[str, set[str]]:
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        named = _every_import(path.read_text(encoding="utf-8")) if everywhere else _imports(path, type_checking)
        for target in named:
            if everywhere and target not in modules:
                continue  # a name imported from a module (``from gradguard.x import y``), not a submodule
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "gradguard"


def _cycle(graph: dict[str, set[str]]) -> None:
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_no_module_of_the_package_imports_itself_back_through_others():
    """The module-level import graph of gradguard has no cycle."""
    _cycle(_graph())


def test_no_module_knows_a_module_above_it_even_for_a_type():
    """Counting the imports under TYPE_CHECKING too, there is no cycle: a lower room that needs a type of a room
    above it declares a Protocol of what it uses instead."""
    _cycle(_graph(type_checking=True))


def test_no_module_imports_itself_back_even_through_a_function_local_import() -> None:
    """Every import of the package counted, at any level (inside a function, under TYPE_CHECKING, a submodule named
    through its package), the module graph has no cycle: a lazy import that closes a circle still ties the two
    modules into one, and whichever is imported first sees the other half-initialised."""
    _cycle(_graph(everywhere=True))


def test_the_cycle_check_sees_an_import_inside_a_function() -> None:
    """The check above can fail: a function-local import that closes a circle is found and named."""
    seen = _every_import("def f():\n    from gradguard.cli.explain import action_text\n")
    assert seen == {"gradguard.cli.explain", "gradguard.cli.explain.action_text"}
    graph = {"gradguard.cli.explain": {"gradguard.cli.explain_policy"}, "gradguard.cli.explain_policy": set()}
    graph["gradguard.cli.explain_policy"] = {name for name in seen if name in graph}
    named = re.escape("gradguard.cli.explain -> gradguard.cli.explain_policy -> gradguard.cli.explain")
    with pytest.raises(AssertionError, match=named):
        _cycle(graph)


def test_each_room_imports_only_the_rooms_it_may():
    """policy and events stand alone, audit shares only the pattern language and the event definitions; enforce
    builds on policy and events."""
    wrong = []
    for module, targets in _graph().items():
        room = _room(module)
        if room not in ALLOWED:
            continue
        for target in targets:
            other = _room(target)
            if other not in (room, "errors", "gradguard") and other not in ALLOWED[room]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_source_file_is_longer_than_about_500_lines():
    """A room is split before any one file grows past about 500 lines."""
    lengths = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert not {name: n for name, n in lengths.items() if n > 520}


def test_no_class_is_longer_than_about_300_lines():
    """A class that grows past about 300 lines is split into collaborators."""
    long = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and (size := node.end_lineno - node.lineno + 1) > 320:
                long[f"{path.relative_to(PACKAGE)}:{node.name}"] = size
    assert not long


def _enforce_rooms() -> dict[str, set[str]]:
    """Each room of ``gradguard.enforce`` and the rooms its docstring's ``May import:`` line names."""
    rooms = {}
    for init in sorted((PACKAGE / "enforce").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        lines = [line for line in doc.splitlines() if line.startswith("May import:")]
        assert len(lines) == 1, f"{init.parent.name}'s docstring needs one 'May import:' line"
        named = lines[0].removeprefix("May import:").strip().rstrip(".")
        rooms[init.parent.name] = set() if named == "nothing of enforce" else {r.strip() for r in named.split(",")}
    return rooms


def test_each_room_of_enforce_imports_only_the_rooms_its_docstring_names():
    """enforce/ is in rooms (the step, hooks into torch, recovery, provenance, triggers, distributed, and the work,
    actions and plans they share); a room imports only what its docstring says it may, even for a type."""
    rooms = _enforce_rooms()
    assert {"distributed", "work", "actions", "plans", "triggers", "recovery", "provenance", "hooks", "step"} <= set(
        rooms
    )
    loose = [path.name for path in (PACKAGE / "enforce").glob("*.py") if path.name != "__init__.py"]
    assert not loose, f"every module of enforce/ lives in a room: {loose}"
    wrong = []
    for module, targets in _graph(type_checking=True).items():
        parts = module.split(".")
        if parts[:2] != ["gradguard", "enforce"] or len(parts) < 3:
            continue
        for target in targets:
            other = target.split(".")
            inside = other[:2] == ["gradguard", "enforce"] and len(other) > 2 and other[2] != parts[2]
            if inside and other[2] not in rooms[parts[2]]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_rooms_of_enforce_stand_in_layers():
    """What each room may import forms no circle: a room never needs a room above it."""
    _cycle({room: set(allowed) for room, allowed in _enforce_rooms().items()})


def test_no_module_of_enforce_is_longer_than_400_lines():
    """The step's modules stay short enough to read in one sitting."""
    long = {}
    for path in (PACKAGE / "enforce").rglob("*.py"):
        if (n := len(path.read_text().splitlines())) > 400:
            long[str(path.relative_to(PACKAGE))] = n
    assert not long, long
