"""The audit's totals against an independent count: random event streams of data-parallel jobs (several runs and
ranks, halts of every kind, skips, rewinds, outlier skips, counters events), written by the guard's own ``EventLog``
(tests/support/audit_streams.py), whose true account the test knows. The audit's counts, per-rank table and
findings must equal it, with no counter mismatch that is not there."""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.audit_streams import HALT_KINDS, HAPPENINGS, JobPlan, write_plan

from gradguard.cli import main


@st.composite
def jobs(draw: st.DrawFn) -> list[JobPlan]:
    plans = []
    ranks = draw(st.integers(1, 3))  # a job resumed with other ranks into the same files is not told apart (yet)
    for _ in range(draw(st.integers(1, 3))):
        step = st.tuples(st.sampled_from(HAPPENINGS), st.integers(1, 4), st.integers(0, ranks - 1))
        steps = draw(st.lists(step, min_size=1, max_size=8))
        plans.append(JobPlan(ranks, steps, draw(st.none() | st.sampled_from(HALT_KINDS))))
    return plans


def audit_json(paths: list[Path]) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["audit", "--format", "json", *map(str, paths)])
    data: dict[str, Any] = json.loads(result.stdout)
    return data


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=jobs())
def test_the_audits_account_of_random_jobs_equals_the_count_made_as_they_were_written(plan: list[JobPlan]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        paths, expected = write_plan(Path(folder), plan)
        data = audit_json(paths)
    assert data["mismatches_total"] == 0, data["mismatches"]
    assert data["bad_lines_total"] == 0, data["bad_lines"]
    assert data["totals"] == expected.totals
    assert data["halts_total"] == expected.halts
    assert data["rewinds_total"] == expected.rewinds
    assert data["skips"]["events"] == expected.skips
    assert data["intervention_count"] == expected.clips
    assert data["nonfinite"]["events"] == expected.nonfinite
    assert [job["ranks"] for job in data["jobs"]] == [list(range(job.ranks)) for job in plan]
    columns = ("halts", "rewinds", "skips", "outliers", "divergences")
    table = {
        row["rank"]: Counter({column: row[column] for column in columns if row[column]}) for row in data["by_rank"]
    }
    assert table == expected.by_rank
    findings = "; ".join(data["findings"])
    assert ("halt" in findings) == bool(expected.halts)
    assert ("skipped step" in findings) == bool(expected.skips)
    assert "mismatch" not in findings
    assert data["exit_code"] == int(bool(data["findings"]))
