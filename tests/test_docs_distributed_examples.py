"""The DDP and FSDP2 examples of docs/distributed.md run as written, under torchrun, with real gloo process groups."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.docs import ROOT, documented_example
from support.gloo_ranks import free_port

EXAMPLES = {
    "ddp": documented_example("docs/distributed.md", "ddp"),
    "fsdp2": documented_example("docs/distributed.md", "fsdp2"),
    "deepspeed": documented_example("docs/distributed.md", "deepspeed"),
    "which-rank": documented_example("docs/distributed.md", "which-rank"),
    "pipeline": documented_example("docs/distributed.md", "pipeline"),
}


TEARDOWN_ABORT = "terminate called without an active exception"


def torchrun(name: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """The page's example ``name`` as a script, run under torchrun on 2 gloo ranks in ``tmp_path``."""
    script = tmp_path / f"{name.replace('-', '_')}_example.py"
    script.write_text(EXAMPLES[name], encoding="utf-8")
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"),
        str(script),
    ]
    # This checkout's gradguard, not whichever one the environment has installed.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False)


@pytest.mark.parametrize("name", ["ddp", "fsdp2", "deepspeed"])
def test_the_documented_distributed_example_runs_as_written_on_two_ranks(name: str, tmp_path: Path) -> None:
    """torchrun --nproc_per_node 2 on the page's code: both ranks finish with the same counters (none: a healthy run)
    and a log each."""
    if name == "deepspeed":
        pytest.importorskip("deepspeed")
    done = torchrun(name, tmp_path)
    if done.returncode != 0 and TEARDOWN_ABORT in done.stderr:
        # torch's, not gradguard's (round 6, from a core dump): a gloo worker thread still releasing a finished
        # all-reduce (FSDP2's, from backward) takes the GIL while the interpreter finalizes, and is ended inside a
        # noexcept destructor. Without gradguard imported: 11 aborts in 30 runs; with the example dropping its model
        # and optimizer and collecting them before destroy_process_group() (as it now does): 0 in 30. Should it
        # still happen, one more run, and the assertions below still hold it to its results.
        done = torchrun(name, tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    # The two ranks print at the same moment: their lines may interleave, so find each rank's report.
    reports = dict(re.findall(r"rank (\d): (\{(?:[^{}]|\{[^{}]*\})*\})", done.stdout))
    assert sorted(reports) == ["0", "1"], done.stdout
    assert reports["0"] == reports["1"]
    assert reports["0"] == "{}"  # the shipped default changes nothing in this healthy run (#58), on either rank
    assert (tmp_path / f"{name}-rank0.jsonl").stat().st_size > 0
    assert (tmp_path / f"{name}-rank1.jsonl").stat().st_size > 0


def test_the_which_rank_example_names_the_rank_that_made_the_nan_on_both_ranks(tmp_path: Path) -> None:
    """torchrun --nproc_per_node 2 on the page's code: both ranks halt at step 5 naming rank 1 and this host."""
    done = torchrun("which-rank", tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    host = socket.gethostname()
    for rank in (0, 1):
        expected = f"rank {rank}: halted at step 5 in ['2.weight'], made on {{1: {host!r}}}"
        assert expected in done.stdout, done.stdout


def test_the_pipeline_example_halts_both_stages_at_the_step_of_the_nan(tmp_path: Path) -> None:
    """torchrun --nproc_per_node 2 on the page's pipeline: a NaN in the last stage's gradient halts both stages at step
    3, each naming rank 1 (and its host) as the one that made it."""
    done = torchrun("pipeline", tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    host = socket.gethostname()
    for rank in (0, 1):
        assert f"rank {rank}: halted at step 3, made on {{1: '{host}'}}" in done.stdout, done.stdout
