"""The fenced code blocks of the documentation (``docs/*.md`` and ``README.md``), as the tests read them.

The convention every page follows (``tests/test_docs_examples.py`` holds it; ``docs/development.md``
explains it to writers):

- A fence always names its language: ``python``, ``console``, ``bash``, ``yaml``, ``toml``, ``json``
  or ``text``. A fence without one, or with another, fails the tests.
- Markers are HTML comments on the lines right above a fence (invisible on GitHub and in the site):
  ``<!-- example: NAME -->`` (a python block run by a dedicated test, listed in
  :data:`DEDICATED_EXAMPLES`), ``<!-- file: NAME -->`` (the block is also written to NAME in the
  page's working directory, for the page's python and console blocks to use) and ``<!-- invalid -->``
  (a policy block shown as an example of a mistake: it must fail validation).
- ``python``: a whole program; it runs in a fresh interpreter in an empty directory and must exit 0.
- ``console``: a transcript. Lines starting with ``$ `` are commands, run with bash in order, per page,
  in one directory that holds a copy of the repository's ``policies/`` (as a clone does); a trailing
  ``# exit N`` gives a command's expected exit status (else 0). Other lines are output, shown for the
  reader and not compared.
- ``bash``: commands for the reader to run in their own setting (installs, long benchmarks, torchrun);
  not run, but parsed (``bash -n``), and each ``gradguard SUBCOMMAND`` and ``python FILE.py`` must exist.
- ``yaml``/``toml``/``json``: a policy, or a list of rules as written under ``rules:``; validated
  with ``Policy.from_dict`` (a list is wrapped as ``{version: 1, rules: [...]}``).
- ``text``: output or an illustration; not checked.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = [
    "DEDICATED_EXAMPLES",
    "DEDICATED_TRANSCRIPTS",
    "LANGUAGES",
    "ROOT",
    "Block",
    "blocks",
    "documented_example",
    "pages",
    "policy_data",
]

ROOT = Path(__file__).resolve().parent.parent.parent

LANGUAGES = ("python", "console", "bash", "yaml", "toml", "json", "text")

DEDICATED_EXAMPLES: dict[str, str] = {
    "accelerate": "tests/test_integration_transformers.py",
    "ddp": "tests/test_docs_distributed_examples.py",
    "deepspeed": "tests/test_docs_distributed_examples.py",
    "fsdp2": "tests/test_docs_distributed_examples.py",
    "hf-trainer": "tests/test_integration_transformers.py",
    "lightning": "tests/test_integration_lightning.py",
    "metrics": "tests/test_live_metrics.py",
    "pipeline": "tests/test_docs_distributed_examples.py",
    "timm": "tests/test_recovery_schedulers.py",
    "which-rank": "tests/test_docs_distributed_examples.py",
}
"""Each ``<!-- example: NAME -->`` block and the test file that runs it (and checks what it does)."""

DEDICATED_TRANSCRIPTS: dict[str, str] = {
    "docs/choosing-thresholds.md": "tests/test_docs_choosing_thresholds.py",
}
"""Pages whose console transcripts need what the page's python made (a recorded run's log), and the test
file that runs them there and compares their output with the page's, byte for byte."""

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARK = re.compile(r"^<!-- ([a-z][\w-]*)(?::\s*(.*?))?\s*-->$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its text and the markers above it."""

    page: str
    """The page's path from the repository root, e.g. ``docs/frameworks.md``."""
    line: int
    """The 1-based line of the opening fence."""
    language: str
    code: str
    marks: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """Every page whose blocks the tests read: ``docs/*.md`` and ``README.md``."""
    return [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, in order; an unclosed fence is an error."""
    lines = page.read_text(encoding="utf-8").splitlines()
    name = page.relative_to(ROOT).as_posix()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        end = next((i for i in range(index + 1, len(lines)) if lines[i].rstrip() == "```"), None)
        if end is None:
            raise AssertionError(f"{name}:{index + 1}: a fence that is never closed")
        marks: dict[str, str] = {}
        above = index - 1
        while above >= 0 and (mark := _MARK.match(lines[above])):
            marks[mark.group(1)] = mark.group(2) or ""
            above -= 1
        code = "".join(line + "\n" for line in lines[index + 1 : end])
        found.append(Block(name, index + 1, opening.group(1), code, marks))
        index = end + 1
    return found


def documented_example(page: str, name: str) -> str:
    """The code of the python block marked ``<!-- example: NAME -->`` on ``page`` (e.g. ``docs/distributed.md``)."""
    marked = [
        block.code for block in blocks(ROOT / page) if block.marks.get("example") == name and block.language == "python"
    ]
    assert len(marked) == 1, f"{page} has {len(marked)} python blocks marked 'example: {name}', not one"
    return marked[0]


def policy_data(block: Block) -> dict[str, Any]:
    """The policy a yaml/toml/json block shows, a bare list of rules wrapped as a whole policy."""
    if block.language == "toml":
        data: Any = tomllib.loads(block.code)
    elif block.language == "json":
        data = json.loads(block.code)
    else:
        data = yaml.safe_load(textwrap.dedent(block.code))
    if isinstance(data, list):
        return {"version": 1, "rules": data}
    assert isinstance(data, dict), f"{block.where}: a policy block holds a mapping or a list of rules"
    return data
