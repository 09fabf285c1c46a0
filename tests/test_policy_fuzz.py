"""Fuzzed policies, from files in the three formats and from dicts: each loads or raises PolicyError, never
hangs, and nothing in them runs.

The file fuzzer is seeded (the same cases every run): it mutates the shipped policies and a few
hostile seeds by byte flips, truncation, line shuffles and insertions of YAML tags, anchors and
aliases, huge and NaN numbers, deep nesting, pathological regexes and unknown actions. The dict
fuzzer is hypothesis (derandomized). Every policy that loads is bound to a model whose parameter
names have 100 characters and more. Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from gradguard import Policy, PolicyError
from gradguard.policy.loading import load_policy_text
from gradguard.policy.matching import bind

REPO = Path(__file__).resolve().parent.parent
HUNG_S = 60.0
"""A hang guard, not a speed claim: a case that takes longer has hung (a parser or matcher gone quadratic or
exponential). The slowest case is printed; speed is measured by ``benchmarks/policy_fuzz.py`` (``--bound``)."""
FILE_CASES = 3000
FROM_DISK = 10
"""One case in this many is written to a file and read by Policy.from_file; the others parse the text."""
DICT_CASES = 1000

KEYS = ["a" * 100, "a" * 99 + "b", "embed_" + "e" * 94, "blocks_0_attn_" + "q" * 86, "x.y".replace(".", "_") * 34]


def long_named_model() -> nn.Module:
    """Names of 100 to 230 characters (nested ModuleDicts with 100-character keys)."""
    inner = nn.ModuleDict({key: nn.Linear(1, 1) for key in KEYS})
    return nn.ModuleDict({"blocks": nn.ModuleDict({"a" * 100: inner}), "head": nn.Linear(1, 1)})


class Tally:
    """Counts outcomes and the slowest case."""

    def __init__(self) -> None:
        self.cases = self.loaded = self.refused = self.bound = 0
        self.slowest = 0.0
        self.failures: list[str] = []

    def run(self, label: str, load: Any, model: nn.Module) -> None:
        self.cases += 1
        start = time.perf_counter()
        try:
            policy = load()
        except PolicyError:
            self.refused += 1
        except Exception as exc:  # the one thing that must never happen
            self.failures.append(f"{label}: {type(exc).__name__}: {str(exc)[:300]}")
        else:
            self.loaded += 1
            try:
                bind(policy, model)
                self.bound += 1
            except PolicyError:
                pass
            except Exception as exc:
                self.failures.append(f"{label} (bind): {type(exc).__name__}: {str(exc)[:300]}")
        elapsed = time.perf_counter() - start
        self.slowest = max(self.slowest, elapsed)
        if elapsed > HUNG_S:
            self.failures.append(f"{label}: hung ({elapsed:.0f} s)")

    def report(self, what: str) -> str:
        return (
            f"{what}: {self.cases} cases, {self.loaded} loaded ({self.bound} bound), {self.refused} refused, "
            f"{len(self.failures)} failures, slowest {self.slowest * 1e3:.1f} ms"
        )


def shown(value: Any) -> str:
    """A short repr, also of values Python cannot print (ints of more than 4300 digits)."""
    try:
        return repr(value)[:300]
    except ValueError:
        return f"<{type(value).__name__} that repr refuses>"


# --- files ----------------------------------------------------------------------------------------

SEED_TEXTS = {
    "yaml": [
        "version: 1\nrules:\n  - name: a\n    match: ['re:(a+)+$', '*embed*']\n    exclude: '*.bias'\n"
        "    actions: [{action: clip_norm, max_norm: 1.0}, {action: halt_on_nonfinite}]\n",
        "base: &b {action: clip_norm, max_norm: 1.0}\nversion: 1\nrules:\n  - name: a\n    match: '*'\n"
        "    actions: [*b, {<<: *b, max_norm: 2.0}]\n",
        "version: 1\nrules:\n- {name: r, match: ['re:(.*a){20}'], allow_no_match: true, actions: [{action: zero}]}\n",
    ],
    "toml": [
        'version = 1\n[[rules]]\nname = "a"\nmatch = ["re:(a|a)*$", "blocks.*"]\n'
        'actions = [{ action = "scale", factor = 0.5, from_step = 1, until_step = 9 }]\n',
    ],
    "json": [
        '{"version": 1, "rules": [{"name": "a", "match": ["re:(a*)*b", "*"], "exclude": [],\n'
        ' "actions": [{"action": "skip_step_on_nonfinite", "max_skips": 2, "window_steps": 10}]}]}\n',
    ],
}
INSERTS = {
    "yaml": [
        "!!python/object/apply:builtins.exec ['import pathlib; pathlib.Path(SENTINEL).touch()']",
        "!!python/object/apply:os.system ['touch SENTINEL']",
        "!!python/name:os.system",
        "!!binary aGVsbG8=",
        "!!set {a, b}",
        "!!timestamp 2001-13-45",
        "2001-13-45",
        "&x [1, 2]",
        "*x",
        "<<: *x",
        "&y [*y]",
        "9" * 5000,
        "0x" + "f" * 5000,
        "1e999",
        ".nan",
        "-.inf",
        "[" * 200,
        "{" * 200,
        "re:(a+)+$",
        "'re:(.*a){20}'",
        "'re:(?=a)'",
        "'re:\\1'",
        "{action: explode}",
        "{action: clip_norm, max_norm: .nan}",
        "true",
        "null",
        "[]",
        "{}",
        "? [a]\n: b",
        "\t",
        "'" + "x" * 2000 + "'",
    ],
    "toml": [
        "[[rules]]",
        "inf",
        "nan",
        "9" * 5000,
        "[" * 200,
        "{ a = 1 }",
        '"re:(a+)+$"',
        "'''",
        "1979-05-27T07:32:00Z",
    ],
    "json": ["[" * 200, "{" * 200, "NaN", "Infinity", "9" * 5000, '"re:(a+)+$"', '"\\ud800"', "null", "{}", "[]"],
}


def mutate(text: str, fmt: str, rng: random.Random, sentinel: str) -> str:
    """One to four random edits of ``text``."""
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(6)
        if kind == 0 and text:  # flip a byte (as a character)
            i = rng.randrange(len(text))
            text = text[:i] + chr(rng.randrange(1, 256)) + text[i + 1 :]
        elif kind == 1 and text:  # truncate
            text = text[: rng.randrange(len(text))]
        elif kind == 2:  # insert a hostile token
            i = rng.randrange(len(text) + 1)
            token = rng.choice(INSERTS[fmt]).replace("SENTINEL", sentinel)
            text = text[:i] + token + text[i:]
        elif kind == 3:  # replace a value after a colon or equals sign
            token = rng.choice(INSERTS[fmt]).replace("SENTINEL", sentinel)
            marks = [i for i, c in enumerate(text) if c in ":="]
            if marks:
                i = rng.choice(marks) + 1
                end = min((j for j in (text.find(c, i) for c in ",}\n") if j >= 0), default=len(text))
                text = text[:i] + " " + token + text[end:]
        elif kind == 4:  # duplicate or drop a line
            lines = text.splitlines(keepends=True)
            if lines:
                i = rng.randrange(len(lines))
                lines[i:i] = [lines[i]] if rng.random() < 0.5 else []
                if rng.random() < 0.5:
                    del lines[i]
                text = "".join(lines)
        else:  # swap two lines
            lines = text.splitlines(keepends=True)
            if len(lines) > 1:
                i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
                lines[i], lines[j] = lines[j], lines[i]
                text = "".join(lines)
    return text


def test_fuzzed_policy_files_load_or_raise_policy_error_within_a_second_and_run_nothing(tmp_path):
    """Thousands of mutated YAML, TOML and JSON files: only PolicyError, each case under 1 s, no tag executed."""
    rng = random.Random(14)
    sentinel = str(tmp_path / "executed")
    corpus = {fmt: list(texts) for fmt, texts in SEED_TEXTS.items()}
    for path in sorted((REPO / "policies").iterdir()):
        fmt = {".yaml": "yaml", ".yml": "yaml", ".toml": "toml", ".json": "json"}.get(path.suffix)
        if fmt:
            corpus[fmt].append(path.read_text())
    model = long_named_model()
    tally = Tally()
    for case in range(FILE_CASES):
        fmt = ("yaml", "yaml", "toml", "json")[case % 4]
        text = mutate(rng.choice(corpus[fmt]), fmt, rng, sentinel)
        label = f"case {case} ({fmt}): {text[:200]!r}"
        if case % FROM_DISK == 0:  # through the file system (slow here: about 1 ms per open)
            path = tmp_path / f"case.{'yml' if case % 8 == 0 else fmt}"
            path.write_bytes(text.encode("utf-8", "surrogatepass"))
            tally.run(label, lambda path=path: Policy.from_file(path), model)
        else:  # the same parse and validation, from the text
            tally.run(label, lambda text=text, fmt=fmt: load_policy_text(Policy, text, fmt, "<fuzz>"), model)
    print(tally.report("policy files"))
    assert not tally.failures, "\n".join(tally.failures[:20])
    assert not Path(sentinel).exists(), "a YAML tag ran code"
    assert tally.loaded > FILE_CASES // 20
    assert tally.refused > FILE_CASES // 2


# --- dicts ----------------------------------------------------------------------------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([5000, -400, 64]).map(lambda digits: 10**digits)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.binary(max_size=5)
    | st.sampled_from(["*", "re:(a+)+$", "re:(.*a){20}", "re:(?=x)", "re:[", "a" * 2000, "zero", "clip_norm"])
)
_junk = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
_patterns = st.sampled_from(
    [
        "*",
        "blocks.*",
        "*a",
        "re:(a+)+$",
        "re:(.*a){20}",
        "re:(a|a)*$",
        "re:(a*)*b",
        "re:a{,3}",
        "re:(?<=a)b",
        "",
        "re:" + "a" * 999,
        "re:(.?){1000}",
        "*" * 1001,
        "head.*",
        "re:.*\\.weight",
    ]
)


def _mostly(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``good`` three times in four (``a | b`` would weigh every branch of ``b`` as much as ``a``)."""
    return st.integers(0, 3).flatmap(lambda k: bad if k == 0 else good)


_good_patterns = st.sampled_from(["*", "blocks.*", "re:(a+)+$", "re:(.*a){20}", "re:(a|a)*$", "re:(a*)*b", "*a*a*a*b"])
_good_action = st.sampled_from(
    [
        {"action": "zero"},
        {"action": "halt_on_nonfinite"},
        {"action": "clip_norm", "max_norm": 1.0, "scope": "group"},
        {"action": "scale", "factor": 0.5, "from_step": 2, "until_step": 9},
    ]
)
_action = (
    _good_action
    | _good_action
    | _good_action
    | st.fixed_dictionaries(
        {
            "action": st.sampled_from(
                ["clip_norm", "clip_value", "scale", "zero", "drop", "halt_on_nonfinite", "explode"]
            )
        },
        optional={
            "max_norm": _scalars,
            "limit": _scalars,
            "factor": _scalars,
            "norm_type": _scalars,
            "scope": st.sampled_from(["tensor", "group", 3]),
            "from_step": _scalars,
            "until_step": _scalars,
        },
    )
)
_rule = st.fixed_dictionaries(
    {
        "match": _mostly(st.lists(_mostly(_good_patterns, _patterns), min_size=1, max_size=3), _patterns | _junk),
        "actions": _mostly(st.lists(_action, min_size=1, max_size=2), _junk),
        "allow_no_match": _mostly(st.just(True), _scalars),
    },
    optional={"exclude": st.lists(_patterns, max_size=2)},
)


def _named(rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Unique names (junk in a rule's other fields is enough; duplicates are a refusal of their own)."""
    return [{"name": f"r{index}", **rule} for index, rule in enumerate(rules)]


_policy = _mostly(
    st.fixed_dictionaries(
        {
            "version": _mostly(st.just(1), _scalars),
            "rules": _mostly(st.lists(_rule, min_size=1, max_size=3).map(_named), _junk),
        },
    ),
    st.dictionaries(st.text(max_size=8), _junk, max_size=3),
)


def test_fuzzed_policy_dicts_load_or_raise_policy_error_within_a_second():
    """Policy.from_dict on generated data (policy-shaped and junk): only PolicyError, each case under 1 s."""
    model = long_named_model()
    tally = Tally()

    @settings(
        max_examples=DICT_CASES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(_policy)
    def case(data: dict[str, Any]) -> None:
        tally.run(shown(data), lambda: Policy.from_dict(data), model)

    case()
    print(tally.report("policy dicts"))
    assert not tally.failures, "\n".join(tally.failures[:20])
    assert tally.loaded > 0
    assert tally.refused > 0


def test_an_explicit_timestamp_tag_on_something_else_is_a_policy_error_with_its_line(tmp_path):
    """`!!timestamp 2001-13-45base` (found by the fuzzer) is a PolicyError at its line, not PyYAML's AttributeError."""
    path = tmp_path / "p.yaml"
    body = "  - name: a\n    match: !!timestamp 2001-13-45base\n    actions: [{action: zero}]\n"
    path.write_text("version: 1\nrules:\n" + body)
    with pytest.raises(PolicyError) as excinfo:
        Policy.from_file(path)
    (issue,) = excinfo.value.issues
    assert issue.line == 4
    assert "tagged !!timestamp but is not a date or time" in issue.message
