"""Reading the fields of one gradguard event: each reader returns the field or raises :class:`Malformed`.

A malformed event's line is reported as unreadable and skipped (see :meth:`Summarizer.add
<gradguard.audit.summarizer.Summarizer.add>`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradguard.audit.summary import Counts

__all__ = ["Malformed", "counters_field", "names_field", "number_or_none", "per_parameter", "text_field"]


class Malformed(Exception):
    """A gradguard event whose fields are not what its kind requires; its line is reported and skipped."""


def number_or_none(value: Any) -> float | None:
    """A JSON number, or the strings the guard writes for non-finite ones, as a float; anything else is None.

    Raises :class:`Malformed` for an integer too large for a float: the guard never writes one.
    """
    if type(value) is float:
        return value
    if type(value) is int:
        try:
            return float(value)
        except OverflowError:
            raise Malformed(f"a number too large for a float ({len(str(abs(value)))} digits)") from None
    if value in ("NaN", "Infinity", "-Infinity"):
        return float(value)
    return None


def text_field(event: Mapping[str, Any], key: str) -> str:
    value = event.get(key)
    if type(value) is not str:
        name = event.get("event")
        raise Malformed(f"gradguard {name!r} event without a {key!r} string (got {value!r})")
    return value


def names_field(event: Mapping[str, Any], key: str) -> list[str]:
    value = event.get(key)
    if not isinstance(value, list) or not all(type(item) is str for item in value):
        raise Malformed(f"gradguard {event.get('event')!r} event whose {key!r} is not a list of parameter names")
    return value


def counters_field(event: Mapping[str, Any]) -> Counts:
    value = event.get("counters")
    if isinstance(value, dict) and all(
        isinstance(by_action, dict) and all(type(n) is int for n in by_action.values()) for by_action in value.values()
    ):
        return value
    raise Malformed(f"gradguard {event.get('event')!r} event whose 'counters' is not {{rule: {{action: count}}}}")


def per_parameter(event: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """An ``adaptive_clip`` event of ``scope: tensor`` (its ``params`` and figures are lists, one entry per
    clipped parameter) as one event per parameter, with ``param`` set; any other event as itself."""
    before = event.get("before")
    if not isinstance(before, list):
        return [event]
    params = names_field(event, "params")
    listed = {key: value for key, value in event.items() if isinstance(value, list) and key != "params"}
    if any(len(value) != len(params) for value in listed.values()):
        raise Malformed(
            f"gradguard {event.get('event')!r} event whose lists do not have one entry per parameter "
            f"({len(params)} params; {', '.join(f'{key}: {len(value)}' for key, value in listed.items())})"
        )
    shared = {key: value for key, value in event.items() if key not in listed and key not in ("params", "n_params")}
    return [
        shared | {key: value[i] for key, value in listed.items()} | {"param": name} for i, name in enumerate(params)
    ]
