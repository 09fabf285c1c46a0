"""Every code block of the documentation runs, parses or validates, as ``tests/support/docs.py`` lays down.

Python blocks run in a subprocess in an empty directory; each page's console transcript runs in order
in one directory holding a copy of ``policies/``; bash blocks are parsed and their commands looked up;
policy blocks are validated. Blocks marked ``<!-- example: NAME -->`` are left to their dedicated tests,
and every such name must have one.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.docs import (
    DEDICATED_EXAMPLES,
    DEDICATED_TRANSCRIPTS,
    LANGUAGES,
    ROOT,
    Block,
    blocks,
    pages,
    policy_data,
)

from gradguard import Policy, PolicyError
from gradguard.cli import main

ALL = [block for page in pages() for block in blocks(page)]
_EXIT = re.compile(r"\s+# exit (\d+)\b.*$")


def _unique(language: str) -> list[Block]:
    """The page's blocks of ``language``, each distinct text once (the README repeats the quick start)."""
    seen: dict[str, Block] = {}
    for block in ALL:
        if block.language == language and "example" not in block.marks:
            seen.setdefault(block.code, block)
    return list(seen.values())


def _run(command: list[str], cwd: Path, **environment: str) -> subprocess.CompletedProcess[str]:
    """``command`` in ``cwd`` with this checkout's gradguard and this interpreter's scripts first."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PATH": path, "PYTHONPATH": python_path, "OMP_NUM_THREADS": "1", **environment}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)


def _page_directory(page: str, directory: Path) -> Path:
    """``directory`` with the page's ``<!-- file: NAME -->`` blocks written into it."""
    for block in ALL:
        if block.page == page and "file" in block.marks:
            (directory / block.marks["file"]).write_text(block.code, encoding="utf-8")
    return directory


def test_every_fence_names_a_known_language():
    """A fence says what it holds (python, console, bash, yaml, toml, json, text), so the tests know what to do."""
    unknown = [f"{block.where}: {block.language or '(none)'}" for block in ALL if block.language not in LANGUAGES]
    assert not unknown, f"fences with no or an unknown language (use one of {', '.join(LANGUAGES)}): {unknown}"


def test_every_marked_example_has_its_dedicated_test():
    """Each `<!-- example: NAME -->` is registered, marked once, and its test file reads it by that name."""
    marked = [block.marks["example"] for block in ALL if "example" in block.marks]
    assert sorted(marked) == sorted(DEDICATED_EXAMPLES), "register new examples in support.docs.DEDICATED_EXAMPLES"
    for name, test_file in DEDICATED_EXAMPLES.items():
        source = (ROOT / test_file).read_text(encoding="utf-8")
        assert re.search(rf"documented_example\([^)]*\"{re.escape(name)}\"", source), (
            f"{test_file} never reads {name!r}"
        )
    assert all(block.language == "python" for block in ALL if "example" in block.marks)


@pytest.mark.parametrize("block", _unique("python"), ids=lambda block: block.where)
def test_the_python_block_runs_as_written(block: Block, tmp_path: Path):
    """The block is a whole program: run alone, in an empty directory, it exits 0."""
    script = _page_directory(block.page, tmp_path) / "docs_example.py"
    script.write_text(block.code, encoding="utf-8")
    done = _run([sys.executable, script.name], tmp_path)
    assert done.returncode == 0, f"{block.where} failed:\n{(done.stdout + done.stderr)[-4000:]}"


def _transcript_pages() -> list[str]:
    return sorted({block.page for block in ALL if block.language == "console"} - set(DEDICATED_TRANSCRIPTS))


def test_every_page_left_to_a_dedicated_transcript_test_has_one():
    """A page in DEDICATED_TRANSCRIPTS has console blocks, and its test file reads that page."""
    for page, test_file in DEDICATED_TRANSCRIPTS.items():
        assert any(block.page == page and block.language == "console" for block in ALL), page
        assert Path(page).name in (ROOT / test_file).read_text(encoding="utf-8"), f"{test_file} never reads {page}"


@pytest.mark.parametrize("page", _transcript_pages())
def test_the_console_transcripts_of_the_page_run_with_the_exit_codes_shown(page: str, tmp_path: Path):
    """Each `$ command` of the page's console blocks, in order, in a clone-like directory, exits as shown."""
    shutil.copytree(ROOT / "policies", tmp_path / "policies")
    _page_directory(page, tmp_path)
    for block in ALL:
        if block.page != page or block.language != "console":
            continue
        commands = [line[2:] for line in block.code.splitlines() if line.startswith("$ ")]
        assert commands, f"{block.where}: a console block without a `$ ` command (use ```text for output alone)"
        for command in commands:
            expected = _EXIT.search(command)
            done = _run(["bash", "-c", command], tmp_path)
            want = int(expected.group(1)) if expected else 0
            assert done.returncode == want, (
                f"{block.where}: `{command}` exited {done.returncode}, not {want}:\n"
                + (done.stdout + done.stderr)[-3000:]
            )


@pytest.mark.parametrize("block", _unique("bash"), ids=lambda block: block.where)
def test_the_bash_block_parses_and_names_real_commands(block: Block):
    """bash -n accepts it; every `gradguard SUBCOMMAND` exists and every `python FILE.py` is in the repository."""
    parsed = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True, check=False)
    assert parsed.returncode == 0, f"{block.where}: {parsed.stderr}"
    for line in block.code.splitlines():
        words = shlex.split(line, comments=True)
        for index, word in enumerate(words[:-1]):
            following = words[index + 1]
            if word == "gradguard" and not following.startswith("-"):
                assert following in main.commands, f"{block.where}: no `gradguard {following}` command"
            if word in {"python", "python3"} and following.endswith(".py"):
                assert (ROOT / following).is_file(), f"{block.where}: no file {following}"


@pytest.mark.parametrize(
    "block", [block for block in ALL if block.language in {"yaml", "toml", "json"}], ids=lambda block: block.where
)
def test_the_policy_block_validates(block: Block):
    """A policy (or a list of rules) shown in the docs is a valid one, unless marked as a mistake."""
    if "invalid" in block.marks:
        with pytest.raises(PolicyError):
            Policy.from_dict(policy_data(block), source=block.where)
        return
    Policy.from_dict(policy_data(block), source=block.where)


def test_the_readme_stays_a_front_page():
    """README.md is at most 250 lines and keeps the set-up contract: the two commands, exactly."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    assert "python -m pip install torch==2.13.0 -e . && gradguard demo\n" in readme
    assert "python -m pip install torch==2.13.0 -e '.[test]' && python -m pytest\n" in readme


def test_the_readme_links_only_to_pages_there_are():
    """Every relative link of the README to docs/ names a file that exists (GitHub shows them as they are)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert targets
    assert [target for target in targets if not (ROOT / target).is_file()] == []


def test_every_page_is_in_the_site_navigation():
    """mkdocs.yml's nav lists each docs/*.md page (mkdocs only notes a page left out; the tests refuse it)."""
    nav = re.findall(r"^\s+- [^:#]+: ([\w-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(encoding="utf-8"), re.M)
    assert sorted(nav) == sorted(path.name for path in (ROOT / "docs").glob("*.md"))


def test_the_site_builds_strict_where_mkdocs_is_installed(tmp_path: Path):
    """`mkdocs build --strict` (broken links, missing API references are errors); the docs extra provides it."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings", reason="the docs extra is not installed: pip install -e '.[docs]'")
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    done = _run(command, ROOT, NO_MKDOCS_2_WARNING="1")
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
