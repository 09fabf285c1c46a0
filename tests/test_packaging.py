"""The wheel and sdist carry the shipped policies and their schema, and work installed, outside the clone.

The artefacts are built once per session by setuptools' own PEP 517 hooks (what ``pip wheel .
--no-build-isolation`` runs), from a copy of the checkout, so the checkout gets no ``build/`` folder.
The wheel is then unpacked into a folder put first on ``PYTHONPATH`` and run from an empty directory:
the code and the policies come from the wheel alone (a test checks where they were read from).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

import gradguard

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_FILES = sorted(path.name for path in (ROOT / "policies").iterdir() if path.is_file())

# What a build never needs, and what would be slow or wrong to copy (a virtual environment, caches).
_NOT_COPIED = shutil.ignore_patterns(
    ".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", "site", ".*_cache", "*.jsonl"
)


@dataclass(frozen=True)
class Built:
    wheel: Path
    sdist: Path
    installed: Path
    """The wheel unpacked, as pip would lay it out in site-packages."""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    base = tmp_path_factory.mktemp("packaging")
    source, out = base / "source", base / "dist"
    shutil.copytree(ROOT, source, ignore=_NOT_COPIED)
    hooks = "from setuptools import build_meta as b; b.build_wheel({0!r}); b.build_sdist({0!r})".format(str(out))
    done = subprocess.run(
        [sys.executable, "-c", hooks], cwd=source, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    installed = base / "site-packages"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(installed)
    return Built(wheel, sdist, installed)


def _run_installed(built: Built, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(built.installed), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def test_the_package_list_names_every_package_of_the_source_tree():
    """pyproject's explicit package list is every gradguard package plus policies, all under the root."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    found = {".".join(path.parent.relative_to(ROOT).parts) for path in (ROOT / "gradguard").rglob("__init__.py")}
    assert sorted(config["packages"]) == sorted({*found, "gradguard.policies"})
    # Every package where its name puts it: the editable install is then a plain path entry (next test).
    assert config["package-dir"] == {"": "."}
    assert (ROOT / "gradguard" / "policies").resolve() == (ROOT / "policies").resolve()


def test_the_editable_install_is_a_plain_path_entry(tmp_path: Path):
    """`pip install -e .` builds a wheel whose .pth puts the checkout on sys.path: no import hook to outrank."""
    source, out = tmp_path / "source", tmp_path / "dist"
    shutil.copytree(ROOT, source, ignore=_NOT_COPIED, symlinks=True)
    hook = f"from setuptools import build_meta as b; b.build_editable({str(out)!r})"
    done = subprocess.run(
        [sys.executable, "-c", hook], cwd=source, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        top_level = [name for name in archive.namelist() if "/" not in name]
        (pth,) = top_level
        assert pth.endswith(".pth"), top_level
        assert archive.read(pth).decode().strip() == str(source)


def test_gradguard_imports_from_a_directory_that_holds_a_folder_named_gradguard(tmp_path: Path):
    """Beside a clone (or any folder called gradguard), `import gradguard` finds the installed package."""
    (tmp_path / "gradguard").mkdir()
    script = "import gradguard; print(gradguard.GradGuard.__module__, gradguard.__file__)"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    module, file = done.stdout.split()
    assert module == "gradguard.guard"
    assert Path(file).resolve() == Path(gradguard.__file__).resolve()


def test_the_wheel_holds_every_file_of_policies_and_the_version(built: Built):
    """unzip -l of the wheel: every file of policies/ under gradguard/policies/, py.typed, and __version__."""
    names = set(zipfile.ZipFile(built.wheel).namelist())
    assert {f"gradguard/policies/{name}" for name in SHIPPED_FILES} <= names
    assert "gradguard/policies/gradguard-policy.schema.json" in names
    assert "gradguard/py.typed" in names
    assert built.wheel.name.startswith(f"gradguard-{gradguard.__version__}-py3-none-any")


def test_the_sdist_holds_every_file_of_policies(built: Built):
    """The sdist holds policies/ as gradguard/policies/, plain files, so a build from it finds them there."""
    with tarfile.open(built.sdist) as archive:
        names = set(archive.getnames())
        assert all(member.isfile() for member in archive.getmembers() if "/policies/" in member.name)
    top = f"gradguard-{gradguard.__version__}"
    assert {f"{top}/gradguard/policies/{name}" for name in SHIPPED_FILES} <= names
    assert f"{top}/pyproject.toml" in names


def test_policy_shipped_loads_from_the_installed_wheel_outside_the_clone(built: Built, tmp_path: Path):
    """Run from an empty directory, gradguard and its policies are the wheel's, and every policy loads."""
    script = (
        "import gradguard; from gradguard import Policy; from gradguard.policy.shipped import shipped_policies\n"
        "print(gradguard.__file__)\n"
        "for entry in shipped_policies(): print(Policy.shipped(entry.name).source)\n"
    )
    done = _run_installed(built, tmp_path, "-c", script)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 1 + len(SHIPPED_FILES) - 1  # the schema is no policy
    for line in lines:
        assert Path(line).is_relative_to(built.installed), line


def test_gradguard_policies_and_the_demo_run_from_the_installed_wheel(built: Built, tmp_path: Path):
    """`gradguard policies` lists, `gradguard policies default` prints, `gradguard demo` halts at the NaN."""
    listed = _run_installed(built, tmp_path, "-m", "gradguard.cli", "policies")
    assert listed.returncode == 0, listed.stderr
    assert "llm-pretraining.yaml" in listed.stdout
    printed = _run_installed(built, tmp_path, "-m", "gradguard.cli", "policies", "default")
    assert printed.returncode == 0, printed.stderr
    assert (built.installed / "gradguard" / "policies" / "gradguard-policy.schema.json").as_uri() in printed.stdout
    demo = _run_installed(built, tmp_path, "-m", "gradguard.cli", "demo", "--log", "demo.jsonl")
    assert demo.returncode == 0, (demo.stdout + demo.stderr)[-3000:]
    assert "halted at step 90 on nan; parameters after the halt: unchanged" in demo.stdout
    assert str(built.installed / "gradguard" / "policies" / "llm-pretraining.yaml") in demo.stdout
    assert (tmp_path / "demo.jsonl").stat().st_size > 0


def test_the_version_is_written_once_and_the_changelog_names_it():
    """The installed metadata is gradguard.__version__, and CHANGELOG.md's newest release is that version."""
    assert importlib.metadata.version("gradguard") == gradguard.__version__
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", changelog, re.M)
    assert releases[0] == gradguard.__version__
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in pyproject["project"], "the version belongs in gradguard/__init__.py only"
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gradguard.__version__"}


def test_python_dash_m_gradguard_runs_the_gradguard_command_in_a_fresh_interpreter(tmp_path: Path):
    """``python -m gradguard`` (issue 58: "No module named gradguard.__main__") is the ``gradguard`` command: its help
    names it by how it was run, and a subcommand works, from an empty directory."""
    helped = subprocess.run(
        [sys.executable, "-m", "gradguard", "--help"], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("Usage: python -m gradguard [OPTIONS] COMMAND [ARGS]..."), helped.stdout
    validated = subprocess.run(
        [sys.executable, "-m", "gradguard", "validate", "default"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert validated.returncode == 0, validated.stderr
    assert validated.stdout == "default: ok (3 rules: nonfinite, explosions, health)\n"
