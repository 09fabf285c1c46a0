"""The documentation site: it builds strictly, and its API page shows cross-references as links, never raw reST roles.

The docstrings are Google style (``Args:`` sections) with Markdown cross-references, resolved by
mkdocs-autorefs: ``[`GradientHalt`][gradguard.GradientHalt]`` for an object the site renders, plain
code (````Name````) for one it does not (a link to it would fail the strict build). A reST role
(``:class:`Name```) is not read by mkdocstrings and reached the page as raw text.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gradguard"

# A role as a docstring writes it, and as it reaches a rendered page (the backticks become <code>).
ROLE_IN_SOURCE = re.compile(r":(?:py:)?(?:class|meth|func|data|attr|mod|exc|obj|const):`")
ROLE_ON_PAGE = re.compile(r":(?:py:)?(?:class|meth|func|data|attr|mod|exc|obj|const):(?:`|<code>)")


def docstrings_with_roles(path: Path) -> list[int]:
    """The first lines of the docstrings of ``path`` (module, class, function, attribute) that use a reST role."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        and ROLE_IN_SOURCE.search(node.value.value)
    ]


def test_docstrings_use_no_rest_roles() -> None:
    found = {
        path.relative_to(ROOT).as_posix(): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if (lines := docstrings_with_roles(path))
    }
    assert not found, (
        "docstrings with a reST role (:class:`X` and the like; write [`X`][gradguard.X] for what the site "
        f"renders, ``X`` for the rest): {found}"
    )


def test_site_builds_strictly_and_shows_no_raw_role(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed")
    pytest.importorskip("mkdocstrings", reason="the docs extra is not installed")
    site = tmp_path / "site"
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stdout}\n{built.stderr}"

    pages = sorted(site.rglob("*.html"))
    assert pages
    raw = {
        page.relative_to(site).as_posix(): sorted(set(ROLE_ON_PAGE.findall(page.read_text(encoding="utf-8"))))
        for page in pages
        if ROLE_ON_PAGE.search(page.read_text(encoding="utf-8"))
    }
    assert not raw, f"raw reST roles on rendered pages: {raw}"

    # The cross-references became links to the objects rendered on the API page (not plain text).
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    links = set(re.findall(r'<a class="autorefs autorefs-internal"[^>]* href="#([^"]+)"', api))
    for anchor in ("gradguard.Policy", "gradguard.errors.GradientHalt", "gradguard.GradGuard.remove"):
        assert anchor in links, f"no link to {anchor} on the API page (links to: {sorted(links)})"
    # Google-style "Args:" sections render as parameter tables, not as a paragraph that starts "Args:".
    assert "<p>Args:" not in api
