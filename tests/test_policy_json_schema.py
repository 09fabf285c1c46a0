"""``gradguard schema``: the policy JSON Schema for editors, and the shipped copy that must never drift."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from gradguard import Policy, PolicyError
from gradguard.cli import main
from gradguard.policy.schema import ACTION_NAMES

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
POLICIES = REPO / "policies"
SHIPPED_SCHEMA = POLICIES / "gradguard-policy.schema.json"
MODELINE = "# yaml-language-server: $schema=./gradguard-policy.schema.json"


def schema_output() -> str:
    result = CliRunner().invoke(main, ["schema"])
    assert result.exit_code == 0, result.output
    return result.output


def test_the_shipped_schema_file_is_exactly_what_the_schema_command_prints():
    """policies/gradguard-policy.schema.json equals `gradguard schema` (regenerate it with --output if not)."""
    assert SHIPPED_SCHEMA.read_text(encoding="utf-8") == schema_output(), (
        "regenerate: gradguard schema --output policies/gradguard-policy.schema.json"
    )


def test_schema_output_writes_the_same_text_to_a_file(tmp_path: Path):
    """`gradguard schema --output FILE` writes what it would print, and says where on stderr."""
    target = tmp_path / "policy.schema.json"
    result = CliRunner().invoke(main, ["schema", "--output", str(target)])
    assert result.exit_code == 0, result.output
    assert target.read_text(encoding="utf-8") == schema_output()
    assert f"written to {target}" in result.output


def test_the_schema_is_draft_2020_12_with_a_title_and_the_policy_fields():
    """The schema names its dialect and title, requires version and rules, allows $schema, forbids other keys."""
    schema = json.loads(schema_output())
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["title"] == "gradguard policy"
    assert schema["type"] == "object"
    assert schema["required"] == ["version", "rules"]
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == {"$schema", "version", "rules"}
    assert schema["properties"]["version"]["const"] == 1
    assert schema["properties"]["rules"]["minItems"] == 1


def _action_schemas(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    actions = schema["$defs"]["Rule"]["properties"]["actions"]["items"]
    refs = [option["$ref"].rsplit("/", 1)[-1] for option in actions["oneOf"]]
    return {schema["$defs"][ref]["properties"]["action"]["const"]: schema["$defs"][ref] for ref in refs}


def test_every_action_is_enumerated_with_its_required_fields():
    """Each action of the policy model appears once, discriminated by `action`, with its required fields."""
    schema = json.loads(schema_output())
    actions = _action_schemas(schema)
    assert sorted(actions) == sorted(ACTION_NAMES)
    assert schema["$defs"]["Rule"]["properties"]["actions"]["items"]["discriminator"]["propertyName"] == "action"
    assert actions["clip_norm"]["required"] == ["action", "max_norm"]
    assert actions["clip_value"]["required"] == ["action", "limit"]
    assert actions["scale"]["required"] == ["action", "factor"]
    assert actions["clip_norm"]["properties"]["scope"]["enum"] == ["tensor", "group"]
    assert all(action["additionalProperties"] is False for action in actions.values())


def test_rules_take_one_pattern_or_a_list_and_carry_field_descriptions():
    """`match` is a string or a non-empty list, as the loader accepts; docstrings become descriptions."""
    schema = json.loads(schema_output())
    rule = schema["$defs"]["Rule"]
    assert rule["required"] == ["name", "match", "actions"]
    match = rule["properties"]["match"]
    assert match["anyOf"][0] == {"type": "string", "minLength": 1}
    assert match["anyOf"][1]["type"] == "array"
    assert match["anyOf"][1]["minItems"] == 1
    assert "re:<regex>" in match["description"]
    assert "``" not in json.dumps(schema)  # reStructuredText markup turned into plain backticks
    assert rule["properties"]["allow_no_match"]["description"]
    assert _action_schemas(schema)["clip_norm"]["properties"]["max_norm"]["description"]


def test_shipped_yaml_policies_start_with_the_schema_modeline_and_still_load():
    """Each shipped YAML policy's first line points yaml-language-server at the schema; the file loads."""
    for path in sorted(POLICIES.glob("*.yaml")):
        assert path.read_text(encoding="utf-8").splitlines()[0] == MODELINE, path.name
        assert Policy.from_file(path).rules


def test_shipped_json_and_toml_policies_name_the_schema_and_still_load():
    """vision.json carries a "$schema" key and the TOML policy taplo's #:schema line; both load unchanged."""
    vision = POLICIES / "vision.json"
    data = json.loads(vision.read_text(encoding="utf-8"))
    assert data["$schema"] == "./gradguard-policy.schema.json"
    without = {key: value for key, value in data.items() if key != "$schema"}
    assert Policy.from_file(vision) == Policy.from_dict(without)
    toml = POLICIES / "finetune-frozen-backbone.toml"
    assert toml.read_text(encoding="utf-8").splitlines()[0] == "#:schema ./gradguard-policy.schema.json"
    assert Policy.from_file(toml) == Policy.from_dict(tomllib.loads(toml.read_text(encoding="utf-8")))
    assert (POLICIES / data["$schema"]).resolve() == SHIPPED_SCHEMA


def test_a_schema_key_must_be_a_string():
    """A top-level $schema that is not a string is a PolicyError; other unknown keys stay errors."""
    rules = [{"name": "a", "match": "*", "actions": [{"action": "zero"}]}]
    with pytest.raises(PolicyError, match=r"\$schema must be a string"):
        Policy.from_dict({"$schema": 3, "version": 1, "rules": rules})
    with pytest.raises(PolicyError, match="unknown field 'schema'"):
        Policy.from_dict({"schema": "x", "version": 1, "rules": rules})


def _shipped_documents() -> list[tuple[str, Any]]:
    documents = []
    for path in sorted(POLICIES.iterdir()):
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".yaml":
            documents.append((path.name, yaml.safe_load(text)))
        elif path.suffix == ".toml":
            documents.append((path.name, tomllib.loads(text)))
        elif path.suffix == ".json" and path != SHIPPED_SCHEMA:
            documents.append((path.name, json.loads(text)))
    return documents


def test_every_shipped_policy_validates_against_the_json_schema():
    """With jsonschema installed, every shipped policy is valid under the schema (and a broken one is not)."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SHIPPED_SCHEMA.read_text(encoding="utf-8"))
    validator = jsonschema.Draft202012Validator(schema)
    for name, document in _shipped_documents():
        assert not list(validator.iter_errors(document)), name
    broken = {"version": 1, "rules": [{"name": "a", "match": "*", "actions": [{"action": "clip_norm"}]}]}
    assert list(validator.iter_errors(broken))


def test_the_schema_command_does_not_import_torch():
    """`gradguard schema` answers without importing torch."""
    code = (
        "import sys\n"
        "from gradguard.cli import main\n"
        "try:\n"
        "    main(['schema'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('torch imported:', 'torch' in sys.modules, file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60, cwd=REPO
    )
    assert "torch imported: False" in done.stderr
    assert json.loads(done.stdout)["title"] == "gradguard policy"
