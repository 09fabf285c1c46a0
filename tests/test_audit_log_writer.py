"""The audit log is written by a background thread: nothing is lost, lines are whole, and exits flush."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import torch
from torch import nn

from gradguard import GradGuard, Policy
from gradguard.events.log import EventLog

CLIP = Policy.from_dict(
    {"version": 1, "rules": [{"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 1e-3}]}]}
)


def read_events(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_events_emitted_from_several_threads_are_all_written_as_whole_lines_after_flush(tmp_path: Path) -> None:
    """4 threads x 500 events, then flush(): 2,000 valid JSON lines, each thread's events in its own order."""
    path = tmp_path / "threads.jsonl"
    log = EventLog(audit_log=path, logger=None, context={"run": "t", "rank": 0})

    def emit(thread: int) -> None:
        for index in range(500):
            log.emit("debug", "intervention", thread=thread, index=index, value=float("nan"))

    threads = [threading.Thread(target=emit, args=(thread,)) for thread in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert log.flush(timeout=30)
    events = read_events(path)
    log.close()
    assert len(events) == 2000
    for thread in range(4):
        assert [e["index"] for e in events if e["thread"] == thread] == list(range(500))
    assert all(e["value"] == "NaN" for e in events)


def test_guard_flush_makes_a_running_guards_events_readable(tmp_path: Path) -> None:
    """guard.flush() mid-run: the clips of the steps so far are in the file before the guard is removed."""
    path = tmp_path / "live.jsonl"
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradGuard(model, CLIP, audit_log=path, logger=None) as guard:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).sum().backward()
            opt.step()
        assert guard.flush(timeout=30)
        interventions = [e for e in read_events(path) if e["event"] == "intervention"]
        assert len(interventions) == guard.counters.snapshot()["clip"]["clip_norm"] == 6


def run_script(body: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(body), encoding="utf-8")
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)


TRAIN = """
    import sys, torch
    from torch import nn
    from gradguard import GradGuard, Policy
    policy = Policy.from_dict({"version": 1, "rules": [
        {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 1e-3}]}]})
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GradGuard(model, policy, audit_log=sys.argv[0] + ".jsonl", logger=None)
    for _ in range(50):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).sum().backward()
        opt.step()
"""


def test_every_event_reaches_the_file_when_the_process_ends_on_an_uncaught_exception(tmp_path: Path) -> None:
    """50 clipped steps, then an uncaught exception: 100 interventions and the interpreter-exit detach are written."""
    done = run_script(TRAIN + "    raise RuntimeError('the user code failed')\n", tmp_path)
    assert done.returncode == 1
    assert "the user code failed" in done.stderr
    events = read_events(tmp_path / "run.py.jsonl")
    assert sum(e["event"] == "intervention" for e in events) == 100
    assert events[-1]["event"] == "detach"
    assert events[-1]["reason"] == "interpreter-exit"
    assert events[-1]["counters"] == {"clip": {"clip_norm": 100}}


def test_every_event_reaches_the_file_on_a_normal_exit_without_remove(tmp_path: Path) -> None:
    """The script ends with the guard still attached: all events, then the detach, are in the file."""
    done = run_script(TRAIN, tmp_path)
    assert done.returncode == 0, done.stderr
    events = read_events(tmp_path / "run.py.jsonl")
    assert [e["event"] for e in events[:1]] == ["attach"]
    assert sum(e["event"] == "intervention" for e in events) == 100
    assert events[-1]["event"] == "detach"
