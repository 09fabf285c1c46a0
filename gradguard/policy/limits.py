"""Caps that a hostile or broken policy cannot blow through, checked before the policy is validated.

Policies come from files copied between projects and, with hot reload, from files edited during a
run. Each cap is generous (real policies stay far below it) and each refusal is a
[`PolicyError`][gradguard.PolicyError] naming the file, the line where known, what was given and the limit.
The walks here are iterative (no recursion, however deep the data) and linear in the data's size
(YAML aliases and shared Python objects are counted as often as they are referenced, without
walking them again).

Nesting is capped before any parser can recurse into it: ``check_nesting`` scans the raw text of a
JSON or TOML file for brackets (outside strings and comments, a linear scan with no parser behind it)
and refuses the file where they open more than ``MAX_DEPTH`` deep, so ``json.loads`` and ``tomllib``
(both recursive, one frame or more per level) never see it; YAML's scanner and parser are state
machines, and the composer that recurses is capped by the loader itself
(``gradguard.policy.loading``), after ``check_yaml_events`` has walked the parser's events.
"""

from __future__ import annotations

import re
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
    "TOO_DEEP",
    "check_counts",
    "check_data_shape",
    "check_nesting",
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


TOO_DEEP = (
    f"mappings and lists are nested more than {MAX_DEPTH} levels deep here; the limit is {MAX_DEPTH} (a policy needs 5)"
)
"""The refusal of nesting past ``MAX_DEPTH``, wherever it is found (raw text, parser events, composer)."""

# What a bracket scan stops at, outside strings and inside each kind of string (a backslash escapes
# the next character in JSON strings and TOML basic strings). Each pattern matches one fixed token, so
# the scan is linear: ``re.search`` jumps to the next one, and no pattern can backtrack.
_JSON_OUTSIDE = re.compile(r'["\[\]{}]')
_JSON_STRING = re.compile(r'["\\]')
_TOML_OUTSIDE = re.compile(r'"""|\'\'\'|["\'#\[\]{}.=,]')
_TOML_ENDS = {
    '"': re.compile(r'["\\\n]'),  # a basic string ends at its quote, or (unterminated) at the line's end
    "'": re.compile(r"['\n]"),
    '"""': re.compile(r'"""|\\'),
    "'''": re.compile(r"'''"),
}


def check_nesting(text: str, fmt: str, source: str) -> None:
    """Refuse a JSON or TOML text whose brackets open more than ``MAX_DEPTH`` levels deep, before it is parsed.

    ``json.loads`` and ``tomllib`` recurse once or more per level of nesting, so a file of a few
    thousand ``[`` would end in a ``RecursionError`` inside them (or, where the recursion limit is
    raised, overflow the C stack). This scan reads the raw text once, without recursion: it skips
    strings (with their escapes) and TOML comments, counts ``[``/``{`` up and ``]``/``}`` down, and
    stops at the first bracket past the cap, naming its line. TOML's table headers (``[a]``,
    ``[[rules]]``) open and close on their line and count 1 or 2 at most; a TOML document is itself a
    table, so its values may nest one level less than a JSON document's. TOML also nests tables
    without brackets, by dotted keys (``a.b.c = 1``, ``[a.b.c]``), and ``tomllib`` takes time and
    memory that grow as the square of a key's parts (50,000 parts in 100 KB exhaust gigabytes): the
    dots since the last ``=``, ``,`` or bracket are counted too (a value adds one at most, a float's
    or a time's), and a key of more parts than the cap is refused the same way. Unbalanced or misplaced
    brackets are left to the parser, which reports them. YAML is capped in the loader's composer
    (the only recursive part of PyYAML), so this scan does nothing for it.
    """
    if fmt == "json":
        limit, outside, ends = MAX_DEPTH, _JSON_OUTSIDE, {'"': _JSON_STRING}
    elif fmt == "toml":
        limit, outside, ends = MAX_DEPTH - 1, _TOML_OUTSIDE, _TOML_ENDS
    else:
        return
    depth = 0
    dots = 0  # TOML: dots since the last '=', ',' or bracket: the parts of a dotted key, less one
    at = 0
    size = len(text)
    while at < size:
        found = outside.search(text, at)
        if found is None:
            return
        token = found.group()
        at = found.end()
        if token in "[{":
            depth += 1
            dots = 0
            if depth > limit:
                raise _refuse(source, text.count("\n", 0, found.start()) + 1, "", TOO_DEEP)
        elif token in "]}":
            depth = max(depth - 1, 0)
            dots = 0
        elif token == ".":
            dots += 1
            if dots >= limit:
                raise _refuse(source, text.count("\n", 0, found.start()) + 1, "", TOO_DEEP)
        elif token in "=,":
            dots = 0
        elif token == "#":  # a TOML comment, to the end of the line
            newline = text.find("\n", at)
            at = size if newline < 0 else newline + 1
        else:  # a string: skip to its end
            end = ends[token]
            while True:
                closing = end.search(text, at)
                if closing is None:
                    return  # unterminated: the parser reports it
                at = closing.end()
                if closing.group() == "\\":
                    at += 1  # the escaped character, whatever it is
                    continue
                break


def check_yaml_events(text: str, loader: Any, source: str) -> None:
    """Walk the YAML parser's events (a state machine, not recursive): refuse deep nesting, recursive
    aliases and alias expansion beyond ``MAX_NODES`` before anything is composed or constructed.

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
                    raise _refuse(source, line, "", TOO_DEEP)
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
    except PolicyError:
        raise
    except Exception:  # a syntax error (or libyaml refusing text PyYAML reads): the real parse reports it
        return


def check_data_shape(data: Any, source: str) -> None:
    """Refuse data nested deeper than ``MAX_DEPTH``, larger than ``MAX_NODES`` (shared objects
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
    """Refuse more than ``MAX_RULES`` rules or ``MAX_PATTERNS`` patterns."""
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
