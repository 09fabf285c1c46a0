"""Reading gradguard audit logs: streamed, tolerant of damage, several files merged in step order.

A file is read in chunks and split into lines here, so memory is bounded by the chunk size and the
longest line accepted (``MAX_LINE_BYTES``), never by the size of
the file. Each line is decoded once, by msgspec, straight into its typed event
(``gradguard.events.definitions``: the one definition of every event the
guard writes). A line that is not a gradguard event (corrupt JSON, a last line torn by a crash
mid-write, a line another program wrote, bytes that are not UTF-8, an over-long line, an event whose
fields do not fit its definition) becomes a ``BadLine`` with its file
and line number, and reading goes on with the next line: nothing else is lost.

Each file is in step order (the guard appends as it goes), so several files (one per rank, or a run
resumed into a new file) are merged lazily with `heapq.merge`, holding one event per file.
"""

from __future__ import annotations

import heapq
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Any, BinaryIO, Final, Union

import msgspec

from gradguard.audit.merging import merged_batches
from gradguard.audit.plausible import (
    CHECKED_EVENTS,
    INT_LIMIT,
    digit_limit,
    invalid_text,
    long_digit_run,
    out_of_range,
)
from gradguard.events.definitions import (
    EVENT_DECODER,
    EVENTS,
    FOREIGN_DECODER,
    Attach,
    Detach,
    ForeignEvent,
    GuardEvent,
    Intervention,
)

__all__ = [
    "MAX_LINE_BYTES",
    "AnyEvent",
    "BadLine",
    "FollowReader",
    "LineSplitter",
    "ReadStats",
    "Record",
    "parse_line",
    "read_batches",
    "read_file",
    "read_line",
    "read_merged",
    "total_bytes",
]

CHUNK_BYTES: Final = 1 << 16
"""Bytes read at a time; a chunk's events are decoded together, so this bounds the memory they take. 64 KiB: a
chunk's events (about 170 lines of a real log) stay in the processor's cache while the collectors read them, which
a 256 KiB chunk's did not. Several files merged hold a chunk of each: each file is read in its share of
``MERGED_BYTES`` (``MIN_CHUNK_BYTES`` at least)."""
MERGED_BYTES: Final = 1 << 18
"""What several files merged read at a time, together (a file's share at most ``CHUNK_BYTES``): 4 ranks' logs read
64 KiB a file took 1% to 4% less time a line than in 32 KiB shares, side by side with one log (three runs of 12
turns: docs/performance.md), though a simulated 1 MiB cache says they miss it more (40 times a line against 17.4);
16 KiB shares were 4% slower than 32 KiB (twice the batches)."""
MIN_CHUNK_BYTES: Final = 1 << 13
"""The smallest share of ``MERGED_BYTES`` a file of several is read in (about 20 lines): smaller, and the work done
once a chunk would cost more than the cache saves."""
MAX_LINE_BYTES: Final = 64 << 20
"""Longer lines are reported and skipped (a group clip of a million parameters is about 50 MiB)."""
_EXCERPT_CHARS: Final = 80


AnyEvent = Union[GuardEvent, ForeignEvent]  # noqa: UP007
"""What a line is read into: the typed event of ``gradguard.events.definitions``."""

_STEP_BOUNDS: Final = (Attach, Detach)
"""Events without a step whose fields bound their run's steps: where they go in the step order (``Record.order``)."""
_DECODE_ERRORS: Final = (msgspec.MsgspecError, UnicodeDecodeError, RecursionError, ValueError)
"""What decoding a line may raise: it does not fit a definition, is not JSON, not UTF-8, too deep."""


class Record(msgspec.Struct, order=True, frozen=True, gc=False):
    """One gradguard event and where it was read.

    ``order`` is the merge key: the event's ``step``, or for an event without one the last step seen before it in
    its file (``-1`` before any), raised for an ``attach`` to the step before its ``start_step`` and for a
    ``detach`` to its last step (``steps - 1``). Records compare by
    ``(order, file, line)``: never by ``event``, as no two records share a file and line.
    """

    order: int
    file: int
    line: int
    event: AnyEvent


@dataclass(frozen=True)
class BadLine:
    """A line that was skipped, and why."""

    path: str
    line: int
    reason: str
    excerpt: str

    def __str__(self) -> str:
        shown = f": {self.excerpt}" if self.excerpt else ""
        return f"{self.path}:{self.line}: {self.reason}{shown}"


@dataclass
class ReadStats:
    """Lines and events read per file; every skipped line is counted, and the first ``keep`` are kept."""

    keep: int = 200
    bad_total: int = 0
    bad_lines: list[BadLine] = field(default_factory=list)
    """The first ``keep`` bad lines, in the order read."""
    bad_per_file: dict[str, int] = field(default_factory=dict)
    lines: dict[str, int] = field(default_factory=dict)
    """Lines read so far, per file (bad and blank lines included)."""
    events: dict[str, int] = field(default_factory=dict)
    """gradguard events read so far, per file."""

    def bad_line(self, path: str, line: int, reason: str, raw: bytes | None = None) -> None:
        self.bad_total += 1
        self.bad_per_file[path] = self.bad_per_file.get(path, 0) + 1
        if len(self.bad_lines) < self.keep:
            self.bad_lines.append(BadLine(path, line, reason, _excerpt(raw)))


def _excerpt(raw: bytes | None) -> str:
    if not raw:
        return ""
    text = raw[: _EXCERPT_CHARS * 4].decode("utf-8", "replace").strip()
    text = "".join(ch if ch.isprintable() else "\N{REPLACEMENT CHARACTER}" for ch in text)
    return text if len(text) <= _EXCERPT_CHARS else text[: _EXCERPT_CHARS - 3] + "..."


def read_line(raw: bytes, error: Exception | None = None) -> AnyEvent | str | None:
    """The typed event of one line, or why the line is not one (a ``str``), or ``None`` for a blank line.

    ``error``: what decoding it raised already (the readers decode every line once, and come here only
    for a line that did not fit). Why a line is not JSON is told in the standard library's words
    (``parse_line``), a line that is JSON but does not fit its event's
    definition in msgspec's (the field and what was expected). A line no gradguard writer could have
    written (invalid UTF-8, a 400-digit integer: ``gradguard.audit.plausible``) is not one, wherever it is.
    """
    if not raw.isascii() and (why := invalid_text(raw)) is not None:
        return why
    if (refused := _refused(raw, digit_limit())) is not None:
        return refused
    if error is None:
        try:
            event: AnyEvent = EVENT_DECODER.decode(raw)
        except _DECODE_ERRORS as exc:
            error = exc
        else:
            return out_of_range(event) or event
    checked = parse_line(raw)
    if not isinstance(checked, dict):
        return checked
    name = checked["event"]
    if name not in EVENTS:
        try:
            return FOREIGN_DECODER.decode(raw)
        except _DECODE_ERRORS as exc:
            error = exc
    if isinstance(error, msgspec.ValidationError):
        return f"gradguard {name!r} event that does not fit its definition ({_first_words(error)})"
    return f"JSON the audit cannot read ({_first_words(error)}): not a gradguard event"


def parse_line(raw: bytes) -> dict[str, Any] | str | None:
    """The line as the standard library's ``json`` reads it (a dict with ``event`` and ``run`` strings and a valid
    ``step``), or why it is not one (a ``str``), or ``None`` for a blank line; the diagnosis of a line that
    ``read_line`` could not read."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not UTF-8 text (byte {exc.start + 1}): a corrupt line"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        if not text.strip():
            return None
        return f"not JSON ({exc.msg} at column {exc.colno}): a corrupt line, or a line from another program"
    except RecursionError:
        return "JSON nested too deeply: not a gradguard event"
    except ValueError as exc:  # e.g. an integer longer than Python's limit on digits (sys.get_int_max_str_digits)
        return f"JSON Python cannot read ({_first_words(exc)}): not a gradguard event"
    if not isinstance(obj, dict):
        return f"a JSON {_json_type(obj)}, not an event object: a line from another program?"
    event = obj.get("event")
    run = obj.get("run")
    if not isinstance(event, str) or not isinstance(run, str):
        return "JSON without gradguard's 'event' and 'run' fields: a line from another program?"
    step = obj.get("step")
    if step is not None and (type(step) is not int or step < 0):
        return f"gradguard {event!r} event with an invalid 'step' ({step!r}; expected an integer >= 0)"
    return obj


def _refused(raw: bytes, limit: int) -> str | None:
    """Why the standard library's ``json`` refuses ``raw``, where it may hold an integer of more than ``limit`` digits
    (``gradguard.audit.plausible.long_digit_run``); else ``None``."""
    if not long_digit_run(raw, limit):
        return None
    parsed = parse_line(raw)
    return parsed if isinstance(parsed, str) else None


def _unended(raw: bytes) -> bytes:
    """``raw`` without its newline: the standard library's reasons for a line that is not JSON name its columns as
    they were written, an unterminated string as such (not as a newline inside it)."""
    return raw[:-1] if raw.endswith(b"\n") else raw


def _longest(lines: Sequence[bytes | None]) -> int:
    """The length of the longest line of ``lines`` (an over-long one, ``None``, is not read)."""
    try:
        return max(map(len, lines), default=0)  # type: ignore[arg-type]
    except TypeError:
        return max((len(line) for line in lines if line is not None), default=0)


def _first_words(exc: BaseException) -> str:
    """The start of an exception's message, for a bad line's reason (a message can repeat the whole line)."""
    text = str(exc).split(";")[0]
    return text if len(text) <= 80 else text[:77] + "..."


def _json_type(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


class LineSplitter:
    """Splits a byte stream into complete lines, numbering them from 1.

    An incomplete last line is held back until its newline arrives (``feed``) or the stream ends
    (``finish``). A line longer than ``max_line`` is dropped while it streams past and comes out
    as ``None``, so memory stays bounded whatever the input.
    """

    def __init__(self, max_line: int = MAX_LINE_BYTES, *, newlines: bool = False) -> None:
        self.max_line = max_line
        self.newlines = newlines
        """Whether a complete line keeps its newline (the reader's: msgspec skips it, and no line is copied again)."""
        self.lines_done = 0
        """How many lines have been handed out (the last one's number)."""
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._overlong = False

    @property
    def holding(self) -> bool:
        """Whether an incomplete line is held back."""
        return self._overlong or self._held_bytes > 0

    def feed(self, chunk: bytes) -> tuple[int, list[bytes | None]]:
        """The complete lines that ``chunk`` finishes (with their newline where ``newlines``), and the number of the
        first of them."""
        first_number = self.lines_done + 1
        # BytesIO finds each newline with memchr: a sixth of the time bytes.split takes, which looks at every byte.
        lines: list[bytes | None] = BytesIO(chunk).readlines()  # type: ignore[assignment]
        tail = lines.pop() if lines and not chunk.endswith(b"\n") else None
        longest = self.max_line + 1  # a line and its newline
        if lines and (self._overlong or self._held):
            first = None if self._overlong else b"".join([*self._held, lines[0]])  # type: ignore[list-item]
            lines[0] = None if first is None or len(first) > longest else first
            self._held, self._held_bytes, self._overlong = [], 0, False
        if len(chunk) > self.max_line:  # only then can a line of this chunk alone be over-long
            for index, line in enumerate(lines):
                if line is not None and len(line) > longest:
                    lines[index] = None
        self.lines_done += len(lines)
        if tail:
            self._hold(tail)
        if not self.newlines:
            lines = [line if line is None else line[:-1] for line in lines]
        return first_number, lines

    def _hold(self, piece: bytes) -> None:
        if self._overlong:
            return
        self._held_bytes += len(piece)
        if self._held_bytes > self.max_line:
            self._held, self._held_bytes, self._overlong = [], 0, True
        else:
            self._held.append(piece)

    def finish(self) -> tuple[int, bytes | None] | None:
        """The held incomplete last line, as ``(number, bytes or None if over-long)``, or ``None``."""
        if not self.holding:
            return None
        self.lines_done += 1
        line = None if self._overlong else b"".join(self._held)
        self._held, self._held_bytes, self._overlong = [], 0, False
        return self.lines_done, line


_OVERLONG = f"line longer than {MAX_LINE_BYTES >> 20} MiB: skipped (corrupt, or not a gradguard log)"
_TRUNCATED = "truncated last line (no newline at the end: the writer probably stopped mid-write)"


class _FileState:
    """Line splitting and step tracking for one file, shared by the batch and the follow readers."""

    def __init__(self, path: Path, index: int, stats: ReadStats) -> None:
        self.path = path
        self.name = str(path)
        self.index = index
        self.stats = stats
        self.splitter = LineSplitter(newlines=True)
        self.last_step = -1
        self.events = 0
        self._ascii_before = True
        stats.lines.setdefault(self.name, 0)
        stats.events.setdefault(self.name, 0)

    def feed(self, chunk: bytes) -> list[Record]:
        first_number, lines = self.splitter.feed(chunk)
        self.stats.lines[self.name] = self.splitter.lines_done
        ascii_only = chunk.isascii()
        screen = not ascii_only or not self._ascii_before  # a line held from the chunk before is checked too
        self._ascii_before = ascii_only
        return self.records(first_number, lines, screen=screen)

    def records(self, first_number: int, lines: Sequence[bytes | None], *, screen: bool = True) -> list[Record]:
        """The events among ``lines`` (numbered from ``first_number``); the rest are reported to the stats.

        ``screen``: whether a line may hold a non-ASCII byte (then each such line is checked to be UTF-8).
        """
        out: list[Record] = []
        append = out.append
        index = self.index
        last_step = self.last_step
        decode = EVENT_DECODER.decode
        clip, record, int_limit = Intervention, Record, INT_LIMIT  # locals: looked up once a line
        limit = digit_limit()
        # Only a line longer than the limit can hold an integer the standard library refuses: one pass in C over
        # the lengths spares a clean log's short lines the check.
        digits = bool(limit) and _longest(lines) > limit
        for number, raw in enumerate(lines, first_number):
            if raw is None:
                self.stats.bad_line(self.name, number, _OVERLONG)
                continue
            if screen and not raw.isascii() and (why := invalid_text(raw)) is not None:
                self.stats.bad_line(self.name, number, why, raw)
                continue
            if (
                digits
                and len(raw) > limit
                and long_digit_run(raw, limit)
                and (refused := _refused(_unended(raw), limit)) is not None
            ):
                self.stats.bad_line(self.name, number, refused, raw)
                continue
            try:
                event: AnyEvent = decode(raw)
            except _DECODE_ERRORS as exc:
                checked = read_line(_unended(raw), exc)
                if checked is None:
                    continue
                if isinstance(checked, str):
                    self.stats.bad_line(self.name, number, checked, raw)
                    continue
                event = checked
            if type(event) is clip:
                # Most lines: their integers, the step, rank and group size, are compared here and now.
                clip_step = event.step
                n_params = event.n_params
                if clip_step < int_limit and 0 <= event.rank < int_limit and (n_params is None or n_params < int_limit):
                    last_step = clip_step
                    append(record(clip_step, index, number, event))
                    continue
            step = getattr(event, "step", None)
            # Inline for speed: a step, rank or group size past 64 bits, or an event with other integers or
            # containers (the rare ones), is checked through (gradguard.audit.plausible).
            if (
                type(event) in CHECKED_EVENTS
                or (step is not None and step >= INT_LIMIT)
                or not 0 <= event.rank < INT_LIMIT
                or (getattr(event, "n_params", None) or 0) >= INT_LIMIT
            ) and (why := out_of_range(event)) is not None:
                self.stats.bad_line(self.name, number, why, raw)
                continue
            if step is not None:
                last_step = step
            elif type(event) in _STEP_BOUNDS:
                # An attach is just before its first step, a detach at its last (``steps`` is the next step), even
                # where no line of its run has a step: a job resumed into the same per-rank files is then read after
                # the job before it on every rank, not mixed with it (never below a step seen before: in order).
                bound = event.start_step - 1 if type(event) is Attach else event.steps - 1  # type: ignore[union-attr]
                if bound > last_step:
                    last_step = bound
            append(record(last_step, index, number, event))
        self.last_step = last_step
        self.events += len(out)
        self.stats.events[self.name] += len(out)
        return out

    def finish(self) -> Iterator[Record]:
        held = self.splitter.finish()
        if held is None:
            return
        number, raw = held
        self.stats.lines[self.name] = number
        if raw is None:
            self.stats.bad_line(self.name, number, _OVERLONG)
            return
        parsed = read_line(raw)
        if not isinstance(parsed, str | None):
            # Complete but for its newline: nothing is lost, so it is read like any other line.
            yield from self.records(number, [raw])
        elif parsed is not None:
            self.stats.bad_line(self.name, number, _TRUNCATED, raw)


def read_file(
    path: Path,
    index: int,
    stats: ReadStats,
    progress: Callable[[int], None] | None = None,
) -> Iterator[Record]:
    """Every gradguard event of one file, in file order; bad lines go to ``stats``."""
    for batch in _file_batches(path, index, stats, progress):
        yield from batch


def _file_batches(
    path: Path, index: int, stats: ReadStats, progress: Callable[[int], None] | None, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[list[Record]]:
    """The events of one file, a chunk's worth (``chunk_bytes``) at a time."""
    state = _FileState(path, index, stats)
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            if progress is not None:
                progress(len(chunk))
            yield state.feed(chunk)
    yield list(state.finish())


def read_batches(
    paths: Sequence[Path],
    stats: ReadStats,
    progress: Callable[[int], None] | None = None,
) -> Iterator[list[Record]]:
    """What ``read_merged`` gives, in lists (a read chunk's worth of one file; of several, ``merged_batches``')."""
    if len(paths) == 1:
        yield from _file_batches(paths[0], 0, stats, progress)
        return
    share = min(max(MERGED_BYTES // len(paths), MIN_CHUNK_BYTES), CHUNK_BYTES)
    yield from merged_batches([_file_batches(path, index, stats, progress, share) for index, path in enumerate(paths)])


def read_merged(
    paths: Sequence[Path],
    stats: ReadStats,
    progress: Callable[[int], None] | None = None,
) -> Iterator[Record]:
    """The events of several files merged in step order (ties keep file order), one event held per file."""
    streams = [read_file(path, index, stats, progress) for index, path in enumerate(paths)]
    if len(streams) == 1:
        return streams[0]
    return heapq.merge(*streams)


class FollowReader:
    """Reads files that are still being written, like ``tail -f``: each ``poll`` returns what was appended.

    An incomplete last line is held until its newline arrives. Files are read round-robin, at most
    ``budget`` bytes per poll, so a long backlog never keeps the caller from refreshing its view.
    """

    def __init__(self, paths: Sequence[Path], stats: ReadStats, *, budget: int = 16 << 20) -> None:
        self._states = [_FileState(path, index, stats) for index, path in enumerate(paths)]
        self._handles: list[BinaryIO] = [open(path, "rb") for path in paths]  # noqa: SIM115 - closed in close()
        self.budget = budget
        self.backlog = False
        """Whether the last poll stopped at its budget with more data waiting."""

    def poll(self) -> list[Record]:
        out: list[Record] = []
        remaining = self.budget
        self.backlog = False
        for state, handle in zip(self._states, self._handles, strict=True):
            while remaining > 0:
                chunk = handle.read(min(CHUNK_BYTES, remaining))
                if not chunk:
                    break
                remaining -= len(chunk)
                out.extend(state.feed(chunk))
            if remaining <= 0:
                self.backlog = True
        return out

    @property
    def waiting_lines(self) -> int:
        """How many files end in an incomplete line (still being written, or torn)."""
        return sum(state.splitter.holding for state in self._states)

    def close(self) -> None:
        for handle in self._handles:
            handle.close()


def total_bytes(paths: Iterable[Path]) -> int:
    """The summed size of the files, for a progress bar."""
    return sum(os.stat(path).st_size for path in paths)
