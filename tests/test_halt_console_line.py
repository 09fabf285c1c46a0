"""A halt's console line is short (rule, step, kind, count, first names, origin); the audit log keeps every name."""

from __future__ import annotations

import io
import json
import re

import pytest
import structlog
import torch
from torch import nn

from gradguard import GradGuard, GradientHalt, Policy
from gradguard.errors import origin_sentence

HALT = {"version": 1, "rules": [{"name": "halt", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}]}
LAYERS = 150  # 300 parameters: a weight and a bias per layer


def console_logger(buffer: io.StringIO) -> structlog.typing.FilteringBoundLogger:
    """structlog's default console rendering (level, time stamp, ConsoleRenderer), into ``buffer``, uncoloured."""
    processors = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S", utc=False),
        structlog.dev.ConsoleRenderer(colors=False),
    ]
    logger: structlog.typing.FilteringBoundLogger = structlog.wrap_logger(
        structlog.PrintLogger(buffer), processors=processors
    )
    return logger


def deep_mlp_halt(tmp_path, buffer: io.StringIO, provenance: str | None) -> GradientHalt:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(LAYERS)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard_log = tmp_path / "audit.jsonl"
    with GradGuard(
        model, Policy.from_dict(HALT), audit_log=guard_log, logger=console_logger(buffer), provenance=provenance
    ):
        x = torch.randn(8, 4)
        x[0, 0] = float("nan")  # a NaN in the batch: every gradient goes NaN
        model(x).square().mean().backward()
        with pytest.raises(GradientHalt) as info:
            opt.step()
    return info.value


@pytest.mark.parametrize("provenance", ["first_fault", "after_fault"])
def test_a_300_parameter_halts_console_line_is_short_and_the_audit_log_keeps_every_name(tmp_path, provenance):
    """The console line of a 300-parameter halt is under 800 characters; the JSON line holds all 300 names."""
    buffer = io.StringIO()
    halt = deep_mlp_halt(tmp_path, buffer, provenance)
    (line,) = [line for line in buffer.getvalue().splitlines() if re.search(r"\] halt\s", line)]
    assert len(line) < 800, line
    for shown in ("rule=halt", "step=0", "kind=nan", "count=300", "0.weight", "... and 295 more", "origin="):
        assert shown in line, (shown, line)
    assert "149.bias" not in line
    assert "{'phase'" not in line  # the origin in words, not its dict
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    event = next(e for e in map(json.loads, lines) if e["event"] == "halt")
    assert len(event["params"]) == len(event["kinds"]) == 2 * LAYERS
    assert set(event["params"]) == {f"{i}.{kind}" for i in range(LAYERS) for kind in ("weight", "bias")}
    assert event["counters"]
    assert len(halt.params) == 2 * LAYERS


def test_a_300_parameter_halts_message_names_eight_and_counts_the_rest(tmp_path):
    """GradientHalt's message shows eight names and "and 292 more", and its origin sentence stays short."""
    halt = deep_mlp_halt(tmp_path, io.StringIO(), "first_fault")
    assert "and 292 more" in str(halt)
    assert halt.origin is not None
    assert len(origin_sentence(halt.origin)) < 800
    assert len(str(halt)) < 1500, str(halt)


def test_the_rewind_and_halt_console_lines_say_the_origin_in_words_and_leave_out_empty_fields(tmp_path):
    """No ``reason=None`` and no raw dict: ``origin=`` is the sentence a halt says; the audit log keeps the dict."""
    buffer = io.StringIO()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = {**HALT, "recovery": {"snapshot_every": 2, "min_age": 1, "skip_steps": 1, "max_rewinds": 1}}

    def loop() -> None:
        for step in range(12):
            x = torch.randn(8, 4)
            if step in (5, 9):
                x[0, 0] = float("nan")
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

    guard = GradGuard(model, Policy.from_dict(data), audit_log=tmp_path / "a.jsonl", logger=console_logger(buffer))
    with guard, pytest.raises(GradientHalt):
        loop()
    lines = [line for line in buffer.getvalue().splitlines() if re.search(r"\] (halt|rewind)\s", line)]
    assert len(lines) == 2, buffer.getvalue()
    for line in lines:
        assert "=None" not in line, line
        assert "{'phase'" not in line, line
        assert "origin='It started in the input batch, already nan" in line, line
    logged = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert {e["event"]: e["origin"]["phase"] for e in logged if e["event"] in ("halt", "rewind")} == {
        "halt": "forward",
        "rewind": "forward",
    }
