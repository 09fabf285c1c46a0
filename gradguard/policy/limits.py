"""Caps that a hostile or broken policy cannot blow through, checked before the policy is validated.

Policies come from files copied between projects and, with hot reload, from files edited during a
run. Each cap is generous (real policies stay far below it) and each refusal is a
:class:`~gradguard.PolicyError` naming the file, the line where known, what was given and the limit.
The walks here are iterative (no recursion, however deep the data) and linear in the data's size
(YAML aliases and shared Python objects are counted as often as they are referenced, without
walking them again).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import yaml

from gradguard.errors import PolicyError, PolicyIssue

__all__ = [
    "MAX_DEPTH",
    "MAX_FILE_BYTES",
    "MAX_INT_BITS",
    "MAX_NODES",
    "MAX_PATTERNS",
    "MAX_RULES",
    "check_counts",
    "check_data_shape",
    "check_yaml_events",
]

MAX_FILE_BYTES = 1024 * 1024
"""Size of a policy file (1 MiB). The shipped policies have under 2 KB."""
MAX_DEPTH = 32
"""Nesting of mappings and lists. A policy needs 5 (policy, rules, rule, actions, action)."""
MAX_NODES = 20_000
"""Mappings, lists, keys and values in a policy, counted after YAML aliases are expanded."""
MAX_RULES = 1000
"""Rules in a policy."""
MAX_PATTERNS = 10_000
"""Patterns in a policy, ``match`` and ``exclude`` of every rule together."""
MAX_INT_BITS = 63
"""Whole numbers of a policy stay below ``2**63`` in magnitude."""


def _refuse(source: str, line: int | None, path: str, message: str) -> PolicyError:
    return PolicyError([PolicyIssue(source, line, path, message)])


def check_yaml_events(text: str, loader: Any, source: str) -> None:
    """Walk the YAML parser's events (a state machine, not recursive): refuse deep nesting, recursive
    aliases and alias expansion beyond :data:`MAX_NODES` before anything is composed or constructed.

    Syntax errors are left to the real parse, which reports them.
    """
    # Each open collection: [nodes so far, anchor]; sizes of finished anchors, by name.
    open_nodes: list[list[Any]] = [[0, None]]
    anchored: dict[str, int] = {}
    open_anchors: set[str] = set()
    try:
        for event in yaml.parse(text, Loader=loader):
            line = event.start_mark.line + 1 if event.start_mark is not None else None
            if isinstance(event, yaml.CollectionStartEvent):
                if len(open_nodes) > MAX_DEPTH:
                    raise _refuse(
                        source,
                        line,
                        "",
                        f"mappings and lists are nested more than {MAX_DEPTH} levels deep here; the limit is "
                        f"{MAX_DEPTH} (a policy needs 5)",
                    )
                anchor = event.anchor
                if anchor is not None:
                    open_anchors.add(anchor)
                open_nodes.append([1, anchor])
                continue
            if isinstance(event, yaml.CollectionEndEvent):
                size, anchor = open_nodes.pop()
                if anchor is not None:
                    anchored[anchor] = size
                    open_anchors.discard(anchor)
            elif isinstance(event, yaml.AliasEvent):
                if event.anchor in open_anchors:
                    raise _refuse(
                        source,
                        line,
                        "",
                        f"alias *{event.anchor} refers to the collection it is part of (a recursive structure); "
                        "a policy is a tree: write the value out",
                    )
                size = anchored.get(str(event.anchor), 1)
            elif isinstance(event, yaml.ScalarEvent):
                size = 1
                if event.anchor is not None:
                    anchored[event.anchor] = 1
            else:
                continue
            open_nodes[-1][0] += size
            if open_nodes[-1][0] > MAX_NODES:
                raise _refuse(
                    source,
                    line,
                    "",
                    f"the document grows past {MAX_NODES} mappings, lists, keys and values here (YAML aliases "
                    f"counted as often as they are used); the limit is {MAX_NODES}",
                )
    except yaml.YAMLError:
        return


def check_data_shape(data: Any, source: str) -> None:
    """Refuse data nested deeper than :data:`MAX_DEPTH`, larger than :data:`MAX_NODES` (shared objects
    counted at each use) or holding itself (a cycle)."""
    done: dict[int, int] = {}  # id -> nodes of a finished container, itself included
    active: set[int] = set()  # containers entered and not finished: the ones above the current one
    work: list[tuple[Any, bool]] = [(data, False)]
    alive: list[Any] = []  # holds every container walked, so that no id is reused during the walk
    while work:
        item, finished = work.pop()
        key = id(item)
        if finished:
            active.discard(key)
            nodes = 1 + sum(done.get(id(child), 1) if _is_container(child) else 1 for child in _children(item))
            done[key] = nodes
            if nodes > MAX_NODES:
                raise _refuse(
                    source,
                    None,
                    "",
                    f"the policy holds {nodes} mappings, lists, keys and values (shared objects counted at each "
                    f"use); the limit is {MAX_NODES}",
                )
            continue
        if key in done:
            continue
        if key in active:
            raise _refuse(source, None, "", "the policy contains itself (a cyclic reference); a policy is a tree")
        if len(item) > MAX_NODES:
            raise _refuse(
                source, None, "", f"a collection of the policy has {len(item)} items; the limit is {MAX_NODES}"
            )
        for child in _children(item):
            if isinstance(child, int) and child.bit_length() > MAX_INT_BITS:
                # pydantic would try to print it, and Python refuses to turn > 4300 digits into text
                digits = "over 4300" if child.bit_length() > 14_000 else str(len(str(abs(child))))
                raise _refuse(
                    source,
                    None,
                    "",
                    f"a whole number of the policy has {digits} digits; the limit is 2**{MAX_INT_BITS} "
                    "(no step number or threshold needs more)",
                )
        alive.append(item)
        active.add(key)
        work.append((item, True))
        if len(active) > MAX_DEPTH:  # the active containers are the ones above this one
            raise _refuse(
                source,
                None,
                "",
                f"mappings and lists are nested more than {MAX_DEPTH} levels deep; the limit is {MAX_DEPTH} "
                "(a policy needs 5)",
            )
        work.extend((child, False) for child in _children(item) if _is_container(child) and id(child) not in done)


def check_counts(data: Mapping[str, Any], source: str, locate: Any) -> None:
    """Refuse more than :data:`MAX_RULES` rules or :data:`MAX_PATTERNS` patterns."""
    rules = data.get("rules")
    if not isinstance(rules, list | tuple):
        return
    if len(rules) > MAX_RULES:
        raise _refuse(
            source,
            locate(("rules",)) if locate else None,
            "rules",
            f"got {len(rules)} rules; the limit is {MAX_RULES}. Merge rules that share actions (a rule takes a "
            "list of patterns)",
        )
    total = 0
    for index, rule in enumerate(rules):
        if not isinstance(rule, Mapping):
            continue
        for field in ("match", "exclude"):
            value = rule.get(field)
            total += 1 if isinstance(value, str) else len(value) if isinstance(value, list | tuple) else 0
            if total > MAX_PATTERNS:
                raise _refuse(
                    source,
                    locate(("rules", index, field)) if locate else None,
                    f"rules[{index}].{field}",
                    f"the policy has more than {MAX_PATTERNS} patterns (match and exclude of all rules) by here; "
                    f"the limit is {MAX_PATTERNS}. Use globs or regexes that cover several names",
                )


def _is_container(value: Any) -> bool:
    return isinstance(value, Mapping) or (isinstance(value, Sequence | set | frozenset) and not _is_text(value))


def _is_text(value: Any) -> bool:
    return isinstance(value, str | bytes | bytearray | memoryview)


def _children(value: Any) -> Iterator[Any]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield key
            yield item
    else:
        yield from value
