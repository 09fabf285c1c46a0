"""``gradguard audit --follow``: a log still being written is read as it grows, and Ctrl-C stops cleanly."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from click.testing import CliRunner
from support.synthetic_log import LogBuilder

from gradguard.cli import main


def wait_for(predicate: object, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def _ctrl_c_as_in_a_terminal() -> None:
    """SIGINT back to its default in the follower: a test run started in the background (``nohup .ci/run &``)
    ignores it, the follower inherits that, and Python then installs no KeyboardInterrupt handler: the follower
    would rightly go on, as ``tail -f`` run so does (round 6: faulthandler showed it still polling 60 s after)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_follow_updates_the_summary_as_lines_arrive_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    """A follower started on a growing log shows new events, and SIGINT ends it with a summary, no traceback."""
    log_path = tmp_path / "live.jsonl"
    out_path = tmp_path / "out.txt"
    writer = LogBuilder(log_path, run="live")
    writer.attach({"embed": 1})
    writer.clip(0, "embed", "embed.weight", 2.0)
    writer.flush()
    with open(out_path, "w") as out, open(tmp_path / "err.txt", "w") as err:
        follower = subprocess.Popen(
            [sys.executable, "-m", "gradguard.cli", "audit", str(log_path), "--follow", "--interval", "0.1"],
            stdout=out,
            stderr=err,
            # faulthandler: a follower still alive long after Ctrl-C is made to print every thread's stack (below).
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"},
            preexec_fn=_ctrl_c_as_in_a_terminal,
        )
    try:
        assert wait_for(lambda: re.search(r"embed +clip_norm +1 ", out_path.read_text())), out_path.read_text()
        for step in range(1, 6):
            writer.clip(step, "embed", "embed.weight", 3.0)
        writer.nonfinite(6, "embed", "embed.weight", "nan")
        writer.flush()
        assert wait_for(lambda: re.search(r"embed +clip_norm +6 ", out_path.read_text())), out_path.read_text()
        assert "following 1 file (Ctrl-C to stop); updated" in out_path.read_text()
    finally:
        follower.send_signal(signal.SIGINT)
        try:
            code = follower.wait(timeout=60)
        except subprocess.TimeoutExpired:
            follower.send_signal(signal.SIGABRT)  # faulthandler writes where each thread is to err.txt
            follower.wait(timeout=20)
            stacks = (tmp_path / "err.txt").read_text()
            raise AssertionError(f"the follower did not exit within 60 s of Ctrl-C; its threads:\n{stacks}") from None
        finally:
            writer.close()
    assert code == 1  # the NaN is a finding
    assert "Traceback" not in (tmp_path / "err.txt").read_text()
    assert "1 non-finite gradient (exit 1)" in out_path.read_text()


def test_follow_reads_a_line_written_in_two_pieces_once_it_is_complete(tmp_path: Path) -> None:
    """A line half-written when polled is held back, then read whole: it is neither lost nor reported as torn."""
    log_path = tmp_path / "live.jsonl"
    with LogBuilder(log_path, run="live") as writer:
        writer.attach({"embed": 1})
    line = json.dumps(
        {
            "ts": "2026-01-01T00:00:01Z",
            "event": "intervention",
            "run": "live",
            "rank": 0,
            "step": 0,
            "rule": "embed",
            "action": "clip_norm",
            "param": "embed.weight",
            "before": 2.0,
            "after": 1.0,
        }
    )

    def append() -> None:
        time.sleep(0.4)
        with open(log_path, "a") as handle:
            handle.write(line[:40])
        time.sleep(0.4)
        with open(log_path, "a") as handle:
            handle.write(line[40:] + "\n")

    thread = threading.Thread(target=append)
    thread.start()
    result = CliRunner().invoke(
        main, ["audit", str(log_path), "--follow", "--interval", "0.05", "--format", "json", "--follow-timeout", "1.6"]
    )
    thread.join()
    documents = [json.loads(text) for text in result.stdout.splitlines()]
    assert len(documents) >= 2  # one JSON document per update
    assert documents[0]["intervention_events"] == 0
    final = documents[-1]
    assert final["intervention_events"] == 1
    assert final["bad_lines_total"] == 0
    assert result.exit_code == 0
