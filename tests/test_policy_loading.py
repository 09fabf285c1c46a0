"""Loading policies: every format gives the same policy, and every mistake is one readable PolicyError.

Each error test checks the issue's file, line (YAML; JSON and TOML for syntax errors), field path and
the value the user gave, and that no pydantic, YAML, TOML or JSON exception leaks out.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from gradguard import ClipNorm, Policy, PolicyError, PolicyIssue

POLICY = {
    "version": 1,
    "rules": [
        {"name": "nonfinite", "match": ["*"], "actions": [{"action": "halt_on_nonfinite"}]},
        {
            "name": "embeddings",
            "match": ["*embed*", "re:(.*\\.)?wte\\..*"],
            "exclude": ["*.bias"],
            "allow_no_match": True,
            "until_step": 100,
            "actions": [
                {"action": "clip_norm", "max_norm": 0.5, "norm_type": math.inf, "scope": "group"},
                {"action": "clip_value", "limit": 0.25, "from_step": 3},
            ],
        },
        {"name": "slow", "match": "blocks.0.*", "from_step": 2, "actions": [{"action": "scale", "factor": 0.1}]},
        {"name": "frozen", "match": ["head.*"], "actions": [{"action": "zero", "until_step": 10}]},
    ],
}

YAML = """\
version: 1
rules:
  - name: nonfinite
    match: ["*"]
    actions:
      - {action: halt_on_nonfinite}
  - name: embeddings
    match: ["*embed*", 're:(.*\\.)?wte\\..*']
    exclude: ["*.bias"]
    allow_no_match: true
    until_step: 100
    actions:
      - {action: clip_norm, max_norm: 0.5, norm_type: .inf, scope: group}
      - action: clip_value
        limit: 0.25
        from_step: 3
  - name: slow
    match: blocks.0.*
    from_step: 2
    actions: [{action: scale, factor: 0.1}]
  - name: frozen
    match: ["head.*"]
    actions:
      - {action: zero, until_step: 10}
"""

TOML = """\
version = 1

[[rules]]
name = "nonfinite"
match = ["*"]
actions = [{ action = "halt_on_nonfinite" }]

[[rules]]
name = "embeddings"
match = ["*embed*", 're:(.*\\.)?wte\\..*']
exclude = ["*.bias"]
allow_no_match = true
until_step = 100
actions = [
  { action = "clip_norm", max_norm = 0.5, norm_type = inf, scope = "group" },
  { action = "clip_value", limit = 0.25, from_step = 3 },
]

[[rules]]
name = "slow"
match = "blocks.0.*"
from_step = 2
actions = [{ action = "scale", factor = 0.1 }]

[[rules]]
name = "frozen"
match = ["head.*"]
actions = [{ action = "zero", until_step = 10 }]
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _load_error(path: Path) -> PolicyError:
    """Load ``path``, expecting a PolicyError and nothing else; check nothing foreign leaks out."""
    with pytest.raises(PolicyError) as info:
        Policy.from_file(path)
    return _checked(info.value, str(path))


def _dict_error(data: object) -> PolicyError:
    with pytest.raises(PolicyError) as info:
        Policy.from_dict(data)  # type: ignore[arg-type]
    return _checked(info.value, "<dict>")


def _checked(exc: PolicyError, source: str) -> PolicyError:
    assert type(exc) is PolicyError
    assert isinstance(exc, ValueError)
    assert exc.__cause__ is None
    assert exc.__suppress_context__ or exc.__context__ is None  # a traceback shows no pydantic/yaml error
    assert exc.issues, "a PolicyError lists at least one issue"
    for issue in exc.issues:
        assert isinstance(issue, PolicyIssue)
        assert issue.source == source
        assert str(issue) in str(exc)
    return exc


def _issue_at(exc: PolicyError, path: str) -> PolicyIssue:
    found = [issue for issue in exc.issues if issue.path == path]
    assert found, f"no issue at {path!r}; issues: {[str(issue) for issue in exc.issues]}"
    return found[0]


def _marked_line(text: str) -> int:
    """1-based number of the line carrying the ``# <-`` marker."""
    lines = [number for number, line in enumerate(text.splitlines(), start=1) if "# <-" in line]
    assert len(lines) == 1
    return lines[0]


# --- equal policies from every format -------------------------------------------------------------


def test_yaml_yml_toml_json_and_dict_give_equal_policies(tmp_path):
    """A .yaml, .yml, .toml and .json file with the same content, and Policy.from_dict, give equal policies."""
    from_dict = Policy.from_dict(POLICY)
    files = {
        "p.yaml": YAML,
        "p.yml": YAML,
        "p.toml": TOML,
        "p.json": json.dumps(POLICY, indent=2),  # json writes inf as Infinity, which json.loads reads back
    }
    loaded = {name: Policy.from_file(_write(tmp_path, name, text)) for name, text in files.items()}
    for name, policy in loaded.items():
        assert policy == from_dict, name
        assert policy.model_dump() == from_dict.model_dump(), name
        assert hash(policy) == hash(from_dict), name
        assert policy.source == str(tmp_path / name)
    assert from_dict.source == "<dict>"
    embeddings = from_dict.rules[1]
    assert embeddings.match == ("*embed*", "re:(.*\\.)?wte\\..*")
    assert isinstance(embeddings.actions[0], ClipNorm)
    assert embeddings.actions[0].norm_type == math.inf
    assert from_dict.rules[2].match == ("blocks.0.*",)  # one pattern is a list of one
    other = Policy.from_dict({**POLICY, "rules": POLICY["rules"][:1]})
    assert other != from_dict
    assert hash(other) != hash(from_dict)  # the hash follows the content too
    assert len({from_dict, other, *loaded.values()}) == 2


def test_a_recovery_section_loads_from_every_format_with_its_defaults(tmp_path):
    """`recovery` with only snapshot_every gets the documented defaults, equal from YAML, TOML, JSON and a dict;
    a skip action with a limit is a rule that can halt; halt_on_nonfinite's GradScaler floor is 1.0 unless set."""
    skip = {
        "name": "skips",
        "match": "*",
        "actions": [{"action": "skip_step_on_nonfinite", "max_consecutive_skips": 3}],
    }
    data = {"version": 1, "rules": [skip], "recovery": {"snapshot_every": 50}}
    yaml_text = (
        "version: 1\nrules:\n  - name: skips\n    match: '*'\n"
        "    actions: [{action: skip_step_on_nonfinite, max_consecutive_skips: 3}]\nrecovery:\n  snapshot_every: 50\n"
    )
    toml_text = (
        'version = 1\n[[rules]]\nname = "skips"\nmatch = "*"\n'
        'actions = [{ action = "skip_step_on_nonfinite", max_consecutive_skips = 3 }]\n'
        "[recovery]\nsnapshot_every = 50\n"
    )
    from_dict = Policy.from_dict(data)
    for name, text in {"r.yaml": yaml_text, "r.toml": toml_text, "r.json": json.dumps(data)}.items():
        assert Policy.from_file(_write(tmp_path, name, text)) == from_dict, name
    assert from_dict.recovery is not None
    assert from_dict.recovery.model_dump() == {
        "snapshot_every": 50,
        "keep": 2,
        "min_age": 10,
        "skip_steps": 10,
        "max_rewinds": 3,
        "lr_factor": 1.0,
        "memory": "auto",
    }
    assert from_dict != Policy.from_dict({"version": 1, "rules": [skip]})  # recovery is part of the policy
    halt = Policy.from_dict(
        {"version": 1, "rules": [{"name": "n", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}]}
    )
    assert halt.recovery is None
    assert halt.rules[0].actions[0].min_loss_scale == 1.0  # type: ignore[union-attr]
    assert halt.rules[0].actions[0].max_scaler_skips is None  # type: ignore[union-attr]
    never = {"action": "halt_on_nonfinite", "min_loss_scale": None, "max_scaler_skips": 8}
    rule = Policy.from_dict({"version": 1, "rules": [{"name": "n", "match": "*", "actions": [never]}]}).rules[0]
    assert rule.actions[0].min_loss_scale is None  # type: ignore[union-attr]
    assert rule.actions[0].max_scaler_skips == 8  # type: ignore[union-attr]


def test_policy_is_frozen():
    """A loaded policy cannot be changed: assigning to the policy, a rule or an action raises."""
    policy = Policy.from_dict(POLICY)
    with pytest.raises(ValidationError, match="frozen"):
        policy.version = 2  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        policy.rules[1].name = "other"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        policy.rules[1].actions[0].max_norm = 10.0  # type: ignore[union-attr]
    with pytest.raises(TypeError):
        policy.rules[0] = policy.rules[1]  # type: ignore[index]
    assert isinstance(policy.rules, tuple)
    assert isinstance(policy.rules[1].match, tuple)
    assert policy == Policy.from_dict(POLICY)


# --- one mistake, one issue with file, line, path and value -----------------------------------------

HEAD = """\
version: 1
rules:
  - name: first
    match: "*"
    actions:
      - {action: clip_norm, max_norm: 1.0}
"""

SECOND = "  - name: second\n    match: '*'\n"
HALTS = HEAD + "  - {name: nonfinite, match: '*', actions: [{action: halt_on_nonfinite}]}\n"
ACTION = "    actions:\n      - "

CASES = {
    "unknown top-level key": (
        "version: 1\ncolour: red  # <-\nrules:\n  - {name: a, match: '*', actions: [{action: zero}]}\n",
        "colour",
        ["unknown field 'colour'", "allowed here: version, rules"],
    ),
    "unknown rule key, did you mean": (
        HEAD + SECOND + "    exlude: ['*.bias']  # <-\n    actions: [{action: zero}]\n",
        "rules[1].exlude",
        ["unknown field 'exlude'", "did you mean 'exclude'?"],
    ),
    "unknown action field, did you mean": (
        HEAD + SECOND + ACTION + "{action: clip_norm, max_norm: 2, norm_tpye: 1}  # <-\n",
        "rules[1].actions[0].norm_tpye",
        [
            "unknown field 'norm_tpye'",
            "did you mean 'norm_type'?",
            "allowed here: from_step, until_step, action, max_norm",
        ],
    ),
    "unknown action, did you mean": (
        HEAD + SECOND + ACTION + "{action: clip_nrom, max_norm: 2}  # <-\n",
        "rules[1].actions[0]",
        ["unknown action 'clip_nrom'", "did you mean 'clip_norm'?", "expected one of: ", "clip_norm, clip_value"],
    ),
    "action without action field": (
        HEAD + SECOND + ACTION + "{max_norm: 2}  # <-\n",
        "rules[1].actions[0]",
        ["no 'action' field", "'max_norm': 2"],
    ),
    "string for a number": (
        HEAD + SECOND + ACTION + "{action: clip_norm, max_norm: big}  # <-\n",
        "rules[1].actions[0].max_norm",
        ["got 'big'", "expected a number"],
    ),
    "quoted number": (
        HEAD + SECOND + ACTION + "{action: clip_value, limit: '0.5'}  # <-\n",
        "rules[1].actions[0].limit",
        ["got '0.5'", "expected a number"],
    ),
    "boolean for a number": (
        HEAD + SECOND + ACTION + "{action: scale, factor: true}  # <-\n",
        "rules[1].actions[0].factor",
        ["got True", "expected a number"],
    ),
    "number for a pattern list": (
        HEAD + "  - name: second\n    match: 5  # <-\n    actions: [{action: zero}]\n",
        "rules[1].match",
        ["got 5", "expected a list"],
    ),
    "string for a boolean": (
        HEAD + SECOND + "    allow_no_match: sure  # <-\n    actions: [{action: zero}]\n",
        "rules[1].allow_no_match",
        ["got 'sure'", "expected true or false"],
    ),
    "float for a step": (
        HEAD + SECOND + "    from_step: 1.5  # <-\n    actions: [{action: zero}]\n",
        "rules[1].from_step",
        ["got 1.5", "expected an integer"],
    ),
    "number for a name": (
        HEAD + "  - name: 7  # <-\n    match: '*'\n    actions: [{action: zero}]\n",
        "rules[1].name",
        ["got 7", "expected a string"],
    ),
    "wrong version": (
        "version: 2  # <-\nrules:\n  - {name: a, match: '*', actions: [{action: zero}]}\n",
        "version",
        ["got 2", "expected 1"],
    ),
    "boolean version": (
        "version: true  # <-\nrules:\n  - {name: a, match: '*', actions: [{action: zero}]}\n",
        "version",
        ["got True", "expected 1"],
    ),
    "negative max_norm": (
        HEAD + SECOND + ACTION + "action: clip_norm\n        max_norm: -1.0  # <-\n",
        "rules[1].actions[0].max_norm",
        ["got -1.0", "greater than 0"],
    ),
    "zero max_norm": (
        HEAD + SECOND + ACTION + "{action: clip_norm, max_norm: 0}  # <-\n",
        "rules[1].actions[0].max_norm",
        ["got 0", "greater than 0"],
    ),
    "NaN max_norm": (
        HEAD + SECOND + ACTION + "{action: clip_norm, max_norm: .nan}  # <-\n",
        "rules[1].actions[0].max_norm",
        ["nan"],
    ),
    "infinite max_norm": (
        HEAD + SECOND + ACTION + "{action: clip_norm, max_norm: .inf}  # <-\n",
        "rules[1].actions[0].max_norm",
        ["inf", "finite"],
    ),
    "zero norm_type": (
        HEAD + SECOND + ACTION + "{action: clip_norm, max_norm: 1, norm_type: 0}  # <-\n",
        "rules[1].actions[0].norm_type",
        ["got 0", "greater than 0"],
    ),
    "unknown scope": (
        HEAD + SECOND + ACTION + "{action: clip_norm, max_norm: 1, scope: global}  # <-\n",
        "rules[1].actions[0].scope",
        ["got 'global'", "'tensor' or 'group'"],
    ),
    "negative factor": (
        HEAD + SECOND + ACTION + "{action: scale, factor: -0.5}  # <-\n",
        "rules[1].actions[0].factor",
        ["got -0.5", "at least 0"],
    ),
    "zero limit": (
        HEAD + SECOND + ACTION + "{action: clip_value, limit: 0.0}  # <-\n",
        "rules[1].actions[0].limit",
        ["got 0.0", "greater than 0"],
    ),
    "negative from_step": (
        HEAD + SECOND + "    from_step: -1  # <-\n    actions: [{action: zero}]\n",
        "rules[1].from_step",
        ["got -1", "at least 0"],
    ),
    "rule window until_step <= from_step": (
        HEAD + SECOND + "    from_step: 5\n    until_step: 5  # <-\n    actions: [{action: zero}]\n",
        "rules[1].until_step",
        ["got 5", "from_step (5)", "never apply"],
    ),
    "action window until_step <= from_step": (
        HEAD + SECOND + "    actions:\n      - {action: scale, factor: 2, from_step: 9, until_step: 3}  # <-\n",
        "rules[1].actions[0].until_step",
        ["got 3", "from_step (9)", "never apply"],
    ),
    "empty match": (
        HEAD + "  - name: second\n    match: []  # <-\n    actions: [{action: zero}]\n",
        "rules[1].match",
        ["got []", "at least 1"],
    ),
    "empty pattern": (
        HEAD + "  - name: second\n    match: ['']  # <-\n    actions: [{action: zero}]\n",
        "rules[1].match",
        ["must not be empty"],
    ),
    "bad regex": (
        HEAD + "  - name: second\n    match: ['re:blocks\\.(\\d+']  # <-\n    actions: [{action: zero}]\n",
        "rules[1].match",
        ["invalid regular expression", "'re:blocks\\\\.(\\\\d+'"],
    ),
    "bad regex in exclude": (
        HEAD + SECOND + "    exclude: 're:[a-'  # <-\n    actions: [{action: zero}]\n",
        "rules[1].exclude",
        ["invalid regular expression", "'re:[a-'"],
    ),
    "no actions": (
        HEAD + SECOND + "    actions: []  # <-\n",
        "rules[1].actions",
        ["got []", "at least 1"],
    ),
    "missing match": (
        HEAD + "  - name: second  # <-\n    actions: [{action: zero}]\n",
        "rules[1].match",
        ["missing required field 'match'"],
    ),
    "duplicate rule name": (
        HEAD + "  - name: first  # <-\n    match: '*'\n    actions: [{action: zero}]\n",
        "rules[1].name",
        ["got 'first'", "rules[0] already uses", "unique"],
    ),
    "rule that is not a mapping": (
        HEAD + "  - just a string  # <-\n",
        "rules[1]",
        ["got 'just a string'", "expected a mapping"],
    ),
    "no rules": (
        "version: 1\nrules: []  # <-\n",
        "rules",
        ["got []", "at least 1"],
    ),
    "unknown recovery key, did you mean": (
        HALTS + "recovery:\n  snapshot_every: 100\n  skip_step: 4  # <-\n",
        "recovery.skip_step",
        [
            "unknown field 'skip_step'",
            "did you mean 'skip_steps'?",
            "allowed here: snapshot_every, keep, min_age, skip_steps, max_rewinds, lr_factor",
        ],
    ),
    "recovery without snapshot_every": (
        HALTS + "recovery:\n  keep: 3  # <-\n",
        "recovery.snapshot_every",
        ["missing required field 'snapshot_every'"],
    ),
    "recovery lr_factor above 1": (
        HALTS + "recovery:\n  snapshot_every: 100\n  lr_factor: 1.5  # <-\n",
        "recovery.lr_factor",
        ["got 1.5", "at most 1"],
    ),
    "recovery lr_factor of 0": (
        HALTS + "recovery:\n  snapshot_every: 100\n  lr_factor: 0  # <-\n",
        "recovery.lr_factor",
        ["got 0", "greater than 0"],
    ),
    "recovery keep of 0": (
        HALTS + "recovery:\n  snapshot_every: 100\n  keep: 0  # <-\n",
        "recovery.keep",
        ["got 0", "at least 1"],
    ),
    "recovery snapshot_every of 0": (
        HALTS + "recovery:\n  snapshot_every: 0  # <-\n",
        "recovery.snapshot_every",
        ["got 0", "at least 1"],
    ),
    "negative recovery min_age": (
        HALTS + "recovery:\n  snapshot_every: 100\n  min_age: -1  # <-\n",
        "recovery.min_age",
        ["got -1", "at least 0"],
    ),
    "float max_rewinds": (
        HALTS + "recovery:\n  snapshot_every: 100\n  max_rewinds: 2.5  # <-\n",
        "recovery.max_rewinds",
        ["got 2.5", "expected an integer"],
    ),
    "recovery that is not a mapping": (
        HALTS + "recovery: 100  # <-\n",
        "recovery",
        ["got 100", "expected a mapping"],
    ),
    "recovery with no rule that can halt": (
        # Issues about a whole mapping are placed on its first line (here the line after `recovery:`).
        HEAD + "  - {name: skips, match: '*', actions: [{action: skip_step_on_nonfinite}]}\n"
        "recovery:\n  snapshot_every: 100  # <-\n",
        "recovery",
        ["no rule can halt", "recovery would never rewind", "halt_on_nonfinite", "max_consecutive_skips"],
    ),
    "min_loss_scale of 0": (
        HEAD + SECOND + ACTION + "{action: halt_on_nonfinite, min_loss_scale: 0}  # <-\n",
        "rules[1].actions[0].min_loss_scale",
        ["got 0", "greater than 0"],
    ),
    "max_scaler_skips of 0": (
        HEAD + SECOND + ACTION + "{action: halt_on_nonfinite, max_scaler_skips: 0}  # <-\n",
        "rules[1].actions[0].max_scaler_skips",
        ["got 0", "at least 1"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_mistake_is_a_policy_error_naming_file_line_path_and_value(tmp_path, case):
    """Unknown keys or actions, wrong types, bad values, windows, matches, regexes, names: one located issue each."""
    text, path, fragments = CASES[case]
    file = _write(tmp_path, "policy.yaml", text)
    exc = _load_error(file)
    assert len(exc.issues) == 1, [str(issue) for issue in exc.issues]
    issue = _issue_at(exc, path)
    assert issue.line == _marked_line(text)
    for fragment in fragments:
        assert fragment in issue.message, (fragment, issue.message)
    assert f"{file}:{issue.line}: {path}: " in str(exc)


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_mistakes_in_a_dict_name_the_field_path(case):
    """Policy.from_dict reports the same issue, with <dict> as source and no line."""
    import yaml

    text, path, fragments = CASES[case]
    data = yaml.safe_load(text)
    exc = _dict_error(data)
    assert len(exc.issues) == 1
    issue = _issue_at(exc, path)
    assert issue.line is None
    for fragment in fragments:
        assert fragment in issue.message


def test_several_problems_are_reported_at_once(tmp_path):
    """Every problem of a file is listed in one PolicyError, each with its own line and path, in file order."""
    text = textwrap.dedent(
        """\
        version: 1
        rules:
          - name: clip
            match: "*"
            colour: red
            actions:
              - {action: clip_norm, max_norm: -1.0}
              - {action: clip, limit: 2}
          - name: clip
            match: []
            from_step: 4
            until_step: 2
            actions:
              - {action: scale, factor: -3}
          - name: regex
            match: ["re:(unclosed"]
            actions: [{action: zero}]
        """
    )
    exc = _load_error(_write(tmp_path, "bad.yaml", text))
    located = [(issue.line, issue.path) for issue in exc.issues]
    assert located == [
        (5, "rules[0].colour"),
        (7, "rules[0].actions[0].max_norm"),
        (8, "rules[0].actions[1]"),
        (9, "rules[1].name"),
        (10, "rules[1].match"),
        (12, "rules[1].until_step"),
        (14, "rules[1].actions[0].factor"),
        (16, "rules[2].match"),
    ]
    assert str(exc).startswith("invalid policy (8 problems):\n")


def test_toml_and_json_validation_errors_name_the_path_and_value(tmp_path):
    """In TOML and JSON files a field problem names the file, the field path and the value (no line)."""
    data = {"version": 1, "rules": [{"name": "a", "match": "*", "actions": [{"action": "clip_norm", "max_norm": -2}]}]}
    toml = 'version = 1\n[[rules]]\nname = "a"\nmatch = "*"\nactions = [{ action = "clip_norm", max_norm = -2 }]\n'
    for file in (_write(tmp_path, "p.json", json.dumps(data)), _write(tmp_path, "p.toml", toml)):
        exc = _load_error(file)
        issue = _issue_at(exc, "rules[0].actions[0].max_norm")
        assert issue.line is None
        assert "got -2" in issue.message
        assert f"{file}: rules[0].actions[0].max_norm: got -2" in str(exc)


# --- files that cannot be read as a policy --------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "text", "fragment"),
    [
        ("bad.yaml", "version: 1\nrules:\n  - name: a\n    match: [\n", "YAML syntax error"),
        ("tabs.yaml", "version: 1\nrules:\n\t- name: a\n", "YAML syntax error"),
        ("bad.json", '{"version": 1,\n "rules": [\n  {"name": "a",}\n ]}\n', "JSON syntax error"),
        ("bad.toml", 'version = 1\n[[rules]]\nname = "a"\nmatch = \n', "TOML syntax error"),
        ("dup.yaml", "version: 1\nrules:\n  - name: a\n    match: '*'\n    match: 'x'\n", "duplicate key 'match'"),
    ],
)
def test_syntax_errors_and_duplicate_yaml_keys_name_the_line(tmp_path, name, text, fragment):
    """YAML, JSON and TOML syntax errors and duplicate YAML keys are PolicyErrors naming the file and line."""
    exc = _load_error(_write(tmp_path, name, text))
    assert len(exc.issues) == 1
    issue = exc.issues[0]
    assert fragment in issue.message
    expected_line = {"bad.yaml": 5, "tabs.yaml": 3, "bad.json": 3, "bad.toml": 4, "dup.yaml": 5}[name]
    if name == "bad.yaml":
        assert issue.line in (4, 5)  # the unclosed bracket, or where the document ends
    else:
        assert issue.line == expected_line
    assert f"{tmp_path / name}:{issue.line}:" in str(exc)


UNCLOSED_BRACKET = """\
version: 1
rules:
  - name: clip
    actions: [{action: clip_norm, max_norm: 1.0}]
    match: ["*", "b*"
  - name: halt
    match: ["*"]
    actions: [{action: halt_on_nonfinite}]
"""


def test_a_missing_closing_bracket_is_pointed_at_the_bracket_that_opened_it_with_the_fix(tmp_path):
    """PyYAML gives up on line 6 (the next item); the slip is on line 5, column 12, where the '[' opened."""
    path = _write(tmp_path, "p.yaml", UNCLOSED_BRACKET)
    (issue,) = _load_error(path).issues
    assert issue.line == 5
    assert issue.message == (
        "YAML syntax error: the '[' opened at line 5, column 12 is not closed (line 6, column 3 goes on with a list "
        "item ('- ')); close it with ']' after its last item, before line 6, column 3"
    )


def test_a_missing_comma_inside_brackets_says_to_put_one_between_the_items(tmp_path):
    path = _write(
        tmp_path, "p.yaml", 'version: 1\nrules:\n  - {name: a, match: ["x" "y"], actions: [{action: zero}]}\n'
    )
    (issue,) = _load_error(path).issues
    assert issue.line == 3
    assert issue.message == (
        "YAML syntax error: the '[' opened at line 3, column 22 is not closed (line 3, column 27 goes on with a "
        "value); put a ',' between its items, or close it with ']' where it ends"
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "version: 1\nrules:\n  - name: a\n    match: ['*']\n      actions: [{action: zero}]\n",
            "bad indentation at line 5, column 7: a key indented 6 spaces, where the block it follows (from line 3)"
            " is indented 4; indent it by 4 spaces",
        ),
        (
            "version: 1\nrules:\n  - name: a\n    match: ['*']\n    actions: [{action: zero}]\n   - name: b\n",
            "bad indentation at line 6, column 4: a list item ('- ') indented 3 spaces, where the block it follows "
            "(from line 3) is indented 2; indent it by 2 spaces",
        ),
    ],
    ids=["a key too deep", "a list item off by one"],
)
def test_a_bad_indent_is_named_in_words_at_its_line_with_the_indentation_to_use(tmp_path, text, expected):
    """Not PyYAML's "expected <block end>, but found '<block mapping start>'": what is indented how, and the fix."""
    (issue,) = _load_error(_write(tmp_path, "p.yaml", text)).issues
    assert issue.line == int(expected.split("line ")[1].split(",")[0])
    assert expected in issue.message
    assert "<block" not in issue.message
    assert issue.message.endswith("or under the key it belongs to (YAML nests by indentation alone)")


def test_duplicate_yaml_key_says_where_the_first_one_is(tmp_path):
    """A YAML key given twice is not silently overwritten: the error names both lines."""
    text = "version: 1\nrules:\n  - name: a\n    match: '*'\n    actions: [{action: zero}]\n    match: 'x'\n"
    exc = _load_error(_write(tmp_path, "dup.yaml", text))
    assert exc.issues[0].line == 6
    assert "first on line 4" in exc.issues[0].message


def test_missing_file_is_a_policy_error(tmp_path):
    """A path that does not exist is a PolicyError naming it."""
    exc = _load_error(tmp_path / "nowhere.yaml")
    assert "no such file" in exc.issues[0].message


@pytest.mark.parametrize("name", ["policy.txt", "policy", "policy.yaml.bak"])
def test_unsupported_suffix_is_a_policy_error(tmp_path, name):
    """A file that is not .yaml/.yml/.toml/.json is refused, saying which suffixes work."""
    exc = _load_error(_write(tmp_path, name, "version: 1\n"))
    assert "unsupported file type" in exc.issues[0].message
    assert ".yaml, .yml, .toml or .json" in exc.issues[0].message
    assert "Policy.shipped" not in exc.issues[0].message  # a file that is there is not a shipped name


def test_policy_from_file_given_a_shipped_policys_name_says_how_to_load_it_by_name():
    """Policy.from_file("default"): no such file and no suffix, so the error points at Policy.shipped
    (GradGuard(model, "default") and Policy.load take the name: tests/test_shipped_names.py)."""
    with pytest.raises(PolicyError) as caught:
        Policy.from_file("default")
    assert "Policy.shipped('default')" in caught.value.issues[0].message


@pytest.mark.parametrize(
    ("name", "text", "given"),
    [
        ("list.yaml", "- version: 1\n- rules: []\n", "list"),
        ("scalar.yaml", "just words\n", "string"),
        ("empty.yaml", "", "null"),
        ("array.json", "[1, 2]", "list"),
    ],
)
def test_non_mapping_document_is_a_policy_error(tmp_path, name, text, given):
    """A document that is not a mapping (a list, a scalar, nothing) is a PolicyError saying what it is."""
    exc = _load_error(_write(tmp_path, name, text))
    assert len(exc.issues) == 1
    assert f"the document is a {given}" in exc.issues[0].message


def test_non_mapping_dict_argument_is_a_policy_error():
    """Policy.from_dict with a list is a PolicyError, not a pydantic error."""
    exc = _dict_error([POLICY])
    assert "got list" in exc.issues[0].message
