"""gradguard: a training-safety guard for PyTorch.

Map parameter-name patterns to gradient actions in a policy file, wrap any training loop with
``GradGuard(model, policy)``, and read every intervention back from a JSON-lines audit log.
"""

from gradguard._counters import Counters
from gradguard._errors import (
    GradGuardError,
    GradientHalt,
    GuardStateError,
    GuardWarning,
    PolicyError,
    PolicyIssue,
)
from gradguard._guard import GradGuard
from gradguard._policy import ClipNorm, ClipValue, HaltOnNonfinite, Policy, Rule, Scale, Zero

__all__ = [
    "ClipNorm",
    "ClipValue",
    "Counters",
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
    "Zero",
]

__version__ = "0.1.0"
