"""Follow one step through the code: which of gradguard's files it enters, in which order, and how often it comes
back to a file it had already left (issue 43's measure of a step that reads top to bottom).

    python benchmarks/step_walk.py            # the walk of one guard.step(opt) of the shipped default policy
    python benchmarks/step_walk.py --trace    # and every stay, with the function it entered by

A stay is a run of calls in one file of ``gradguard/``; calls into torch or the standard library between two
calls of the same file do not end it. ``entries`` counts the stays, ``files`` the distinct files, ``returns`` the
stays in a file already left earlier in the step, and a climb back up is a stay in a module that a module the step
went through later imports from (a callee calling back into its caller's room), as the package layout test names
rooms. The step is ``guard.step(opt)`` of a 2-layer MLP under the shipped ``default`` policy with the default
provenance, after two warm-up steps, the gradients of a fresh backward.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn

from gradguard import GradGuard

PACKAGE = Path(__file__).resolve().parent.parent / "gradguard"


@dataclass
class Walk:
    stays: list[tuple[str, str]] = field(default_factory=list)
    """(file relative to gradguard/, the function the stay began in), in order."""

    @property
    def files(self) -> list[str]:
        return list(dict.fromkeys(name for name, _ in self.stays))

    @property
    def returns(self) -> int:
        seen: set[str] = set()
        count = 0
        for name, _ in self.stays:
            if name in seen:
                count += 1
            seen.add(name)
        return count


def walk_of_one_step() -> Walk:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    walk = Walk()
    with GradGuard(model, "default", logger=None, before_clip=False) as guard:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            if _ < 2:
                guard.step(opt)
                opt.step()
        last: list[str | None] = [None]

        def tracer(frame: FrameType, event: str, arg: Any) -> None:
            if event != "call":
                return
            path = Path(frame.f_code.co_filename)
            if PACKAGE not in path.parents:
                return
            name = str(path.relative_to(PACKAGE))
            if name != last[0]:
                walk.stays.append((name, frame.f_code.co_name))
                last[0] = name

        sys.setprofile(tracer)
        try:
            guard.step(opt)
        finally:
            sys.setprofile(None)
        opt.step()
    return walk


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", action="store_true", help="print every stay")
    args = parser.parse_args(argv)
    walk = walk_of_one_step()
    stays, files = len(walk.stays), len(walk.files)
    print(f"guard.step(opt), shipped default: {stays} stays in {files} files, {walk.returns} returns")
    print("files in order: " + ", ".join(walk.files))
    if args.trace:
        for name, function in walk.stays:
            print(f"  {name}: {function}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
