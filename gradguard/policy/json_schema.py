"""The policy's JSON Schema, for editors: completion, hover docs and checks while a policy is written.

Generated from the pydantic models (``PolicyFields`` and the classes under it), so it cannot drift
from what the loader accepts; ``gradguard schema`` prints it, and the shipped
``policies/gradguard-policy.schema.json`` is its output (a test holds them equal). Beyond what
pydantic writes it adds the draft-2020-12 ``$schema``, a title and description, the top-level
``$schema`` key a policy may carry, and the single-pattern form of ``match``/``exclude``. What a
JSON Schema cannot say (an empty step window, duplicate rule names, which parameters a pattern
matches) is still checked by ``gradguard validate`` and ``gradguard explain``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gradguard.policy.schema import PolicyFields

__all__ = ["JSON_SCHEMA_DIALECT", "SCHEMA_FILE_NAME", "policy_json_schema", "render_policy_json_schema"]

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
SCHEMA_FILE_NAME = "gradguard-policy.schema.json"
"""The file name the schema ships under, beside the policies in ``policies/``."""

_DESCRIPTION = (
    "A gradguard policy: rules that map parameter-name patterns to gradient actions (clip_norm, "
    "clip_value, zclip, autoclip, agc, scale, zero, drop, halt_on_nonfinite, skip_step_on_nonfinite, "
    "skip_step_on_spike, monitor), enforced at every "
    "optimizer step by GradGuard(model, policy), and an optional recovery section that turns a halt into a "
    "rewind to an in-memory snapshot. Check a file with `gradguard validate`, and against a "
    "model with `gradguard explain`."
)


def policy_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a policy document."""
    generated = PolicyFields.model_json_schema()
    defs: dict[str, Any] = generated.get("$defs", {})
    for definition in defs.values():
        _plain_backticks(definition)
    rule = defs["Rule"]["properties"]
    for key in ("match", "exclude"):
        # The loader also takes one pattern as a plain string.
        array = rule[key]
        described = {name: array.pop(name) for name in ("title", "description", "default") if name in array}
        rule[key] = {**described, "anyOf": [{"type": "string", "minLength": 1}, array]}
    properties = {
        "$schema": {
            "description": "Where editors find this JSON Schema (a path or URL); gradguard ignores it.",
            "title": "$schema",
            "type": "string",
        },
        **generated["properties"],
    }
    for value in properties.values():
        _plain_backticks(value)
    top = {key: value for key, value in generated.items() if key not in ("$defs", "properties", "title", "description")}
    return {
        "$schema": JSON_SCHEMA_DIALECT,
        "title": "gradguard policy",
        "description": _DESCRIPTION,
        **top,
        "properties": properties,
        "$defs": defs,
    }


def render_policy_json_schema() -> str:
    """The schema as ``gradguard schema`` prints it and as it ships: indented JSON ending in a newline."""
    return json.dumps(policy_json_schema(), indent=2, ensure_ascii=False) + "\n"


_CROSS_REFERENCE = re.compile(r"\[(`[^`]+`)\]\[[\w.]+\]")


def _plain_backticks(node: Any) -> None:
    """Docstrings write ``x``, [`X`][gradguard.X] (a link on the site) and ``None``; a policy file says `x`, `null`."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "description" and isinstance(value, str):
                value = _CROSS_REFERENCE.sub(r"\1", value)  # [`X`][gradguard.X]: the site's link, `X` here
                node[key] = value.replace("``None``", "``null``").replace("``", "`")
            else:
                _plain_backticks(value)
    elif isinstance(node, list):
        for item in node:
            _plain_backticks(item)
