"""The ``gradguard`` command line."""

from __future__ import annotations

import sys
from pathlib import Path

import click

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gradguard")
def main() -> None:
    """gradguard: per-parameter gradient policies for PyTorch, enforced and audited."""


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
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Policy file to use instead of the shipped policies/llm-pretraining.yaml.",
)
@click.option("--steps", type=click.IntRange(min=1), default=120, show_default=True, help="Training steps.")
def demo(log_path: Path, policy_path: Path | None, steps: int) -> None:
    """Train a small decoder on the CPU with a spike and a NaN injected, guarded by a shipped policy."""
    from gradguard._demo import bundled_policy_path, run_demo
    from gradguard._errors import PolicyError
    from gradguard._policy import Policy

    path = policy_path or bundled_policy_path()
    try:
        policy = Policy.from_file(path)
    except PolicyError as exc:
        click.echo(str(exc), err=True)
        sys.exit(2)
    result = run_demo(log_path=log_path, steps=steps, policy=policy, say=click.echo)
    if result.halt is not None and not result.params_untouched:
        sys.exit(1)
