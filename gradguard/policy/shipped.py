"""The policies gradguard ships, read from the installed package wherever the code runs.

The files live in the repository's top-level ``policies/``, which ``gradguard/policies`` links to, and
install as the data package ``gradguard.policies``, so a wheel, an sdist install, an editable install
and a zip import all find them through ``importlib.resources.files``. A checkout without the link (git
on Windows without symbolic links) reads the checkout's ``policies/`` instead: the same files.

``Policy.shipped(name)`` loads one; ``gradguard policies`` lists them and prints one to start a
policy of one's own.
"""

from __future__ import annotations

import importlib.resources
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gradguard.errors import PolicyError, PolicyIssue
from gradguard.policy.json_schema import SCHEMA_FILE_NAME
from gradguard.policy.loading import did_you_mean

if TYPE_CHECKING:
    if sys.version_info >= (3, 11):
        from importlib.resources.abc import Traversable
    else:
        from importlib.abc import Traversable

__all__ = ["SHIPPED_PURPOSES", "ShippedPolicy", "policies_folder", "shipped_policies", "shipped_policy"]

SHIPPED_PURPOSES: dict[str, str] = {
    "default": "any model, transparent on a healthy run: halt on NaN/Inf, clip a tensor's explosion, watch health",
    "finetune-frozen-backbone": "fine-tuning: early layers held still, the backbone slowed and clipped, head clipped",
    "llm-adaptive": "decoder LLM pretraining with adaptive thresholds: spike skips, AutoClip, ZClip per tensor",
    "per-tensor-clip": "0.2.0's default: halt on NaN/Inf, clip each gradient's norm to 1.0, watch gradient health",
    "llm-pretraining": "decoder LLM pretraining: embeddings, attention and router clipped apart, a warm-up clip",
    "vision": "convolutional nets: conv weights clipped by value, norm layers and the classifier by norm",
}
"""What each shipped policy is for, by name (its file name without the suffix): one line each."""

_FORMATS = {".yaml": "yaml", ".yml": "yaml", ".toml": "toml", ".json": "json"}
_SCHEMA_REFERENCE = "./" + SCHEMA_FILE_NAME


@dataclass(frozen=True)
class ShippedPolicy:
    """One shipped policy file: its name, what it is for, and where it is installed."""

    name: str
    """The file name without its suffix, e.g. ``default``."""
    purpose: str
    """One line on what it is for."""
    file: Traversable
    """The installed file."""

    @property
    def file_name(self) -> str:
        return self.file.name

    @property
    def format(self) -> str:
        """``yaml``, ``toml`` or ``json``."""
        return _FORMATS[Path(self.file.name).suffix.lower()]

    @property
    def source(self) -> str:
        """Where it was read from, as errors and the audit log's ``attach`` event name it."""
        return str(self.file)

    def text(self) -> str:
        return self.file.read_text(encoding="utf-8")

    def text_for_a_copy(self) -> str:
        """The text to start a policy of one's own from, its schema reference usable wherever it is saved.

        The shipped files point editors at the schema beside them (``./gradguard-policy.schema.json``),
        which a copy saved elsewhere would not find: the reference becomes the installed schema's
        ``file://`` URI, or, where the schema is no plain file (a zip import), the line is dropped.
        """
        schema = policies_folder() / SCHEMA_FILE_NAME
        lines = self.text().splitlines(keepends=True)
        if isinstance(schema, Path) and schema.is_file():
            return "".join(line.replace(_SCHEMA_REFERENCE, schema.resolve().as_uri()) for line in lines)
        return "".join(line for line in lines if _SCHEMA_REFERENCE not in line)


def policies_folder() -> Traversable:
    """The folder holding the shipped policies and their JSON Schema."""
    installed = importlib.resources.files("gradguard").joinpath("policies")
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parents[2] / "policies"  # a checkout without the link: its own


def shipped_policies() -> tuple[ShippedPolicy, ...]:
    """Every shipped policy, by name."""
    found = [
        ShippedPolicy(Path(entry.name).stem, SHIPPED_PURPOSES.get(Path(entry.name).stem, ""), entry)
        for entry in policies_folder().iterdir()
        if Path(entry.name).suffix.lower() in _FORMATS and entry.name != SCHEMA_FILE_NAME
    ]
    return tuple(sorted(found, key=lambda policy: policy.name))


def shipped_policy(name: str) -> ShippedPolicy:
    """The shipped policy called ``name`` (``default``, or its file name ``default.yaml``).

    An unknown name is a [`PolicyError`][gradguard.PolicyError] that lists the names there are.
    """
    every = shipped_policies()
    for policy in every:
        if name in (policy.name, policy.file_name):
            return policy
    names = [policy.name for policy in every]
    message = (
        f"no shipped policy is called {name!r}{did_you_mean(name, names)}; the shipped policies are: "
        f"{', '.join(names)} "
        "(`gradguard policies` lists them; for a file of your own, give its path where you gave the name "
        "(GradGuard(model, 'my-policy.yaml')))"
    )
    raise PolicyError([PolicyIssue(f"<shipped policy {name!r}>", None, "", message)], head="no such policy")
