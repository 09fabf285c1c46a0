"""``gradguard suggest`` and ``gradguard replay``: a policy from a recorded run, and any policy tried on one.

Both read the ``stats`` events of a ``monitor`` (each tensor's gradient norm as it arrived); the work is
done in ``gradguard.tuning``, imported inside the commands (neither imports torch, but for a policy with an adaptive
action or ``agc``, whose decisions are the guard's own torch functions).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from gradguard.cli.common import LOGS, POLICY, fail, load_policy, output_option, skip_the_exit_collection, unreadable

__all__ = ["replay", "suggest"]


@click.command()
@LOGS
@output_option("the policy")
@click.option(
    "--budget",
    type=click.FloatRange(min=0.0001, max=0.5),
    default=0.01,
    show_default=True,
    help="At most this share of the recorded run's ordinary steps may be acted on.",
)
@click.option(
    "--z",
    "z",
    type=click.FloatRange(min=1.0, max=50.0),
    default=6.0,
    show_default=True,
    help="How many robust spreads of ln(norm) above a family's median its threshold lies (at least).",
)
@click.option(
    "--merge-within",
    type=click.FloatRange(min=1.0),
    default=1.5,
    show_default=True,
    metavar="FACTOR",
    help="Merge families whose median norms lie within this factor of each other (1: never merge).",
)
@click.option(
    "--loss",
    is_flag=True,
    help="Also propose a loss section (a NaN/Inf loss or a loss spike skips the step) whose spike.factor comes "
    "from the recorded losses, as the norms' thresholds do.",
)
@click.option(
    "--policy",
    "run_policy",
    type=POLICY,
    metavar="POLICY",
    help="The policy the run used: the suggestion keeps its sections (recovery, rerun, loss: a --loss section "
    "replaces the latter), halts on a NaN/Inf gradient where it did, and keeps apart a clip it wrote below a "
    "tensor's median norm. Without it, the sections of the log's attach event and the clips its interventions "
    "show are kept the same way, and a NaN/Inf gradient halts (so rewinds) under a recovery section.",
)
def suggest(
    logs: tuple[Path, ...],
    output: Path | None,
    budget: float,
    z: float,
    merge_within: float,
    loss: bool,
    run_policy: Path | None,
) -> None:
    """Propose a policy from the gradient norms a run recorded: a clip per family of parameters.

    \b
    LOGS are audit logs of a run whose policy had a monitor recording each tensor's norm:
      {name: record-norms, match: '*', actions: [{action: monitor, stats: [norm], scope: tensor, every: 1}]}
    Parameters are grouped into families by name (layer indices folded), families with alike norms
    are merged, and each gets a per-tensor clip_norm set from the median and spread of its
    log-norms, so that on the recorded run the clips act on spikes and on at most --budget of the
    ordinary steps. Every parameter gets a non-finite rule (skip the step; halt where the run's policy
    halted or had a recovery section). Every section of the run's policy (loss, recovery, rerun) is
    kept, and a clip the run held a tensor under (below its median norm) is kept apart from the
    families; the header says what changed. Each number is explained in a comment.
    Exit 2 if the logs hold no per-tensor norms. The suggestion is replayed on the logs before it is
    written.
    """
    keep = load_policy(run_policy) if run_policy is not None else None
    from gradguard.tuning.suggest import NoNorms, suggest_files

    skip_the_exit_collection()

    try:
        suggestion = suggest_files(list(logs), budget=budget, z=z, merge_within=merge_within, loss=loss, keep=keep)
    except NoNorms as exc:
        fail(str(exc))
    except OSError as exc:
        unreadable(exc)
    _note_recording(suggestion.recording)
    if output is None:
        click.echo(suggestion.text, nl=False)
        return
    try:
        output.write_text(suggestion.text, encoding="utf-8")
    except OSError as exc:
        fail(f"cannot write {output}: {exc.strerror or exc}")
    families = len(suggestion.thresholds)
    click.echo(
        f"policy written to {output}: {families} famil{'ies' if families != 1 else 'y'} with a clip, "
        f"{suggestion.params} parameters, from {suggestion.recording.steps:,} recorded steps"
        + (f"; loss spike factor {suggestion.loss.factor:g}" if suggestion.loss is not None else "")
        + "".join(f"; {said}" for said in suggestion.changes()),
        err=True,
    )


@click.command()
@click.argument("policy_path", metavar="POLICY", type=POLICY)
@LOGS
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def replay(policy_path: Path, logs: tuple[Path, ...], fmt: str) -> None:
    """Apply POLICY to the gradient norms recorded in LOGS: on which steps each action would have acted.

    \b
    Per rule and action: the steps on which it would have changed a gradient, or skipped or halted
    the step, as the guard would have (rules in policy order, each on what the earlier ones left;
    zclip, autoclip and skip_step_on_spike with their statistics as the guard keeps them). Actions
    the log cannot decide are listed with the reason (e.g. clip_value without recorded max_abs).
    The logs need a monitor of each tensor's norm (see `gradguard suggest --help`).
    Exit 1 if an action would have halted the run, 2 on unusable input.
    """
    policy = load_policy(policy_path)
    from gradguard.tuning.records import no_norms_message
    from gradguard.tuning.replay import replay_files

    skip_the_exit_collection()

    try:
        result = replay_files(policy, list(logs))
    except OSError as exc:
        unreadable(exc)
    if not result.params:
        fail(no_norms_message(list(logs), result.recording))
    _note_recording(result.recording)
    guarded = result.recording.guarded_params
    if guarded is not None and guarded > len(result.params):
        click.echo(
            f"note: the log recorded norms of {len(result.params)} of the {guarded} parameters the guard watched; "
            "actions on the others are not replayed",
            err=True,
        )
    from gradguard.tuning.report import replay_json, replay_text

    click.echo(replay_json(result) if fmt == "json" else replay_text(result), nl=False)
    sys.exit(result.exit_code)


def _note_recording(recording: object) -> None:
    """Say on stderr how many log lines were unreadable (and skipped), and whether the steps went back."""
    from gradguard.tuning.records import Recording

    assert isinstance(recording, Recording)
    if recording.step_back is not None:
        after, back = recording.step_back
        click.echo(
            f"note: the steps go back from {after} to {back}: the log holds several runs, read as one "
            "(give each run's log on its own)",
            err=True,
        )
    read = recording.read
    if not read.bad_total:
        return
    shown = "".join(f"\n  {bad}" for bad in read.bad_lines[:3])
    click.echo(f"warning: {read.bad_total} unreadable log line(s) skipped:{shown}", err=True)
