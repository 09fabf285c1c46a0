"""Hostile policy files of every kind give a PolicyError naming the file (and the line where the reader
knows it) or load; nothing else escapes the loader, and ``gradguard validate`` never prints a traceback.

The kinds: YAML tags the constructor cannot read, anchors and aliases (billion laughs, recursion),
nesting far past the cap (refused before any parser recurses into it), huge scalars and numbers,
binary noise. The generator is ``benchmarks/policy_fuzz.py``, which runs 10,000 of these files; the
suite runs a few hundred.
"""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from click.testing import CliRunner

from gradguard import Policy, PolicyError
from gradguard.cli import main
from gradguard.policy import loading
from gradguard.policy.limits import MAX_DEPTH, MAX_FILE_BYTES, TOO_DEEP
from gradguard.policy.loading import load_policy_text

REPO = Path(__file__).resolve().parent.parent
SUITE_FILES = 600
"""Generated files run in the suite (the benchmark runs 10,000)."""


def _load_fuzzer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("policy_fuzz", REPO / "benchmarks" / "policy_fuzz.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("policy_fuzz", module)  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


fuzz = _load_fuzzer()
VALID = fuzz.VALID


def refusal(path: Path) -> PolicyError:
    """The PolicyError that reading ``path`` raises; fails on a load or on any other exception."""
    with pytest.raises(PolicyError) as caught:
        Policy.from_file(path)
    for issue in caught.value.issues:
        assert issue.source == str(path), issue
    return caught.value


def write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    return path


@contextmanager
def recursion_headroom(frames: int) -> Iterator[None]:
    """Python's recursion limit set to the frames in use now plus ``frames``."""
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + frames)
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


# --- YAML tags ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("!!bool maybe", "cannot read 'maybe' as !!bool"),
        ("!!bool ''", "cannot read '' as !!bool"),
        ("!!float ''", "cannot read '' as !!float"),
        ("!!int '#'", "cannot read '#' as !!int"),
        ("!!int ''", "cannot read '' as !!int"),
        ("!!int 0x", "cannot read '0x' as !!int"),
        ("!!timestamp 2001-02-30", "cannot read '2001-02-30' as !!timestamp: day is out of range for month"),
        ("!<tag:yaml.org,2002:bool> ~", "cannot read '~' as !!bool"),
        ("!!map [1]", "expected a mapping node, but found sequence"),
        ("!!map x", "expected a mapping node, but found scalar"),
    ],
)
def test_a_tag_the_constructor_cannot_read_is_a_policy_error_at_its_line(tmp_path, value, shown):
    """`enabled: !!bool maybe` was a KeyError from PyYAML's construct_yaml_bool; every such tag is a PolicyError."""
    path = write(tmp_path, "p.yaml", VALID["yaml"] + f"enabled: {value}\n")
    (issue,) = refusal(path).issues
    assert issue.line == 9
    assert shown in issue.message


def test_a_tag_directive_that_makes_a_bare_tag_a_yaml_bool_is_read_the_same_way(tmp_path):
    """`%TAG ! tag:yaml.org,2002:` turns `!bool maybe` into `!!bool maybe`: the same refusal, at the line."""
    path = write(tmp_path, "p.yaml", "%TAG ! tag:yaml.org,2002:\n---\n" + VALID["yaml"] + "enabled: !bool maybe\n")
    (issue,) = refusal(path).issues
    assert issue.line == 11
    assert "cannot read 'maybe' as !!bool" in issue.message


def test_code_running_tags_are_refused_and_run_nothing(tmp_path):
    sentinel = tmp_path / "ran"
    for tag in ("!!python/object/apply:os.system", "!!python/object/apply:builtins.exec"):
        argument = f"['touch {sentinel}']" if "system" in tag else f"['open({str(sentinel)!r}, \"w\")']"
        path = write(tmp_path, "p.yaml", VALID["yaml"] + f"extra: {tag} {argument}\n")
        (issue,) = refusal(path).issues
        assert issue.line == 9
    assert not sentinel.exists()


# --- anchors and aliases --------------------------------------------------------------------------


def test_a_billion_laughs_is_refused_at_the_line_where_it_grows_past_the_cap_within_a_second(tmp_path):
    levels = [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, 10)]
    text = "l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "\n".join(levels) + "\n" + VALID["yaml"]
    path = write(tmp_path, "laughs.yaml", text)
    (issue,) = refusal(path).issues
    assert issue.line == 5, "l4 holds 10**5 items: the first past 20,000"
    assert "grows past 20000" in issue.message


def test_aliases_inside_the_policy_itself_are_counted_as_often_as_they_are_used(tmp_path):
    """The laughs in the policy's own match list, where the policy would otherwise be valid."""
    inline = "&l0 [a, a, a, a, a, a, a, a], " + ", ".join(
        f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 8) + "]" for i in range(1, 7)
    )
    path = write(tmp_path, "laughs.yaml", VALID["yaml"].replace("match: ['*']", f"match: [{inline}, *l6]"))
    (issue,) = refusal(path).issues
    assert issue.line == 4
    assert "grows past" in issue.message


@pytest.mark.parametrize("value", ["&a [*a]", "&a {b: *a}", "&a [1, {x: [*a]}]", "&a {? *a : 1}"])
def test_a_recursive_alias_is_refused_at_its_line(tmp_path, value):
    path = write(tmp_path, "p.yaml", VALID["yaml"].replace("match: ['*']", f"match: {value}"))
    (issue,) = refusal(path).issues
    assert issue.line == 4
    assert "recursive" in issue.message


def test_undefined_aliases_and_chains_of_merge_keys_are_refused_at_their_lines(tmp_path):
    undefined = write(tmp_path, "undefined.yaml", VALID["yaml"].replace("match: ['*']", "match: *nope"))
    assert [issue.line for issue in refusal(undefined).issues] == [4]
    for links, line in ((3, 2), (3000, None)):
        chain = "m0: &m0 {action: zero}\n" + "".join(f"m{i}: &m{i} {{<<: *m{i - 1}}}\n" for i in range(1, links))
        merged = write(tmp_path, "merged.yaml", chain + VALID["yaml"])
        with recursion_headroom(200):
            (issue,) = refusal(merged).issues
        assert issue.line is not None
        if line is not None:
            assert issue.line == line, "the first merge key"
            assert "tag:yaml.org,2002:merge" in issue.message
        else:  # the merges count as aliases, each as large as the chain below it: past the cap long before the end
            assert "grows past 20000" in issue.message


def test_aliases_that_reuse_a_value_within_the_caps_load():
    text = (
        "version: 1\nrules:\n"
        "  - {name: a, match: &pat ['*'], allow_no_match: true, actions: [&act {action: clip_norm, max_norm: 1.0}]}\n"
        "  - {name: b, match: *pat, allow_no_match: true, actions: [*act, *act]}\n"
    )
    policy = load_policy_text(Policy, text, "yaml", "reuse.yaml")
    assert [rule.name for rule in policy.rules] == ["a", "b"]
    assert len(policy.rules[1].actions) == 2


# --- deep nesting ---------------------------------------------------------------------------------

DEEP_YAML = {
    "flow lists": lambda n: "extra: " + "[" * n + "]" * n,
    "flow mappings": lambda n: "extra: " + "{a: " * n + "1" + "}" * n,
    "flow, left open": lambda n: "extra: " + "[" * n,
    "flow, then garbage": lambda n: "extra: " + "[{" * (n // 2) + "x: : ]]",
    "block, indented": lambda n: "extra:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(min(n, 600))),
    "block, compact": lambda n: "extra:\n  " + "- " * n + "x",
    "complex keys": lambda n: "extra:\n  " + "? " * n + "x",
}


@pytest.mark.parametrize("form", DEEP_YAML)
@pytest.mark.parametrize("levels", [1000, 100_000])
def test_yaml_nested_far_past_the_cap_is_refused_at_its_line_before_the_composer_recurses(tmp_path, form, levels):
    """The issue's `[[[[...` of 1000 levels was a RecursionError; now refused, with 200 frames to spare at most.

    libyaml's event walk gives up on it at its own limit (1000 flow levels) with a syntax error, so
    the refusal comes from the composer's own count of open collections.
    """
    text = DEEP_YAML[form](levels)
    path = write(tmp_path, "deep.yaml", VALID["yaml"] + text + "\n")
    with recursion_headroom(200):
        (issue,) = refusal(path).issues
    assert issue.message == TOO_DEEP
    assert issue.line is not None
    assert 9 <= issue.line <= 9 + MAX_DEPTH


def test_the_issues_3_5_kb_file_of_nested_flow_lists_is_a_policy_error_at_line_1():
    text = "[" * 1000 + "x" + "]" * 1000 + "\n" + "#" * 1500
    with pytest.raises(PolicyError) as caught:
        load_policy_text(Policy, text, "yaml", "nested.yaml")
    assert [(issue.line, issue.message) for issue in caught.value.issues] == [(1, TOO_DEEP)]


@pytest.mark.parametrize(
    ("fmt", "deep"),
    [
        ("json", lambda n: '{"version": 1, "extra": ' + "[" * n + "]" * n + "}"),
        ("json", lambda n: '{"version": 1,\n"extra": ' + '{"a": ' * n + "1"),
        ("toml", lambda n: "version = 1\nextra = " + "[" * n + "]" * n),
        ("toml", lambda n: "version = 1\n\nextra = " + "{ a = " * n + "1" + " }" * n),
    ],
)
def test_json_and_toml_nested_far_past_the_cap_are_refused_at_their_line_before_parsing(tmp_path, fmt, deep):
    """The bracket scan refuses them: json.loads and tomllib (one frame or more a level) never see them."""
    for levels in (1000, 100_000):
        path = write(tmp_path, f"deep.{fmt}", deep(levels))
        with recursion_headroom(200):
            (issue,) = refusal(path).issues
        assert issue.message == TOO_DEEP
        assert issue.line == deep(1).count("\n") + 1


@pytest.mark.parametrize(
    ("fmt", "nest"),
    [
        ("yaml", lambda n: VALID["yaml"] + "extra: " + "[" * n + "]" * n + "\n"),
        ("yaml", lambda n: VALID["yaml"] + "extra:\n" + "".join("  " * (i + 1) + "-\n" for i in range(n))),
        ("json", lambda n: VALID["json"].replace('"version": 1,', '"version": 1, "extra": ' + "[" * n + "]" * n + ",")),
        ("toml", lambda n: "extra = " + "[" * n + "]" * n + "\n" + VALID["toml"]),
    ],
)
def test_nesting_to_the_cap_is_read_and_one_level_more_is_refused_in_every_format(fmt, nest):
    """The document counts as a level; 31 more under it reach the cap, and the file is read (and refused
    for its unknown field); 32 more are refused for their depth, by the composer, the scan or the walk."""
    with recursion_headroom(200), pytest.raises(PolicyError) as caught:
        load_policy_text(Policy, nest(MAX_DEPTH - 1), fmt, f"p.{fmt}")
    assert [issue.path for issue in caught.value.issues] == ["extra"], caught.value
    with recursion_headroom(200), pytest.raises(PolicyError) as caught:
        load_policy_text(Policy, nest(MAX_DEPTH), fmt, f"p.{fmt}")
    assert [issue.message for issue in caught.value.issues] == [TOO_DEEP]


def test_brackets_inside_strings_and_comments_are_not_nesting():
    brackets = "[" * 40 + "{" * 40
    texts = {
        "json": VALID["json"].replace('"name": "r"', f'"name": "\\"{brackets}\\\\"'),
        "toml": VALID["toml"].replace('name = "r"', f"name = '''{brackets}''' # {brackets}"),
        "yaml": VALID["yaml"].replace("name: r", f"name: '{brackets}' # {brackets}"),
    }
    for fmt, text in texts.items():
        policy = load_policy_text(Policy, text, fmt, f"p.{fmt}")
        assert brackets in policy.rules[0].name, fmt


@pytest.mark.parametrize("key", ["a." * 50_000 + "a = 1", '"a". ' * 50_000 + "a = 1", "[" + "a." * 50_000 + "a]"])
def test_dotted_toml_keys_of_more_parts_than_the_cap_are_refused_before_tomllib_reads_them(tmp_path, key, monkeypatch):
    """`a.a.a... = 1` nests tables without a bracket, and tomllib's time and memory grow as the square of
    the parts (50,000 parts: minutes and gigabytes): the scan refuses the key at its line, and tomllib never
    reads the file (counted, not timed)."""
    path = write(tmp_path, "dotted.toml", VALID["toml"] + key + "\n")
    reads: list[str] = []
    real_loads = loading.tomllib.loads

    def counted_loads(text: str, **kwargs: Any) -> Any:
        reads.append(text)
        return real_loads(text, **kwargs)

    monkeypatch.setattr(loading.tomllib, "loads", counted_loads)
    (issue,) = refusal(path).issues
    assert reads == []
    assert (issue.line, issue.message) == (VALID["toml"].count("\n") + 1, TOO_DEEP)
    Policy.from_file(write(tmp_path, "valid.toml", VALID["toml"]))
    assert len(reads) == 1  # the count sees a read: a file within the caps is read by tomllib


def test_dotted_toml_keys_and_floats_within_the_cap_are_read():
    """Dots of floats, times and quoted keys do not add up across values; 30 parts nest within the cap."""
    text = VALID["toml"].replace("max_norm = 1.0", "max_norm = 1.5, from_step = 1") + (
        "[extra]\n"
        + "b.c.d = 1.5\nt = 07:32:00.999\n"
        + '"x.y"."z" = [1.5, 2.5, 3.5]\n'
        + ".".join(["k"] * 30)
        + " = 1\n"
    )
    with pytest.raises(PolicyError) as caught:
        load_policy_text(Policy, text, "toml", "p.toml")
    assert [issue.path for issue in caught.value.issues] == ["extra"], caught.value


# --- huge scalars and numbers ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["yaml", "json", "toml"])
def test_numbers_of_a_hundred_thousand_digits_are_refused_in_every_format(tmp_path, fmt):
    digits = "9" * 100_000
    text = {
        "yaml": VALID["yaml"].replace("max_norm: 1.0", f"max_norm: {digits}"),
        "json": VALID["json"].replace('"max_norm": 1.0', f'"max_norm": {digits}'),
        "toml": VALID["toml"].replace("max_norm = 1.0", f"max_norm = {digits}"),
    }[fmt]
    (issue,) = refusal(write(tmp_path, f"p.{fmt}", text)).issues
    assert "digits" in issue.message
    if fmt == "yaml":
        assert issue.line == 7


def test_a_scalar_of_almost_a_mebibyte_is_read_and_one_past_the_size_limit_is_refused_unread(tmp_path):
    long_name = "x" * (MAX_FILE_BYTES - 400)
    for fmt, text in {
        "yaml": VALID["yaml"].replace("name: r", f"name: {long_name}"),
        "json": VALID["json"].replace('"name": "r"', f'"name": "{long_name}"'),
        "toml": VALID["toml"].replace('name = "r"', f"name = '''{long_name}'''"),
    }.items():
        assert Policy.from_file(write(tmp_path, f"p.{fmt}", text)).rules[0].name == long_name
    (issue,) = refusal(write(tmp_path, "big.yaml", "#" * (MAX_FILE_BYTES + 1))).issues
    assert "the limit for a policy file is" in issue.message


# --- binary noise ---------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".yaml", ".json", ".toml"])
def test_binary_noise_is_a_policy_error_from_the_file_and_as_text(tmp_path, suffix):
    rng = random.Random(27)
    fmt = suffix[1:]
    for size in (1, 16, 512, 65_536):
        data = rng.randbytes(size)
        refusal(write(tmp_path, f"noise{suffix}", data))
        with pytest.raises(PolicyError):
            load_policy_text(Policy, data.decode("latin-1"), fmt, "<noise>")
    spliced = VALID[fmt].replace("r", "r\x00\x1b\ufffe\ud800", 1)
    refusal(write(tmp_path, f"spliced{suffix}", spliced))


# --- generated files, and the command line --------------------------------------------------------


def test_hundreds_of_generated_hostile_files_of_every_kind_load_or_raise_policy_error_naming_the_file(tmp_path):
    """benchmarks/policy_fuzz.py's files, read from disk: no other exception, each case under 2 s.

    Run ``python benchmarks/policy_fuzz.py`` for 10,000 files; ``-s`` here prints the table.
    """
    files = fuzz.hostile_files(SUITE_FILES, seed=2027)
    outcomes = fuzz.run(files, tmp_path, bound_s=2.0)
    print(outcomes.table())
    assert not outcomes.failures, "\n".join(outcomes.failures[:10])
    for kind in fuzz.KINDS:
        assert outcomes.refused[kind] > 0, kind
    assert sum(outcomes.loaded.values()) > SUITE_FILES // 50, "some of them are valid policies, and load"
    assert sum(outcomes.refused_with_line.values()) > sum(outcomes.refused.values()) // 2


HOSTILE = {
    "tag.yaml": VALID["yaml"] + "enabled: !!bool maybe\n",
    "flow.yaml": "[" * 1000 + "]" * 1000,
    "nested.yaml": VALID["yaml"] + "extra: " + "[" * 5000 + "\n",
    "compact.yaml": "- " * 100_000,
    "laughs.yaml": "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    + "".join(f"a{i}: &a{i} [{', '.join(['*a' if i == 1 else f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9)),
    "deep.json": "[" * 100_000,
    "deep.toml": "a = " + "{ b = " * 100_000,
    "digits.json": '{"version": ' + "9" * 100_000 + "}",
    "noise.yaml": bytes(range(256)) * 4,
}


def test_gradguard_validate_prints_a_policy_error_and_never_a_traceback_for_hostile_files(tmp_path):
    paths = [write(tmp_path, name, text) for name, text in HOSTILE.items()]
    result = CliRunner().invoke(main, ["validate", *map(str, paths)])
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    for path in paths:
        assert f"{path}: invalid policy" in result.output, path.name
    assert f"0 of {len(paths)} policy files valid" in result.output


def test_gradguard_validate_in_its_own_process_exits_1_with_nothing_on_stderr(tmp_path):
    """The two files of the issue, as a user runs them: exit status 1, the refusals on stdout, stderr empty."""
    tag = write(tmp_path, "tag.yaml", HOSTILE["tag.yaml"])
    flow = write(tmp_path, "flow.yaml", HOSTILE["flow.yaml"])
    done = subprocess.run(
        [sys.executable, "-m", "gradguard.cli", "validate", str(tag), str(flow)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr == ""
    assert f"{tag}:9: cannot read 'maybe' as !!bool" in done.stdout
    assert f"{flow}:1: {TOO_DEEP}" in done.stdout
