"""docs/api.md reads as Markdown where most users read it (GitHub), not only on the site (#50 item 7): its "At a
glance" part lists every public name of ``gradguard`` and of each ``gradguard.integrations`` module, with the
signature ``inspect.signature`` gives and one line, and this test holds that list to the code. The site's generated
reference below it is checked by tests/test_docs_site.py.

A signature is shown as ``inspect.signature`` gives it, written for a reader: ``typing.`` dropped, ``Annotated[X,
...]`` shown as ``X`` (pydantic's constraints are in the policy reference), the quotes of postponed annotations
dropped, and a class's ``-> None`` left out. ``python tests/test_api_page.py`` prints the lines the page must have.
"""

from __future__ import annotations

import importlib
import inspect
import re
import types
import typing
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import gradguard

PAGE = Path(__file__).resolve().parent.parent / "docs" / "api.md"
INTEGRATIONS = ("lightning", "transformers", "accelerate")
"""The modules of ``gradguard.integrations``, each public with its ``__all__``."""


def annotation_text(annotation: Any) -> str:
    """An annotation as a reader writes it: ``int | None``, ``Literal['tensor', 'group']``, ``tuple[Rule, ...]``."""
    if isinstance(annotation, str):
        return annotation
    if annotation is type(None):
        return "None"
    if annotation is Ellipsis:
        return "..."
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return annotation_text(args[0])
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(annotation_text(arg) for arg in args)
    if origin is typing.Literal:
        return f"Literal[{', '.join(repr(arg) for arg in args)}]"
    if origin is not None:
        name = getattr(origin, "__name__", None) or str(origin).replace("typing.", "")
        return f"{name}[{', '.join(annotation_text(arg) for arg in args)}]"
    if isinstance(annotation, type):
        return annotation.__name__
    return inspect.formatannotation(annotation).replace("typing.", "")


def signature_text(obj: Any) -> str | None:
    """``(model: nn.Module, policy: ..., *, ...)``: ``obj``'s signature as the page shows it; ``None`` where it has
    none of its own (an exception class that takes ``Exception``'s arguments)."""
    try:
        signature = inspect.signature(obj)
    except ValueError:
        return None
    shown = []
    keyword_only = False
    for parameter in signature.parameters.values():
        text = parameter.name
        if parameter.kind is parameter.VAR_POSITIONAL:
            text, keyword_only = f"*{text}", True
        elif parameter.kind is parameter.VAR_KEYWORD:
            text = f"**{text}"
        elif parameter.kind is parameter.KEYWORD_ONLY and not keyword_only:
            shown.append("*")
            keyword_only = True
        if parameter.annotation is not parameter.empty:
            text += f": {annotation_text(parameter.annotation)}"
        if parameter.default is not parameter.empty:
            text += f" = {parameter.default!r}"
        shown.append(text)
    returns = signature.return_annotation
    tail = "" if inspect.isclass(obj) or returns is signature.empty else f" -> {annotation_text(returns)}"
    return f"({', '.join(shown)}){tail}"


def public() -> dict[str, tuple[ModuleType, list[str]]]:
    """Each public module's heading on the page -> the module and its public names."""
    modules = {"gradguard": (gradguard, list(gradguard.__all__))}
    for name in INTEGRATIONS:
        module = importlib.import_module(f"gradguard.integrations.{name}")
        modules[module.__name__] = (module, list(module.__all__))
    return modules


def shown_item(module: ModuleType, name: str) -> str:
    """The code span the page shows for ``name``: its signature, or a constant's value."""
    obj = getattr(module, name)
    if not callable(obj):
        return f"{name} = {obj!r}"
    signature = signature_text(obj)
    return name if signature is None else f"{name}{signature}"


def page_items() -> dict[str, list[str]]:
    """The page's "At a glance" part: each module heading -> the leading code span of each of its bullets."""
    text = PAGE.read_text(encoding="utf-8")
    glance = text.split("## At a glance", 1)[1].split("\n## ", 1)[0]
    items: dict[str, list[str]] = {}
    current = None
    for line in glance.splitlines():
        heading = re.fullmatch(r"### `([\w.]+)`", line)
        if heading:
            current = items.setdefault(heading.group(1), [])
        elif line.startswith("- `") and current is not None:
            current.append(line[3 : line.index("`", 3)])
    return items


def test_every_public_name_is_on_the_page_under_its_module() -> None:
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    items = page_items()
    assert list(items) == list(public()), "the page's module headings, in this order"
    for heading, (_, names) in public().items():
        shown = [re.split(r"[( =]", item, maxsplit=1)[0] for item in items[heading]]
        assert shown == names, f"{heading}: the page lists {shown}; its __all__ is {names}"


def test_each_signature_on_the_page_is_the_one_inspect_gives() -> None:
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    items = page_items()
    for heading, (module, names) in public().items():
        for name, item in zip(names, items[heading], strict=True):
            assert item == shown_item(module, name), f"{heading}.{name}: the page shows {item!r}"


def test_each_public_name_has_a_line_saying_what_it_is() -> None:
    text = PAGE.read_text(encoding="utf-8").split("## At a glance", 1)[1].split("\n## ", 1)[0]
    bullets = [line for line in text.splitlines() if line.startswith("- `")]
    assert bullets
    assert all(re.search(r"`: \S.{10,}", bullet) for bullet in bullets), "each bullet: `signature`: what it is"


if __name__ == "__main__":
    for heading, (module, names) in public().items():
        print(f"### `{heading}`\n")
        for name in names:
            print(f"- `{shown_item(module, name)}`: ")
        print()
