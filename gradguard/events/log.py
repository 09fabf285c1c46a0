"""Structured events: one JSON line per event in the audit log, and the application's structlog.

The audit log keeps every field of every event; the application's logger (a console, by default) gets
a short form of the long ones (``console_fields``): a halt of a 300-parameter model is one line of a
few hundred characters there, with the rule, step, kind, count, the first names and the origin.

gradguard never calls ``structlog.configure``. The audit log has a processor chain of its own
(``structlog.wrap_logger``), so its format is the same whatever the application configured. Events
also go to a structlog logger (by default ``structlog.get_logger("gradguard")``), where the
application's configuration decides what happens to them; while structlog is unconfigured, only
warnings and errors go there, because structlog's default prints everything to stdout.

The training thread never waits on the audit file: ``EventLog.emit`` stamps the event and puts it on
a queue (about a microsecond), and a background thread renders it to JSON and appends it, writing
whole lines only, one ``os.write`` per batch of lines on a file opened with ``O_APPEND``.
``EventLog.flush`` waits until everything emitted so far is on disk; it runs before every halt is
raised, on ``EventLog.close`` and at interpreter exit (also after an uncaught exception).
"""

from __future__ import annotations

import atexit
import datetime
import math
import os
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any, Final

import structlog

from gradguard.errors import origin_sentence

__all__ = ["CONSOLE_NAMES", "DEFAULT_LOGGER", "EVENT_SCHEMA_VERSION", "EventLog", "JsonLinesFile", "console_fields"]

EVENT_SCHEMA_VERSION: Final = 1

_LEVELS: Final = {"debug": 10, "info": 20, "warning": 30, "error": 40}

CONSOLE_NAMES: Final = 5
"""Names (list items) the application's logger is shown per field; the audit log has them all."""

_BATCH_BYTES: Final = 1 << 20
"""A batch of lines is written once it reaches this size, so a burst never builds one huge buffer."""
_EXIT_FLUSH_TIMEOUT_S: Final = 30.0
"""How long interpreter exit waits for a log's pending lines (a stuck disk must not hang exit)."""


class _DefaultLogger:
    def __repr__(self) -> str:
        return "DEFAULT_LOGGER"


DEFAULT_LOGGER: Final = _DefaultLogger()
"""Sentinel: use ``structlog.get_logger("gradguard")``."""


class _FileLock:
    """The lock of one file (device and inode), shared by every ``JsonLinesFile`` of the process on it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()


_FILE_LOCKS: weakref.WeakValueDictionary[tuple[int, int], _FileLock] = weakref.WeakValueDictionary()
_FILE_LOCKS_LOCK = threading.Lock()


def _lock_of(fd: int) -> _FileLock:
    status = os.fstat(fd)
    with _FILE_LOCKS_LOCK:
        found = _FILE_LOCKS.get((status.st_dev, status.st_ino))
        if found is None:
            found = _FILE_LOCKS[(status.st_dev, status.st_ino)] = _FileLock()
        return found


class JsonLinesFile:
    """A structlog 'logger' that appends each rendered event as one line, in one ``write`` call.

    The file is opened with ``O_APPEND``, so a line is never torn or interleaved with another
    writer's, and it is on disk (in the OS's hands) as soon as ``msg`` returns. Guards of one process
    that share a file (each with its own descriptor and writer thread) also share one lock for it, so
    whole batches of lines go in one after another even where the OS accepts a write only in part.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._shared = _lock_of(self._fd)
        self._lock = self._shared.lock

    def msg(self, message: str) -> None:
        self.write_lines((message,))

    debug = info = warning = error = msg

    def write_lines(self, lines: Sequence[str]) -> None:
        """Append whole lines with one ``os.write`` (repeated only if the OS accepts part of it)."""
        data = "".join(line + "\n" for line in lines).encode("utf-8")
        with self._lock:
            if self._fd is None:
                return
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]

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


_SAID_WHEN_NOT_EMPTY = frozenset({"params", "kinds", "ranks"})
"""Fields the console line leaves out when empty (the audit log keeps them, as every field)."""


def console_fields(event: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The short form of an event's fields for the application's logger; the audit log keeps ``fields``.

    A list longer than ``CONSOLE_NAMES`` keeps its first items and says how many more there are
    (``params`` also gets its ``count``); ``kinds`` (a kind per parameter) becomes a tally per kind;
    ``origin`` becomes the sentence a halt says (``It started in the forward pass: ...``); a field
    without a value (``reason=None``), an empty ``params``, ``kinds`` or ``ranks`` (a ranks halt names ranks, not
    parameters: ``count=0 ... params=[]`` said nothing) and a halt's cumulative ``counters`` are left to the audit
    log (and ``guard.counters``).
    """
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if value is None or (key == "counters" and event == "halt") or (key in _SAID_WHEN_NOT_EMPTY and not value):
            continue
        if key == "kinds" and isinstance(value, Mapping):
            tally: dict[str, int] = {}
            for kind in value.values():
                tally[kind] = tally.get(kind, 0) + 1
            value = tally
        elif key == "origin" and isinstance(value, Mapping):
            value = _origin_words(value)
        elif isinstance(value, list | tuple) and len(value) > CONSOLE_NAMES:
            value = [*value[:CONSOLE_NAMES], f"... and {len(value) - CONSOLE_NAMES} more"]
        out[key] = value
        if key == "params" and isinstance(fields[key], list | tuple):
            out["count"] = len(fields[key])
    return out


def _origin_words(origin: Mapping[str, Any]) -> Any:
    """Where a NaN/Inf started, in words (``origin_sentence``); an origin it cannot read, as it is."""
    try:
        return origin_sentence(origin).removeprefix("Origin: ")
    except (AttributeError, TypeError, ValueError):
        return dict(origin)


def _add_level(_: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    event_dict["level"] = method_name
    return event_dict


_STAMP_KEY: Final = "_gradguard_emitted_at"


def _stamp(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """``ts`` from the time ``EventLog.emit`` was called, not the time the line is rendered.

    The same text structlog's ``TimeStamper(fmt="iso", utc=True)`` writes.
    """
    emitted_at = event_dict.pop(_STAMP_KEY)
    stamp = datetime.datetime.fromtimestamp(emitted_at, tz=datetime.timezone.utc).isoformat()
    event_dict["ts"] = stamp.replace("+00:00", "Z")
    return event_dict


class _ReturnRendered:
    """A structlog 'logger' that hands the rendered line back to the caller (the writer thread)."""

    def msg(self, message: str) -> str:
        return message

    debug = info = warning = error = msg


class _Flushed:
    """A marker on the queue: set once every line queued before it has been written."""

    def __init__(self) -> None:
        self.done = threading.Event()


_STOP: Final = object()

_Item = tuple[str, str, dict[str, Any], float] | str
"""``(level, event, fields, emitted_at)``: an event waiting to be rendered and written; or its line."""

RENDER_ON_WRITER = True
"""Render audit lines on the writer thread (True) or on the emitting thread (False).

Both keep file I/O off the emitting thread; the benchmark suite measures the two (docs/performance.md)."""


class _BackgroundWriter:
    """Renders and appends queued events on a daemon thread, so the caller never waits on file I/O.

    The thread is started on the first event (in whichever process emits it: a forked child starts
    its own and never writes the parent's queue). Lines are written in emission order.
    """

    def __init__(self, file: JsonLinesFile, render: Any) -> None:
        self._file = file
        self._render = render
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = -1
        self._start_lock = threading.Lock()
        self._closed = False
        self.error: BaseException | None = None
        """The first error the writer met; later lines are dropped (the training goes on)."""

    def put(self, item: _Item) -> None:
        if self._closed:
            return
        if self._pid != os.getpid():
            self._start()
        self._queue.put(item)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every line put so far is written; False if ``timeout`` ran out first."""
        thread = self._thread
        if thread is None or self._pid != os.getpid() or not thread.is_alive():
            return True
        if threading.current_thread() is thread:
            return True  # called from the writer itself (a finalizer run by its garbage collection)
        marker = _Flushed()
        self._queue.put(marker)
        return marker.done.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Write everything queued, stop the thread and close the file."""
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        if thread is None or self._pid != os.getpid() or not thread.is_alive():
            self._file.close()
            return
        self._queue.put(_STOP)  # the writer closes the file once it has written everything before this
        if threading.current_thread() is not thread:
            thread.join(timeout)

    def _start(self) -> None:
        with self._start_lock:
            if self._pid == os.getpid():
                return
            if self._pid != -1:
                self._queue = queue.SimpleQueue()  # a forked child: the parent writes its own queue
            self._thread = threading.Thread(target=self._run, name="gradguard-audit-log", daemon=True)
            self._pid = os.getpid()
            self._thread.start()

    def _run(self) -> None:
        source = self._queue
        while True:
            items = [source.get()]
            size = 0
            while size < _BATCH_BYTES:
                try:
                    items.append(source.get_nowait())
                except queue.Empty:
                    break
                size += 256  # a typical line; only bounds how much one batch holds
            lines: list[str] = []
            markers: list[_Flushed] = []
            stop = False
            for item in items:
                if isinstance(item, _Flushed):
                    markers.append(item)
                elif item is _STOP:
                    stop = True
                else:
                    self._render_into(lines, item)
            self._write(lines)
            for marker in markers:
                marker.done.set()
            if stop:
                self._file.close()
                return

    def render(self, item: _Item) -> str:
        if isinstance(item, str):
            return item
        level, event, fields, emitted_at = item
        line: str = getattr(self._render, level)(event, **fields, **{_STAMP_KEY: emitted_at})
        return line

    def _render_into(self, lines: list[str], item: _Item) -> None:
        try:
            lines.append(self.render(item))
        except Exception as exc:  # an unrenderable field must not stop the log
            self._record(exc)

    def _write(self, lines: list[str]) -> None:
        if not lines or self.error is not None:
            return
        try:
            self._file.write_lines(lines)
        except Exception as exc:  # a full disk, a closed descriptor: recorded, and the thread goes on
            self._record(exc)

    def _record(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc


_OPEN_WRITERS: weakref.WeakSet[_BackgroundWriter] = weakref.WeakSet()


@atexit.register
def _flush_all_at_exit() -> None:
    """Interpreter exit (normal, or after an uncaught exception): put every pending line on disk."""
    for writer in list(_OPEN_WRITERS):
        writer.close(_EXIT_FLUSH_TIMEOUT_S)


class EventLog:
    """Sends every gradguard event to the audit file (all of them) and to a structlog logger.

    Audit lines are rendered and written by a background thread; see ``flush``.
    """

    def __init__(
        self,
        *,
        audit_log: str | os.PathLike[str] | None,
        logger: Any,
        context: Mapping[str, Any],
    ) -> None:
        self._file = JsonLinesFile(audit_log) if audit_log is not None else None
        self._writer: _BackgroundWriter | None = None
        self._render_on_writer = RENDER_ON_WRITER
        self._warned_error = False
        if self._file is not None:
            render = structlog.wrap_logger(
                _ReturnRendered(),
                processors=[_add_level, _stamp, _finite_json, structlog.processors.JSONRenderer()],
                context_class=dict,
            ).bind(**context)
            self._writer = _BackgroundWriter(self._file, render)
            _OPEN_WRITERS.add(self._writer)
        self._app_min_level = _LEVELS["debug"]
        if logger is DEFAULT_LOGGER:
            logger = structlog.get_logger("gradguard")
            if not structlog.is_configured():
                self._app_min_level = _LEVELS["warning"]
        self._app: Any = logger.bind(**context) if logger is not None else None
        self.observers: list[Callable[[str, Mapping[str, Any]], None]] = []
        """Called with each event and its fields as it is emitted (the live metrics' faults by rank)."""

    @property
    def audit_path(self) -> Path | None:
        return self._file.path if self._file is not None else None

    def emit(self, level: str, event: str, **fields: Any) -> None:
        """Record ``event``; ``level`` is one of debug, info, warning, error.

        The audit line is written later, by the writer thread, so ``fields`` must not be changed
        after the call (gradguard builds them fresh for every event).
        """
        if self._writer is not None:
            if level not in _LEVELS:
                raise AttributeError(f"unknown event level {level!r}; expected one of {', '.join(_LEVELS)}")
            item: _Item = (level, event, fields, time.time())
            self._writer.put(item if self._render_on_writer else self._writer.render(item))
            self._warn_on_write_error()
        if self.observers:
            for observe in self.observers:
                observe(event, fields)
        if self._app is not None and _LEVELS[level] >= self._app_min_level:
            getattr(self._app, level)(event, **console_fields(event, fields))

    def flush(self, timeout: float | None = None) -> bool:
        """Return once every event emitted so far is in the audit file (in the OS's hands).

        Returns False only if ``timeout`` (seconds) ran out first.
        """
        if self._writer is None:
            return True
        done = self._writer.flush(timeout)
        self._warn_on_write_error()
        return done

    def close(self) -> None:
        """Write every pending event, then close the audit file; later events are not written."""
        if self._writer is not None:
            self._writer.close()
            _OPEN_WRITERS.discard(self._writer)
            self._warn_on_write_error()

    def _warn_on_write_error(self) -> None:
        error = self._writer.error if self._writer is not None else None
        if error is None or self._warned_error:
            return
        self._warned_error = True
        warnings.warn(
            f"gradguard could not write its audit log {self.audit_path}: {error!r}; "
            "later events are not written there (training goes on)",
            RuntimeWarning,
            stacklevel=3,
        )
