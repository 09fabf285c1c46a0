"""The public surface: ``gradguard.__all__``, and an import that does not pull in torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import gradguard

EXPECTED = {
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
}


def test_all_is_sorted_and_is_the_expected_set():
    """gradguard.__all__ is sorted, has no duplicate, equals the expected names, and each one resolves."""
    assert gradguard.__all__ == sorted(gradguard.__all__)
    assert len(set(gradguard.__all__)) == len(gradguard.__all__)
    assert set(gradguard.__all__) == EXPECTED
    for name in gradguard.__all__:
        assert getattr(gradguard, name) is not None


def test_exception_hierarchy_is_as_documented():
    """PolicyError is a ValueError, GradientHalt and GuardStateError RuntimeErrors, all GradGuardErrors."""
    assert issubclass(gradguard.PolicyError, ValueError)
    assert issubclass(gradguard.GradientHalt, RuntimeError)
    assert issubclass(gradguard.GuardStateError, RuntimeError)
    for name in ("PolicyError", "GradientHalt", "GuardStateError"):
        assert issubclass(getattr(gradguard, name), gradguard.GradGuardError)
    assert issubclass(gradguard.GuardWarning, UserWarning)


def test_importing_gradguard_and_policy_does_not_import_torch(tmp_path):
    """`import gradguard; from gradguard import Policy` (and loading a policy file) leave torch unimported."""
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nrules:\n  - {name: a, match: '*', actions: [{action: clip_norm, max_norm: 1}]}\n")
    code = (
        "import json, sys\n"
        "import gradguard\n"
        "from gradguard import Policy, PolicyError\n"
        f"Policy.from_file({str(policy)!r})\n"
        "print(json.dumps(sorted(name for name in sys.modules if name == 'torch' or name.startswith('torch.'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert json.loads(out.stdout) == []


def test_gradguard_attribute_imports_torch_on_first_use():
    """gradguard.GradGuard is resolved lazily (and the same class every time); unknown names raise AttributeError."""
    from gradguard.guard import GradGuard

    assert gradguard.GradGuard is GradGuard
    with pytest.raises(AttributeError, match="NoSuchThing"):
        gradguard.NoSuchThing  # noqa: B018


def test_guarding_a_model_never_imports_a_training_framework():
    """Attaching and stepping a GradGuard imports no framework and no prometheus_client (extras)."""
    code = (
        "import json, sys, torch\n"
        "from gradguard import GradGuard, Policy\n"
        "model = torch.nn.Linear(2, 2)\n"
        "policy = Policy.from_dict({'version': 1, 'rules': [{'name': 'a', 'match': '*', "
        "'actions': [{'action': 'clip_norm', 'max_norm': 1.0}]}]})\n"
        "with GradGuard(model, policy, logger=None):\n"
        "    model(torch.ones(1, 2)).sum().backward()\n"
        "    torch.optim.SGD(model.parameters(), lr=0.1).step()\n"
        "frameworks = ('lightning', 'pytorch_lightning', 'transformers', 'accelerate', 'prometheus_client')\n"
        "print(json.dumps(sorted(n for n in sys.modules if n.split('.')[0] in frameworks)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert json.loads(out.stdout) == []
