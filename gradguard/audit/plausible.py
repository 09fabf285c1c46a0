"""Lines that decode but that no gradguard writer could have written: corrupt, so unreadable lines.

msgspec reads a line into its typed event fast, and leniently where the definition leaves room: a key the
definition does not have is skipped unread (invalid UTF-8 in it too), an ``int`` field takes a 400-digit
integer, a ``dict[str, int]`` (counters) or ``Any`` field (``origin``) a long one too. The guard's writer never
writes such a line: its JSON is UTF-8 and its integers fit in 64 bits. So a chunk of bytes that is all ASCII
(``bytes.isascii``, at memory speed) needs no UTF-8 check, and the lines of another one are checked one by
one (``invalid_text``); and every event's integers are checked where msgspec put them: the reader compares
``step``, ``rank`` and ``n_params`` with ``INT_LIMIT`` inline (a clean log's bulk, its interventions, costs
no more), and hands ``out_of_range`` the rest: those past the limit, and every event of ``CHECKED_EVENTS``
(the rarer ones with other integers or containers: counters, halts, rewinds, skips, stats, attach).
"""

from __future__ import annotations

import math
import typing
from typing import Any, Final

from gradguard.events.definitions import EVENTS

__all__ = ["CHECKED_EVENTS", "INT_LIMIT", "invalid_text", "out_of_range"]

_MAX_BITS: Final = 64
"""The largest integer a gradguard writer writes fits in 64 bits (a step, a count, a process id)."""


def _fields_to_check() -> tuple[dict[type, tuple[str, ...]], frozenset[type]]:
    """Per event class: its integer fields, and whether it has containers that may hold integers (walked)."""
    flat: dict[type, tuple[str, ...]] = {}
    deep = set()
    for cls in EVENTS.values():
        hints = typing.get_type_hints(cls)
        ints = []
        for name, hint in hints.items():
            text = str(hint)
            if "dict[" in text or "list[int]" in text or "Any" in text:
                deep.add(cls)
            elif hint is int or text in ("int | None", "typing.Optional[int]"):
                ints.append(name)
        flat[cls] = tuple(ints)
    return flat, frozenset(deep)


_INT_FIELDS, _DEEP = _fields_to_check()
INT_LIMIT: Final = 1 << _MAX_BITS
"""An integer at or past it (a step, rank or group size) is no writer's: the reader checks those inline."""
_COMMON: Final = frozenset({"step", "rank", "n_params"})
CHECKED_EVENTS: Final = _DEEP | {cls for cls, names in _INT_FIELDS.items() if set(names) - _COMMON}
"""The event classes the reader hands ``out_of_range`` whatever their ``step`` and ``rank``: those with other
integer fields or containers (attach, counters, detach, halt, rewind, skip, stats, ...)."""


def invalid_text(raw: bytes) -> str | None:
    """Why ``raw`` (one line) is not UTF-8 text, or ``None``; needed only for a line with a non-ASCII byte."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not UTF-8 text (byte {exc.start + 1}): a corrupt line"
    return None


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
    if cls in _DEEP:
        return _walk(event.__struct_fields__ and [getattr(event, name) for name in event.__struct_fields__])
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
