"""The ``gradguard`` command line: ``validate``, ``explain``, ``audit``, ``suggest``, ``replay``, ``schema``,
``policies`` and ``demo``.

Exit codes: 0 all good; 1 findings (an invalid policy, a rule that matches nothing, a halt, a
non-finite gradient, a skipped step, an unreadable log line, a counter mismatch); 2 a usage or input
error (a missing file, a bad ``MODULE:CALLABLE``, a log with no gradguard event).

Only ``explain --model``, ``validate --model``, ``demo``, ``suggest`` and ``replay`` import torch, inside the
command: ``validate`` and ``explain`` of a policy alone, ``audit``, ``schema`` and ``policies`` answer without it
(``tests/test_cli_without_torch.py``).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from gradguard.cli.common import POLICY, fail, load_policy, output_option, run_as_process, unreadable
from gradguard.cli.tuning import replay, suggest

if TYPE_CHECKING:
    from collections.abc import Callable

    from gradguard.policy.document import Policy

__all__ = ["main", "run"]

_FORMATS = click.Choice(["table", "json", "markdown"])


class _Group(click.Group):
    """Ends quietly where a user would otherwise see a traceback: Ctrl-C, or a closed pipe (``| head``)."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(130)
        except BrokenPipeError:
            # The reader went away (`gradguard audit big.jsonl | head`): stop writing, without a traceback.
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
            except (OSError, ValueError):
                pass
            sys.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="gradguard")
def main() -> None:
    """gradguard: per-parameter gradient policies for PyTorch, enforced and audited.

    \b
    Exit codes: 0 ok; 1 findings; 2 usage or input error.
    """


def run() -> None:
    """The ``gradguard`` console script and ``python -m gradguard.cli``: ``main`` as the process's own command
    (tests call ``main`` itself, inside theirs)."""
    run_as_process(main)


# --- validate --------------------------------------------------------------------------------------


@main.command()
@click.argument("policies", nargs=-1, required=True, type=POLICY)
@click.option(
    "--model",
    "model_spec",
    metavar="MODULE:CALLABLE",
    help="Also bind each policy to this model, as the guard does at attach: a rule that matches nothing is an "
    "error, an exclude that excludes nothing a warning (see `gradguard explain --model`; imports torch).",
)
def validate(policies: tuple[Path, ...], model_spec: str | None) -> None:
    """Check policy files (.yaml, .yml, .toml, .json), without a model or against one (--model).

    A POLICY is a file, or the name of a shipped policy (`gradguard policies`); a path that exists wins.

    Every problem is printed with its file, line, field, what was given and what is expected.
    What a valid policy can never do (a rerun verdict nothing gives, a pattern that can only match a
    parameter on the model itself) is printed as a warning, with exit 0.
    With --model, what the guard would refuse at attach is an error (the file is invalid) and what it would
    warn of (an exclude that excludes nothing) a warning.
    Exit 1 if any file is invalid. JSON Schema files (*.schema.json, as `gradguard schema` writes
    beside the policies) are skipped, so `gradguard validate policies/*` checks the policies alone.
    Does not import torch without --model.
    """
    from gradguard.errors import PolicyError
    from gradguard.policy.advice import policy_warnings
    from gradguard.policy.document import Policy

    against = _model_check(model_spec) if model_spec is not None else None

    invalid = 0
    checked = [path for path in policies if not _is_json_schema(path)]
    for path in policies:
        if _is_json_schema(path):
            click.echo(f"{path}: skipped (a JSON Schema for editors, not a policy)")
            continue
        try:
            policy = Policy.load(path)
        except PolicyError as exc:
            invalid += 1
            click.echo(f"{path}: {exc}")
            continue
        problems, model_warnings = against(policy) if against is not None else ([], [])
        if problems:
            invalid += 1
            click.echo(f"{path}: does not bind to {model_spec}:" + "".join(f"\n  {problem}" for problem in problems))
            continue
        names = ", ".join(rule.name for rule in policy.rules)
        count = len(policy.rules)
        click.echo(f"{path}: ok ({count} rule{'s' if count != 1 else ''}: {names}{_also_sections(policy)})")
        for warning in [*policy_warnings(policy), *model_warnings]:
            click.echo(f"{path}: warning: {warning}")
    if len(checked) > 1:
        click.echo(f"{len(checked) - invalid} of {len(checked)} policy files valid")
    sys.exit(1 if invalid else 0)


def _model_check(model_spec: str) -> Callable[[Policy], tuple[list[str], list[str]]]:
    """``validate --model``: the model loaded once, and a check of each policy against it that gives what attaching
    would refuse and what it would warn of (``gradguard.cli.explain``'s, which binds as the guard does)."""
    from gradguard.cli.explain import ModelSpecError, explain, load_model

    try:
        model = load_model(model_spec)
    except ModelSpecError as exc:
        fail(str(exc))

    def check(policy: Policy) -> tuple[list[str], list[str]]:
        found = explain(policy, model, model_spec)
        return found.issues, found.warnings

    return check


def _also_sections(policy: Policy) -> str:
    """``; and a recovery section`` (``; and loss and recovery sections``): the top-level sections besides rules."""
    from gradguard.cli.explain_policy import top_level_sections

    sections = top_level_sections(policy)
    if not sections:
        return ""
    if len(sections) == 1:
        return f"; and a {sections[0]} section"
    return f"; and {', '.join(sections[:-1])} and {sections[-1]} sections"


def _is_json_schema(path: Path) -> bool:
    return path.name.lower().endswith(".schema.json")


# --- explain ---------------------------------------------------------------------------------------


@main.command()
@click.argument("policy_path", metavar="POLICY", type=POLICY)
@click.option(
    "--model",
    "model_spec",
    metavar="MODULE:CALLABLE",
    help="A callable that takes no arguments and returns the nn.Module, e.g. mypkg.models:build_model or "
    "path/to/models.py:build_model (modules are imported from the working directory first). Without it, "
    "the policy alone is explained: its rules and top-level sections.",
)
@click.option("--format", "fmt", type=_FORMATS, default="table", show_default=True, help="Output format.")
def explain(policy_path: Path, model_spec: str | None, fmt: str) -> None:
    """Show which rules and actions of POLICY (a file, or a shipped policy's name) each parameter of a model gets.

    A table of every parameter (name, shape, dtype, rules, actions in the order they apply), the
    parameters no rule covers, the rules that match nothing, the tied parameters, and the problems
    GradGuard would raise when attaching. Exit 1 if there are such problems (e.g. a rule that matches
    nothing without allow_no_match). Without --model: the policy's rules, its recovery section and any other
    top-level section in words, and what a model would add.
    """
    policy = load_policy(policy_path)

    from gradguard.audit.render import render

    if model_spec is None:
        from gradguard.cli.explain_policy import policy_header, policy_json, policy_sections

        sections = policy_sections(policy)
        click.echo(render(fmt, "gradguard explain", policy_header(policy), sections, policy_json(policy)), nl=False)
        sys.exit(0)

    from gradguard.cli.explain import ModelSpecError, explain, explain_header, explain_sections, load_model

    try:
        model = load_model(model_spec)
    except ModelSpecError as exc:
        fail(str(exc))
    result = explain(policy, model, model_spec)
    title = "gradguard explain"
    click.echo(render(fmt, title, explain_header(result), explain_sections(result), result.as_json()), nl=False)
    sys.exit(result.exit_code)


# --- audit -----------------------------------------------------------------------------------------


@main.command()
@click.argument("logs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--format", "fmt", type=_FORMATS, default="table", show_default=True, help="Output format.")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE.png",
    help="Also draw the run: gradient norm before/after the guard for the most-clipped parameters or rules, "
    "with clips, skips and halts marked (.png, .svg or .pdf; needs the 'plot' extra: matplotlib).",
)
@click.option("--since", type=click.IntRange(min=0), metavar="STEP", help="Only steps >= STEP.")
@click.option("--until", type=click.IntRange(min=0), metavar="STEP", help="Only steps <= STEP.")
@click.option("--rule", "rules", multiple=True, metavar="NAME", help="Only this rule (repeatable).")
@click.option(
    "--param",
    "params",
    multiple=True,
    metavar="PATTERN",
    help="Only parameters matching PATTERN, as in a policy: a glob ('*attn*') or 're:<regex>' (repeatable).",
)
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True, help="Rows in the top-N tables.")
@click.option(
    "--follow", "-f", is_flag=True, help="Keep reading the log(s) as they grow, like tail -f; Ctrl-C to stop."
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.05),
    default=2.0,
    show_default=True,
    metavar="SECONDS",
    help="With --follow: refresh the summary at most this often.",
)
@click.option("--progress/--no-progress", default=None, hidden=True, help="Force the progress bar on or off.")
@click.option(
    "--follow-timeout",
    type=click.FloatRange(min=0),
    default=None,
    hidden=True,
    help="Stop following after this many seconds.",
)
@click.option("--plot-series", type=click.IntRange(min=1, max=10), default=5, hidden=True, help="Series to plot.")
@click.option(
    "--threshold-policy",
    type=POLICY,
    metavar="POLICY",
    help="With --plot: draw, over each plotted parameter's recorded norm, the max_norm of the clip_norm POLICY "
    "gives it (e.g. the output of `gradguard suggest`).",
)
def audit(
    logs: tuple[Path, ...],
    fmt: str,
    plot_path: Path | None,
    since: int | None,
    until: int | None,
    rules: tuple[str, ...],
    params: tuple[str, ...],
    top: int,
    follow: bool,
    interval: float,
    progress: bool | None,
    follow_timeout: float | None,
    plot_series: int,
    threshold_policy: Path | None,
) -> None:
    """Summarize gradguard audit logs: what the guard did, where and when.

    \b
    LOGS are JSON-lines files written with GradGuard(..., audit_log=PATH): several at once (one
    per rank, or a run resumed into a new file) are merged in step order. Reports the runs (steps,
    time span, ranks), interventions by rule, action and parameter, the top offenders, NaN/Inf
    events, skipped steps, halts with their context, and the counters the log reproduces (equal
    to guard.counters.snapshot()), cross-checked against the per-event lines. Unreadable lines (a
    torn last line, corruption, another program's output) are reported with their line numbers and
    skipped. Logs of any size are streamed in bounded memory.

    \b
    Filters (--since, --until, --rule, --param) narrow the breakdowns; runs and counters always
    cover the whole log. Exit 1 on findings: halts, non-finite gradients, skipped steps,
    unreadable lines, counter mismatches.
    """
    from gradguard.audit import command as _audit
    from gradguard.audit.filters import Filters

    if since is not None and until is not None and since > until:
        raise click.BadParameter(f"--since {since} is after --until {until}", param_hint="'--since'/'--until'")
    try:
        filters = Filters(since=since, until=until, rules=rules, params=params)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--param'") from None
    paths: list[Path] = []
    for path in logs:
        if any(path.resolve() == known.resolve() for known in paths):
            click.echo(f"note: {path} is given twice; reading it once", err=True)
            continue
        paths.append(path)
    thresholds = None
    if threshold_policy is not None:
        if plot_path is None:
            raise click.BadParameter("draws on the plot: give --plot FILE.png too", param_hint="'--threshold-policy'")
        thresholds = load_policy(threshold_policy)
    if plot_path is not None:
        from gradguard.audit.plot import PLOT_SUFFIXES, PlotUnavailable, require_matplotlib

        if plot_path.suffix.lower() not in PLOT_SUFFIXES:
            raise click.BadParameter(
                f"{str(plot_path)!r} must end in {', '.join(PLOT_SUFFIXES)}", param_hint="'--plot'"
            )
        try:
            require_matplotlib()
        except PlotUnavailable as exc:
            fail(str(exc))

    try:
        if follow:
            clear = click.clear if fmt != "json" and sys.stdout.isatty() else None
            summary = _audit.follow_files(
                paths,
                filters,
                fmt=fmt,
                top=top,
                interval=interval,
                timeout=follow_timeout,
                echo=lambda text: click.echo(text, nl=False),
                clear=clear,
            )
        else:
            summary = _audit.summarize_files(paths, filters, progress=progress)
    except OSError as exc:
        unreadable(exc)

    if summary.events == 0 and not follow:
        shown = "".join(f"\n  {bad}" for bad in summary.bad_lines[:3])
        fail(
            f"no gradguard event in {', '.join(map(str, paths))}: is it an audit log written with "
            f"GradGuard(..., audit_log=PATH)?{shown}"
        )
    if not follow:
        click.echo(_audit.render_summary(summary, fmt, top), nl=False)
    if plot_path is not None:
        try:
            _audit.plot_files(paths, filters, summary, plot_path, plot_series, thresholds)
        except OSError as exc:
            fail(f"cannot write the plot {plot_path}: {exc.strerror or exc}")
        click.echo(f"plot written to {plot_path}", err=True)
    sys.exit(summary.exit_code)


# --- schema ----------------------------------------------------------------------------------------


@main.command()
@output_option("the schema")
def schema(output: Path | None) -> None:
    """Print the JSON Schema of policy files, for editors: completion, hover docs and checks as you type.

    \b
    The shipped policies/gradguard-policy.schema.json is this output. Point an editor at it:
      YAML (yaml-language-server, e.g. VS Code's YAML extension), as the first line:
        # yaml-language-server: $schema=./gradguard-policy.schema.json
      JSON: a top-level "$schema": "./gradguard-policy.schema.json" key (gradguard ignores it).
      TOML (taplo, e.g. Even Better TOML), as the first line:
        #:schema ./gradguard-policy.schema.json
    Does not import torch.
    """
    from gradguard.policy.json_schema import render_policy_json_schema

    text = render_policy_json_schema()
    if output is None:
        click.echo(text, nl=False)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        fail(f"cannot write {output}: {exc.strerror or exc}")
    click.echo(f"policy JSON Schema written to {output}", err=True)


# --- policies --------------------------------------------------------------------------------------


@main.command()
@click.argument("name", required=False)
def policies(name: str | None) -> None:
    """List the policies gradguard ships, or print the one called NAME.

    \b
    Without NAME: one line each, its name, file and what it is for.
    With NAME (e.g. default, or default.yaml): the file, to start a policy of your own:
      gradguard policies default > my-policy.yaml
    The printed copy's $schema reference points at the installed JSON Schema, so an editor still
    finds it. In Python, Policy.shipped(NAME) loads one. Does not import torch.
    """
    from gradguard.errors import PolicyError
    from gradguard.policy.shipped import shipped_policies, shipped_policy

    if name is not None:
        try:
            found = shipped_policy(name)
        except PolicyError as exc:
            fail(str(exc.issues[0].message))
        click.echo(found.text_for_a_copy(), nl=False)
        return
    every = shipped_policies()
    width = max(len(policy.name) for policy in every)
    file_width = max(len(policy.file_name) for policy in every)
    for policy in every:
        click.echo(f"{policy.name:<{width}}  {policy.file_name:<{file_width}}  {policy.purpose}")
    click.echo("\nprint one: gradguard policies NAME > my-policy.yaml; load one: Policy.shipped(NAME)")


# --- demo ------------------------------------------------------------------------------------------


@main.command()
@click.option(
    "--log",
    "log_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("gradguard-demo.jsonl"),
    show_default=True,
    help="Where to write the demo's JSON-lines audit log (overwritten).",
)
@click.option(
    "--policy",
    "policy_path",
    type=POLICY,
    default=None,
    help="Policy file or shipped policy name to use instead of the shipped llm-pretraining policy.",
)
@click.option("--steps", type=click.IntRange(min=1), default=120, show_default=True, help="Training steps.")
def demo(log_path: Path, policy_path: Path | None, steps: int) -> None:
    """Train a small decoder on the CPU with a spike and a NaN injected, guarded by a shipped policy."""
    from gradguard.cli.demo import DEMO_POLICY, run_demo
    from gradguard.errors import PolicyError
    from gradguard.policy.document import Policy

    try:
        policy = Policy.load(policy_path) if policy_path is not None else Policy.shipped(DEMO_POLICY)
    except PolicyError as exc:
        click.echo(str(exc), err=True)
        sys.exit(2)
    result = run_demo(log_path=log_path, steps=steps, policy=policy, say=click.echo)
    click.echo(f"  next: gradguard audit {shlex.quote(str(log_path))}")
    if result.halt is not None and not result.params_untouched:
        sys.exit(1)


main.add_command(suggest)
main.add_command(replay)
