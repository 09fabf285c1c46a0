"""The benchmarks still start: their ``--quick`` runs finish in seconds and report everything.

The benchmarks themselves (``python benchmarks/step_overhead.py``, ``benchmarks/spikes.py``: minutes)
are not part of the test run. The step-overhead and CUDA scripts run in this process (no second torch
import), with torch's thread count restored after; the spikes benchmark runs in a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from gradguard import Policy
from gradguard.policy.schema import ZClip

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def benchmarks() -> Iterator[dict[str, ModuleType]]:
    """The benchmark scripts as modules; torch's intra-op thread count is put back afterwards."""
    threads = torch.get_num_threads()
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import cuda_sync_check
        import host_time
        import step_overhead
        import step_walk

        yield {
            "step_overhead": step_overhead,
            "cuda_sync_check": cuda_sync_check,
            "host_time": host_time,
            "step_walk": step_walk,
        }
    finally:
        sys.path.remove(str(BENCHMARKS))
        torch.set_num_threads(threads)


def test_the_quick_benchmark_run_prints_every_table_and_the_targets(
    benchmarks: dict[str, ModuleType], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--quick`` measures every treatment on both models and the sweep, and writes its JSON."""
    out = tmp_path / "result.json"
    assert benchmarks["step_overhead"].main(["--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for heading in ("**gpt**", "**deep**", "**sweep**", "**targets**"):
        assert heading in printed, printed
    result = json.loads(out.read_text())
    assert set(result["models"]) == {"gpt", "deep"}
    rows = {row["name"]: row for row in result["models"]["gpt"]["rows"]}
    for name in ("none", "global", "loop", "item-hook", "anomaly", "gg-a", "gg-a0", "gg-b", "gg-c0", "gg-c"):
        assert name in rows, sorted(rows)
    assert rows["gg-a"]["extra_syncs"] == 1, "gradguard reads its figures back in one sync per step"
    assert rows["gg-a"]["backward_syncs"] == 0, "and none while backward runs"
    assert rows["item-hook"]["backward_syncs"] > 0, "the sync counter sees a sync inside a hook"
    assert len(result["sweep"]["sizes"]) == 2
    assert not torch.is_anomaly_enabled(), "the anomaly row switched detection off again"


def test_the_cuda_sync_check_says_it_is_skipped_without_a_gpu(
    benchmarks: dict[str, ModuleType], capsys: pytest.CaptureFixture[str]
) -> None:
    """Without CUDA the sync check exits 0 and says why it checked nothing; with --require it fails."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run python benchmarks/cuda_sync_check.py for the real check")
    check = benchmarks["cuda_sync_check"]
    assert check.main([]) == 0
    assert "skipped, no CUDA device" in capsys.readouterr().out
    assert check.main(["--require"]) == 1


def _run_quick(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``benchmarks/SCRIPT --quick ARGS`` in a subprocess (a benchmark may set torch's threads), which must pass."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCHMARKS.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done


def test_the_quick_spikes_benchmark_prints_a_row_of_figures_for_every_arm(tmp_path: Path) -> None:
    """``benchmarks/spikes.py --quick`` (a subprocess: it sets torch's thread count) prints every arm's figures."""
    out = tmp_path / "spikes.json"
    done = _run_quick("spikes.py", "--json", str(out))
    rows = {line.split(" | ")[0].lstrip("| "): line for line in done.stdout.splitlines() if line.startswith("| ")}
    labels = (
        "no treatment",
        "`clip_grad_norm_(params, 1.0)`, global",
        "gradguard `clip_norm` 1.0 per tensor",
        "gradguard `zclip` (defaults, per tensor)",
        "gradguard `zclip`, `scope: group`",
        "gradguard `autoclip` (defaults, per tensor)",
        "gradguard `skip_step_on_spike` (defaults: window 128, min_samples 64, z 6, group)",
    )
    for label in labels:
        assert label in rows, done.stdout
        cells = rows[label].strip().strip("|").split("|")[1:]
        assert len(cells) == 8, rows[label]
        for cell in cells:
            float(cell.split("(")[0])  # every column starts with a number (the mean over seeds)
    assert "none: step time" in done.stdout
    result = json.loads(out.read_text())
    assert set(result["seeds"][0]["arms"]) == {"none", "global", "clip", "zclip", "zclip-group", "autoclip", "spike"}
    assert result["seeds"][0]["arms"]["global"]["clipped_steps"] > 0, "the injected spikes are above the global clip"


def test_the_quick_suggest_and_replay_benchmark_times_both_commands_beside_a_baseline_at_two_lengths(
    tmp_path: Path,
) -> None:
    """``benchmarks/suggest_replay.py --quick --baseline TREE`` times suggest and replay from this tree and from
    ``TREE`` (here a copy of this tree's package: each side must import its own) at two log lengths, catches
    the spikes, and replays in blocks with the verdicts of one step at a time."""
    baseline = tmp_path / "baseline"
    shutil.copytree(BENCHMARKS.parent / "gradguard", baseline / "gradguard")
    out = tmp_path / "suggest.json"
    done = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "suggest_replay.py"),
            "--quick",
            "--baseline",
            str(baseline),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "| steps | log MB | suggest s | before s | x | replay s | before s | x |" in done.stdout
    result = json.loads(out.read_text())
    assert [row["steps"] for row in result["rows"]] == [300, 1200]
    for row in result["rows"]:
        assert row["spikes_caught"] == row["spikes"]
        assert row["imported"] == {"now": str(BENCHMARKS.parent / "gradguard"), "before": str(baseline / "gradguard")}
    assert result["in_process"]["verdicts_equal"] is True


def test_the_quick_recovery_benchmark_halts_without_recovery_and_rewinds_exactly_with_it(tmp_path: Path) -> None:
    """``benchmarks/recovery.py --quick``: the run without recovery halts, the one with it rewinds and finishes,
    and ends bitwise equal to the run that never learned from what the rewind undid."""
    out, png = tmp_path / "recovery.json", tmp_path / "recovery.png"
    args = [sys.executable, str(BENCHMARKS / "recovery.py"), "--quick", "--json", str(out)]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        png = None
    else:
        args += ["--plot", str(png)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCHMARKS.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "| run | held-out loss | vs reference | halted at | rewinds |" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and not line.startswith("| run ")]
    assert len(rows) == 4, done.stdout
    assert "recovery bitwise equal to its twin: yes" in done.stdout
    (seed,) = json.loads(out.read_text())["seeds"]
    runs = seed["runs"]
    assert runs["halt"]["halted_at"] is not None, "the bad stretch ends the run without recovery"
    assert runs["recovery"]["halted_at"] is None, "with recovery it finishes"
    assert runs["recovery"]["rewinds"], "by rewinding"
    assert runs["recovery"]["rewinds"][0]["step"] == runs["halt"]["halted_at"], "at the step the other run halted"
    assert seed["exact"], "the rewound run is the run that never learned from the undone batches"
    assert runs["reference"]["halted_at"] is None
    if png is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_quick_host_time_run_prints_every_treatment_with_its_counts(
    benchmarks: dict[str, ModuleType], capsys: pytest.CaptureFixture[str]
) -> None:
    assert benchmarks["host_time"].main(["--quick"]) == 0
    printed = capsys.readouterr().out
    rows = ("| none | 1 |", "| default |", "| default, provenance=None |", "| MLP: none | 1 |", "| MLP: default |")
    said = ("| default | nanoGPT's GPT | 8 |", "target: the shipped default", "budget on every tree, and no more at 4x")
    for row in (*rows, *said):
        assert row in printed, printed


def test_the_host_time_phases_time_each_part_of_the_step_for_every_treatment(
    benchmarks: dict[str, ModuleType], capsys: pytest.CaptureFixture[str]
) -> None:
    assert benchmarks["host_time"].main(["--phases", "--quick"]) == 0
    printed = capsys.readouterr().out
    assert "| treatment | forward (us) | backward (us) | clip (us) | update (us) | step (us) | / none |" in printed
    for row in ("| none |", "| default |", "| default, provenance=None |", "| no-op forward hooks |"):
        assert row in printed, printed
    (none,) = [line for line in printed.splitlines() if line.startswith("| none |")]
    assert none.endswith("| 1.000 |")


def test_the_step_walk_names_the_files_one_step_enters(
    benchmarks: dict[str, ModuleType], capsys: pytest.CaptureFixture[str]
) -> None:
    walk = benchmarks["step_walk"].walk_of_one_step()
    assert walk.files[0] == "guard.py"
    assert "enforce/step/engine.py" in walk.files
    assert len(walk.stays) >= len(walk.files) > 1
    assert walk.returns == len(walk.stays) - len(walk.files)


def test_one_step_reads_top_to_bottom_through_at_most_12_files_with_at_most_5_returns_and_no_climb(
    benchmarks: dict[str, ModuleType],
) -> None:
    """Issue 43's measure: the pipeline's walk of one guard.step(opt) of the shipped default enters each file of
    the step's pipeline in order, the participants visited at their stages."""
    pipeline = benchmarks["step_walk"].walk_of_one_step().pipeline
    assert pipeline.files[:2] == ["guard.py", "enforce/plans/plan_book.py"]
    assert pipeline.files.index("enforce/step/pipeline.py") < pipeline.files.index("enforce/step/gather.py")
    assert len(pipeline.files) <= 12, pipeline.files
    assert pipeline.returns <= 5, pipeline.entries
    assert not pipeline.climbs
    assert {"opens", "applied"} <= set(pipeline.visits)  # the participants took part, at their stages


def test_the_ddp_benchmark_prints_every_treatment_of_nanogpts_loop_on_two_ranks() -> None:
    """``benchmarks/ddp_agreement.py --shape gpt`` (two gloo ranks, one round): every treatment, the tapped and the
    untapped default guard among them, has a row with a step time and a ratio against the unguarded loop."""
    args = [sys.executable, str(BENCHMARKS / "ddp_agreement.py"), "--shape", "gpt", "--rounds", "1", "--steps", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "DDP, gloo, 2 ranks, gpt" in done.stdout
    for name in ("none", "halt only", "halt, no a-r", "default.yaml", "default, untapped"):
        (row,) = [line for line in done.stdout.splitlines() if line.startswith(f"{name}  ")]
        step_ms, ratio = (float(value) for value in row[len(name) :].split())
        assert step_ms > 0
        assert ratio > 0
    assert "a replica check: " in done.stdout


def test_the_quick_warm_up_ratio_run_measures_every_healthy_run_against_the_default_s_own_ceiling() -> None:
    """``benchmarks/warm_up_ratios.py --quick`` prints a row of figures for each of its ten runs, with the default's
    own ratio and floor; the default's ceiling clips none of them."""
    done = _run_quick("warm_up_ratios.py")
    lines = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    rows = [line.strip("|").split("|") for line in lines]
    assert len(rows) == 11, done.stdout  # the header and ten runs
    for row in rows[1:]:
        assert float(row[2].split("(")[0]) > 0, row
        assert [int(cell) for cell in row[4:6]] == [0, int(row[5])], row  # the default (with its floor) clips none
    zclip = Policy.shipped("default").rules[1].actions[0]
    assert isinstance(zclip, ZClip)
    assert f"the default's ceiling: {zclip.max_norm_ratio:g}x, at least {zclip.ratio_floor:g}" in done.stdout
    assert "steps of these healthy runs the default's ceiling clips: 0" in done.stdout
    assert zclip.warmup_steps == 25  # the benchmark's WARMUP: the norms whose mean is the warm-up scale
