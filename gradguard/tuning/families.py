"""Families of parameters: names with their layer index folded, merged where their norms are alike.

``blocks.3.attn.qkv.weight`` and ``blocks.7.attn.qkv.weight`` are one family, ``blocks.*.attn.qkv.weight``:
the first segment of the dotted name that is a number (the layer index) is folded into ``*``. Later
numbers are kept: in ``blocks.3.mlp.0.weight`` and ``blocks.3.mlp.2.weight`` they name different roles
(an ``nn.Sequential``'s up and down projections) whose gradients can differ several-fold. Families whose
median norms lie within a factor of each other are then merged (``merge_alike``), so a policy has one rule
per kind of gradient rather than one per layer type (and nested indices, ``stages.*.blocks.4``, collapse
there when their norms agree). A family's pattern is a glob where the glob matches exactly its members
among the recorded names (a policy's ``*`` also crosses dots), else an RE2 ``re:`` pattern with ``\\d+``
for the folded index.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from gradguard.policy.patterns import REGEX_PREFIX, pattern_matcher
from gradguard.tuning.histogram import LogHistogram

__all__ = ["Family", "family_key", "family_pattern", "merge_alike"]


def family_key(name: str) -> str:
    """The first all-digit segment folded into ``*``: ``blocks.3.mlp.0.weight`` -> ``blocks.*.mlp.0.weight``."""
    parts = name.split(".")
    for position, part in enumerate(parts):
        if part.isdigit():
            parts[position] = "*"
            break
    return ".".join(parts)


def family_pattern(key: str, members: set[str], names: Iterable[str]) -> str:
    """A policy pattern for the family ``key`` that matches exactly ``members`` among ``names``."""
    glob = pattern_matcher(key)
    if all(glob(name) == (name in members) for name in names):
        return key
    parts = (r"\d+" if part == "*" else re.escape(part) for part in key.split("."))  # only the folded index is "*"
    return REGEX_PREFIX + r"\.".join(parts)


@dataclass
class Family:
    """Parameters whose norms are summarised together, and what the log showed of them."""

    keys: list[str]
    """The folded names it is made of (one; several after merging)."""
    members: set[str] = field(default_factory=set)
    histogram: LogHistogram = field(default_factory=LogHistogram)
    """``ln(norm)`` of every finite, positive recorded norm of every member."""
    by_member: dict[str, LogHistogram] = field(default_factory=dict)
    """The same, member by member: each tensor's norms are measured against its own median."""
    zeros: int = 0
    nonfinite: int = 0

    @property
    def samples(self) -> int:
        return self.histogram.total

    def merged_with(self, others: Sequence[Family]) -> Family:
        out = Family([*self.keys, *(key for other in others for key in other.keys)])
        out.members = self.members.union(*(other.members for other in others))
        out.histogram = self.histogram.merged(other.histogram for other in others)
        out.by_member = {name: h for family in (self, *others) for name, h in family.by_member.items()}
        out.zeros = self.zeros + sum(other.zeros for other in others)
        out.nonfinite = self.nonfinite + sum(other.nonfinite for other in others)
        return out


def merge_alike(families: Sequence[Family], within: float, centre: Callable[[Family], float]) -> list[Family]:
    """Merge families whose ``centre`` (a median ``ln(norm)``) lies within ``ln(within)`` of the lowest one of a run.

    Families are taken in order of their centre; a family joins the current merged one while its centre is
    at most a factor ``within`` above the merged one's first (so a chain of small steps cannot drift far).
    """
    ordered = sorted(families, key=centre)
    out: list[Family] = []
    run: list[Family] = []
    reach = math.log(within)
    for family in ordered:
        if run and centre(family) - centre(run[0]) > reach:
            out.append(run[0].merged_with(run[1:]))
            run = []
        run.append(family)
    if run:
        out.append(run[0].merged_with(run[1:]))
    return out
