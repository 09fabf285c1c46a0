"""What the audit's collectors raise for an event that fits its definition but not the audit's reading of it.

The typed events (``gradguard.events.definitions``) already hold every
field in its type; a collector raises ``Malformed`` for what a type
cannot say (lists of unequal length, figures per name at group scope). Its line is reported as
unreadable and skipped (see ``Summarizer.add``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradguard.events.definitions import as_float

__all__ = ["Malformed", "names_field", "number_or_none", "per_parameter"]


class Malformed(Exception):
    """A gradguard event whose fields are not what its kind requires; its line is reported and skipped."""


def number_or_none(value: Any) -> float | None:
    """A ``Number`` as a float (the non-finite strings too); None for None."""
    if value is None:
        return None
    return as_float(value)


def names_field(event: Mapping[str, Any], key: str) -> list[str]:
    """``event[key]`` if it is a list of names (an event read as a dict), else ``Malformed``."""
    value = event.get(key)
    if not isinstance(value, list) or not all(type(item) is str for item in value):
        raise Malformed(f"gradguard {event.get('event')!r} event whose {key!r} is not a list of parameter names")
    return value


def per_parameter(event: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """An ``adaptive_clip`` line read as a dict (``json.loads``) at ``scope: tensor`` (its ``params`` and figures
    are lists, one entry per clipped parameter) as one dict per parameter, with ``param`` set; any other as itself.

    The audit reads typed events (its collectors split them themselves); this is for code that reads lines
    as dicts."""
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
