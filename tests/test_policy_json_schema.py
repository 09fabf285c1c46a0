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
    assert set(schema["properties"]) == {"$schema", "version", "rules", "loss", "recovery", "rerun", "ranks"}
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


def test_the_recovery_section_and_max_scaler_skips_are_in_the_schema_with_their_bounds_and_defaults():
    """`recovery` is an optional object (or null) requiring snapshot_every; its keys carry the loader's bounds,
    defaults and documentation; halt_on_nonfinite has min_loss_scale (1.0, or null) and max_scaler_skips
    (null, or at least 1)."""
    schema = json.loads(schema_output())
    assert schema["properties"]["recovery"]["anyOf"] == [{"$ref": "#/$defs/Recovery"}, {"type": "null"}]
    assert schema["properties"]["recovery"]["default"] is None
    assert "recovery" not in schema["required"]
    recovery = schema["$defs"]["Recovery"]
    assert recovery["required"] == ["snapshot_every"]
    assert recovery["additionalProperties"] is False
    fields = recovery["properties"]
    assert list(fields) == ["snapshot_every", "keep", "min_age", "skip_steps", "max_rewinds", "lr_factor", "memory"]
    assert {key: field.get("default") for key, field in fields.items()} == {
        "snapshot_every": None,
        "keep": 2,
        "min_age": 10,
        "skip_steps": 10,
        "max_rewinds": 3,
        "lr_factor": 1.0,
        "memory": "auto",
    }
    assert fields["memory"]["enum"] == ["device", "host", "auto"]
    assert fields["snapshot_every"]["minimum"] == 1
    assert fields["keep"]["minimum"] == 1
    assert fields["min_age"]["minimum"] == fields["skip_steps"]["minimum"] == fields["max_rewinds"]["minimum"] == 0
    assert fields["lr_factor"]["exclusiveMinimum"] == 0
    assert fields["lr_factor"]["maximum"] == 1
    assert all(field["description"] for field in fields.values())
    halt = _action_schemas(schema)["halt_on_nonfinite"]["properties"]
    assert halt["max_scaler_skips"]["default"] is None
    assert halt["max_scaler_skips"]["anyOf"] == [{"minimum": 1, "type": "integer"}, {"type": "null"}]
    assert halt["min_loss_scale"]["default"] == 1.0
    assert halt["min_loss_scale"]["anyOf"][0]["exclusiveMinimum"] == 0
    assert halt["min_loss_scale"]["anyOf"][1] == {"type": "null"}
    assert "DeepSpeed" in halt["min_loss_scale"]["description"]
    good = {
        "version": 1,
        "rules": HALT,
        "recovery": {"snapshot_every": 100, "keep": 1, "min_age": 0, "skip_steps": 0, "max_rewinds": 0, "lr_factor": 1},
    }
    assert subset_errors(schema, good, schema) == []
    assert Policy.from_dict(good).recovery is not None


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


_ANNOTATIONS = {"$schema", "$defs", "title", "description", "default", "discriminator"}
_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "null": type(None),
}


def subset_errors(node: dict[str, Any], value: Any, root: dict[str, Any], where: str = "$") -> list[str]:
    """A JSON Schema check for exactly the keywords the generated schema uses (it fails on any other).

    Stands in for the jsonschema package where that is not installed: enough to show that the schema
    accepts every shipped policy and rejects broken ones.
    """
    errors: list[str] = []
    for keyword, expected in node.items():
        if keyword in _ANNOTATIONS:
            continue
        if keyword == "$ref":
            errors += subset_errors(root["$defs"][expected.rsplit("/", 1)[-1]], value, root, where)
        elif keyword == "type":
            python_type = _TYPES[expected]
            if not isinstance(value, python_type) or (expected in ("integer", "number") and isinstance(value, bool)):
                errors.append(f"{where}: not {expected}")
        elif keyword == "const" and value != expected:
            errors.append(f"{where}: {value!r} != {expected!r}")
        elif keyword == "enum" and value not in expected:
            errors.append(f"{where}: {value!r} not in {expected}")
        elif keyword == "required" and isinstance(value, dict):
            errors += [f"{where}: {name} missing" for name in expected if name not in value]
        elif keyword == "properties" and isinstance(value, dict):
            for name, sub in expected.items():
                if name in value:
                    errors += subset_errors(sub, value[name], root, f"{where}.{name}")
        elif keyword == "additionalProperties" and isinstance(value, dict):
            assert expected is False
            errors += [f"{where}: extra {name}" for name in value if name not in node.get("properties", {})]
        elif keyword == "items" and isinstance(value, list):
            for index, item in enumerate(value):
                errors += subset_errors(expected, item, root, f"{where}[{index}]")
        elif keyword == "minItems" and isinstance(value, list) and len(value) < expected:
            errors.append(f"{where}: fewer than {expected} items")
        elif keyword == "minLength" and isinstance(value, str) and len(value) < expected:
            errors.append(f"{where}: shorter than {expected}")
        elif keyword == "minimum" and isinstance(value, int | float) and value < expected:
            errors.append(f"{where}: below {expected}")
        elif keyword == "exclusiveMinimum" and isinstance(value, int | float) and value <= expected:
            errors.append(f"{where}: not above {expected}")
        elif keyword == "maximum" and isinstance(value, int | float) and value > expected:
            errors.append(f"{where}: above {expected}")
        elif keyword == "exclusiveMaximum" and isinstance(value, int | float) and value >= expected:
            errors.append(f"{where}: not below {expected}")
        elif keyword in ("anyOf", "oneOf"):
            passing = sum(not subset_errors(option, value, root, where) for option in expected)
            if passing == 0 or (keyword == "oneOf" and passing > 1):
                errors.append(f"{where}: {passing} of the {keyword} options match")
        elif keyword not in {
            "type",
            "const",
            "enum",
            "required",
            "properties",
            "additionalProperties",
            "items",
            "minItems",
            "minLength",
            "minimum",
            "exclusiveMinimum",
            "maximum",
            "exclusiveMaximum",
        }:
            raise AssertionError(f"the schema uses {keyword!r}, which this check does not know")
    return errors


HALT = [{"name": "n", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}]

BROKEN = [
    {"version": 2, "rules": [{"name": "a", "match": "*", "actions": [{"action": "zero"}]}]},
    {"version": 1, "rules": []},
    {"version": 1, "rules": [{"name": "a", "match": "*", "actions": [{"action": "clip_norm"}]}]},
    {"version": 1, "rules": [{"name": "a", "match": "*", "actions": [{"action": "clip"}]}]},
    {"version": 1, "rules": [{"name": "a", "match": "*", "actions": [{"action": "clip_norm", "max_norm": -1.0}]}]},
    {"version": 1, "rules": [{"name": "a", "mtch": "*", "actions": [{"action": "zero"}]}]},
    {"version": 1, "rules": [{"name": "a", "match": [], "actions": [{"action": "zero"}]}]},
    {"version": 1, "rules": [{"name": "a", "match": "*", "actions": [{"action": "zero"}]}], "extra": 1},
    {"version": 1, "rules": HALT, "recovery": {"keep": 2}},
    {"version": 1, "rules": HALT, "recovery": {"snapshot_every": 0}},
    {"version": 1, "rules": HALT, "recovery": {"snapshot_every": 10, "skip_step": 4}},
    {"version": 1, "rules": HALT, "recovery": {"snapshot_every": 10, "lr_factor": 1.5}},
    {"version": 1, "rules": HALT, "recovery": {"snapshot_every": 10, "lr_factor": 0}},
    {"version": 1, "rules": HALT, "recovery": {"snapshot_every": 10, "min_age": -1}},
    {"version": 1, "rules": HALT, "recovery": 100},
    {
        "version": 1,
        "rules": [{"name": "n", "match": "*", "actions": [{"action": "halt_on_nonfinite", "max_scaler_skips": 0}]}],
    },
]


def test_the_schema_accepts_every_shipped_policy_and_rejects_broken_ones():
    """Checked keyword by keyword: shipped policies (with $schema) pass; the loader's own rejects fail."""
    schema = json.loads(SHIPPED_SCHEMA.read_text(encoding="utf-8"))
    documents = _shipped_documents()
    assert {name for name, _ in documents} == {
        "default.yaml",
        "llm-adaptive.yaml",
        "llm-pretraining.yaml",
        "per-tensor-clip.yaml",
        "finetune-frozen-backbone.toml",
        "vision.json",
    }
    for name, document in documents:
        assert subset_errors(schema, document, schema) == [], name
    for document in BROKEN:
        with pytest.raises(PolicyError):
            Policy.from_dict(document)
        assert subset_errors(schema, document, schema), document


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


def test_the_loss_and_rerun_sections_are_in_the_schema_with_their_bounds_and_defaults():
    schema = json.loads(schema_output())
    spike = schema["$defs"]["LossSpike"]["properties"]
    assert spike["factor"]["exclusiveMinimum"] == 1
    assert spike["factor"]["default"] == 10.0
    assert spike["window"]["minimum"] == 1
    assert schema["$defs"]["Loss"]["properties"]["nonfinite"]["enum"] == ["halt", "skip", "ignore"]
    rerun = schema["$defs"]["Rerun"]["properties"]
    assert rerun["transient"]["enum"] == ["continue", "halt"]
    assert rerun["tolerance"]["minimum"] == 0
