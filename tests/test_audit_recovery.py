"""``gradguard audit`` on runs that recovered: each rewind listed with the stretch it undid, figures exact.

A rewind is not a halt: the run went on. The audit lists it (fault step, snapshot step, the steps never
learned from, rule, kind, origin), counts it under its rule as ``rewind`` as the guard does, and still
reproduces every counter; a halt after ``max_rewinds`` says which snapshot it restored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from gradguard import GradGuard, GradientHalt, Policy
from gradguard.cli import main

HALT = {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}
CLIP = {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.05}]}
RECOVERY = {"snapshot_every": 5, "keep": 2, "min_age": 3, "skip_steps": 4}


def audit(*args: str | Path) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["audit", *map(str, args)])
    return result.exit_code, result.output


def audit_json(*args: str | Path) -> dict[str, Any]:
    _code, out = audit(*args, "--format", "json")
    return json.loads(out)


def events(log: Path, kind: str) -> list[dict[str, Any]]:
    return [e for line in log.read_text().splitlines() if (e := json.loads(line))["event"] == kind]


def train(
    log: Path,
    rules: list[dict[str, Any]],
    *,
    nan_at: set[int] | range,
    steps: int = 40,
    recovery: dict[str, Any] | None = None,
    fp16: bool = False,
) -> tuple[dict[str, dict[str, int]], GradientHalt | None]:
    """A small guarded loop (a NaN in the input at ``nan_at``); the guard's counters and its halt, if any."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if fp16 else None
    data: dict[str, Any] = {"version": 1, "rules": rules, "recovery": recovery or RECOVERY}
    halt = None
    with GradGuard(model, Policy.from_dict(data), logger=None, audit_log=log, summary_every=10, scaler=scaler) as guard:
        try:
            for step in range(steps):
                x = torch.randn(4, 8) * (30.0 if step % 3 == 0 else 1.0)
                if step in nan_at:
                    x[0, 0] = float("nan")
                optimizer.zero_grad()
                if scaler is None:
                    nn.functional.mse_loss(model(x), torch.ones(4, 2)).backward()
                    optimizer.step()
                else:
                    with torch.autocast("cpu", dtype=torch.float16):
                        out = model(x)
                    scaler.scale(nn.functional.mse_loss(out.float(), torch.ones(4, 2))).backward()
                    scaler.step(optimizer)
                    scaler.update()
        except GradientHalt as exc:
            halt = exc
    return guard.counters.snapshot(), halt


def test_a_rewind_is_listed_with_the_stretch_it_undid_and_the_counters_stay_exact(tmp_path: Path) -> None:
    """NaN at step 23, snapshots every 5, min_age 3, skip 4: rewound to 20, steps 20-27 never learned from;
    the run went on to its 40 steps, no halt, and the reproduced counters are the guard's (rewind included)."""
    log = tmp_path / "run.jsonl"
    counters, halt = train(log, [HALT, CLIP], nan_at={23})
    assert halt is None
    assert counters["nonfinite"]["rewind"] == 1
    data = audit_json(log)
    assert data["totals"] == counters
    assert data["mismatches_total"] == 0
    assert data["halts_total"] == 0
    (run,) = data["runs"]
    assert run["steps"] == 40
    assert run["rewinds"] == 1
    assert run["unlearned_steps"] == [[20, 27]]
    assert "halted" not in run["ended"]
    assert data["rewinds_total"] == 1
    (row,) = data["rewinds"]
    assert (row["step"], row["to_step"], row["skip_until"], row["rule"], row["kind"]) == (
        23,
        20,
        28,
        "nonfinite",
        "nan",
    )
    assert row["n_params"] == 4
    assert row["ranks"] == [0]
    assert row["rewinds"] == 1
    assert row["origin"]["phase"] == "forward"  # the NaN came in with the batch
    assert row["where"].endswith(f"run.jsonl:{_line_of(log, 'rewind')}")
    assert data["unlearned_steps"] == [[20, 27]]
    assert "1 rewind (8 steps never learned from)" in data["findings"]
    assert "rewind" not in data["other_events"]

    code, out = audit(log)
    assert code == 1
    section = out.split("Rewinds (recovery)\n", 1)[1].split("\n\n", 1)[0]
    assert (
        "1 rewind instead of a halt (the run went on); the batches of 8 steps were never learned from: 20-27" in section
    )
    assert "step 23: rule 'nonfinite' rewound on nan to the snapshot of step 20" in section
    assert (
        "steps 20-27 never learned from: 20-22 undone, 23 the fault (not applied), 24-27 skipped; "
        "applied again from step 28"
    ) in section
    assert "origin: It started in the input batch" in section
    assert "rewind 1 of the run; run " in section
    assert "1 rewind (8 steps never learned from); detached (removed)" in out  # the run table's "ended"
    assert "Halts\n  none\n" in out
    assert "cross-check: the per-event lines reproduce every" in out


def test_the_steps_a_rewind_left_without_an_update_are_in_the_skipped_steps_with_their_cause(tmp_path: Path) -> None:
    """NaN at 23, rewound to 20, skip 4: "Skipped steps" lists 23 (the fault) and 24-27 (its window), not "none";
    the guard counts the window's steps as ``recovery``/``skip``, and the audit's totals are its counters."""
    log = tmp_path / "run.jsonl"
    counters, _halt = train(log, [HALT, CLIP], nan_at={23})
    assert counters["recovery"] == {"skip": 4}
    data = audit_json(log)
    assert data["totals"] == counters
    assert data["mismatches_total"] == 0
    assert data["rewind_skips"] == [[23, 27]]
    _code, out = audit(log)
    section = out.split("Skipped steps\n", 1)[1].split("\n\n", 1)[0]
    assert "none" not in section
    assert "5 steps without an update after a rewind (never learned from): 23-27" in section
    assert "step 23: the fault (rule 'nonfinite' rewound on nan), 24-27 its window" in section


def test_pass_step_counts_the_steps_it_passes_as_skipped(tmp_path: Path) -> None:
    """A loop that asks ``guard.pass_step()`` in the window: the passed steps counted as ``recovery``/``skip``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    policy = Policy.from_dict({"version": 1, "rules": [HALT], "recovery": RECOVERY})
    passed = []
    with GradGuard(model, policy, logger=None, audit_log=tmp_path / "run.jsonl") as guard:
        for step in range(40):
            if guard.pass_step():
                passed.append(step)
                continue
            x = torch.randn(4, 8)
            if step == 23:
                x[0, 0] = float("nan")
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), torch.ones(4, 2)).backward()
            optimizer.step()
    assert passed == [24, 25, 26, 27]
    assert guard.counters.snapshot()["recovery"] == {"skip": 4}
    assert audit_json(tmp_path / "run.jsonl")["totals"]["recovery"] == {"skip": 4}


def test_two_runs_appended_to_one_log_that_rewind_at_the_same_step_are_two_rewinds(tmp_path: Path) -> None:
    """Runs are not ranks: two runs of rank 0 in one log, each rewinding at step 23, make two rows."""
    log = tmp_path / "run.jsonl"
    train(log, [HALT], nan_at={23})
    train(log, [HALT], nan_at={23})
    data = audit_json(log)
    assert data["totals"]["nonfinite"]["rewind"] == 2
    assert data["rewinds_total"] == 2
    assert [(row["runs"], row["ranks"]) for row in data["rewinds"]] == [
        ([data["runs"][0]["run"]], [0]),
        ([data["runs"][1]["run"]], [0]),
    ]
    _code, out = audit(log)
    assert "2 rewinds instead of a halt" in out
    assert "runs " not in out.split("Rewinds (recovery)\n", 1)[1].split("\n\n", 1)[0]


def test_an_origin_the_loss_made_is_said_once_under_its_label(tmp_path: Path) -> None:
    """A NaN made after backward (``loss * nan``): the audit's line is ``origin: its forward was finite ...``,
    not ``origin: Origin: ...``, under Halts and Rewinds alike."""
    log = tmp_path / "run.jsonl"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = {"version": 1, "rules": [HALT], "recovery": {**RECOVERY, "max_rewinds": 1}}

    def loop() -> None:
        for step in range(40):
            loss = model(torch.randn(4, 8)).square().mean() * (float("nan") if step in (13, 23) else 1.0)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    with GradGuard(model, Policy.from_dict(data), logger=None, audit_log=log), pytest.raises(GradientHalt):
        loop()
    _code, out = audit(log)
    origins = [line.strip() for line in out.splitlines() if line.strip().startswith("origin: ")]
    assert len(origins) == 2, out
    for line in origins:
        assert not line.lower().startswith("origin: origin"), line
        assert "forward was finite" in line, line


def test_a_persistent_overflow_rewinds_until_max_rewinds_then_halts_restored(tmp_path: Path) -> None:
    """Under GradScaler a NaN from step 12 on: each `max_scaler_skips` overflow is a rewind (no parameters), the
    one after max_rewinds a halt that restored the snapshot; both listed, counters exact, stretches joined."""
    log = tmp_path / "fp16.jsonl"
    skips = {**HALT, "actions": [{"action": "halt_on_nonfinite", "max_scaler_skips": 2}]}
    recovery = {"snapshot_every": 5, "min_age": 2, "skip_steps": 2, "max_rewinds": 2}
    counters, halt = train(log, [skips], nan_at=range(12, 60), steps=60, recovery=recovery, fp16=True)
    assert halt is not None
    assert halt.kind == "overflow"
    assert halt.restored_to is not None
    logged = events(log, "rewind")
    assert [e["kind"] for e in logged] == ["overflow", "overflow"]
    data = audit_json(log)
    assert data["totals"] == counters
    assert data["mismatches_total"] == 0
    assert [(r["step"], r["to_step"], r["skip_until"]) for r in data["rewinds"]] == [
        (e["step"], e["to_step"], e["skip_until"]) for e in logged
    ]
    assert all(r["n_params"] == 0 and r["reason"].startswith("GradScaler skipped 3 steps") for r in data["rewinds"])
    (shown,) = data["halts"]
    assert (shown["kind"], shown["restored_to"], shown["step"]) == ("overflow", halt.restored_to, halt.step)
    first, last = min(e["to_step"] for e in logged), max(e["skip_until"] for e in logged) - 1
    assert data["unlearned_steps"] == [[first, last]]  # the second rewind went back over the first one's stretch

    _code, out = audit(log)
    assert f"step {halt.step}: rule 'nonfinite' halted on overflow\n" in out  # no "in 0 parameters"
    assert (
        f"restored to the recovery snapshot of step {halt.restored_to} before halting (max_rewinds reached): "
        f"steps {halt.restored_to}-{halt.step - 1} undone"
    ) in out
    assert f"rewound on overflow to the snapshot of step {logged[0]['to_step']}" in out
    assert "rewind 2 of the run" in out
    assert f"halted at step {halt.step}" in out


def test_an_escalating_skip_rule_rewinds_and_recovery_reasons_do_not_confuse_the_halt_counts(tmp_path: Path) -> None:
    """A skip rule past its limit rewinds (the skip rule before it counted the step's skip); a halt that recovery
    could not turn into a rewind (no snapshot old enough) counts every halt rule: no counter mismatch either way."""
    skip_a = {"name": "skip_a", "match": "0.*", "actions": [{"action": "skip_step_on_nonfinite"}]}
    skip_b = {
        "name": "skip_b",
        "match": "2.*",
        "actions": [{"action": "skip_step_on_nonfinite", "max_consecutive_skips": 1}],
    }
    escalated = tmp_path / "escalated.jsonl"
    counters, halt = train(escalated, [skip_a, skip_b], nan_at={12, 13}, steps=30)
    assert halt is None
    assert counters["skip_b"]["rewind"] == 1
    assert counters["skip_a"]["skip_step_on_nonfinite"] == 2  # step 12's skip event, and step 13 inside the rewind
    data = audit_json(escalated)
    assert data["totals"] == counters
    assert data["mismatches_total"] == 0
    (row,) = data["rewinds"]
    assert (row["step"], row["to_step"], row["rule"]) == (13, 10, "skip_b")
    assert row["reason"].startswith("skip limit exceeded")

    halt_a = {"name": "halt_a", "match": "2.*", "actions": [{"action": "halt_on_nonfinite"}]}
    halt_b = {"name": "halt_b", "match": "0.*", "actions": [{"action": "halt_on_nonfinite"}]}
    too_early = tmp_path / "too-early.jsonl"
    counters, halt = train(too_early, [halt_a, halt_b], nan_at={2})
    assert halt is not None
    assert halt.reason is not None
    assert halt.reason.startswith("recovery: no snapshot at least 3 steps older")
    assert counters["halt_a"]["halt_on_nonfinite"] == counters["halt_b"]["halt_on_nonfinite"] == 1
    data = audit_json(too_early)
    assert data["totals"] == counters
    assert data["mismatches_total"] == 0
    assert data["rewinds_total"] == 0
    assert data["halts"][0]["restored_to"] is None


def _line_of(log: Path, kind: str) -> int:
    return next(n for n, line in enumerate(log.read_text().splitlines(), 1) if json.loads(line)["event"] == kind)


# --- synthetic logs: several ranks, filters, damaged lines ------------------------------------------


def _event(run: str, rank: int, event: str, second: int, **fields: Any) -> str:
    ts = f"2026-11-25T10:00:{second:02d}.000000Z"
    return json.dumps({"ts": ts, "level": "info", "event": event, "run": run, "rank": rank, **fields})


def _rank_log(path: Path, rank: int, *, rewind: dict[str, Any] | None = None) -> Path:
    run = f"run{rank}"
    counts = {"nonfinite": {"nan": 2, "rewind": 1}}
    rewind = rewind or {}
    lines = [
        _event(run, rank, "attach", 0, schema=1, policy="p.yaml", model="Net", params=2, rules={"nonfinite": 2}),
        _event(run, rank, "nonfinite", 1, step=23, rule="nonfinite", param="w", kind="nan", halts=True, skips=False),
        _event(run, rank, "nonfinite", 1, step=23, rule="nonfinite", param="b", kind="nan", halts=True, skips=False),
        _event(
            run,
            rank,
            "rewind",
            1,
            **{
                "step": 23,
                "to_step": 20,
                "rule": "nonfinite",
                "params": ["w", "b"],
                "kinds": {"w": "nan", "b": "nan"},
                "kind": "nan",
                "reason": None,
                "origin": None,
                "rewinds": 1,
                "skip_until": 28,
                "lr_scale": 0.5,
                **rewind,
            },
        ),
        _event(run, rank, "counters", 2, step=39, steps=40, counters=counts),
        _event(run, rank, "detach", 2, reason="removed", steps=40, counters=counts),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_ranks_of_a_distributed_run_rewind_together_in_one_row(tmp_path: Path) -> None:
    """Two ranks' logs with the same rewind: one row naming both ranks; each run's counters kept as its rank's, and
    the totals per step across the ranks (one rewind and its two NaNs, not one per rank)."""
    logs = [_rank_log(tmp_path / f"rank{rank}.jsonl", rank) for rank in (0, 1)]
    data = audit_json(*logs)
    assert data["rewinds_total"] == 1
    (row,) = data["rewinds"]
    assert row["ranks"] == [0, 1]
    assert row["runs"] == ["run0", "run1"]
    assert row["lr_scale"] == 0.5
    assert data["totals"] == {"nonfinite": {"nan": 2, "rewind": 1}}
    assert [run["counters"] for run in data["runs"]] == [{"nonfinite": {"nan": 2, "rewind": 1}}] * 2
    assert [run["rewinds"] for run in data["runs"]] == [1, 1]
    assert data["mismatches_total"] == 0
    assert data["unlearned_steps"] == [[20, 27]]
    _code, out = audit(*logs)
    assert "1 rewind instead of a halt" in out
    assert "rewind 1 of the run; LRs now x0.5; runs run0, run1, ranks 0, 1, at " in out
    assert "rank0.jsonl:4, 2026-11-25T10:00:01.000000Z" in out
    different = _rank_log(tmp_path / "other.jsonl", 2, rewind={"step": 24})
    assert audit_json(*logs, different)["rewinds_total"] == 2  # another fault step is another rewind


def test_filters_narrow_the_rewinds_but_not_the_run_table_or_the_counters(tmp_path: Path) -> None:
    """--since/--until, --rule and --param select rewinds as they select halts; runs and counters keep them all."""
    log = _rank_log(tmp_path / "rank0.jsonl", 0)
    assert audit_json(log, "--since", "23", "--until", "23")["rewinds_total"] == 1
    for args in (["--since", "24"], ["--rule", "other"], ["--param", "x*"]):
        data = audit_json(log, *args)
        assert data["rewinds_total"] == 0, args
        assert data["runs"][0]["rewinds"] == 1
        assert data["totals"]["nonfinite"]["rewind"] == 1
    assert audit_json(log, "--param", "w")["rewinds"][0]["params"] == ["w", "b"]
    overflow = _rank_log(tmp_path / "overflow.jsonl", 0, rewind={"params": [], "kinds": {}, "kind": "overflow"})
    assert audit_json(overflow)["rewinds"][0]["kind"] == "overflow"  # no parameters: shown without --param
    assert audit_json(overflow, "--param", "w")["rewinds_total"] == 0


def test_a_rewind_line_without_its_fields_is_an_unreadable_line_not_a_crash(tmp_path: Path) -> None:
    """A rewind event whose params or rule are missing is reported as an unreadable line; the rest is read."""
    log = _rank_log(tmp_path / "rank0.jsonl", 0, rewind={"params": "w"})
    data = audit_json(log)
    assert data["bad_lines_total"] == 1
    assert "'rewind' event that does not fit its definition" in data["bad_lines"][0]["reason"]
    assert "`$.params`" in data["bad_lines"][0]["reason"]
    assert data["rewinds_total"] == 0
    assert data["runs"][0]["steps"] == 40


def test_markdown_and_plot_show_the_rewinds(tmp_path: Path) -> None:
    """--format markdown has the Rewinds section; --plot shades each rewind's stretch once for all its ranks."""
    logs = [_rank_log(tmp_path / f"rank{rank}.jsonl", rank) for rank in (0, 1)]
    _code, out = audit(*logs, "--format", "markdown")
    assert "### Rewinds (recovery)" in out
    from gradguard.audit.filters import Filters
    from gradguard.audit.plot import PlotCollector
    from gradguard.audit.reader import ReadStats, read_merged

    collector = PlotCollector(Filters(), [], "clip_norm")
    collector.add_all(read_merged(logs, ReadStats()))
    assert collector.rewinds == [(23, 20, 28)]
    pytest.importorskip("matplotlib")
    code, out = audit(*logs, "--plot", tmp_path / "run.png")
    assert code == 1, out
    assert (tmp_path / "run.png").stat().st_size > 0
