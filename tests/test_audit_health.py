"""gradguard audit's "Gradient health": from a real guarded training loop's log, filters, formats and --plot."""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from gradguard import GradGuard
from gradguard.audit.health import EXACT_SAMPLES, LogHistogram
from gradguard.cli import main


class _Crushed(nn.Module):
    """A residual layer whose output is scaled by ``gain``: its own gradient vanishes while ``gain`` is tiny."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gain * self.linear(x.detach())


@pytest.fixture
def health_log(tmp_path: Path, make_policy) -> Path:
    """A real run: 30 steps of SGD, a clip, a monitor of every module every 2 steps, a layer crushed on 10-19."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), _Crushed(16), nn.Linear(16, 1))
    rules = [
        {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.5}]},
        {
            "name": "health",
            "match": "*",
            "actions": [
                {
                    "action": "monitor",
                    "every": 2,
                    "scope": "module",
                    "stats": ["norm", "max_abs"],
                    "vanishing_below": 1e-6,
                }
            ],
        },
    ]
    log = tmp_path / "run.jsonl"
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradGuard(model, make_policy(*rules), audit_log=log, logger=None):
        for step in range(30):
            model[1].gain = 1e-9 if 10 <= step < 20 else 1.0
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
            opt.step()
    return log


def _audit(*args: str) -> dict:
    result = CliRunner().invoke(main, ["audit", *args, "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _recorded(log: Path, module: str, stat: str, since: int = 0) -> list[tuple[int, float]]:
    events = [json.loads(line) for line in log.read_text().splitlines()]
    return [(e["step"], e["figures"][stat][module]) for e in events if e["event"] == "stats" and e["step"] >= since]


def test_health_rows_give_first_last_min_median_max_of_every_recorded_figure(health_log: Path):
    """Each (rule, module, stat) row is exactly first, last, min, median and max of the logged figures."""
    data = _audit(str(health_log))
    rows = {(r["rule"], r["name"], r["stat"]): r for r in data["health"]}
    assert set(rows) == {("health", m, s) for m in ("0", "1", "2") for s in ("norm", "max_abs")}
    for (_, module, stat), row in rows.items():
        recorded = _recorded(health_log, module, stat)
        values = [v for _, v in recorded]
        assert row["samples"] == 15
        assert (row["first_step"], row["last_step"]) == (0, 28)
        assert (row["first"], row["last"]) == (values[0], values[-1])
        assert (row["min"], row["max"]) == (min(values), max(values))
        assert row["median"] == statistics.median(values)
        assert row["median_exact"] is True


def test_the_crushed_layer_is_listed_as_vanishing_with_the_steps_it_vanished_and_recovered(health_log: Path):
    """The flag row names module 1, vanishing from step 10 to its recovery at step 20, and the audit counts it."""
    data = _audit(str(health_log))
    (flag,) = data["health_flags"]
    assert (flag["rule"], flag["name"], flag["kind"], flag["times"]) == ("health", "1", "vanishing", 1)
    assert flag["episodes"] == [[10, 20]]
    assert flag["threshold"] == 1e-6
    assert flag["worst"] < 1e-6
    assert data["totals"]["health"] == {"vanishing": 1}
    assert not data["mismatches"]


def test_filters_narrow_the_health_section(health_log: Path):
    """--since/--until narrow the steps, --param the modules, --rule the rules."""
    data = _audit(str(health_log), "--since", "20", "--param", "1")
    rows = {(r["name"], r["stat"]): r for r in data["health"]}
    assert set(rows) == {("1", "norm"), ("1", "max_abs")}
    values = [v for _, v in _recorded(health_log, "1", "norm", since=20)]
    assert rows[("1", "norm")]["samples"] == len(values) == 5
    assert rows[("1", "norm")]["min"] == min(values)
    assert data["health_flags"] == []  # the vanishing began at step 10, before --since
    assert _audit(str(health_log), "--rule", "clip")["health"] == []


def test_table_and_markdown_show_the_gradient_health_section(health_log: Path):
    """The text and markdown reports have a Gradient health section naming the vanishing module."""
    text = CliRunner().invoke(main, ["audit", str(health_log)]).output
    assert "Gradient health" in text
    assert "vanishing: 1 (rule 'health', threshold 1e-06" in text
    assert "from step 10 to 20" in text
    markdown = CliRunner().invoke(main, ["audit", str(health_log), "--format", "markdown"]).output
    assert "### Gradient health" in markdown
    assert "| health | module | 1 | norm |" in markdown


def test_plot_draws_the_recorded_norms_per_module(health_log: Path, tmp_path: Path):
    """--plot adds a panel with one recorded-norm curve per module, on a log scale, and writes the picture."""
    from gradguard.audit.command import plot_files  # noqa: F401 - the command path the CLI takes
    from gradguard.audit.filters import Filters
    from gradguard.audit.plot import PlotCollector, pick_health
    from gradguard.audit.reader import ReadStats, read_merged

    summary_json = _audit(str(health_log))
    assert summary_json["health"]
    picture = tmp_path / "run.png"
    result = CliRunner().invoke(main, ["audit", str(health_log), "--plot", str(picture)])
    assert result.exit_code == 0, result.output
    assert picture.stat().st_size > 10_000

    from gradguard.audit.summarizer import Summarizer

    stats = ReadStats()
    summarizer = Summarizer([str(health_log)], stats)
    summarizer.add_all(read_merged([health_log], stats))
    summary = summarizer.summary()
    keys = pick_health(summary, 8)
    assert sorted(keys) == [("health", "0"), ("health", "1"), ("health", "2")]
    collector = PlotCollector(Filters(), [], "clip_norm", health=keys)
    collector.add_all(read_merged([health_log], ReadStats()))
    xs, norms, _, _ = collector.health[("health", "1")].points()
    recorded = _recorded(health_log, "1", "norm")
    assert xs == [float(step) for step, _ in recorded]
    assert norms == [value for _, value in recorded]
    assert collector.clip_thresholds == {"clip": 0.5}


def test_the_streaming_median_stays_within_1_2_percent_in_bounded_memory():
    """Past the exact samples the median comes from log-scale bins: within 1.2%, with at most a few hundred bins."""
    values = [10 ** (k / 1000.0 - 3.0) for k in range(6001)]  # 1e-3 .. 1e3, 6001 values
    histogram = LogHistogram()
    for value in values:
        histogram.add(value)
    assert histogram.exact is None
    assert len(values) > EXACT_SAMPLES
    assert histogram.median() == pytest.approx(statistics.median(values), rel=0.012)
    assert len(histogram.bins) <= 601


@pytest.mark.parametrize("steps", [3, 256, 257, 300, 1500])
def test_a_block_of_monitor_figures_adds_to_each_series_what_adding_them_one_by_one_would(steps: int):
    """``_Block.flush`` takes the whole block's finite columns at once: the series (first, last, smallest, largest,
    non-finite count, exact values or bins) must be those that adding each figure alone gives, with columns that
    hold a NaN or an Inf, columns of zeros and negatives, and blocks that take a series past its exact samples."""
    import struct

    from gradguard.audit.health import _Block, _Series

    rng = random.Random(steps)
    width = 7
    specials = {2: math.nan, 4: math.inf, 5: -math.inf}

    def figure(row: int, column: int) -> float:
        if column in specials and row % 11 == 3:
            return specials[column]
        if column == 6:
            return 0.0 if row % 2 else -(10 ** rng.uniform(-35, 35))
        return 10 ** rng.uniform(-8, 8) * (1 if column % 3 else -1)

    table = [[figure(row, column) for column in range(width)] for row in range(steps)]
    expected = [_Series(table[0][column], 0) for column in range(width)]
    for column, series in enumerate(expected):
        for row in range(steps):
            series.add(table[row][column], row)
    block_series = [_Series(table[0][column], 0) for column in range(width)]
    for column, series in enumerate(block_series):
        series.add(table[0][column], 0)
    block = _Block([f"p{column}" for column in range(width)], block_series, list(range(width)))
    for row in range(1, steps):
        block.add(struct.pack(f"{width}d", *table[row]), row)
    block.flush()
    for got, want in zip(block_series, expected, strict=True):
        assert (got.last_step, got.low, got.high) == (want.last_step, want.low, want.high)
        assert got.nonfinite == want.nonfinite
        assert got.last == want.last or (math.isnan(got.last) and math.isnan(want.last))
        assert got.median.count == want.median.count
        assert got.median.exact == want.median.exact
        assert got.median.bins == want.median.bins
        assert got.median.median() == want.median.median()
