"""Policy patterns: globs and ``re:`` regexes, each matched in time linear in the parameter name.

A pattern comes from a file that may have been copied from anywhere, and is matched against every
parameter name of the model when the guard attaches. Python's ``re`` backtracks: ``re:(a+)+$``
takes seconds on a 30-character name and doubles with each further character. So:

- ``re:`` patterns are compiled by RE2 (``google-re2``), an automaton engine whose matching time is
  linear in the name and in the size of the compiled pattern, never exponential. RE2 refuses the
  constructs that would need backtracking (backreferences, lookarounds); the refusal says why and
  what to write instead. The compiled program is capped at ``MAX_REGEX_PROGRAM_SIZE`` instructions, so
  one pattern costs a bounded time per character of a name.
- globs are translated by ``fnmatch.translate``, whose ``*`` segments are atomic (CPython >= 3.9),
  so a glob matches in ``O(len(name) * len(pattern))`` with Python's ``re``; pattern length is capped.

Nothing here imports torch.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Callable
from typing import Any, NoReturn, Protocol

__all__ = [
    "MAX_PATTERN_LENGTH",
    "MAX_REGEX_PROGRAM_SIZE",
    "REGEX_PREFIX",
    "check_pattern",
    "pattern_matcher",
    "rule_matches",
]

REGEX_PREFIX = "re:"

MAX_PATTERN_LENGTH = 1000
"""Characters in one pattern, ``re:`` prefix included. Real patterns have a few dozen."""

MAX_REGEX_PROGRAM_SIZE = 2000
"""Instructions of one compiled RE2 program (RE2's ``ProgramSize``). Real patterns compile to under 200
(``(.*a){20}`` to 184); counted repetitions multiply (``(.?){1000}`` is about 9,000). Matching costs
at most about one microsecond per instruction and character, so this bounds one pattern's cost per
100-character name to about 2 ms (measured: under 8 ms for a program of 10,000)."""

_SUGGESTION = (
    "a 're:' pattern is an RE2 regular expression (matched in linear time: no backreferences, lookarounds "
    "or possessive quantifiers) that must match the whole dotted name; or use a glob such as 'blocks.*.attn.*'"
)

_REASONS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(problem), reason)
    for problem, reason in (
        (
            r"invalid perl operator: \(\?<?[=!]",
            "lookarounds ((?=...), (?!...), (?<=...), (?<!...)) are not supported: they need a backtracking "
            "matcher; to leave names out, put a pattern for them under 'exclude'",
        ),
        (
            r"invalid escape sequence: \\[1-9]|invalid perl operator: \(\?P=",
            "backreferences (\\1, (?P=name)) are not supported: they need a backtracking matcher",
        ),
        (
            r"invalid perl operator: \(\?>|bad repetition operator: [*+?}]\+",
            "atomic groups and possessive quantifiers are not needed (RE2 never backtracks): "
            "drop the '?>' or the trailing '+'",
        ),
        (
            r"invalid escape sequence: \\Z",
            "'\\Z' is written '\\z' in RE2 (or left out: the pattern matches the whole name)",
        ),
        (
            r"invalid perl operator: \(\?\(",
            "conditional groups ((?(1)...)) are not supported",
        ),
        (
            r"invalid perl operator: \(\?[#xauL]",
            "only the flags i, m, s and U are supported; verbose mode (?x), comments (?#...) and the "
            "flags a, u, L are not",
        ),
        (r"invalid escape sequence: \\[uUN]", "write a character by its code point as \\x{HHHH}"),
        (
            r"invalid repetition size",
            "a counted repetition {m,n} goes up to 1000, and nested counts multiply up to 1000",
        ),
        (
            r"pattern too large",
            "the pattern compiles to more than RE2's memory budget; write it with fewer or smaller counted repetitions",
        ),
    )
)

_EMPTY_LOWER_BOUND = re.compile(r"(?<!\\)(?:\\\\)*\{,\d+\}")
"""``{,n}``: a repetition in Python's ``re``, literal text in RE2. Refused rather than silently changed."""


def check_pattern(pattern: str) -> str:
    """Return ``pattern`` if it is a valid policy pattern; else raise ``ValueError`` saying why and what to write."""
    if not pattern:
        raise ValueError("a pattern must not be empty; use '*' to match every parameter")
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise ValueError(
            f"pattern {_shorten(pattern)} has {len(pattern)} characters; the limit is {MAX_PATTERN_LENGTH}. "
            "Write a shorter glob or regex (one pattern per group of names)"
        )
    if pattern.startswith(REGEX_PREFIX):
        _compile_regex(pattern)
    return pattern


@functools.lru_cache(maxsize=4096)
def pattern_matcher(pattern: str) -> Callable[[str], bool]:
    """A predicate for one policy pattern: a glob on dotted names, or ``re:<regex>`` (full match, RE2)."""
    if pattern.startswith(REGEX_PREFIX):
        regex = _compile_regex(pattern)
        return lambda name: regex.fullmatch(name) is not None
    glob = re.compile(fnmatch.translate(pattern))
    return lambda name: glob.match(name) is not None


def _matches_any(patterns: tuple[str, ...], name: str) -> bool:
    return any(pattern_matcher(pattern)(name) for pattern in patterns)


class Patterned(Protocol):
    """What matching needs of a rule: its patterns (the schema's ``Rule`` has them; this room knows no rule)."""

    @property
    def match(self) -> tuple[str, ...]: ...

    @property
    def exclude(self) -> tuple[str, ...]: ...


def rule_matches(rule: Patterned, names: tuple[str, ...]) -> bool:
    """A tensor is covered by a rule if any of its names is matched and not excluded."""
    return any(_matches_any(rule.match, name) and not _matches_any(rule.exclude, name) for name in names)


def _compile_regex(pattern: str) -> Any:
    """Compile the body of a ``re:`` pattern with RE2; ``ValueError`` with the reason if RE2 or a limit refuses it."""
    import re2  # lazily: a policy without 're:' patterns never loads the extension

    body = pattern[len(REGEX_PREFIX) :]
    if _EMPTY_LOWER_BOUND.search(body):
        _refuse(body, pattern, "'{,n}' is literal text in RE2, not a repetition: write '{0,n}'")
    options = re2.Options()
    options.log_errors = False  # RE2 would print its own message to stderr
    options.never_capture = True  # groups only group: matching needs no captures
    try:
        regex = re2.compile(body, options)
    except re2.error as exc:
        detail = exc.args[0] if exc.args else ""
        message = detail.decode("utf-8", "replace") if isinstance(detail, bytes) else str(detail)
        reason = next((why for problem, why in _REASONS if problem.search(message)), None)
        _refuse(body, pattern, message if reason is None else f"{reason} (RE2: {message})")
    size = int(regex.programsize)
    if size > MAX_REGEX_PROGRAM_SIZE:
        _refuse(
            body,
            pattern,
            f"it compiles to {size} RE2 instructions; the limit is {MAX_REGEX_PROGRAM_SIZE} "
            "(counted repetitions such as {1000} multiply the pattern's size)",
        )
    return regex


def _refuse(body: str, pattern: str, why: str) -> NoReturn:
    raise ValueError(
        f"invalid regular expression {_shorten(body)} in pattern {_shorten(pattern)}: {why}; {_SUGGESTION}"
    )


def _shorten(text: str, limit: int = 80) -> str:
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"
