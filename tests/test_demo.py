"""``gradguard demo``: a real small training where the spike is clipped and the NaN halts, weights untouched.

The demo runs twice, in parallel: once in this process through click's CliRunner, and once as the
installed ``gradguard`` command in a subprocess (started first, collected last).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from gradguard.cli import main

SPIKE_STEP, NAN_STEP = 40, 90


def _command() -> list[str]:
    script = Path(sys.executable).with_name("gradguard")
    found = str(script) if script.exists() else shutil.which("gradguard")
    assert found, "the gradguard console script is not installed"
    return [found]


@pytest.fixture(scope="module")
def demo_process(tmp_path_factory) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """``gradguard demo --log tmp/x.jsonl`` started in a fresh directory; killed if nobody waits for it."""
    cwd = tmp_path_factory.mktemp("demo-subprocess")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [*_command(), "demo", "--log", "tmp/x.jsonl"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    yield process, cwd
    if process.poll() is None:
        process.kill()
        process.communicate()


def _check_demo(output: str, log: Path, read_audit) -> None:
    """What the demo must show: loss falls, the spike is clipped, the NaN halts with weights unchanged, a log."""
    losses = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", output)
    assert losses, output
    assert float(losses.group(2)) < float(losses.group(1)) / 10
    spike = re.search(rf"step\s+{SPIKE_STEP}\s.*clipped this step:\s+(\d+)", output)
    assert spike, output
    assert int(spike.group(1)) > 0
    assert re.search(rf"step\s+{NAN_STEP}\s+HALT", output), output
    assert "parameters after the halt: unchanged" in output
    assert str(log) in output

    events = read_audit(log)
    assert events[0]["event"] == "attach"
    assert events[-1]["event"] == "detach"
    assert any(event["event"] == "intervention" and event["step"] == SPIKE_STEP for event in events)
    (halt,) = [event for event in events if event["event"] == "halt"]
    assert halt["step"] == NAN_STEP
    assert halt["kind"] == "nan"
    assert halt["params"]
    # where the demo's NaN starts: blocks.0.mlp's output, in the forward pass, named in the halt itself
    assert (halt["origin"]["phase"], halt["origin"]["module"]) == ("forward", "blocks.0.mlp")
    assert "It started in the forward pass: blocks.0.mlp was the first module whose output went nan" in output
    assert not [event for event in events if event.get("step", -1) > NAN_STEP]


def test_demo_through_click_runner(demo_process, read_audit, tmp_path):
    """CliRunner: exit 0, loss falls, the spike is clipped, the halt names blocks.0.mlp's forward and leaves
    weights unchanged, the log is written."""
    log = tmp_path / "demo.jsonl"
    result = CliRunner().invoke(main, ["demo", "--log", str(log)])
    assert result.exit_code == 0, result.output
    _check_demo(result.output, log, read_audit)


def test_demo_as_the_installed_command(demo_process, read_audit):
    """The installed `gradguard demo --log tmp/x.jsonl`: exit 0, same story, the log under the relative path."""
    process, cwd = demo_process
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    log = cwd / "tmp" / "x.jsonl"
    assert log.exists()
    _check_demo(output, Path("tmp/x.jsonl"), lambda _: read_audit(log))


def test_the_demo_trains_on_one_torch_thread_and_gives_the_process_its_threads_back(tmp_path):
    """A model this small runs several times faster on one thread (4.0 s against 16.8 s on 2 busy cores)."""
    import torch

    from gradguard.cli.demo import run_demo

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen: list[int] = []
    try:
        run_demo(log_path=tmp_path / "demo.jsonl", steps=3, say=lambda _line: seen.append(torch.get_num_threads()))
        assert set(seen) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
