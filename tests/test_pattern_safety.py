"""Patterns from any file match in bounded time: 're:' is RE2 (linear), globs are atomic, sizes are capped.

On main, 're:(a+)+$' took 19.2 s and 're:(.*a){20}' 22.9 s against one 29-character name, doubling
with each further character. Here each pathological pattern must compile to a matcher linear in the name (an RE2
automaton of bounded size, a glob of atomic segments: counted, not timed) and bind, without hanging, to a model
whose parameter names have about 100 characters; or be refused at load with the reason.
"""

from __future__ import annotations

import fnmatch
import subprocess
import sys
import time

import pytest
from torch import nn

from gradguard import Policy, PolicyError
from gradguard.policy.matching import bind, pattern_matcher
from gradguard.policy.patterns import MAX_PATTERN_LENGTH, MAX_REGEX_PROGRAM_SIZE, _compile_regex

HUNG_S = 30.0
"""A hang guard, not a speed claim: a pattern that backtracks takes far longer on these names (on main, 19 s on
29 characters, doubling with each further one). How fast patterns load and bind is measured by
``benchmarks/policy_fuzz.py`` (its ``--bound`` per case), not here."""

PATHOLOGICAL_REGEXES = [
    "re:(a+)+$",
    "re:(.*a){20}",
    "re:(a|a)*$",
    "re:(a*)*b",
    "re:(a|aa)+$",
    "re:(a|a?)+b",
    "re:(.*)*b",
    "re:(\\w+\\s?)*$",
    "re:((a+)+)+c",
    "re:(.*a){200}",
    "re:(a?){100}a{100}",
    "re:(x+x+)+y",
    "re:(.*\\.)*(.*)*z",
]
PATHOLOGICAL_GLOBS = [
    "*a*a*a*a*a*a*a*a*a*a*a*a*b",
    "*?*?*?*?*?*?*?*?*?*?*?*?*b",
    "*[a]*[a]*[a]*[a]*[a]*[a]*[a]*b",
    "*.*.*.*.*.*.*.*.*.*.*.*.*.*.*.*.*x",
    "*" * 900 + "b",
]


def long_named_model() -> nn.Module:
    """Parameter names of 100 to 110 characters, mostly 'a's: the worst case for the patterns above."""
    keys = ["a" * 100, "a" * 99 + "c", "a" * 50 + "." * 0 + "b" * 50, "x" * 100]
    inner = nn.ModuleDict({key: nn.Linear(1, 1) for key in keys})
    return nn.ModuleDict({"a" * 20: nn.ModuleDict({"a" * 60: inner})})


def bind_time(pattern: str) -> float:
    """Seconds to load a one-rule policy with ``pattern`` and bind it to :func:`long_named_model`."""
    model = long_named_model()
    pattern_matcher.cache_clear()
    start = time.perf_counter()
    policy = Policy.from_dict(
        {
            "version": 1,
            "rules": [{"name": "r", "match": [pattern], "allow_no_match": True, "actions": [{"action": "zero"}]}],
        }
    )
    bind(policy, model)
    return time.perf_counter() - start


def linear_by_construction(pattern: str) -> bool:
    """Whether ``pattern`` matches in time linear in the name, by what it is compiled to (counted, not timed): a
    regex is an RE2 automaton of at most ``MAX_REGEX_PROGRAM_SIZE`` instructions (RE2 matches in time linear in
    the name times that size); a glob's ``*`` segments are atomic groups (``(?>.*?x)``, never backtracked into),
    but for its last star."""
    if pattern.startswith("re:"):
        regex = _compile_regex(pattern)
        return type(regex).__module__.startswith("re2") and int(regex.programsize) <= MAX_REGEX_PROGRAM_SIZE
    return linear_by_construction_of_translation(fnmatch.translate(pattern))


@pytest.mark.parametrize("pattern", PATHOLOGICAL_REGEXES + PATHOLOGICAL_GLOBS)
def test_patterns_that_backtrack_exponentially_bind_to_100_character_names_in_linear_time(pattern):
    """Nested quantifiers, ambiguous alternations and star-heavy globs compile to matchers linear in the name
    (RE2, atomic globs), and load and bind to 100-character names without hanging."""
    assert max(len(name) for name, _ in long_named_model().named_parameters()) >= 100
    assert linear_by_construction(pattern), pattern
    elapsed = bind_time(pattern)
    assert elapsed < HUNG_S, f"{pattern!r} hung: {elapsed:.1f} s to bind"


def test_the_linear_time_check_tells_a_backtracking_translation_apart():
    """The check above can fail: a glob translated without atomic groups (Python < 3.9's ``fnmatch``) is not
    linear by construction."""
    assert not linear_by_construction_of_translation("(?s:.*a.*a.*a.*b)\\Z")
    assert linear_by_construction_of_translation(fnmatch.translate("*a*a*a*b"))


def linear_by_construction_of_translation(translated: str) -> bool:
    return translated.count(".*") - translated.count("(?>.*?") <= 1


def test_regex_patterns_still_match_the_whole_dotted_name_as_before():
    """RE2 gives the same answers as before on ordinary patterns: full match, groups, classes, alternations."""
    cases = {
        "re:(.*\\.)?(blocks|layers|h)\\.\\d+\\.(attn|attention|self_attn)\\..*": {
            "blocks.3.attn.in_proj_weight": True,
            "model.layers.12.self_attn.q_proj.weight": True,
            "blocks.3.mlp.0.weight": False,
            "xblocks.3.attn.w": False,
        },
        "re:(?i)EMBED.*": {"embed.weight": True, "Embedding.weight": True, "wte.weight": False},
        "re:a.c": {"abc": True, "a.c": True, "abcd": False},
        "re:[^.]+": {"weight": True, "fc.weight": False},
    }
    for pattern, expected in cases.items():
        matches = pattern_matcher(pattern)
        assert {name: matches(name) for name in expected} == expected, pattern


@pytest.mark.parametrize(
    ("pattern", "fragments"),
    [
        ("re:(a)\\1", ["backreferences", "not supported"]),
        ("re:(?P<x>a)(?P=x)", ["backreferences"]),
        ("re:(?!.*bias).*", ["lookarounds", "exclude"]),
        ("re:.*(?<=weight)", ["lookarounds"]),
        ("re:(?>a+)b", ["atomic groups", "never backtracks"]),
        ("re:a++b", ["possessive"]),
        ("re:.*weight\\Z", ["'\\z'"]),
        ("re:(?x) a b", ["verbose"]),
        ("re:a{1001}", ["up to 1000"]),
        ("re:(a{100}){100}", ["multiply"]),
        ("re:a{,3}", ["'{0,n}'"]),
        ("re:(.?){1000}", [f"the limit is {MAX_REGEX_PROGRAM_SIZE}", "RE2 instructions"]),
        ("re:(unclosed", ["missing )"]),
    ],
)
def test_a_regex_that_needs_backtracking_or_is_too_large_is_refused_with_the_reason(tmp_path, pattern, fragments):
    """Each refused construct is a PolicyError naming the file, line, pattern and why, and suggesting a way out."""
    text = (
        "version: 1\nrules:\n  - name: r\n    match: ['*']\n"
        f"    exclude: ['{pattern}']\n    actions: [{{action: zero}}]\n"
    )
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as info:
        Policy.from_file(path)
    (issue,) = info.value.issues
    assert (issue.source, issue.line, issue.path) == (str(path), 5, "rules[0].exclude")
    assert "invalid regular expression" in issue.message
    assert repr(pattern) in issue.message
    assert "RE2 regular expression" in issue.message
    assert "glob" in issue.message
    for fragment in fragments:
        assert fragment in issue.message, (fragment, issue.message)


def test_a_pattern_longer_than_the_limit_is_refused_naming_its_length():
    """A pattern may have at most MAX_PATTERN_LENGTH characters; the error gives the length and the limit."""
    pattern = "blocks." + "x" * MAX_PATTERN_LENGTH
    with pytest.raises(PolicyError) as info:
        Policy.from_dict({"version": 1, "rules": [{"name": "r", "match": pattern, "actions": [{"action": "zero"}]}]})
    message = info.value.issues[0].message
    assert f"has {len(pattern)} characters; the limit is {MAX_PATTERN_LENGTH}" in message
    assert len(message) < 500  # the pattern itself is cut short
    Policy.from_dict(
        {"version": 1, "rules": [{"name": "r", "match": "*" * MAX_PATTERN_LENGTH, "actions": [{"action": "zero"}]}]}
    )


def test_loading_a_policy_imports_neither_torch_nor_re2_until_a_regex_is_compiled():
    """The policy loader stays light: RE2 is loaded for the first 're:' pattern only, torch never."""
    code = (
        "import sys, gradguard, gradguard.policy.loading\n"
        "from gradguard import Policy\n"
        "p = {'version': 1, 'rules': [{'name': 'a', 'match': '*', 'actions': [{'action': 'zero'}]}]}\n"
        "Policy.from_dict(p)\n"
        "assert 'torch' not in sys.modules and 're2' not in sys.modules\n"
        "p['rules'][0]['match'] = 're:.*'\n"
        "Policy.from_dict(p)\n"
        "assert 'torch' not in sys.modules and 're2' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
