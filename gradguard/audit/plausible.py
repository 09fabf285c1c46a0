"""Lines that decode but that no gradguard writer could have written: corrupt, so unreadable lines.

msgspec reads a line into its typed event fast, and leniently where the definition leaves room: a key the
definition does not have is skipped unread (invalid UTF-8 in it too), an ``int`` field takes a 400-digit
integer, a ``dict[str, int]`` (counters) or ``Any`` field (``origin``) a long one too. The guard's writer never
writes such a line: its JSON is UTF-8 and its integers fit in 64 bits. So a chunk of bytes that is all ASCII
(``bytes.isascii``, at memory speed) needs no UTF-8 check, and the lines of another one are checked one by
one (``invalid_text``); and every event's integers are checked where msgspec put them: the reader compares
``step``, ``rank`` and ``n_params`` with ``INT_LIMIT`` inline (a clean log's bulk, its interventions, costs
no more), and hands ``out_of_range`` the rest: those past the limit, and every event of ``CHECKED_EVENTS``
(the rarer ones with other integers, or containers that may hold one: counters, halts, rewinds, skips, attach).

A key the definition does not have may also hold an integer of more digits than the standard library's ``json``
reads (``sys.get_int_max_str_digits``): msgspec skips it, Python's own reader refuses the line. Only a line longer
than that limit can hold one, so the reader looks (``long_digit_run``) only in a chunk whose longest line is.
"""

from __future__ import annotations

import math
import re
import sys
import typing
from functools import lru_cache
from typing import Any, Final

from gradguard.events.definitions import EVENTS

__all__ = ["CHECKED_EVENTS", "INT_LIMIT", "digit_limit", "invalid_text", "long_digit_run", "out_of_range"]

_MAX_BITS: Final = 64
"""The largest integer a gradguard writer writes fits in 64 bits (a step, a count, a process id)."""


def _fields_to_check() -> tuple[dict[type, tuple[str, ...]], dict[type, tuple[str, ...]]]:
    """Per event class: its integer fields, and its fields of containers or ``Any`` that may hold integers (walked).

    A container of floats and strings alone (``figures`` of ``stats``, the lists of ``adaptive_clip``) is not
    walked: msgspec makes a JSON integer a float there and refuses one past a float's range, and JSON has no literal
    for a non-finite float, so whatever it holds is finite and no integer.
    """
    flat: dict[type, tuple[str, ...]] = {}
    deep: dict[type, tuple[str, ...]] = {}
    for cls in EVENTS.values():
        hints = typing.get_type_hints(cls)
        ints = []
        walked = []
        for name, hint in hints.items():
            text = str(hint)
            if hint is int or text in ("int | None", "typing.Optional[int]"):
                ints.append(name)
            elif "Any" in text or _INT_WORD.search(text):
                walked.append(name)
        flat[cls] = tuple(ints)
        if walked:
            deep[cls] = tuple(walked)
    return flat, deep


_INT_WORD: Final = re.compile(r"\bint\b")
_INT_FIELDS, _DEEP = _fields_to_check()
INT_LIMIT: Final = 1 << _MAX_BITS
"""An integer at or past it (a step, rank or group size) is no writer's: the reader checks those inline."""
_COMMON: Final = frozenset({"step", "rank", "n_params"})
CHECKED_EVENTS: Final = frozenset(_DEEP) | {cls for cls, names in _INT_FIELDS.items() if set(names) - _COMMON}
"""The event classes the reader hands ``out_of_range`` whatever their ``step`` and ``rank``: those with other
integer fields, or containers that may hold integers (attach, counters, detach, halt, rewind, skip, rerun, ...)."""


def invalid_text(raw: bytes) -> str | None:
    """Why ``raw`` (one line) is not UTF-8 text, or ``None``; needed only for a line with a non-ASCII byte."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not UTF-8 text (byte {exc.start + 1}): a corrupt line"
    return None


def digit_limit() -> int:
    """The most digits the standard library's ``json`` reads in an integer (``sys.get_int_max_str_digits``, 4,300
    by default); 0 where it has no limit. Only a line longer than this can hold an integer it refuses."""
    return sys.get_int_max_str_digits()


_DIGITS_AS_ZEROS: Final = bytes(0x30 if 0x30 <= byte <= 0x39 else 0x20 for byte in range(256))
"""``bytes.translate`` table: every digit a ``0``, every other byte a space, so a run of digits is a run of zeros."""


@lru_cache(maxsize=4)
def _zeros(limit: int) -> bytes:
    return b"0" * (limit + 1)


def long_digit_run(raw: bytes, limit: int) -> bool:
    """Whether ``raw`` (one line) has a run of more than ``limit`` digits: maybe an integer the standard library's
    ``json`` refuses (``digit_limit``).

    msgspec reads such an integer where the definition has a number (and says it is out of range), but skips it
    unread in a field the definition does not name, so the line would count as an event though no gradguard writer
    wrote it and Python's own JSON reader refuses it. A run of digits is only a suspect (it may lie in a string, or
    be a float's), so the standard library's parse of the line decides (``reader.parse_line``).
    """
    if not limit or len(raw) <= limit:
        return False
    # A run of more than ``limit`` digits holds a whole block of ``limit // 2 + 1`` bytes starting at a multiple of
    # that: a clean line (a monitor's 200 floats, 8 KB) is cleared by a few blocks' ``isdigit``, each stopping at its
    # first non-digit, and only a suspect pays for translate and find (4% of the audit's instructions on a clean log).
    block = limit // 2 + 1
    if not any(raw[start : start + block].isdigit() for start in range(0, len(raw) - block + 1, block)):
        return False
    # translate and find run in C at memory speed; a regular expression for the run is several times slower.
    return raw.translate(_DIGITS_AS_ZEROS).find(_zeros(limit)) >= 0


def out_of_range(event: Any) -> str | None:
    """Why ``event`` holds a number no gradguard writer writes (an integer past 64 bits, a non-finite float where
    the guard writes only strings for those), or ``None``."""
    cls = type(event)
    step = getattr(event, "step", None)
    if type(step) is int and step.bit_length() > _MAX_BITS:
        return _too_long(step)
    for name in _INT_FIELDS.get(cls, ()):
        value = getattr(event, name)
        if type(value) is int and value.bit_length() > _MAX_BITS:
            return _too_long(value)
    walked = _DEEP.get(cls)
    if walked:
        return _walk([getattr(event, name) for name in walked])
    return None


def _walk(value: Any) -> str | None:
    if type(value) is int:
        return _too_long(value) if value.bit_length() > _MAX_BITS else None
    if type(value) is float:
        return None if math.isfinite(value) else f"the number {value} where a gradguard writer writes a string"
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        for item in value:
            why = _walk(item)
            if why is not None:
                return why
    return None


def _too_long(value: int) -> str:
    digits = int(value.bit_length() * math.log10(2)) + 1
    if 10 ** (digits - 1) > abs(value):
        digits -= 1
    return f"a {digits:,}-digit integer: no gradguard writer writes one (a corrupt line)"
