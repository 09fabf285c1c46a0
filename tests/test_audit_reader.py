"""Reading damaged and huge logs: every bad line reported with its number and skipped, nothing else lost."""

from __future__ import annotations

import heapq
import json
import random
import tracemalloc
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.synthetic_log import LogBuilder, write_synthetic_run

from gradguard.audit.merging import GATHERED, merged_batches
from gradguard.audit.reader import LineSplitter, ReadStats, read_batches, read_file, read_line, read_merged
from gradguard.audit.summarizer import Summarizer
from gradguard.cli import main
from gradguard.events.definitions import Attach, ForeignEvent


def damaged_log(path: Path) -> LogBuilder:
    """A clean 8-step run with garbage of every kind in between, and a last line torn mid-write."""
    with LogBuilder(path) as log:
        log.attach({"embed": 1})  # line 1
        log.clip(0, "embed", "embed.weight", 2.0)  # 2
        log.raw('{"ts": "2026-01-01T00:00:00Z", "level": "debug", "event": "intervention", "ru\n')  # 3: corrupt
        log.clip(1, "embed", "embed.weight", 3.0)  # 4
        log.raw("Epoch 1/10 - loss: 0.3412 - accuracy: 0.91\n")  # 5: another program's print
        log.raw('{"event": "epoch_end", "epoch": 1, "loss": 0.34}\n')  # 6: another program's JSON log
        log.raw("\n")  # 7: blank, ignored
        log.raw('{"ts": "x", "event": "intervention", "run": "run0", "step": 2, "action": "clip_norm"}\n')  # 8
        log.raw('{"ts": "x", "event": "intervention", "run": "run0", "step": "two"}\n')  # 9
        log.clip(2, "embed", "embed.weight", 4.0)  # 10
        log.raw("[1, 2, 3]\n")  # 11
        log.flush()
    with open(path, "ab") as handle:
        handle.write(
            b'{"ts": "2026-01-01T00:00:00Z", "event": "intervention", "run": "run0", "step": 2, "rule": "\xff"}\n'
        )  # 12
    with LogBuilder(path) as tail:
        tail.counts = log.counts
        for step in range(3, 8):
            tail.clip(step, "embed", "embed.weight", 5.0)  # 13-17
        tail.counters(7)  # 18
        tail.detach(8)  # 19
        tail.raw('{"ts": "2026-01-01T00:00:01Z", "level": "debug", "event": "interv')  # 20: torn mid-write
    return tail


def test_every_bad_line_is_reported_with_its_number_and_reason(tmp_path: Path) -> None:
    """Corrupt, foreign, non-UTF-8, malformed and torn lines are listed by line number; good lines all count."""
    path = tmp_path / "damaged.jsonl"
    log = damaged_log(path)
    result = CliRunner().invoke(main, ["audit", "--format", "json", str(path)])
    data = json.loads(result.stdout)
    assert result.exit_code == 1
    reasons = {bad["line"]: bad["reason"] for bad in data["bad_lines"]}
    assert sorted(reasons) == [3, 5, 6, 8, 9, 11, 12, 20]
    assert reasons[3].startswith("not JSON (Unterminated string")
    assert reasons[5].startswith("not JSON (Expecting value at column 1)")
    assert reasons[6] == "JSON without gradguard's 'event' and 'run' fields: a line from another program?"
    assert reasons[8] == (
        "gradguard 'intervention' event that does not fit its definition (Object missing required field `rule`)"
    )
    assert reasons[9].startswith("gradguard 'intervention' event with an invalid 'step' ('two'")
    assert reasons[11] == "a JSON list, not an event object: a line from another program?"
    assert reasons[12].startswith("not UTF-8 text")
    assert reasons[20].startswith("truncated last line (no newline at the end")
    assert data["bad_lines_total"] == 8
    assert data["files"] == [{"path": str(path), "lines": 20, "events": 11, "bad_lines": 8}]
    assert data["totals"] == log.counts == {"embed": {"clip_norm": 8}}
    assert data["mismatches"] == []
    assert "8 unreadable lines" in data["findings"]


def test_the_table_lists_bad_lines_as_file_line_reason_and_excerpt(tmp_path: Path) -> None:
    """In the table, each skipped line reads path:line: reason: the start of the line."""
    path = tmp_path / "damaged.jsonl"
    damaged_log(path)
    out = CliRunner().invoke(main, ["audit", str(path)]).output
    assert f"{path}:5: not JSON (Expecting value at column 1): a corrupt line, or a line from another program: " in out
    assert "Epoch 1/10 - loss: 0.3412 - accuracy: 0.91" in out
    assert f"{path}:20: truncated last line" in out


def test_a_last_line_missing_only_its_newline_is_read() -> None:
    """A complete event without the final newline loses nothing: it is read like any other line."""
    splitter = LineSplitter()
    assert splitter.feed(b'{"a": 1}\n{"b"') == (1, [b'{"a": 1}'])
    assert splitter.feed(b": 2}") == (2, [])
    assert splitter.finish() == (2, b'{"b": 2}')
    assert splitter.finish() is None


def test_complete_last_line_without_newline_counts_in_the_summary(tmp_path: Path) -> None:
    """The writer crashing just before the newline loses no event and is no finding."""
    path = tmp_path / "nonl.jsonl"
    with LogBuilder(path) as log:
        log.attach({"embed": 1})
        log.clip(0, "embed", "embed.weight", 2.0)
        log.detach(1)
    path.write_bytes(path.read_bytes().rstrip(b"\n"))
    result = CliRunner().invoke(main, ["audit", "--format", "json", str(path)])
    data = json.loads(result.stdout)
    assert result.exit_code == 0
    assert data["bad_lines_total"] == 0
    assert data["runs"][0]["ended"] == "detached (removed)"


def test_lines_split_across_chunks_come_out_whole() -> None:
    """Fed one byte at a time, the splitter gives the same numbered lines as fed at once."""
    data = b'{"x": 1}\n\n{"y": "\xc3\xa9"}\nlast'
    whole = LineSplitter()
    first, lines = whole.feed(data)
    assert (first, lines) == (1, [b'{"x": 1}', b"", b'{"y": "\xc3\xa9"}'])
    assert whole.finish() == (4, b"last")
    bytewise = LineSplitter()
    got: list[tuple[int, bytes | None]] = []
    for index in range(len(data)):
        start, pieces = bytewise.feed(data[index : index + 1])
        got.extend(enumerate(pieces, start))
    assert got == list(enumerate(lines, 1))
    assert bytewise.finish() == (4, b"last")


def test_an_overlong_line_is_dropped_as_it_streams_and_reading_goes_on() -> None:
    """A line over the limit is never held whole: it comes out as None, and the next line is intact."""
    splitter = LineSplitter(max_line=16)
    out: list[bytes | None] = []
    for _ in range(10):
        out.extend(splitter.feed(b"x" * 10)[1])
    out.extend(splitter.feed(b'x\n{"ok": 1}\n')[1])
    assert out == [None, b'{"ok": 1}']
    assert splitter.lines_done == 2


def test_read_line_accepts_gradguard_events_only() -> None:
    """An event needs an object with 'event' and 'run' strings, a non-negative integer step if any, and the fields
    of its definition; an unknown name is a foreign event, counted by name."""
    attach = b'{"event": "attach", "run": "a", "rank": 0, "schema": 1, "policy": null, "model": "M", "params": 2, '
    assert read_line(attach + b'"rules": {"r": 2}}') == Attach(
        run="a", schema=1, policy=None, model="M", params=2, rules={"r": 2}
    )
    assert read_line(attach + b'"rules": {"r": "two"}}') == (
        "gradguard 'attach' event that does not fit its definition (Expected `int`, got `str` - at `$.rules[...]`)"
    )
    assert read_line(b'{"event": "x", "run": "a", "rank": 1}') == ForeignEvent(event="x", run="a", rank=1)
    assert read_line(b"   ") is None
    assert read_line(b'{"event": "x", "run": "a", "step": -1}') == (
        "gradguard 'x' event with an invalid 'step' (-1; expected an integer >= 0)"
    )
    assert isinstance(read_line(b'{"event": "x", "run": "a", "step": true}'), str)
    assert isinstance(read_line(b'{"event": "counters", "run": "a", "step": true}'), str)
    assert isinstance(read_line(b"[" * 100_000), str)  # nested too deeply, reported not raised
    assert isinstance(read_line(b'{"event": "stats", "run": "a", "step": 1, "x": NaN}'), str)


def test_a_large_log_is_summarized_in_bounded_memory(tmp_path: Path) -> None:
    """Summarizing a 12,000-event log (about 5 MB) allocates a small, fixed amount (a read chunk and its lines)."""
    path = tmp_path / "large.jsonl"
    counts = write_synthetic_run(path, events=12_000, params=500)
    size = path.stat().st_size
    stats = ReadStats()
    summarizer = Summarizer([str(path)], stats)
    tracemalloc.start()
    try:
        summarizer.add_all(read_file(path, 0, stats))
        summary = summarizer.summary()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert summary.events >= 12_000
    assert summary.totals == counts
    assert summary.mismatches_total == 0
    assert size > 4_000_000
    assert peak < 3_500_000, f"peak {peak / 1e6:.1f} MB for a {size / 1e6:.0f} MB log"


_HOSTILE = (
    "9" * 5000,  # more digits than Python's int parser allows: ValueError from the JSON decoder
    "9" * 400,  # an int too large for a float: OverflowError where a number field becomes a float
    "-" + "9" * 400,
    "1e999",
    "-0",
    "null",
    "true",
    "[]",
    "{}",
    '"NaN"',
    '"-Infinity"',
    '{"a": [1, {"b": null}]}',
    "[" * 50 + "]" * 50,
    '"' + "x" * 2000 + '"',
)


def _fuzzed_lines(lines: list[str], seed: int) -> tuple[list[str], set[int]]:
    """Every line of ``lines`` with one value (top level or one level down) replaced by a hostile one, seeded;
    returns them with the line numbers that hold one of the two kinds that used to end in a traceback."""
    rng = random.Random(seed)
    out: list[str] = []
    digits: set[int] = set()
    for number, line in enumerate(lines, 1):
        event = json.loads(line)
        holder = event
        nested = [key for key, value in event.items() if isinstance(value, dict) and value]
        if nested and rng.random() < 0.4:
            holder = event[rng.choice(nested)]
        key = rng.choice(sorted(holder))
        value = _HOSTILE[number % 3] if number % 4 == 0 else rng.choice(_HOSTILE)
        holder[key] = "__HOSTILE__"
        out.append(json.dumps(event).replace('"__HOSTILE__"', value))
        if value == "9" * 5000:
            digits.add(number)
    return out, digits


def test_fuzzed_event_lines_are_listed_as_unreadable_and_never_end_the_audit(tmp_path: Path) -> None:
    """Hostile values in any field (5000-digit and float-overflowing integers too) cost a line, not the report."""
    clean = tmp_path / "clean.jsonl"
    write_synthetic_run(clean, events=400, params=12, seed=3)
    lines = clean.read_text().splitlines()
    for seed in range(4):
        fuzzed, digits = _fuzzed_lines(lines, seed)
        path = tmp_path / f"fuzzed{seed}.jsonl"
        path.write_text("\n".join(fuzzed) + "\n")
        for fmt in ("json", "table"):
            result = CliRunner().invoke(main, ["audit", "--format", fmt, str(path)])
            assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
            assert result.exit_code in (0, 1, 2), result.output[-2000:]
        data = json.loads(CliRunner().invoke(main, ["audit", "--format", "json", str(path)]).stdout)
        listed = {bad["line"] for bad in data["bad_lines"]}
        assert digits
        assert data["bad_lines_total"] > len(listed) or digits <= listed
        assert {line for line in digits if line <= max(listed)} <= listed  # the first 200 bad lines are listed
        assert data["bad_lines_total"] >= len(digits)


def test_an_integer_too_long_for_python_and_one_too_large_for_a_float_are_unreadable_lines(tmp_path: Path) -> None:
    """The two lines the log fuzz found are listed with their numbers and the audit exits 1."""
    path = tmp_path / "run.jsonl"
    with LogBuilder(path) as log:
        log.attach({"embed": 1})  # 1
        log.clip(0, "embed", "embed.weight", 2.0)  # 2
        head = '{"ts": "2026-01-01T00:00:01Z", "level": "info", "event": "intervention", "run": "run0", "rank": 0'
        log.raw(
            head
            + ', "step": 1, "rule": "embed", "action": "clip_norm", "param": "embed.weight", "before": '
            + "7" * 5000
            + "}\n"
        )  # 3
        log.raw(
            head
            + ', "step": 1, "rule": "embed", "action": "clip_norm", "param": "embed.weight", "before": '
            + "7" * 400
            + "}\n"
        )  # 4
        log.clip(2, "embed", "embed.weight", 3.0)  # 5
    result = CliRunner().invoke(main, ["audit", "--format", "json", str(path)])
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    reasons = {bad["line"]: bad["reason"] for bad in data["bad_lines"]}
    assert sorted(reasons) == [3, 4]
    assert "4300 digits" in reasons[3]
    assert reasons[4] == (
        "gradguard 'intervention' event that does not fit its definition (Number out of range - at `$.before`)"
    )
    assert data["totals"] == {"embed": {"clip_norm": 2}}


def test_a_line_with_invalid_utf8_or_a_number_no_writer_writes_is_unreadable_even_where_the_decoder_is_lenient(
    tmp_path: Path,
) -> None:
    """An encoded lone surrogate in a key the definition does not have, a 400-digit step, a 26-digit rank and a
    31-digit count (msgspec reads each): each is listed as unreadable with its line number, the rest is read."""
    path = tmp_path / "run.jsonl"
    head = '{"ts": "2026-01-01T00:00:01Z", "level": "info", "event": "intervention", "run": "run0", "rank": 0'
    clip = ', "rule": "embed", "action": "clip_norm", "param": "embed.weight", "before": 2.5, "after": 1.0}\n'
    with LogBuilder(path) as log:
        log.attach({"embed": 1})  # 1
        log.clip(0, "embed", "embed.weight", 2.0)  # 2
        log.raw(head + ', "step": ' + "1" + "0" * 400 + clip)  # 3: a step no writer writes
        log.raw(head.replace('"rank": 0', '"rank": 1' + "0" * 25) + ', "step": 1' + clip)  # 4: a rank either
        counters = '{"event": "counters", "run": "run0", "rank": 0, "step": 1, "steps": 2, "counters": {"embed": '
        log.raw(counters + '{"clip_norm": ' + "9" * 31 + "}}}\n")  # 5: a count
        log.flush()
    with open(path, "ab") as handle:
        line = head + ', "step": 1, "n\udc80": 1' + clip
        handle.write(line.encode("utf-8", "surrogatepass"))  # 6: invalid UTF-8 in a key the decoder skips
    with LogBuilder(path) as tail:
        tail.counts = log.counts
        tail.clip(2, "embed", "embed.weight", 3.0)  # 7
    data = json.loads(CliRunner().invoke(main, ["audit", "--format", "json", str(path)]).stdout)
    reasons = {bad["line"]: bad["reason"] for bad in data["bad_lines"]}
    assert sorted(reasons) == [3, 4, 5, 6], reasons
    assert reasons[3] == "a 401-digit integer: no gradguard writer writes one (a corrupt line)"
    assert reasons[4] == "a 26-digit integer: no gradguard writer writes one (a corrupt line)"
    assert reasons[5] == "a 31-digit integer: no gradguard writer writes one (a corrupt line)"
    assert reasons[6].startswith("not UTF-8 text (byte ")
    assert data["totals"]["embed"] == {"clip_norm": 2}
    for number, raw in enumerate(path.read_bytes().splitlines(), 1):
        assert isinstance(read_line(raw), str) == (number in reasons), number


def test_a_line_with_an_integer_the_standard_library_refuses_is_unreadable_wherever_the_integer_is(
    tmp_path: Path,
) -> None:
    """An integer of more than 4,300 digits (``json.loads`` refuses it) in a field the definition does not name,
    top level or nested, of a gradguard event or another program's: listed as unreadable with its line number, never
    counted as an event; the same digits in a string, or in a float, are a line the standard library reads."""
    digits = "7" * 5000
    head = '{"ts": "2026-01-01T00:00:01Z", "level": "debug", "event": "intervention", "run": "run0", "rank": 0'
    clip = ', "step": 1, "rule": "embed", "action": "clip_norm", "param": "embed.weight", "before": 2.5, "after": 1.0'
    path = tmp_path / "run.jsonl"
    with LogBuilder(path) as log:
        log.attach({"embed": 1})  # 1
        log.clip(0, "embed", "embed.weight", 2.0)  # 2
        log.raw(head + clip + ', "max_norm_2": ' + digits + "}\n")  # 3: a field no definition names
        log.raw(head + clip + ', "extra": {"a": [1, -' + digits + "]}}\n")  # 4: nested in one
        log.raw('{"event": "callback", "run": "run0", "step": 1, "value": ' + digits + "}\n")  # 5: a foreign event
        log.raw(head + clip + ', "note": "' + digits + '"}\n')  # 6: digits in a string: read
        log.raw(head + clip + ', "ratio": ' + digits + ".5}\n")  # 7: a float's digits: read
        log.clip(2, "embed", "embed.weight", 3.0)  # 8
    result = CliRunner().invoke(main, ["audit", "--format", "json", str(path)])
    data = json.loads(result.stdout)
    reasons = {bad["line"]: bad["reason"] for bad in data["bad_lines"]}
    assert sorted(reasons) == [3, 4, 5], reasons
    for line in (3, 4, 5):
        assert reasons[line].startswith("JSON Python cannot read (Exceeds the limit (4300 digits) for integer string")
    assert data["events"] == 5
    assert data["totals"] == {"embed": {"clip_norm": 4}}
    assert result.exit_code == 1  # unreadable lines are a finding
    for number, raw in enumerate(path.read_bytes().splitlines(), 1):
        assert isinstance(read_line(raw), str) == (number in reasons), number
        try:
            json.loads(raw)
        except ValueError:
            assert number in reasons, number
        else:
            assert number not in reasons, number


def test_a_long_line_whose_integer_is_refused_is_unreadable_in_a_chunk_of_short_ones_too(tmp_path: Path) -> None:
    """The reader looks for long integers only in a chunk that holds a line longer than the limit: one such line among
    a thousand short ones is found, and every short line around it is read."""
    path = tmp_path / "run.jsonl"
    head = '{"ts": "2026-01-01T00:00:01Z", "level": "debug", "event": "intervention", "run": "run0", "rank": 0'
    clip = ', "step": 500, "rule": "embed", "action": "clip_norm", "param": "embed.weight", "before": 2.5, "after": 1'
    with LogBuilder(path) as log:
        log.attach({"embed": 1})
        for step in range(1000):
            log.clip(step, "embed", "embed.weight", 2.0)
            if step == 500:
                log.raw(head + clip + ', "x": ' + "1" * 4301 + "}\n")
        log.detach(1000)
    stats = ReadStats()
    events = list(read_file(path, 0, stats))
    assert len(events) == 1002
    (bad,) = stats.bad_lines
    assert bad.line == 503
    assert bad.reason.startswith("JSON Python cannot read (Exceeds the limit (4300 digits)")


def test_several_files_read_in_batches_come_in_the_merged_order_of_their_records(tmp_path: Path) -> None:
    """Per-rank logs of uneven steps (and a file with no step at all): the batches, runs of one file's records
    gathered, hold the records of the record-by-record merge, in its order."""
    rng = random.Random(7)
    paths = []
    for rank in range(3):
        with LogBuilder(tmp_path / f"rank{rank}.jsonl", run=f"r{rank}", rank=rank) as log:
            log.attach({"clip": 3})
            step = 0
            for _ in range(rng.randrange(40, 400) if rank < 2 else 0):
                step += rng.choice((0, 0, 1, 2))
                log.clip(step, "clip", f"p{rng.randrange(3)}", 2.0)
            log.detach(step + 1)
        paths.append(log.path)
    merged = [(record.order, record.file, record.line) for record in read_merged(paths, ReadStats())]
    batches = list(read_batches(paths, ReadStats()))
    assert [(record.order, record.file, record.line) for batch in batches for record in batch] == merged
    assert len(batches) < len(merged) / 2  # runs of records, not one at a time


@pytest.mark.parametrize("gathered", [0, 1, 5, GATHERED])
def test_merged_batches_hold_heapq_merge_s_order_whatever_they_gather(gathered: int) -> None:
    """Random sorted streams cut into random batches (some empty): the merged batches are heapq.merge's items in its
    order; with ``gathered``, each batch but the last holds at least that many, without it each is one stream's run."""
    rng = random.Random(gathered)
    for _ in range(50):
        streams = []
        for index in range(rng.randrange(1, 6)):
            items = sorted((rng.randrange(60), index, line) for line in range(rng.randrange(0, 80)))
            cuts = sorted(rng.randrange(len(items) + 1) for _ in range(rng.randrange(0, 6)))
            streams.append([items[a:b] for a, b in zip([0, *cuts], [*cuts, len(items)], strict=True)])
        expected = list(heapq.merge(*([item for batch in batches for item in batch] for batches in streams)))
        batches = list(merged_batches([iter(batches) for batches in streams], gathered))
        assert [item for batch in batches for item in batch] == expected
        if gathered:
            assert all(len(batch) >= gathered for batch in batches[:-1])
        else:
            assert all(len({item[1] for item in batch}) == 1 for batch in batches)
