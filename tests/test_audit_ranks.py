"""``gradguard audit`` over the logs of a distributed run: an event every rank wrote counts once per step, and the
ranks table says which rank each fault, outlier, divergence, failure and re-run named.

Synthetic logs, written as the guard writes them (every rank writes every distributed event); the real 2-rank gloo
runs' logs are audited in tests/test_distributed.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner
from support.synthetic_log import LogBuilder

from gradguard.cli import main

PARAMS = ["embed.weight", "body.weight", "body.bias", "head.weight"]
RULES = {"nonfinite": 4, "clip": 4, "slow": 4}


def audit(*args: str | Path) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["audit", *map(str, args)])
    return result.exit_code, result.output


def audit_json(*args: str | Path) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["audit", "--format", "json", *map(str, args)])
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def verdict(log: LogBuilder, event: str, step: int, ranks: dict[str, str], **fields: Any) -> None:
    """A halt, rewind or skip of the rule ``nonfinite`` on ``body.weight``, made on ``ranks`` (counted as the guard
    counts it)."""
    action = {"halt": "halt_on_nonfinite", "skip": "skip_step_on_nonfinite", "rewind": "rewind"}[event]
    log.count("nonfinite", action)
    head = {"rule": "nonfinite", "params": ["body.weight"], "kinds": {"body.weight": "inf"}, "kind": "inf"}
    if event == "halt":
        fields = {"reason": None, "counters": log.snapshot(), **fields}
    log.event(event, "warning", step=step, **head, origin=None, ranks=ranks, **fields)


def replicated_run(
    path: Path, rank: int, *, run: str | None = None, start: int = 0, made_on: dict[str, str] | None = None
) -> LogBuilder:
    """One rank of a data-parallel job of 6 steps from ``start``: 2 clips a step (10 in all), 2 scaled gradients a
    step, a skip at its fourth step made on ``made_on`` (rank 0, host-a), counters and detach: what every rank of
    the job writes."""
    skip_at, steps = start + 3, start + 6
    with LogBuilder(path, run=run or f"r{rank}", rank=rank) as log:
        log.attach(RULES)
        for step in range(start, steps):
            log.count("slow", "scale", 2)
            if step == skip_at:
                log.nonfinite(step, "nonfinite", "body.weight", "inf", skips=True)
                verdict(log, "skip", step, {"0": "host-a"} if made_on is None else made_on)
                continue
            for param in PARAMS[:2]:
                log.clip(step, "clip", param, 2.0 + step)
        log.counters(steps - 1)
        log.detach(steps)
    return log


def test_a_skip_on_both_ranks_is_one_skipped_step_and_their_clips_count_once(tmp_path: Path) -> None:
    """The issue's reproduction: a skip at step 3 on both ranks reads "1 step skipped ... at steps 3", not 2; 10 clips
    on each rank are 10 gradients changed, not 20; each run keeps its rank's own counters, the totals are one job's."""
    logs = [replicated_run(tmp_path / f"rank{rank}.jsonl", rank) for rank in (0, 1)]
    paths = [log.path for log in logs]
    data = audit_json(*paths)
    assert data["skips"]["events"] == 1
    assert data["skips"]["steps"] == [3]
    assert data["skips_by_rule"] == {"nonfinite": 1}
    assert data["intervention_count"] == 10
    assert data["nonfinite"]["events"] == 1
    assert [run["counters"] for run in data["runs"]] == [log.counts for log in logs]
    assert data["totals"] == logs[0].counts  # one rank's, as every rank counted the same
    assert data["mismatches_total"] == 0
    assert [(job["runs"], job["ranks"]) for job in data["jobs"]] == [(["r0", "r1"], [0, 1])]
    code, text = audit(*paths)
    assert code == 1
    assert "1 step skipped by the guard (rule nonfinite 1) at steps 3" in text
    assert "10 gradients changed" in text
    assert "runs r0, r1 (ranks 0, 1) are one job: figures are per step across its ranks" in text
    assert "count: per step across the ranks of each job" in text


def test_one_file_with_the_lines_of_both_ranks_reads_as_their_two_files(tmp_path: Path) -> None:
    """Both ranks appending to one log, their lines interleaved a few steps apart: the same account as two files."""
    logs = [replicated_run(tmp_path / f"rank{rank}.jsonl", rank) for rank in (0, 1)]
    lines = [log.path.read_text().splitlines() for log in logs]
    mixed = [line for pair in zip(lines[0][:9], lines[1][:9], strict=True) for line in pair]
    mixed += lines[0][9:] + lines[1][9:]  # rank 1 falls behind by the rest of the run
    shared = tmp_path / "both.jsonl"
    shared.write_text("\n".join(mixed) + "\n")
    apart, together = audit_json(*[log.path for log in logs]), audit_json(shared)
    for key in ("skips", "intervention_count", "nonfinite", "totals", "by_rank", "mismatches_total"):
        assert together[key] == apart[key], key


def test_a_single_process_log_of_two_runs_still_counts_both(tmp_path: Path) -> None:
    """Two runs of rank 0 appended to one log are two jobs: both skips and all their clips count."""
    path = tmp_path / "run.jsonl"
    first = replicated_run(path, 0, run="a", made_on={})
    replicated_run(path, 0, run="b", made_on={})
    data = audit_json(path)
    assert data["skips"]["events"] == 2
    assert data["intervention_count"] == 20
    assert data["totals"]["clip"] == {"clip_norm": 2 * first.counts["clip"]["clip_norm"]}
    assert [job["ranks"] for job in data["jobs"]] == [[0], [0]]
    _code, text = audit(path)
    assert "are one job" not in text
    assert "Ranks (" not in text  # nothing names a rank: the section is left out, as before


def test_two_jobs_in_the_same_per_rank_files_are_not_merged(tmp_path: Path) -> None:
    """A job of 2 ranks, then its resumption (new guards, from its last step) appended to the same two files: 2
    jobs, a skip in each."""
    for rank in (0, 1):
        replicated_run(tmp_path / f"rank{rank}.jsonl", rank, run=f"first{rank}")
        replicated_run(tmp_path / f"rank{rank}.jsonl", rank, run=f"second{rank}", start=6)
    data = audit_json(tmp_path / "rank0.jsonl", tmp_path / "rank1.jsonl")
    assert sorted(job["ranks"] for job in data["jobs"]) == [[0, 1], [0, 1]]
    assert data["skips"]["events"] == 2
    assert data["intervention_count"] == 20


def test_a_halt_on_both_ranks_is_one_halt_naming_both(tmp_path: Path) -> None:
    """Each rank writes the halt: one row, "runs r0, r1, ranks 0, 1", and one halt in the findings."""
    for rank in (0, 1):
        with LogBuilder(tmp_path / f"rank{rank}.jsonl", run=f"r{rank}", rank=rank) as log:
            log.attach(RULES)
            log.clip(0, "clip", "body.weight", 3.0)
            log.nonfinite(1, "nonfinite", "body.weight", "nan", halts=True)
            verdict(log, "halt", 1, {"1": "host-b"})
            log.detach(2)
    data = audit_json(tmp_path / "rank0.jsonl", tmp_path / "rank1.jsonl")
    assert data["halts_total"] == 1
    (halt,) = data["halts"]
    assert (halt["ranks"], halt["runs"]) == ([0, 1], ["r0", "r1"])
    assert data["totals"]["nonfinite"] == {"nan": 1, "halt_on_nonfinite": 1}
    _code, text = audit(tmp_path / "rank0.jsonl", tmp_path / "rank1.jsonl")
    assert "    runs r0, r1, ranks 0, 1, at " in text
    assert "Findings\n  1 halt;" in text


def test_clips_the_ranks_differ_on_are_counted_once_each(tmp_path: Path) -> None:
    """A clip written by rank 0 only (a line rank 1 lost) still counts, once; a clip both wrote, once."""
    for rank in (0, 1):
        with LogBuilder(tmp_path / f"rank{rank}.jsonl", run=f"r{rank}", rank=rank) as log:
            log.attach(RULES)
            log.clip(0, "clip", "body.weight", 3.0)
            if rank == 0:
                log.clip(1, "clip", "head.weight", 4.0)
            log.detach(2)
    data = audit_json(tmp_path / "rank0.jsonl", tmp_path / "rank1.jsonl")
    assert data["intervention_count"] == 2
    assert data["totals"] == {"clip": {"clip_norm": 2}}
    assert [run["counters"] for run in data["runs"]] == [{"clip": {"clip_norm": 2}}, {"clip": {"clip_norm": 1}}]


def rank_events(path: Path, rank: int) -> LogBuilder:
    """Every event that names a rank, as each of 4 ranks writes it: faults made on rank 2 (host-c), an outlier,
    a divergence, a failure, and re-runs."""
    hosts = {"0": "host-a", "1": "host-a", "2": "host-c", "3": "host-d"}
    with LogBuilder(path, run=f"r{rank}", rank=rank) as log:
        log.attach(RULES)
        log.nonfinite(1, "nonfinite", "body.weight", "inf", skips=True)
        verdict(log, "skip", 1, {"2": hosts["2"]})
        log.event(
            "rank_outlier",
            "warning",
            step=2,
            ranks={"2": hosts["2"]},
            norms={"0": 1.0, "1": 1.1, "2": 40.0, "3": 0.9},
            median=1.05,
            outlier_factor=10.0,
            action="warn",
        )
        log.nonfinite(3, "nonfinite", "body.weight", "nan", halts=True)
        verdict(log, "rewind", 3, {"2": hosts["2"], "3": hosts["3"]}, reason=None, to_step=2, rewinds=1,
                skip_until=5, lr_scale=1.0)  # fmt: skip
        log.event("replica_divergence", "error", step=6, ranks={"3": hosts["3"]}, params=["head.weight"], checked=4,
                  action="warn")  # fmt: skip
        log.count("rerun", "transient")
        log.event("rerun", "warning", step=7, verdict="transient", asked="nonfinite", max_rel_diff=1.0,
                  params=["body.weight"], ranks=[2])  # fmt: skip
        log.count("rerun", "reproducible")
        log.event("rerun", "warning", step=8, verdict="reproducible", asked="spike", max_rel_diff=0.0, params=[],
                  ranks=[1])  # fmt: skip
        log.event("rank_failure", "error", step=9, failed_rank=1, host=hosts["1"], error="RuntimeError: boom")
        log.detach(10)
    return log


def test_the_ranks_table_names_each_rank_s_faults_outliers_divergences_failures_and_reruns(tmp_path: Path) -> None:
    """Four ranks' logs, each with every event: each counted once, against the ranks it names, with their hosts."""
    paths = [rank_events(tmp_path / f"rank{rank}.jsonl", rank).path for rank in range(4)]
    data = audit_json(*paths)
    rows = {row["rank"]: row for row in data["by_rank"]}
    assert sorted(rows) == [1, 2, 3]
    two, three, one = rows[2], rows[3], rows[1]
    assert (two["hosts"], two["skips"], two["rewinds"], two["halts"], two["outliers"], two["transient"]) == (
        ["host-c"],
        1,
        1,
        0,
        1,
        1,
    )
    assert two["steps"]["steps"] == [1, 2, 3, 7]
    assert (three["hosts"], three["rewinds"], three["divergences"], three["skips"]) == (["host-d"], 1, 1, 0)
    assert (one["hosts"], one["failures"], one["reproducible"], one["errors"]) == (
        ["host-a"],
        1,
        1,
        ["step 9: RuntimeError: boom"],
    )
    assert data["rewinds_total"] == 1
    assert data["rewinds"][0]["ranks"] == [0, 1, 2, 3]
    assert data["totals"]["rerun"] == {"transient": 1, "reproducible": 1}
    _code, text = audit(*paths)
    table = text.split("Ranks (", 1)[1].split("\n\n", 1)[0]
    assert "per step across ranks: an event every rank wrote is counted once" in table
    lines = {line.split()[0]: line.split() for line in table.splitlines()[3:] if line.split()[0].isdigit()}
    assert lines["2"][:11] == ["2", "host-c", "2", "0", "1", "1", "1", "0", "0", "1", "0"]
    assert "rank 1 failed at step 9: RuntimeError: boom" in table
    assert "most faults: rank 2 (host-c), 2 faults" in table
    _code, markdown = audit("--format", "markdown", *paths)
    assert "### Ranks (" in markdown
    assert "| 2 | host-c | 2 | 0 | 1 | 1 | 1 | 0 | 0 | 1 | 0 | 1, 2, 3, 7 |" in markdown


def test_a_multi_rank_log_without_rank_events_says_so_in_the_ranks_section(tmp_path: Path) -> None:
    """Two ranks, a fault made after the reduction (``ranks: {}``): the section is there, saying nothing named one."""
    for rank in (0, 1):
        with LogBuilder(tmp_path / f"rank{rank}.jsonl", run=f"r{rank}", rank=rank) as log:
            log.attach(RULES)
            log.nonfinite(1, "nonfinite", "body.weight", "inf", skips=True)
            verdict(log, "skip", 1, {})
            log.detach(2)
    data = audit_json(tmp_path / "rank0.jsonl", tmp_path / "rank1.jsonl")
    assert data["by_rank"] == []
    _code, text = audit(tmp_path / "rank0.jsonl", tmp_path / "rank1.jsonl")
    assert "none: no event named a rank" in text


def test_a_ranks_field_whose_key_is_not_a_rank_is_an_unreadable_line(tmp_path: Path) -> None:
    """``{"two": "host"}`` fits the definition (a dict of strings) but names no rank: reported, the rest is read."""
    with LogBuilder(tmp_path / "rank0.jsonl", run="r0") as log:
        log.attach(RULES)
        log.nonfinite(1, "nonfinite", "body.weight", "inf", skips=True)
        verdict(log, "skip", 1, {"two": "host-b"})
        log.detach(2)
    data = audit_json(tmp_path / "rank0.jsonl")
    assert data["bad_lines_total"] == 1
    assert "'ranks' has 'two', not a rank number" in data["bad_lines"][0]["reason"]


def test_a_rank_whose_log_starts_late_has_its_clips_and_nan_lines_counted_once(tmp_path: Path) -> None:
    """Rank 1's log lost its first line (its attach): its run joins the job only at its first step, after rank 0's
    lines of that step were read as a job of one rank. Those lines (runs of clips, a NaN step's line per tensor) are
    held until the second rank comes, so rank 1's copies are replicas: each clip and detection counts once, as with
    a filter on (which reads every line alone)."""
    paths = []
    for rank in (0, 1):
        with LogBuilder(tmp_path / f"rank{rank}.jsonl", run=f"r{rank}", rank=rank) as log:
            log.attach(RULES)
            for step in range(4):
                if step == 2:
                    for param in PARAMS:
                        log.nonfinite(step, "nonfinite", param, "nan", skips=True)
                    verdict(log, "skip", step, {"0": "host-a"})
                    continue
                for param in PARAMS:
                    log.clip(step, "clip", param, 2.0 + step)
            log.counters(3)
            log.detach(4)
        paths.append(log.path)
    late = paths[1].read_text().splitlines()[1:]
    paths[1].write_text("\n".join(late) + "\n")
    every_line_alone = audit_json(*paths, "--rule", "clip", "--rule", "nonfinite")
    data = audit_json(*paths)
    assert [job["ranks"] for job in data["jobs"]] == [[0, 1]]
    assert data["intervention_count"] == every_line_alone["intervention_count"] == 12
    assert data["nonfinite"]["events"] == every_line_alone["nonfinite"]["events"] == 4
    assert data["totals"]["clip"] == {"clip_norm": 12}
    assert data["totals"]["nonfinite"]["nan"] == 4
    assert data["skips"]["events"] == 1


def test_a_job_of_one_rank_lets_go_of_what_it_held_once_a_newer_job_begins(tmp_path: Path) -> None:
    """A single-process log of many runs is a job per run; each holds its last steps' events in case a second rank
    joins, which only the newest job can get: an older job's are let go (a million-line log of 100 runs held 20 MiB
    of them to the end)."""
    from gradguard.audit.reader import ReadStats, read_batches
    from gradguard.audit.summarizer import Summarizer

    path = tmp_path / "run.jsonl"
    for run in ("a", "b", "c"):
        replicated_run(path, 0, run=run, made_on={})
    summarizer = Summarizer([str(path)], ReadStats())
    for batch in read_batches([path], ReadStats()):
        summarizer.add_all(batch)
    holding = [job.holding for job in summarizer.runs.jobs]
    assert holding[:2] == [0, 0]
    assert holding[2] > 0
