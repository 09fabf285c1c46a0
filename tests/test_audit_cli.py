"""``gradguard audit``: the summary, its formats, filters, several files, findings and input errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from support.synthetic_log import LogBuilder

from gradguard.audit.reader import ReadStats, read_merged
from gradguard.cli import main

ATTN = ["blocks.0.attn.q", "blocks.0.attn.k"]
RULES = {"nonfinite": 5, "embed": 1, "attn": 2, "router": 1, "slow": 2, "skipper": 5, "unused": 0}


def rich_log(path: Path, *, run: str = "run-a", rank: int = 0, halt: bool = True) -> LogBuilder:
    """A 26-step run with every kind of event the guard writes, and some it may write one day."""
    with LogBuilder(path, run=run, rank=rank) as log:
        log.attach(RULES, model="TinyLM")
        for step in range(26):
            log.count("slow", "scale", 2)
            if step % 3 == 0:
                log.clip(step, "embed", "embed.weight", 5.0 + step)
            if step % 5 == 0 and not (halt and step == 25):  # a halted step's clips are never applied
                log.group_clip(step, "attn", ATTN, 3.0)
            if step == 7:
                log.clip_value(step, "router", "router.weight", 0.9, 0.1)
            if step == 10:
                log.nonfinite(step, "skipper", "head.weight", "inf", skips=True)
                log.skip(step, "skipper", ["head.weight"], "inf")
            if step == 14:
                log.scaler_skip(step)
            if step == 20:
                log.event("rebind", "warning", step=step, replaced=["embed.weight"], params=5, rules=RULES)
                log.event("future_thing", step=step, rule="embed", detail="something new")
            if step == 22:
                log.nonfinite(step, "nonfinite", "norm.bias", "nan")
                log.unhalted(step, ["norm.bias"], ["nan"])
            if step in (9, 19):
                log.counters(step)
            if step == 25 and halt:
                log.nonfinite(step, "nonfinite", "embed.weight", "nan", halts=True)
                log.halt(step, "nonfinite", ["embed.weight"], "nan")
        log.counters(25)
        log.detach(26)
    return log


def clean_log(path: Path, *, run: str = "run-c", rank: int = 0, steps: int = 12) -> LogBuilder:
    with LogBuilder(path, run=run, rank=rank) as log:
        log.attach({"embed": 1, "slow": 2})
        for step in range(steps):
            log.count("slow", "scale", 2)
            if step % 2 == rank % 2:
                log.clip(step, "embed", "embed.weight", 2.0 + step)
        log.counters(steps - 1)
        log.detach(steps)
    return log


def audit(*args: str) -> Result:
    return CliRunner().invoke(main, ["audit", *args])


def audit_json(*args: str) -> tuple[int, dict[str, Any]]:
    result = audit("--format", "json", *args)
    return result.exit_code, json.loads(result.stdout)


@pytest.fixture
def rich(tmp_path: Path) -> tuple[Path, LogBuilder]:
    path = tmp_path / "rich.jsonl"
    return path, rich_log(path)


def test_the_table_shows_what_happened_where_and_when(rich: tuple[Path, LogBuilder]) -> None:
    """The table names the run, the interventions by rule, the top offender, NaN/Inf, skips, the halt, the counters."""
    path, _ = rich
    result = audit(str(path))
    out = result.output
    assert result.exit_code == 1
    assert "1 run on rank 0; steps 0-25; 2026-01-01 00:00:00 to 00:00:00 UTC" in out
    assert "run-a     0  TinyLM  policy.yaml  0-25 (26 steps)" in out
    assert "rules that matched no parameter at attach: unused" in out
    assert "attn    clip_norm      10       5  0-20                3        0" in out
    assert "embed.weight                 9  embed   0-24               29 @ 24" in out
    assert "APPLIED BY THE OPTIMIZER (no halt or skip rule covered them) at 1 step: 22; parameters: norm.bias" in out
    assert "step 25: rule 'nonfinite' halted on nan in 1 parameter: embed.weight" in out
    assert "last intervention before it: clip_norm of embed.weight (rule 'embed') at step 24, before 29" in out
    assert "1 step skipped by the guard (rule skipper 1) at steps 10; non-finite parameters: head.weight (1)" in out
    assert "1 step skipped by GradScaler (its loss-scale search; not a finding) at steps 14" in out
    assert "future_thing" in out
    assert "rebind" in out
    assert "cross-check: the per-event lines reproduce every clip" in out
    assert "Unreadable lines (skipped)\n  none" in out
    assert (
        "1 halt; 1 step applied non-finite gradients (no halt or skip rule covered them); 3 non-finite gradients" in out
    )
    assert "1 skipped step (exit 1)" in out


def test_json_totals_are_the_counters_the_guard_would_have(rich: tuple[Path, LogBuilder]) -> None:
    """--format json gives the totals (scale included, from the counters events), runs, halts, skips and findings."""
    path, log = rich
    code, data = audit_json(str(path))
    assert code == 1
    assert data["exit_code"] == 1
    assert data["totals"] == log.counts
    assert data["totals"]["slow"]["scale"] == 52
    assert data["totals"]["grad_scaler"]["skip"] == 1
    assert data["mismatches"] == []
    assert data["skips"]["steps"] == [10]
    assert data["scaler_skips"]["steps"] == [14]
    assert set(data["other_events"]) == {"rebind", "future_thing"}
    assert [halt["step"] for halt in data["halts"]] == [25]
    assert data["by_param"][0]["param"] == "embed.weight"


def test_markdown_output_is_a_markdown_report(rich: tuple[Path, LogBuilder]) -> None:
    """--format markdown renders headings and pipe tables (ready for a pull request or an issue)."""
    path, _ = rich
    result = audit(str(path), "--format", "markdown")
    assert result.exit_code == 1
    assert result.output.startswith("## gradguard audit of ")
    assert "### Interventions by rule and action" in result.output
    assert "| rule | action | count | events | steps | largest before | at step |" in result.output
    assert "|---|---|---:|---:|---|---:|---:|" in result.output


def test_step_filters_narrow_the_breakdowns_but_not_the_counters(rich: tuple[Path, LogBuilder]) -> None:
    """--since/--until keep the steps in between (inclusive); runs and totals still cover the whole log."""
    path, log = rich
    code, data = audit_json(str(path), "--since", "10", "--until", "20")
    rows = {(row["rule"], row["action"]): row for row in data["by_rule_action"]}
    assert rows[("embed", "clip_norm")]["count"] == 3  # steps 12, 15, 18
    assert rows[("embed", "clip_norm")]["first_step"] == 12
    assert rows[("embed", "clip_norm")]["last_step"] == 18
    assert rows[("attn", "clip_norm")]["count"] == 6  # steps 10, 15, 20, two parameters each
    assert ("router", "clip_value") not in rows
    assert data["halts"] == []
    assert data["nonfinite"]["steps"] == [10]
    assert data["totals"] == log.counts
    assert code == 1  # the skip at step 10


def test_rule_and_param_filters_pick_what_to_look_at(rich: tuple[Path, LogBuilder]) -> None:
    """--rule keeps one rule's events; --param narrows a group clip to the matching parameters."""
    path, _ = rich
    _, by_rule = audit_json(str(path), "--rule", "attn")
    assert [(row["rule"], row["count"]) for row in by_rule["by_rule_action"]] == [("attn", 10)]
    assert by_rule["skips"]["events"] == 0
    _, by_param = audit_json(str(path), "--param", "*attn.q")
    assert [(row["rule"], row["count"], row["events"]) for row in by_param["by_rule_action"]] == [("attn", 5, 5)]
    assert [row["param"] for row in by_param["by_param"]] == ["blocks.0.attn.q"]
    _, by_regex = audit_json(str(path), "--param", r"re:embed\.weight")
    assert [halt["step"] for halt in by_regex["halts"]] == [25]
    assert [row["param"] for row in by_regex["by_param"]] == ["embed.weight"]


def test_a_rule_filter_for_a_rule_not_in_the_log_says_so(rich: tuple[Path, LogBuilder]) -> None:
    """A --rule that names no rule of the log is pointed out, with the rules the log has."""
    path, _ = rich
    result = audit(str(path), "--rule", "atn")
    assert "note: --rule atn: no such rule in the log (rules seen: attn, embed, grad_scaler," in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--since", "20", "--until", "10"], "--since 20 is after --until 10"),
        (["--param", "re:(unclosed"], "invalid regular expression in --param 're:(unclosed'"),
        (["--format", "yaml"], "'yaml' is not one of 'table', 'json', 'markdown'"),
        (["--since", "-3"], "-3 is not in the range x>=0"),
    ],
)
def test_bad_options_are_usage_errors(rich: tuple[Path, LogBuilder], args: list[str], message: str) -> None:
    """Contradictory or invalid options exit 2 with a message naming the option."""
    path, _ = rich
    result = audit(str(path), *args)
    assert result.exit_code == 2
    assert message in result.output


def test_a_missing_log_or_a_directory_is_an_input_error(tmp_path: Path) -> None:
    """A path that does not exist, or is a directory, exits 2 before anything is read."""
    missing = audit(str(tmp_path / "nope.jsonl"))
    assert missing.exit_code == 2
    assert "does not exist" in missing.output
    directory = audit(str(tmp_path))
    assert directory.exit_code == 2
    assert "is a directory" in directory.output


def test_a_file_without_gradguard_events_is_an_input_error(tmp_path: Path) -> None:
    """A log of another program, or an empty file, exits 2, saying what the first lines were."""
    other = tmp_path / "train.log"
    other.write_text('epoch 1 loss=2.3\n{"event": "epoch_end", "loss": 2.1}\n')
    result = audit(str(other))
    assert result.exit_code == 2
    assert f"error: no gradguard event in {other}: is it an audit log written with GradGuard" in result.output
    assert f"{other}:1: not JSON" in result.output
    assert f"{other}:2: JSON without gradguard's 'event' and 'run' fields" in result.output
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert audit(str(empty)).exit_code == 2


def test_a_clean_log_exits_0(tmp_path: Path) -> None:
    """Clips alone are the guard doing its job: no finding, exit 0."""
    path = tmp_path / "clean.jsonl"
    log = clean_log(path)
    code, data = audit_json(str(path))
    assert code == 0
    assert data["findings"] == []
    assert data["totals"] == log.counts
    text = audit(str(path))
    assert text.exit_code == 0
    assert "Findings\n  none (exit 0)" in text.output


def test_a_counters_event_the_events_disagree_with_is_a_mismatch(tmp_path: Path) -> None:
    """When the per-event lines do not add up to a counters event (lost lines), it is reported, with exit 1."""
    path = tmp_path / "lossy.jsonl"
    with LogBuilder(path) as log:
        log.attach({"embed": 1})
        for step in range(10):
            log.clip(step, "embed", "embed.weight", 3.0)
        log.count("embed", "clip_norm", 2)  # two clips whose lines were lost
        log.counters(9)
        log.detach(10)
    code, data = audit_json(str(path))
    assert code == 1
    (mismatch,) = data["mismatches"]
    assert (mismatch["rule"], mismatch["action"], mismatch["counters"], mismatch["events"]) == (
        "embed",
        "clip_norm",
        12,
        10,
    )
    assert mismatch["where"] == f"{path}:12"
    assert data["totals"] == {"embed": {"clip_norm": 12}}  # the guard's own count wins
    text = audit(str(path)).output
    assert "MISMATCH: run run0, embed/clip_norm: the counters written at step 9" in text
    assert "say 12, the events before them give 10" in text


def test_one_log_per_rank_is_merged_in_step_order(tmp_path: Path) -> None:
    """Several files are read as one run per rank, merged by step; the ranks make one job, whose totals are per
    step across its ranks: its clips (rank 0's at even steps, rank 1's at odd ones) add up, while the scale every
    rank applied to the same parameter at each step counts once, not once per rank."""
    logs = [clean_log(tmp_path / f"rank{rank}.jsonl", run=f"r{rank}", rank=rank) for rank in (0, 1)]
    paths = [str(tmp_path / "rank0.jsonl"), str(tmp_path / "rank1.jsonl")]
    code, data = audit_json(*paths)
    assert code == 0
    assert data["ranks"] == [0, 1]
    assert [run["run"] for run in data["runs"]] == ["r0", "r1"]
    assert data["totals"] == {"slow": {"scale": 24}, "embed": {"clip_norm": 12}}
    assert [run["counters"] for run in data["runs"]] == [log.counts for log in logs]
    steps = [record.order for record in read_merged([Path(p) for p in paths], ReadStats())]
    assert steps == sorted(steps)
    table = audit(*paths).output
    assert "1 run on rank" not in table
    assert "2 runs on ranks 0, 1" in table
    assert "run r0" in table
    assert "run r1" in table


def test_a_run_resumed_into_a_new_file_adds_up(tmp_path: Path) -> None:
    """A run and its resumption (two guards, two files) give one summary whose totals add both."""
    first = clean_log(tmp_path / "part1.jsonl", run="before", steps=10)
    second = clean_log(tmp_path / "part2.jsonl", run="after", steps=6)
    code, data = audit_json(str(tmp_path / "part1.jsonl"), str(tmp_path / "part2.jsonl"))
    assert code == 0
    assert len(data["runs"]) == 2
    assert data["totals"]["slow"]["scale"] == first.counts["slow"]["scale"] + second.counts["slow"]["scale"]


def test_the_same_file_twice_is_read_once(rich: tuple[Path, LogBuilder]) -> None:
    """Naming a file twice does not double its counts; a note on stderr says so."""
    path, log = rich
    result = CliRunner().invoke(main, ["audit", "--format", "json", str(path), str(path)])
    assert json.loads(result.stdout)["totals"] == log.counts
    assert "is given twice; reading it once" in result.stderr


def test_the_progress_bar_goes_to_stderr(rich: tuple[Path, LogBuilder]) -> None:
    """With a progress bar (automatic on a terminal for large logs), it is drawn on stderr, never in the report."""
    path, _ = rich
    result = CliRunner().invoke(main, ["audit", "--format", "json", "--progress", str(path)])
    assert "reading 1 log file" in result.stderr
    assert json.loads(result.stdout)["events"] > 0
    quiet = CliRunner().invoke(main, ["audit", "--format", "json", str(path)])
    assert "reading" not in quiet.stderr


def test_top_limits_the_offender_table(rich: tuple[Path, LogBuilder]) -> None:
    """--top N shows N offenders and says how many more there are."""
    path, _ = rich
    out = audit(str(path), "--top", "1").output
    assert "Top offenders (parameters by interventions, top 1)" in out
    assert "and 3 more parameters (--top N, or --format json for all)" in out
