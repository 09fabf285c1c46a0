"""``Policy``: a validated, immutable policy document, from a file or a dict."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gradguard.policy.loading import load_policy_file, load_policy_text, validate_policy_data
from gradguard.policy.schema import PolicyFields

__all__ = ["Policy"]


class Policy(PolicyFields):
    """A validated, immutable gradient policy.

    Build one with [`from_file`][gradguard.Policy.from_file] or [`from_dict`][gradguard.Policy.from_dict]; both raise
    [`PolicyError`][gradguard.PolicyError] with the file, line and field of every problem.
    [`shipped`][gradguard.Policy.shipped] loads one of the policies that come with gradguard, by name.
    """

    def __eq__(self, other: object) -> bool:
        """Policies are equal when their rules and sections are (a file, and the dict it holds)."""
        if not isinstance(other, Policy):
            return NotImplemented
        return self._sections() == other._sections()

    def __hash__(self) -> int:
        return hash(self._sections())

    def _sections(self) -> tuple[Any, ...]:
        return (self.version, self.rules, self.loss, self.recovery, self.rerun, self.ranks)

    @property
    def source(self) -> str:
        """Where the policy came from: a file path, or ``<dict>``."""
        return self._source

    def rule_location(self, index: int) -> str:
        """``file:line`` of ``rules[index]`` where known, else the source alone."""
        line = self._rule_lines[index] if index < len(self._rule_lines) else None
        return self._source if line is None else f"{self._source}:{line}"

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Policy:
        """Load and validate a policy from a ``.yaml``/``.yml``, ``.toml`` or ``.json`` file."""
        return load_policy_file(cls, path)

    @classmethod
    def load(cls, where: str | os.PathLike[str]) -> Policy:
        """A policy file's path, or the name of a shipped policy (``"default"``, ``"llm-pretraining"``).

        A path that exists wins: a file called ``default`` in the working directory is that file, not the
        shipped policy. Everything that takes a policy path (``GradGuard``, the integrations' callbacks,
        ``gradguard validate`` and ``explain``) takes a shipped name the same way.
        """
        source = os.fspath(where)
        if not Path(source).exists() and not Path(source).suffix:
            return cls.shipped(source)  # an unknown name: its error lists the names there are
        if not Path(source).exists():
            from gradguard.policy.shipped import shipped_policies

            if any(source == found.file_name for found in shipped_policies()):
                return cls.shipped(source)
        return cls.from_file(source)

    @property
    def file_path(self) -> str | None:
        """The file this policy was read from, or ``None`` (a dict, a shipped policy)."""
        source = self._source
        return None if source.startswith("<") or not Path(source).is_file() else source

    @classmethod
    def shipped(cls, name: str) -> Policy:
        """Load a policy shipped with gradguard by its name: ``default``, ``llm-pretraining``, ...

        ``gradguard policies`` lists them with what each is for; ``gradguard policies NAME`` prints one
        to start a policy of your own. An unknown name is a [`PolicyError`][gradguard.PolicyError] listing the
        names there are.
        """
        from gradguard.policy.shipped import shipped_policy

        found = shipped_policy(name)
        return load_policy_text(cls, found.text(), found.format, found.source)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "<dict>") -> Policy:
        """Validate a policy given as plain data, with the same checks and errors as a file."""
        return validate_policy_data(cls, data, source=source, locate=None)
