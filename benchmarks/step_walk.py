"""Follow one step through the code: which of gradguard's files it enters, in which order, and how often it comes
back to a file it had already left (issue 43's measure of a step that reads top to bottom).

    python benchmarks/step_walk.py            # the walk of one guard.step(opt) of the shipped default policy
    python benchmarks/step_walk.py --trace    # and every stay, with the function it entered by

Two walks are counted. **The pipeline's walk** (issue 43's measure) follows the step as its orchestrators run it:
``GradGuard.step`` and its boundary, ``Enforcer.run`` and every function of ``enforce/step/pipeline.py``. Each call
they make into another file of ``gradguard/`` enters that file (``tensors.without_grad``'s wrapper is see-through);
a call to a participant's stage (a method named as a stage of ``enforce.work.participant.STAGES``) is a participant's
visit, counted by stage, not an entry: participants take part at the stages they need by design. ``files`` are the
orchestrators' files and the files entered, ``returns`` the entries into a file already left, and a climb back up is
an entry into a module that imports the orchestrator's own module (a callee calling back into its caller).

**The fine walk** counts every call into ``gradguard/``, helpers and participants included:

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
from gradguard.enforce.work.participant import STAGES

PACKAGE = Path(__file__).resolve().parent.parent / "gradguard"


ORCHESTRATORS = {"guard.py": {"step", "_explicit_boundary"}, "enforce/step/engine.py": {"run"}}
PIPELINE = "enforce/step/pipeline.py"
SEE_THROUGH = {("enforce/work/tensors.py", "run")}  # without_grad's wrapper


@dataclass
class PipelineWalk:
    files: list[str] = field(default_factory=list)
    """The orchestrators' files and the files their calls entered, in order of first entry."""
    entries: list[tuple[str, str, str]] = field(default_factory=list)
    """(from file, into file, the function entered by), in order."""
    returns: int = 0
    climbs: list[str] = field(default_factory=list)
    visits: dict[str, list[str]] = field(default_factory=dict)
    """Stage -> the participants' files visited at it, in order."""


@dataclass
class Walk:
    stays: list[tuple[str, str]] = field(default_factory=list)
    """(file relative to gradguard/, the function the stay began in), in order."""
    pipeline: PipelineWalk = field(default_factory=PipelineWalk)

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
            _follow(walk.pipeline, frame, name)

        sys.setprofile(tracer)
        try:
            guard.step(opt)
        finally:
            sys.setprofile(None)
        opt.step()
    return walk


def _gradguard_caller(frame: FrameType) -> tuple[str, str] | None:
    """The nearest caller of ``frame`` in gradguard/, through see-through wrappers: (file, function)."""
    caller = frame.f_back
    while caller is not None:
        path = Path(caller.f_code.co_filename)
        if PACKAGE in path.parents:
            found = (str(path.relative_to(PACKAGE)), caller.f_code.co_name)
            if found not in SEE_THROUGH:
                return found
        caller = caller.f_back
    return None


def _orchestrates(file: str, function: str) -> bool:
    return file == PIPELINE or function in ORCHESTRATORS.get(file, ())


def _imports(importer: str, imported: str) -> bool:
    """Whether the module of file ``importer`` imports the module of file ``imported`` (module level)."""
    module = "gradguard." + imported.removesuffix(".py").replace("/", ".")
    source = (PACKAGE / importer).read_text(encoding="utf-8")
    return f"from {module} import" in source or f"import {module}" in source


def _follow(walk: PipelineWalk, frame: FrameType, name: str) -> None:
    caller = _gradguard_caller(frame)
    function = frame.f_code.co_name
    if (name, function) in SEE_THROUGH:
        return
    if caller is None:  # the step's first call: GradGuard.step
        walk.files.append(name)
        return
    if not _orchestrates(*caller) or caller[0] == name:
        return
    if function in STAGES or function == "defers_read":
        walk.visits.setdefault(function, []).append(name)
        return
    if name in walk.files and walk.entries and walk.entries[-1][1] != name:
        walk.returns += 1
    if name not in walk.files:
        walk.files.append(name)
    if _imports(name, caller[0]):
        walk.climbs.append(f"{caller[0]} -> {name} ({function})")
    walk.entries.append((caller[0], name, function))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", action="store_true", help="print every stay")
    args = parser.parse_args(argv)
    walk = walk_of_one_step()
    pipeline = walk.pipeline
    print(
        f"the pipeline's walk of guard.step(opt), shipped default: {len(pipeline.files)} files, "
        f"{len(pipeline.entries)} entries, {pipeline.returns} returns, {len(pipeline.climbs)} climbs back up"
    )
    print("  files in order: " + ", ".join(pipeline.files))
    for stage, files in pipeline.visits.items():
        print(f"  participants at {stage}: {', '.join(files)}")
    for climb in pipeline.climbs:
        print(f"  climb back up: {climb}")
    stays, files = len(walk.stays), len(walk.files)
    print(f"the fine walk: {stays} stays in {files} files, {walk.returns} returns")
    if args.trace:
        print("the pipeline's entries:")
        for source, name, function in pipeline.entries:
            print(f"  {source} -> {name}: {function}")
        print("the fine walk's stays:")
        for name, function in walk.stays:
            print(f"  {name}: {function}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
