"""docs/choosing-thresholds.md is real: its suggest/replay output is what they print (its Python blocks run in
test_docs_examples.py, as every page's)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "choosing-thresholds.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)
REPRODUCED = (
    "gradguard suggest run.jsonl -o suggested.yaml",
    "cat suggested.yaml",
    "gradguard validate suggested.yaml",
    "gradguard replay suggested.yaml run.jsonl",
    "gradguard replay suggested.yaml run.jsonl --format json",
)


def _blocks(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(PAGE.read_text()) if lang == language]


def _console() -> dict[str, str]:
    """Each ``$ command`` of the page's console blocks -> what the page says it printed."""
    out: dict[str, str] = {}
    for block in _blocks("console"):
        for part in re.split(r"^\$ ", block, flags=re.M)[1:]:
            command, _, printed = part.partition("\n")
            out[command] = printed.rstrip("\n")
    return out


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600, check=False, env=env)


def test_the_suggest_and_replay_output_shown_is_what_the_commands_print(tmp_path: Path) -> None:
    """After the page's recording block, suggest, cat, validate and replay print exactly what the page shows."""
    assert _run([sys.executable, "-c", _blocks("python")[0]], tmp_path).returncode == 0
    shown = _console()
    gradguard = str(Path(sys.executable).with_name("gradguard"))
    for command in REPRODUCED:
        words = command.split()
        args = [gradguard, *words[1:]] if words[0] == "gradguard" else words
        done = _run(args, tmp_path)
        assert done.returncode == 0, done.stderr
        assert (done.stdout + done.stderr).rstrip("\n") == shown[command], command


def test_every_console_command_runs_a_tool_of_the_walk_through() -> None:
    """Console blocks hold only `$ gradguard ...` and `$ cat ...` commands, each with its output."""
    commands = _console()
    assert commands
    assert all(command.split()[0] in ("gradguard", "cat") for command in commands), sorted(commands)
