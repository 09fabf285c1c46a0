"""Reading policy files and turning every parse or validation problem into a [`PolicyError`][gradguard.PolicyError].

No raw YAML, TOML, JSON or pydantic error reaches the user: each becomes a [`PolicyIssue`][gradguard.PolicyIssue] that
names the file, the line (YAML always; JSON and TOML for syntax errors), the field path, what was
given and what is expected. That holds for every failure of the readers, not only their syntax
errors: a YAML tag the constructor cannot read (``!!bool maybe``, ``!!map [1]``), a value Python
cannot build, and ``RecursionError`` or ``MemoryError`` anywhere in a reader all become a
[`PolicyError`][gradguard.PolicyError] naming the file (and the line where the reader knows it).

Nesting deeper than ``MAX_DEPTH`` is refused before anything recurses into it. JSON and TOML texts
are scanned for brackets first (``check_nesting``, a linear scan of the raw text), since
``json.loads`` and ``tomllib`` recurse per level. In PyYAML only the composer recurses (its scanner
and parser are state machines with explicit stacks), and the loader's composer counts the
collections it has open and refuses the next one past the cap, at its line, before composing it: no
document, however its syntax ends, takes more than the cap's worth of frames.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import ValidationError

from gradguard.errors import PolicyError, PolicyIssue
from gradguard.policy.limits import (
    MAX_DEPTH,
    MAX_FILE_BYTES,
    TOO_DEEP,
    check_counts,
    check_data_shape,
    check_nesting,
    check_yaml_events,
)
from gradguard.policy.schema import (
    ACTION_NAMES,
    DUPLICATE_RULE_NAME,
    EMPTY_STEP_WINDOW,
    AdaptiveGradClip,
    AutoClip,
    ClipNorm,
    ClipValue,
    Drop,
    HaltOnNonfinite,
    Loss,
    LossSpike,
    Monitor,
    PolicyFields,
    Ranks,
    Recovery,
    Rerun,
    Rule,
    Scale,
    SkipStepOnNonfinite,
    SkipStepOnSpike,
    ZClip,
    Zero,
)
from gradguard.policy.yaml_reader import (
    CannotBuild,
    Locator,
    PolicyYamlLoader,
    TooDeep,
    shown,
    syntax_error_in_words,
    type_name,
    yaml_locator,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["did_you_mean", "load_policy_file", "load_policy_text", "validate_policy_data"]

P = TypeVar("P", bound=PolicyFields)
"""The policy class to validate into ([`gradguard.Policy`][gradguard.Policy])."""


_TOML_LINE = re.compile(r"\(at line (\d+), column \d+\)")

_SUFFIXES = {".yaml": "yaml", ".yml": "yaml", ".toml": "toml", ".json": "json"}

_FIELDS_BY_ACTION: dict[str, tuple[str, ...]] = {
    "agc": tuple(AdaptiveGradClip.model_fields),
    "autoclip": tuple(AutoClip.model_fields),
    "clip_norm": tuple(ClipNorm.model_fields),
    "clip_value": tuple(ClipValue.model_fields),
    "drop": tuple(Drop.model_fields),
    "halt_on_nonfinite": tuple(HaltOnNonfinite.model_fields),
    "monitor": tuple(Monitor.model_fields),
    "scale": tuple(Scale.model_fields),
    "skip_step_on_nonfinite": tuple(SkipStepOnNonfinite.model_fields),
    "skip_step_on_spike": tuple(SkipStepOnSpike.model_fields),
    "zclip": tuple(ZClip.model_fields),
    "zero": tuple(Zero.model_fields),
}
_RULE_FIELDS = tuple(Rule.model_fields)
_POLICY_FIELDS = tuple(PolicyFields.model_fields)
_RECOVERY_FIELDS = tuple(Recovery.model_fields)
_LOSS_FIELDS = tuple(Loss.model_fields)
_LOSS_SPIKE_FIELDS = tuple(LossSpike.model_fields)
_RERUN_FIELDS = tuple(Rerun.model_fields)
_RANKS_FIELDS = tuple(Ranks.model_fields)


def load_policy_file(cls: type[P], path: str | os.PathLike[str]) -> P:
    """Read, parse and validate the policy file at ``path``."""
    text, fmt = read_policy_file(path)
    return load_policy_text(cls, text, fmt, os.fspath(path))


def read_policy_file(path: str | os.PathLike[str]) -> tuple[str, str]:
    """The text of the policy file at ``path`` and its format, read once and no further than the size limit."""
    source = os.fspath(path)
    suffix = Path(source).suffix.lower()
    fmt = _SUFFIXES.get(suffix)
    if fmt is None:
        message = f"unsupported file type {suffix or '(none)'!r}; a policy file ends in .yaml, .yml, .toml or .json"
        if not suffix and not Path(source).exists():
            # GradGuard(model, "default") means a shipped policy more often than a file without a suffix.
            message += f"; a shipped policy by name: Policy.shipped({source!r}) (`gradguard policies` lists them)"
        raise PolicyError([PolicyIssue(source, None, "", message)])
    return _read(source), fmt


def load_policy_text(cls: type[P], text: str, fmt: str, source: str) -> P:
    """Parse and validate the text of a policy file in format ``fmt`` (``yaml``, ``toml`` or ``json``)."""
    if len(text) > MAX_FILE_BYTES:  # characters: at least as many bytes
        raise PolicyError(
            [PolicyIssue(source, None, "", f"the text has {len(text)} characters; the limit is {MAX_FILE_BYTES}")]
        )
    data, locate = _parse(text, fmt, source)
    if not isinstance(data, Mapping):
        raise PolicyError(
            [
                PolicyIssue(
                    source,
                    locate(()) if locate else None,
                    "",
                    f"the document is a {type_name(data)}; expected a mapping with 'version' and 'rules'",
                )
            ]
        )
    return validate_policy_data(cls, data, source=source, locate=locate)


def validate_policy_data(cls: type[P], data: Mapping[str, Any], *, source: str, locate: Locator | None) -> P:
    """Validate already-parsed policy data; ``locate`` supplies line numbers where known."""
    if not isinstance(data, Mapping):
        raise PolicyError(
            [PolicyIssue(source, None, "", f"expected a mapping with 'version' and 'rules', got {type_name(data)}")]
        )
    # The caps first: data past them is refused whole, before any walk over it could take long.
    check_data_shape(data, source)
    check_counts(data, source, locate)
    # Checks across fields run on the raw data too: pydantic runs a model's own checks only once all
    # of its fields are valid, and every problem should be reported at once.
    cross = _cross_field_issues(data, source, locate)
    try:
        policy = cls.model_validate(data)
    except ValidationError as exc:
        issues = _issues_from(exc, data, source, locate) + cross
        if locate is not None:
            issues.sort(key=lambda issue: issue.line or 0)
        raise PolicyError(issues) from None
    if cross:  # pragma: no cover - pydantic's own validators reject the same data
        raise PolicyError(cross)
    policy._source = source
    policy._rule_lines = tuple(locate(("rules", index)) if locate else None for index in range(len(policy.rules)))
    return policy


# --- reading and parsing -------------------------------------------------------------------------


def _read(source: str) -> str:
    """The file's text; refused if it is larger than ``MAX_FILE_BYTES`` (read no further than that)."""

    def refuse(message: str) -> PolicyError:
        return PolicyError([PolicyIssue(source, None, "", message)])

    try:
        size = os.stat(source).st_size
        if size > MAX_FILE_BYTES:
            raise refuse(f"the file has {size} bytes; the limit for a policy file is {MAX_FILE_BYTES} (1 MiB)")
        with open(source, "rb") as file:
            raw = file.read(MAX_FILE_BYTES + 1)  # stat can be wrong (pipes, /proc): never read on without bound
    except FileNotFoundError:
        looked = os.path.abspath(source)
        issue = PolicyIssue(source, None, "", f"no such file (looked for {looked}); check the path")
        raise PolicyError([issue], head="no such policy") from None
    except OSError as exc:
        raise refuse(f"cannot read the file: {exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise refuse(f"the file has more than {MAX_FILE_BYTES} bytes; the limit for a policy file is {MAX_FILE_BYTES}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise refuse(f"cannot read the file: {exc}") from None


def _parse(text: str, fmt: str, source: str) -> tuple[Any, Locator | None]:
    if fmt == "yaml":
        # The parser is a state machine; the composer and constructor recurse and expand aliases. So the
        # events are checked against the caps first (depth, aliases), then the document is built once.
        check_yaml_events(text, getattr(yaml, "CSafeLoader", PolicyYamlLoader), source)  # libyaml's, if built
        loader: PolicyYamlLoader | None = None
        try:
            loader = PolicyYamlLoader(text)  # its reader refuses non-printable characters at once
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        except TooDeep as exc:
            raise PolicyError([PolicyIssue(source, exc.line, "", TOO_DEEP)]) from None
        except CannotBuild as exc:
            line = exc.problem_mark.line + 1 if exc.problem_mark is not None else None
            raise PolicyError([PolicyIssue(source, line, "", str(exc.problem))]) from None
        except yaml.MarkedYAMLError as exc:
            line, message = syntax_error_in_words(exc)
            raise PolicyError([PolicyIssue(source, line, "", message)]) from None
        except yaml.YAMLError as exc:
            raise PolicyError([PolicyIssue(source, None, "", f"YAML syntax error: {exc}")]) from None
        except (RecursionError, MemoryError) as exc:
            raise _reader_gave_up(source, "YAML", exc) from None
        except Exception as exc:  # a reader's own failure; the constructors' are YAML errors with a line already
            raise _reader_failed(source, "YAML", exc) from None
        finally:
            if loader is not None:
                loader.dispose()
        return data, yaml_locator(node)
    check_nesting(text, fmt, source)  # JSON and TOML: brackets past the cap refused before the recursive parse
    if fmt == "toml":
        try:
            return tomllib.loads(text), None
        except tomllib.TOMLDecodeError as exc:
            line = getattr(exc, "lineno", None)  # Python >= 3.14; before, only the message has it
            if line is None and (found := _TOML_LINE.search(str(exc))) is not None:
                line = int(found.group(1))
            message = getattr(exc, "msg", str(exc))
            raise PolicyError([PolicyIssue(source, line, "", f"TOML syntax error: {message}")]) from None
        except ValueError as exc:
            raise _unreadable_value(source, exc) from None
        except (RecursionError, MemoryError) as exc:
            raise _reader_gave_up(source, "TOML", exc) from None
        except Exception as exc:
            raise _reader_failed(source, "TOML", exc) from None
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        raise PolicyError(
            [PolicyIssue(source, exc.lineno, "", f"JSON syntax error: {exc.msg} (column {exc.colno})")]
        ) from None
    except ValueError as exc:
        raise _unreadable_value(source, exc) from None
    except (RecursionError, MemoryError) as exc:
        raise _reader_gave_up(source, "JSON", exc) from None
    except Exception as exc:
        raise _reader_failed(source, "JSON", exc) from None


def _unreadable_value(source: str, exc: ValueError) -> PolicyError:
    return PolicyError([PolicyIssue(source, None, "", f"cannot read a value of the file: {exc}")])


def _reader_gave_up(source: str, reader: str, exc: RecursionError | MemoryError) -> PolicyError:
    """Recursion or memory ran out inside a reader (the caps above should see to it that neither does)."""
    if isinstance(exc, RecursionError):
        why = f"it nests too deeply to read (the limit is {MAX_DEPTH} levels; a policy needs 5)"
    else:
        why = "reading it ran out of memory"
    return PolicyError([PolicyIssue(source, None, "", f"cannot read the file as {reader}: {why}")])


def _reader_failed(source: str, reader: str, exc: Exception) -> PolicyError:
    """Any other failure of a reader: named, never raised as it is."""
    detail = str(exc)[:200]
    return PolicyError(
        [PolicyIssue(source, None, "", f"cannot read the file as {reader}: {type(exc).__name__}: {detail}")]
    )


def _issues_from(
    exc: ValidationError, data: Mapping[str, Any], source: str, locate: Locator | None
) -> list[PolicyIssue]:
    issues = []
    for error in exc.errors(include_url=False):
        if _is_echo_of_item_errors(error) or error["type"] in _CROSS_FIELD_ERRORS:
            continue
        loc = _drop_union_tags(error["loc"])
        line = locate(loc) if locate else None
        issues.append(PolicyIssue(source, line, _format_path(loc), _explain(error, loc, data)))
    return issues


_CROSS_FIELD_ERRORS = frozenset({EMPTY_STEP_WINDOW, DUPLICATE_RULE_NAME})
"""Pydantic errors that ``_cross_field_issues`` reports itself, whatever else is wrong."""


def _cross_field_issues(data: Mapping[str, Any], source: str, locate: Locator | None) -> list[PolicyIssue]:
    """Duplicate rule names and empty step windows, found in the raw data."""
    rules = data.get("rules")
    if not isinstance(rules, list | tuple):
        return []
    issues: list[PolicyIssue] = []

    def add(loc: tuple[int | str, ...], message: str) -> None:
        issues.append(PolicyIssue(source, locate(loc) if locate else None, _format_path(loc), message))

    def check_window(loc: tuple[int | str, ...], item: Mapping[str, Any]) -> None:
        start, end = _as_step(item.get("from_step")), _as_step(item.get("until_step"))
        if start is not None and end is not None and end <= start:
            add(
                (*loc, "until_step"),
                f"got {shown(end)}; expected a step greater than from_step ({shown(start)}): "
                "the window [from_step, until_step) would never apply",
            )

    first_use: dict[str, int] = {}
    for index, rule in enumerate(rules):
        if not isinstance(rule, Mapping):
            continue
        name = rule.get("name")
        if isinstance(name, str) and name:
            if name in first_use:
                add(
                    ("rules", index, "name"),
                    f"got {shown(name)}, which rules[{first_use[name]}] already uses; give every rule a unique name "
                    "(counters and logs are keyed by it)",
                )
            else:
                first_use[name] = index
        check_window(("rules", index), rule)
        actions = rule.get("actions")
        if isinstance(actions, list | tuple):
            for position, action in enumerate(actions):
                if isinstance(action, Mapping):
                    check_window(("rules", index, "actions", position), action)
    return issues


def _as_step(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _is_echo_of_item_errors(error: Any) -> bool:
    """Pydantic re-checks a sequence's length after dropping its invalid items; the items' own errors say it."""
    if error["type"] != "too_short":
        return False
    given = error.get("input")
    return isinstance(given, Sequence) and len(given) >= int((error.get("ctx") or {}).get("min_length", 1))


def _drop_union_tags(loc: Sequence[int | str]) -> tuple[int | str, ...]:
    """Pydantic puts the discriminator's tag into the path (``actions.0.clip_norm.max_norm``); users never wrote it."""
    out: list[int | str] = []
    for index, part in enumerate(loc):
        after_action_index = index >= 2 and loc[index - 2] == "actions" and isinstance(loc[index - 1], int)
        if after_action_index and part in ACTION_NAMES:
            continue
        out.append(part)
    return tuple(out)


def _format_path(loc: Sequence[int | str]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _explain(error: Any, loc: Sequence[int | str], data: Mapping[str, Any]) -> str:
    kind: str = error["type"]
    given = error.get("input")
    ctx = error.get("ctx") or {}
    field = str(loc[-1]) if loc else ""
    if kind == "extra_forbidden":
        allowed = _allowed_fields(loc, data)
        hint = did_you_mean(field, allowed)
        return f"unknown field {shown(field)}{hint}; allowed here: {', '.join(allowed)}"
    if kind == "missing":
        return f"missing required field {shown(field)}; add it"
    if kind == "union_tag_invalid":
        tag = ctx.get("tag", given)
        hint = did_you_mean(str(tag), ACTION_NAMES)
        return f"unknown action {shown(tag)}{hint}; expected one of: {', '.join(ACTION_NAMES)}"
    if kind == "union_tag_not_found":
        return (
            f"this action has no 'action' field; write e.g. {{action: clip_norm, max_norm: 1.0}} (got {shown(given)})"
        )
    if kind == "literal_error":
        return f"got {shown(given)}; expected {ctx.get('expected', 'one of the allowed values')}"
    if kind in {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}:
        relation = {
            "greater_than": "greater than",
            "greater_than_equal": "at least",
            "less_than": "less than",
            "less_than_equal": "at most",
        }[kind]
        bound = next(iter(ctx.values()), "?")
        return f"got {shown(given)}; expected a number {relation} {bound}"
    if kind == "too_short":
        return f"got {shown(given)}; expected at least {ctx.get('min_length', 1)} item(s)"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    expected = _EXPECTED_BY_ERROR_TYPE.get(kind)
    if expected is not None:
        return f"got {shown(given)} ({type_name(given)}); expected {expected}"
    message = str(error["msg"])
    return f"got {shown(given)} ({type_name(given)}); {message[0].lower()}{message[1:]}"


_EXPECTED_BY_ERROR_TYPE: dict[str, str] = {
    "tuple_type": "a list",
    "list_type": "a list",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}
"""What to tell the user a field expects, by pydantic error type (its own words speak of Python types)."""


def _allowed_fields(loc: Sequence[int | str], data: Mapping[str, Any]) -> tuple[str, ...]:
    parent = loc[:-1]
    if not parent:
        return _POLICY_FIELDS
    if len(parent) == 2 and parent[0] == "rules":
        return _RULE_FIELDS
    if tuple(parent) == ("recovery",):
        return _RECOVERY_FIELDS
    if tuple(parent) == ("loss",):
        return _LOSS_FIELDS
    if tuple(parent) == ("loss", "spike"):
        return _LOSS_SPIKE_FIELDS
    if tuple(parent) == ("rerun",):
        return _RERUN_FIELDS
    if tuple(parent) == ("ranks",):
        return _RANKS_FIELDS
    if len(parent) == 4 and parent[2] == "actions":
        try:
            action = data["rules"][parent[1]]["actions"][parent[3]]["action"]
        except (KeyError, IndexError, TypeError):
            action = None
        return _FIELDS_BY_ACTION.get(str(action), ("action",))
    return ()


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the choice closest to ``word``, or nothing if none is close."""
    # A word that begins a choice is a short form of it ('clip' -> 'clip_norm', not 'zclip').
    close = sorted(c for c in choices if word and c.startswith(word)) or difflib.get_close_matches(
        word, list(choices), n=1, cutoff=0.6
    )
    return f" (did you mean {close[0]!r}?)" if close else ""
