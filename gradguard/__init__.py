"""gradguard: a training-safety guard for PyTorch.

Map parameter-name patterns to gradient actions in a policy file, wrap any training loop with
``GradGuard(model, policy)``, and read every intervention back from a JSON-lines audit log.

Importing the package does not import torch: policies can be loaded and validated without it
(``gradguard validate`` answers in well under a second). ``GradGuard`` imports it on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gradguard.errors import (
    GradGuardError,
    GradientHalt,
    GuardStateError,
    GuardWarning,
    PolicyError,
    PolicyIssue,
    UnsupportedOptimizerError,
)
from gradguard.events.counters import Counters
from gradguard.policy.document import Policy
from gradguard.policy.schema import ClipNorm, ClipValue, Drop, HaltOnNonfinite, Rule, Scale, SkipStepOnNonfinite, Zero

if TYPE_CHECKING:
    from gradguard.guard import GradGuard

__all__ = [
    "ClipNorm",
    "ClipValue",
    "Counters",
    "Drop",
    "GradGuard",
    "GradGuardError",
    "GradientHalt",
    "GuardStateError",
    "GuardWarning",
    "HaltOnNonfinite",
    "Policy",
    "PolicyError",
    "PolicyIssue",
    "Rule",
    "Scale",
    "SkipStepOnNonfinite",
    "UnsupportedOptimizerError",
    "Zero",
]

__version__ = "0.2.0"


def __getattr__(name: str) -> Any:
    if name == "GradGuard":
        from gradguard.guard import GradGuard

        return GradGuard
    raise AttributeError(f"module 'gradguard' has no attribute {name!r}")
