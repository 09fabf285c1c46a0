"""What the ``gradguard`` commands share: how they fail, how they load a policy file, their file options."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

if TYPE_CHECKING:
    from gradguard.policy.document import Policy

__all__ = ["LOGS", "fail", "load_policy", "output_option", "unreadable"]

F = TypeVar("F", bound=Callable[..., Any])

LOGS = click.argument("logs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))


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
    """The policy in ``path``, or exit 2 with its problems and the command that checks the fix."""
    from gradguard.errors import PolicyError
    from gradguard.policy.document import Policy

    try:
        return Policy.from_file(path)
    except PolicyError as exc:
        fail(f"{exc}\n(run `gradguard validate {shlex.quote(str(path))}` after fixing it)")
