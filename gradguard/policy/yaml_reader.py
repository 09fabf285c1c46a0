"""The YAML side of reading a policy: a safe loader that refuses duplicate keys, deep nesting and values
Python cannot build, each at its line, and the locator that maps a field path to the line it came from.

PyYAML's scanner and parser are state machines with explicit stacks; only its composer recurses. The
loader's composer counts the collections it has open and refuses the next one past ``MAX_DEPTH`` at its
line, before composing it (``TooDeep``). Every constructor is wrapped so that an exception that is not a
YAML error (``!!bool maybe`` is a ``KeyError`` inside PyYAML) becomes one at the node's line
(``CannotBuild``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from types import GeneratorType
from typing import Any

import yaml

from gradguard.policy.limits import MAX_DEPTH, TOO_DEEP

__all__ = [
    "CannotBuild",
    "Locator",
    "PolicyYamlLoader",
    "TooDeep",
    "shown",
    "syntax_error_in_words",
    "type_name",
    "yaml_locator",
]

Locator = Callable[[Sequence[int | str]], int | None]
"""Maps a field path (``("rules", 0, "match")``) to the 1-based line it came from, where known."""


class TooDeep(yaml.YAMLError):
    """The composer met a collection nested past ``MAX_DEPTH``; ``line`` is where it opens."""

    def __init__(self, line: int | None) -> None:
        super().__init__(TOO_DEEP)
        self.line = line


class PolicyYamlLoader(yaml.SafeLoader):
    """A safe loader that rejects duplicate keys instead of silently keeping the last one, and nesting
    past ``MAX_DEPTH`` before composing it.

    PyYAML's composer is the one recursive part of the loader (``compose_node`` ->
    ``compose_sequence_node`` -> ``compose_node`` ...: two frames a level). ``compose_node`` looks at
    the next event before composing it and refuses a collection that would open one level past the
    cap, so the composer never goes deeper than the cap whatever follows in the text (the event walk
    of ``check_yaml_events`` runs on libyaml where it is built, which stops at its own limit of 1000
    flow levels with a syntax error: it cannot be the only guard).
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._open_collections = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        if not self.check_event(yaml.CollectionStartEvent):
            return super().compose_node(parent, index)
        if self._open_collections >= MAX_DEPTH:
            mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]  # untyped in the stubs
            raise TooDeep(mark.line + 1 if mark is not None else None)
        self._open_collections += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._open_collections -= 1


def _construct_unique_mapping(loader: PolicyYamlLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    if not isinstance(node, yaml.MappingNode):  # `!!map [1]`: PyYAML would unpack the node's value blindly
        raise yaml.constructor.ConstructorError(
            None, None, f"expected a mapping node, but found {getattr(node, 'id', 'node')}", node.start_mark
        )
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"a key must be a plain value, not a {type_name(key)}", key_node.start_mark
            ) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {shown(key)} (first on line {seen[key]}); each key may appear once per mapping",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


PolicyYamlLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_unique_mapping,
)


def _construct_timestamp(loader: PolicyYamlLoader, node: yaml.ScalarNode) -> Any:
    """PyYAML's timestamp, refused with a line number where it is not one (``!!timestamp 2001-13-45x``).

    PyYAML itself assumes an explicit ``!!timestamp`` tag holds a timestamp and fails with an
    ``AttributeError`` when it does not.
    """
    value = loader.construct_scalar(node)
    if not isinstance(value, str) or loader.timestamp_regexp.match(value) is None:
        raise yaml.constructor.ConstructorError(
            None, None, f"{shown(value)} is tagged !!timestamp but is not a date or time", node.start_mark
        )
    return loader.construct_yaml_timestamp(node)


PolicyYamlLoader.add_constructor("tag:yaml.org,2002:timestamp", _construct_timestamp)


def _tag_name(tag: str | None) -> str:
    """``!!bool`` for ``tag:yaml.org,2002:bool``; other tags as written."""
    prefix = "tag:yaml.org,2002:"
    return f"!!{tag[len(prefix) :]}" if tag and tag.startswith(prefix) else str(tag)


class CannotBuild(yaml.constructor.ConstructorError):
    """A constructor's own failure at its node: not a syntax error, a value its tag cannot hold."""


def _cannot_build(node: yaml.Node, exc: Exception) -> CannotBuild:
    """A constructor's own failure (``KeyError`` of ``!!bool maybe``, ``ValueError`` of ``2001-13-45``) at its node."""
    what = shown(node.value) if isinstance(node, yaml.ScalarNode) else f"this {getattr(node, 'id', 'node')}"
    tag = _tag_name(node.tag)
    if isinstance(exc, ValueError):
        reason = f": {exc}"
    elif tag == "!!bool":
        reason = " (a YAML bool is true or false; yes, no, on and off also read as one)"
    else:  # KeyError, IndexError, TypeError: what the value is matters, not where PyYAML tripped on it
        reason = ""
    return CannotBuild(None, None, f"cannot read {what} as {tag}{reason}", node.start_mark)


def _guarded(construct: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``construct``, with every exception that is not a YAML error turned into one at the node's line.

    PyYAML's safe constructors trust what a tag says: ``!!bool maybe`` ends in ``KeyError``,
    ``!!int 1:x`` in ``ValueError``. Constructors of collections are generators that PyYAML finishes
    later, outside the call: their failures are caught when they run.
    """

    def guarded_generator(generator: Iterator[Any], node: yaml.Node) -> Iterator[Any]:
        try:
            yield from generator
        except (yaml.YAMLError, RecursionError, MemoryError):
            raise
        except Exception as exc:
            raise _cannot_build(node, exc) from None

    def construct_guarded(loader: Any, node: Any) -> Any:
        try:
            built = construct(loader, node)
        except (yaml.YAMLError, RecursionError, MemoryError):
            raise
        except Exception as exc:
            raise _cannot_build(node, exc) from None
        return guarded_generator(built, node) if isinstance(built, GeneratorType) else built

    return construct_guarded


for _tag, _construct in list(PolicyYamlLoader.yaml_constructors.items()):
    PolicyYamlLoader.add_constructor(_tag, _guarded(_construct))
del _tag, _construct


def yaml_locator(root: yaml.Node | None) -> Locator:
    def locate(path: Sequence[int | str]) -> int | None:
        node = root
        if node is None:
            return None
        line: int = node.start_mark.line + 1
        for part in path:
            child: yaml.Node | None = None
            if isinstance(node, yaml.MappingNode):
                for key_node, value_node in node.value:
                    if key_node.value == part:
                        # An unknown key is best pointed at by the key itself.
                        line = key_node.start_mark.line + 1
                        child = value_node
                        break
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
                child = node.value[part]
            if child is None:
                break
            node = child
            line = node.start_mark.line + 1
        return line

    return locate


# --- turning pydantic errors into issues ---------------------------------------------------------


def shown(value: Any, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters; a value from a hostile file may be huge or unprintable."""
    try:
        text = repr(value)
    except ValueError:  # an int with more digits than Python turns into text (4300 by default)
        if isinstance(value, int):
            return f"an integer of {len(format(value, 'x'))} hex digits"
        return f"a {type_name(value)}"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def type_name(value: Any) -> str:
    return {dict: "mapping", list: "list", str: "string", type(None): "null"}.get(type(value), type(value).__name__)


_CLOSERS = {"flow sequence": ("[", "]"), "flow mapping": ("{", "}")}
_FOUND = {
    "<block mapping start>": "a key",
    "<block sequence start>": "a list item ('- ')",
    "<block end>": "the end of the block",
    "<scalar>": "a value",
    "-": "a list item ('- ')",
    "<stream end>": "the end of the file",
}


def syntax_error_in_words(exc: yaml.MarkedYAMLError) -> tuple[int | None, str]:
    """``(the 1-based line to point at, what is wrong and how to fix it)`` for a YAML syntax error.

    PyYAML names the place where it gave up (a missing ``]`` is found only on the next line) and says it in
    parser terms (``expected <block end>, but found '<block mapping start>'``). The two common slips are
    pointed at where they were made: an unclosed bracket at the bracket, a bad indent at the line, with the
    indentation the enclosing block has.
    """
    problem, context = exc.problem or "", exc.context or ""
    at, opened = exc.problem_mark, exc.context_mark
    where = f"line {at.line + 1}, column {at.column + 1}" if at is not None else "the end of the file"
    kind = context.removeprefix("while parsing a ")
    if kind in _CLOSERS and opened is not None and problem.startswith("expected ','"):
        opener, closer = _CLOSERS[kind]
        got = problem.partition("but got ")[2].strip("'")
        found = _FOUND.get(got, repr(got) if got else "more text")
        if at is not None and at.line == opened.line:
            fix = f"put a ',' between its items, or close it with '{closer}' where it ends"
        else:
            fix = f"close it with '{closer}' after its last item, before {where}"
        return opened.line + 1, (
            f"YAML syntax error: the '{opener}' opened at line {opened.line + 1}, column {opened.column + 1} is not "
            f"closed ({where} goes on with {found}); {fix}"
        )
    if problem.startswith("expected <block end>") and opened is not None and at is not None:
        found = problem.partition("but found ")[2].strip("'")
        return at.line + 1, (
            f"YAML syntax error: bad indentation at {where}: {_FOUND.get(found, found)} indented "
            f"{at.column} spaces, where the block it follows (from line {opened.line + 1}) is indented "
            f"{opened.column}; indent it by {opened.column} spaces to go on with that block, or under the key it "
            "belongs to (YAML nests by indentation alone)"
        )
    line = at.line + 1 if at is not None else (opened.line + 1 if opened is not None else None)
    return line, "YAML syntax error: " + " ".join(part for part in (context, problem) if part)
