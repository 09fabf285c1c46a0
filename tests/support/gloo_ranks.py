"""The ranks of a scenario script (``tests/*_scenarios.py``): real processes in a real gloo group.

A script defines ``scenario(name, rank, world, outdir) -> dict`` and ends with
``main(scenario, sys.argv[1:])``. Run as ``python SCRIPT NAMES WORLD OUTDIR PORT`` it spawns WORLD ranks;
under torchrun (``python SCRIPT --torchrun NAMES OUTDIR``) each process is one. Every rank joins the group,
runs the comma-separated scenarios one after the other in it, writes ``OUTDIR/NAME/rank{r}.json``, and
leaves the group cleanly. The spawned children receive ``scenario`` by reference (a function at the top of
the script, which they import again).
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TIMEOUT", "Scenario", "failure_record", "free_port", "keep_failure", "main", "run_scenarios", "shutdown"]

TIMEOUT = datetime.timedelta(seconds=30)
"""How long a collective waits for the other ranks: a rank that hangs fails the test instead of blocking it."""

Scenario = Callable[[str, int, int, Path], dict[str, Any]]
"""``(name, rank, world, outdir) -> the rank's result``, written as JSON."""


def free_port() -> int:
    """A port no process listens on now, for a rendezvous (``MASTER_PORT``, ``--master_port``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def failure_record(error: BaseException, started: float) -> dict[str, Any]:
    """What a rank keeps of the error that ended its step: its type and words, the rank it names, and how long it
    waited since ``started`` (``time.monotonic()``), beside the process group's timeout."""
    return {
        "type": type(error).__name__,
        "message": str(error),
        "failed_rank": getattr(error, "failed_rank", None),
        "seconds": time.monotonic() - started,
        "timeout": TIMEOUT.total_seconds(),
    }


def keep_failure(result: dict[str, Any], log: Path, outdir: Path, rank: int) -> None:
    """Write a failure scenario's ``result`` with the ``rank_failure`` events of its audit ``log`` (the group is
    unusable after a failure: the scenario writes its own result and leaves without a barrier)."""
    events = [json.loads(line) for line in log.read_text().splitlines()]
    result["failures"] = [event for event in events if event["event"] == "rank_failure"]
    (outdir / f"rank{rank}.json").write_text(json.dumps(result))


def run_scenarios(scenario: Scenario, names: str, rank: int, world: int, outdir: Path) -> None:
    """Run comma-separated scenarios one after the other in the same process group."""
    for name in names.split(","):
        folder = outdir / name
        folder.mkdir(parents=True, exist_ok=True)
        result = scenario(name, rank, world, folder)
        (folder / f"rank{rank}.json").write_text(json.dumps(result))
        gc.collect()
        dist.barrier()


def shutdown() -> None:
    """Leave the process group cleanly (a torchrun script that does its own ``init_process_group`` ends with it)."""
    # DDP's reducer must be gone before its process group, or gloo aborts at exit (torch 2.13).
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _spawned_rank(rank: int, world: int, names: str, outdir: str, port: int, scenario: Scenario) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        run_scenarios(scenario, names, rank, world, Path(outdir))
    finally:
        shutdown()


def main(scenario: Scenario, argv: list[str]) -> None:
    """``NAMES WORLD OUTDIR PORT`` spawns the ranks; ``--torchrun NAMES OUTDIR`` is one rank of torchrun's."""
    if argv[0] == "--torchrun":
        names, outdir = argv[1], argv[2]
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", timeout=TIMEOUT)
        try:
            run_scenarios(scenario, names, rank, world, Path(outdir))
        finally:
            shutdown()
        return
    names, world, outdir, port = argv[0], int(argv[1]), argv[2], int(argv[3])
    torch.multiprocessing.spawn(_spawned_rank, args=(world, names, outdir, port, scenario), nprocs=world, join=True)
