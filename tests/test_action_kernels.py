"""The action interface: every action a policy can name has exactly one kernel, and kernels agree with it."""

from __future__ import annotations

import typing

from gradguard.enforce.actions import kernel_for
from gradguard.enforce.actions.base import ActionKernel
from gradguard.policy import schema


def _action_classes() -> list[type]:
    union = typing.get_args(schema.Action)[0]
    return list(typing.get_args(union))


def _name(cls: type) -> str:
    (literal,) = typing.get_args(cls.model_fields["action"].annotation)
    return str(literal)


def test_every_schema_action_has_a_kernel_that_names_it():
    """Each action class of the policy schema maps to a kernel whose ``schemas`` lists that class."""
    classes = _action_classes()
    assert {_name(cls) for cls in classes} == set(schema.ACTION_NAMES)
    for cls in classes:
        action = cls.model_validate(_minimal(cls))
        kernel = kernel_for(action)
        assert isinstance(kernel, ActionKernel)
        assert cls in kernel.schemas


def test_only_the_non_finite_watch_is_a_watcher():
    """halt and skip watch (their verdict comes with the raw norms); every other action changes gradients."""
    classes = _action_classes()
    watchers = {_name(cls) for cls in classes if kernel_for(cls.model_validate(_minimal(cls))).watches}
    assert watchers == {"halt_on_nonfinite", "skip_step_on_nonfinite"}


def _minimal(cls: type) -> dict[str, object]:
    required = {"clip_norm": {"max_norm": 1.0}, "clip_value": {"limit": 1.0}, "scale": {"factor": 0.5}}
    name = _name(cls)
    return {"action": name, **required.get(name, {})}
