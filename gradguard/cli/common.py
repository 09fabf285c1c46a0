"""What the ``gradguard`` commands share: how they fail, how they load a policy file, their file options."""

from __future__ import annotations

import atexit
import functools
import gc
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

if TYPE_CHECKING:
    from gradguard.policy.document import Policy

__all__ = [
    "LOGS",
    "POLICY",
    "PolicySource",
    "fail",
    "load_policy",
    "output_option",
    "run_as_process",
    "skip_the_exit_collection",
    "unreadable",
]

F = TypeVar("F", bound=Callable[..., Any])

LOGS = click.argument("logs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))


class _Process:
    own = False
    """Whether the command runs as a process of its own (``run``), not called inside another (a test's
    ``CliRunner``, a user's script): only then may it change how the process exits."""


def run_as_process(command: Callable[[], object]) -> None:
    """Run ``command`` (the ``gradguard`` group) as the process's own: the console script and ``python -m``."""
    _Process.own = True
    command()


@functools.cache
def skip_the_exit_collection() -> None:
    """Let the interpreter's exit skip collecting torch's objects, for a command that imported torch.

    Python's exit collects garbage, and that walks every object torch made at import: 0.2-0.4 s of a
    ``replay`` that takes 2 s, spent after the answer is written. So the objects alive now are frozen
    (``gc.freeze``) in an exit handler, which runs before the handlers registered earlier (newest first)
    and before the collection; those handlers still run, and the collection takes only what is made after.
    What it costs: an object in a reference cycle with a finalizer is not finalized at exit (Python does not
    promise that at exit anyway; the commands close their files themselves). Only in a process of its own.
    """
    if _Process.own:
        atexit.register(gc.freeze)


class PolicySource(click.ParamType):  # type: ignore[type-arg]  # generic from click 8.2 on; unsubscriptable before
    """A policy file's path, or the name of a shipped policy (``default``); a path that exists wins.

    Does not import torch: the shipped names come from the package's data.
    """

    name = "policy"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        path = Path(value)
        if path.is_dir():
            self.fail(f"{str(value)!r} is a directory, not a policy file", param, ctx)
        if path.exists():
            return path
        from gradguard.policy.loading import did_you_mean
        from gradguard.policy.shipped import shipped_policies

        shipped = shipped_policies()
        if any(str(value) in (found.name, found.file_name) for found in shipped):
            return path  # Policy.load reads the shipped one
        names = [found.name for found in shipped]
        self.fail(
            f"{str(value)!r} does not exist, and no shipped policy is called that{did_you_mean(str(value), names)} "
            f"(shipped: {', '.join(names)})",
            param,
            ctx,
        )


POLICY = PolicySource()
"""A ``POLICY`` argument or option: a file, or a shipped policy's name."""


def output_option(what: str) -> Callable[[F], F]:
    """``--output/-o FILE``: write ``what`` to FILE instead of printing it."""
    return click.option(
        "--output",
        "-o",
        "output",
        type=click.Path(dir_okay=False, path_type=Path),
        metavar="FILE",
        help=f"Write {what} to FILE instead of printing it.",
    )


def fail(message: str, code: int = 2) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def unreadable(exc: OSError) -> NoReturn:
    """A log that cannot be read: its name and the system's reason, exit 2."""
    fail(f"cannot read {getattr(exc, 'filename', None) or 'the log'}: {exc.strerror or exc}")


def load_policy(path: Path) -> Policy:
    """The policy in ``path`` (or the shipped one of that name), or exit 2 with its problems and the fix's check."""
    from gradguard.errors import PolicyError
    from gradguard.policy.document import Policy

    try:
        return Policy.load(path)
    except PolicyError as exc:
        fail(f"{exc}\n(run `gradguard validate {shlex.quote(str(path))}` after fixing it)")
