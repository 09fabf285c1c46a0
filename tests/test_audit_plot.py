"""``gradguard audit --plot``: a picture of the run, and a clear message where matplotlib is missing."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.synthetic_log import LogBuilder

from gradguard.audit.filters import Filters
from gradguard.audit.plot import PlotCollector, pick_series
from gradguard.audit.reader import ReadStats, read_merged
from gradguard.audit.summarizer import Summarizer
from gradguard.cli import main


def spiky_log(path: Path) -> LogBuilder:
    """Clips on three parameters (one much more often), a group rule, NaN steps skipped, and a halt at 300."""
    with LogBuilder(path) as log:
        log.attach({"nonfinite": 4, "embed": 1, "attn": 2, "global": 4, "skip": 4})
        for step in range(300):
            log.clip(step, "embed", "embed.weight", 1.5 + (step % 40 == 0) * 30)
            if step % 3 == 0:
                log.clip(step, "attn", "attn.q", 2.0)
            if step % 10 == 0:
                log.clip(step, "attn", "attn.k", 4.0)
                log.group_clip(step, "global", ["embed.weight", "attn.q", "attn.k", "head"], 5.0)
            if step in (120, 121):
                log.nonfinite(step, "skip", "head", "nan", skips=True)
                log.skip(step, "skip", ["head"])
            if step % 100 == 99:
                log.counters(step)
        log.nonfinite(300, "nonfinite", "head", "inf", halts=True)
        log.halt(300, "nonfinite", ["head"], "inf")
        log.detach(301)
    return log


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_plot_writes_a_png_of_the_run(tmp_path: Path) -> None:
    """--plot FILE.png writes a real PNG next to the usual report, and says where on stderr."""
    pytest.importorskip("matplotlib")
    log = tmp_path / "run.jsonl"
    spiky_log(log)
    picture = tmp_path / "run.png"
    result = CliRunner().invoke(main, ["audit", str(log), "--plot", str(picture)])
    assert result.exit_code == 1  # the halt
    assert "Counters reproduced from the log" in result.stdout
    assert f"plot written to {picture}" in result.stderr
    width, height = png_size(picture)
    assert width > 800
    assert height > 600


def test_the_plot_shows_the_most_affected_series_with_skips_and_halts(tmp_path: Path) -> None:
    """The series drawn are the most-clipped ones; the skips and the halt are among the marks."""
    log = tmp_path / "run.jsonl"
    spiky_log(log)
    stats = ReadStats()
    summarizer = Summarizer([str(log)], stats)
    summarizer.add_all(read_merged([log], stats))
    summary = summarizer.summary()
    series, action = pick_series(summary, 3)
    assert (series, action) == (["embed.weight", "attn.q", "attn.k"], "clip_norm")
    collector = PlotCollector(Filters(), series, action)
    collector.add_all(read_merged([log], ReadStats()))
    xs, before, after, _ = collector.norms["embed.weight"].points()
    assert len(xs) == 300
    assert max(before) == pytest.approx(31.5)
    assert max(after) == pytest.approx(1.0, rel=1e-3)
    assert collector.halts == [(300, "nonfinite")]
    assert collector.skips.points()[0] == [120.0, 121.0]
    assert sorted(collector.per_rule) == ["attn", "embed", "global"]


def test_long_runs_are_binned_into_a_bounded_number_of_points(tmp_path: Path) -> None:
    """A series of many steps is kept in at most MAX_BINS bins, each holding the largest norm it saw."""
    from gradguard.audit.plot import MAX_BINS, _Bins

    bins = _Bins()
    for step in range(10 * MAX_BINS):
        bins.add(step, float(step % 977), 1.0)
    xs, largest, _, rate = bins.points()
    assert len(xs) <= MAX_BINS
    assert max(largest) == 976.0
    assert all(value == pytest.approx(1.0) for value in rate[:-1])


def test_without_matplotlib_plot_is_refused_with_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where matplotlib cannot be imported, --plot exits 2 saying how to install the extra; nothing is read."""
    log = tmp_path / "run.jsonl"
    spiky_log(log)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = CliRunner().invoke(main, ["audit", str(log), "--plot", str(tmp_path / "run.png")])
    assert result.exit_code == 2
    assert "error: plotting needs matplotlib: pip install 'gradguard[plot]'" in result.stderr
    assert result.stdout == ""
    assert not (tmp_path / "run.png").exists()


def test_a_plot_file_of_unknown_type_is_a_usage_error(tmp_path: Path) -> None:
    """--plot needs a .png, .svg or .pdf name."""
    log = tmp_path / "run.jsonl"
    spiky_log(log)
    result = CliRunner().invoke(main, ["audit", str(log), "--plot", str(tmp_path / "run.gif")])
    assert result.exit_code == 2
    assert "must end in .png, .svg, .pdf" in result.output
