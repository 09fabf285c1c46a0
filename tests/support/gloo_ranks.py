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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TIMEOUT", "Scenario", "free_port", "main", "run_scenarios", "shutdown"]

TIMEOUT = datetime.timedelta(seconds=30)
"""How long a collective waits for the other ranks: a rank that hangs fails the test instead of blocking it."""

Scenario = Callable[[str, int, int, Path], dict[str, Any]]
"""``(name, rank, world, outdir) -> the rank's result``, written as JSON."""


def free_port() -> int:
    """A port no process listens on now, for a rendezvous (``MASTER_PORT``, ``--master_port``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
