"""Structured events: one JSON line per event in the audit log, and the application's structlog.

gradguard never calls ``structlog.configure``. The audit log has a processor chain of its own
(``structlog.wrap_logger``), so its format is the same whatever the application configured. Events
also go to a structlog logger (by default ``structlog.get_logger("gradguard")``), where the
application's configuration decides what happens to them; while structlog is unconfigured, only
warnings and errors go there, because structlog's default prints everything to stdout.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any, Final

import structlog

__all__ = ["DEFAULT_LOGGER", "EVENT_SCHEMA_VERSION", "EventLog", "JsonLinesFile"]

EVENT_SCHEMA_VERSION: Final = 1

_LEVELS: Final = {"debug": 10, "info": 20, "warning": 30, "error": 40}


class _DefaultLogger:
    def __repr__(self) -> str:
        return "DEFAULT_LOGGER"


DEFAULT_LOGGER: Final = _DefaultLogger()
"""Sentinel: use ``structlog.get_logger("gradguard")``."""


class JsonLinesFile:
    """A structlog 'logger' that appends each rendered event as one line, in one ``write`` call.

    The file is opened with ``O_APPEND``, so a line is never torn or interleaved with another
    writer's, and it is on disk (in the OS's hands) as soon as ``msg`` returns.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def msg(self, message: str) -> None:
        data = (message + "\n").encode("utf-8")
        with self._lock:
            if self._fd is None:
                return
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]

    debug = info = warning = error = msg

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _json_safe(value: Any) -> Any:
    """NaN and Inf are not JSON; they become the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``.

    They are never dropped: a safety log must show a non-finite value as plainly as a finite one.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, Mapping):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(item) for item in value]
    return value


_HEAD_KEYS: Final = ("ts", "level", "event", "run", "rank", "step")


def _finite_json(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> Mapping[str, Any]:
    """Make the event valid JSON, with the keys a reader scans for first."""
    ordered = {key: event_dict[key] for key in _HEAD_KEYS if key in event_dict}
    ordered.update(event_dict)
    return {key: _json_safe(value) for key, value in ordered.items()}


def _add_level(_: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    event_dict["level"] = method_name
    return event_dict


class EventLog:
    """Sends every gradguard event to the audit file (all of them) and to a structlog logger."""

    def __init__(
        self,
        *,
        audit_log: str | os.PathLike[str] | None,
        logger: Any,
        context: Mapping[str, Any],
    ) -> None:
        self._file = JsonLinesFile(audit_log) if audit_log is not None else None
        self._audit: Any = None
        if self._file is not None:
            self._audit = structlog.wrap_logger(
                self._file,
                processors=[
                    _add_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
                    _finite_json,
                    structlog.processors.JSONRenderer(),
                ],
                context_class=dict,
            ).bind(**context)
        self._app_min_level = _LEVELS["debug"]
        if logger is DEFAULT_LOGGER:
            logger = structlog.get_logger("gradguard")
            if not structlog.is_configured():
                self._app_min_level = _LEVELS["warning"]
        self._app: Any = logger.bind(**context) if logger is not None else None

    @property
    def audit_path(self) -> Path | None:
        return self._file.path if self._file is not None else None

    def emit(self, level: str, event: str, **fields: Any) -> None:
        """Record ``event``; ``level`` is one of debug, info, warning, error."""
        if self._audit is not None:
            getattr(self._audit, level)(event, **fields)
        if self._app is not None and _LEVELS[level] >= self._app_min_level:
            getattr(self._app, level)(event, **fields)

    def flush(self) -> None:
        """Return once every event emitted so far is in the audit file (writes are synchronous today)."""

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
