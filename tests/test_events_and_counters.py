"""The audit log and the counters: valid JSON lines with the documented fields, and counts that add up.

Logs are read after the guard is removed (removal closes, and so flushes, the audit file), or after a
halt (the guard flushes before raising), or after the writing process was killed.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import structlog
import torch
import yaml
from structlog.testing import capture_logs

from gradguard import Counters, GradGuard, GradientHalt, Policy

COMMON = {"ts", "level", "event", "run", "rank"}

POLICY_YAML = """\
version: 1
rules:
  - name: halt
    match: "*"
    actions: [{action: halt_on_nonfinite}]
  - name: per-tensor
    match: "hidden.*"
    actions: [{action: clip_norm, max_norm: 1.0}]
  - name: group
    match: "out.*"
    actions: [{action: clip_norm, max_norm: 1.0, scope: group, norm_type: .inf}]
  - name: values
    match: "inp.*"
    actions:
      - {action: clip_value, limit: 0.1}
      - {action: scale, factor: 0.5}
"""


def _log_counts(events) -> dict[str, dict[str, int]]:
    """Counters rebuilt from per-step events: interventions, non-finite detections and halts."""
    counts: Counter[tuple[str, str]] = Counter()
    for event in events:
        if event["event"] == "intervention":
            counts[event["rule"], event["action"]] += event.get("n_params") or 1
        elif event["event"] == "nonfinite":
            counts[event["rule"], event["kind"]] += 1
        elif event["event"] == "halt":
            counts[event["rule"], "halt_on_nonfinite"] += 1
    out: dict[str, dict[str, int]] = {}
    for (rule, action), count in counts.items():
        out.setdefault(rule, {})[action] = count
    return out


def _merge(*parts: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for part in parts:
        for rule, by_action in part.items():
            out.setdefault(rule, {}).update(by_action)
    return out


def _train_with_twin(make_workload, guard_kwargs, policy, steps, *, poison_last=False):
    """Train a guarded MLP for ``steps`` steps (the last one poisoned if asked); return the raw gradients seen."""
    workload = make_workload("mlp")
    opt = torch.optim.SGD(workload.model.parameters(), lr=0.01)
    raw: list[dict[str, torch.Tensor]] = []
    guard = GradGuard(workload.model, policy, **guard_kwargs)
    halt = None
    for step in range(steps):
        opt.zero_grad()
        workload.backward(step)
        if poison_last and step == steps - 1:
            workload.model.hidden.bias.grad[0] = float("nan")
        raw.append({name: p.grad.clone() for name, p in workload.model.named_parameters()})
        try:
            opt.step()
        except GradientHalt as exc:
            halt = exc
    return guard, raw, halt


def test_audit_log_is_valid_json_lines_with_the_documented_fields(make_workload, read_audit, tmp_path):
    """Every line is strict JSON; attach, intervention, counters, halt and detach carry their documented fields."""
    policy_path = tmp_path / "policy.yaml"
    policy_path.write_text(POLICY_YAML)
    log = tmp_path / "audit.jsonl"
    guard, raw, halt = _train_with_twin(
        make_workload,
        {"audit_log": log, "logger": None, "summary_every": 2},
        Policy.from_file(policy_path),
        4,
        poison_last=True,
    )
    assert halt is not None
    run_id = guard.run_id
    guard.remove()
    events = read_audit(log)

    for event in events:
        assert set(event) >= COMMON, event
        stamp = datetime.datetime.fromisoformat(event["ts"])
        assert stamp.utcoffset() == datetime.timedelta(0)
        assert event["run"] == run_id
        assert event["rank"] == 0
    kinds = [event["event"] for event in events]
    assert kinds[0] == "attach"
    assert kinds[-1] == "detach"
    levels = {event["event"]: event["level"] for event in events}
    assert levels == {
        "attach": "info",
        "intervention": "debug",
        "counters": "info",
        "nonfinite": "info",
        "halt": "error",
        "detach": "info",
    }

    attach = events[0]
    assert attach["schema"] == 1
    assert attach["policy"] == str(policy_path)
    assert attach["model"] == "SmallMLP"
    assert isinstance(attach["boundary"], str)
    assert attach["params"] == 6
    assert attach["rules"] == {"halt": 6, "per-tensor": 2, "group": 2, "values": 2}
    assert attach["pid"] == os.getpid()

    interventions = [event for event in events if event["event"] == "intervention"]
    assert {event["step"] for event in interventions} == {0, 1, 2}  # the halted step 3 applied nothing
    for event in interventions:
        grads = raw[event["step"]]
        if event["rule"] == "per-tensor":
            assert event["action"] == "clip_norm"
            assert event["scope"] == "tensor"
            assert event["norm_type"] == 2.0
            assert event["max_norm"] == 1.0
            assert event["before"] == float(torch.linalg.vector_norm(grads[event["param"]]))  # torch's norm, exactly
            assert event["before"] > 1.0
            assert event["after"] == pytest.approx(1.0, abs=1e-5)
            assert event["coef"] == pytest.approx(1.0 / (event["before"] + 1e-6), rel=1e-6)
        elif event["rule"] == "group":
            assert event["param"] is None
            assert event["params"] == ["out.weight", "out.bias"]
            assert event["n_params"] == 2
            assert event["scope"] == "group"
            assert event["norm_type"] == "Infinity"  # a non-finite number is written as a string, not dropped
            peak = max(float(grads[name].abs().max()) for name in ("out.weight", "out.bias"))
            assert event["before"] == peak
            assert event["after"] == pytest.approx(1.0, abs=1e-5)
        else:
            assert event["rule"] == "values"
            assert event["action"] == "clip_value"
            assert event["limit"] == 0.1
            assert event["before"] == float(grads[event["param"]].abs().max())
            assert event["after"] == 0.1

    counters = [event for event in events if event["event"] == "counters"]
    assert [(event["step"], event["steps"]) for event in counters[:1]] == [(1, 2)]
    assert all(isinstance(event["counters"], dict) for event in counters)

    (halt_event,) = [event for event in events if event["event"] == "halt"]
    assert halt_event["step"] == 3
    assert halt_event["rule"] == "halt"
    assert halt_event["params"] == ["hidden.bias"]
    assert halt_event["kinds"] == {"hidden.bias": "nan"}
    assert halt_event["kind"] == "nan"
    assert halt_event["counters"]["halt"]["halt_on_nonfinite"] == 1

    detach = events[-1]
    assert detach["reason"] == "removed"
    assert detach["steps"] == 4
    assert detach["counters"] == guard.counters.snapshot()


def test_a_clip_that_changed_nothing_is_not_logged_or_counted(make_workload, make_policy, read_audit, tmp_path):
    """clip_norm and clip_value whose threshold is never exceeded write no intervention and count nothing."""
    log = tmp_path / "audit.jsonl"
    policy = make_policy(
        {"match": "*", "actions": [{"action": "clip_norm", "max_norm": 1e6}, {"action": "clip_value", "limit": 1e6}]},
        {"match": "out.*", "actions": [{"action": "clip_norm", "max_norm": 1e6, "scope": "group"}]},
    )
    guard, _, _ = _train_with_twin(make_workload, {"audit_log": log, "logger": None}, policy, 3)
    assert guard.step_count == 3
    guard.remove()
    assert guard.counters.snapshot() == {}
    assert [event["event"] for event in read_audit(log)] == ["attach", "counters", "detach"]


def test_scale_and_zero_are_counted_every_step_but_not_logged_per_step(
    make_workload, make_policy, read_audit, tmp_path
):
    """scale and zero count every (parameter, step) pair; only the counters events carry them."""
    log = tmp_path / "audit.jsonl"
    policy = make_policy(
        {"name": "slow", "match": "inp.*", "actions": [{"action": "scale", "factor": 0.5}]},
        {"name": "frozen", "match": "out.*", "actions": [{"action": "zero"}]},
    )
    guard, _, _ = _train_with_twin(make_workload, {"audit_log": log, "logger": None, "summary_every": 2}, policy, 5)
    guard.remove()
    expected = {"slow": {"scale": 10}, "frozen": {"zero": 10}}
    assert guard.counters.snapshot() == expected
    events = read_audit(log)
    assert not [event for event in events if event["event"] == "intervention"]
    counters = [event for event in events if event["event"] == "counters"]
    assert [event["steps"] for event in counters] == [2, 4, 5]
    assert counters[0]["counters"] == {"slow": {"scale": 4}, "frozen": {"zero": 4}}
    assert counters[-1]["counters"] == expected


def test_counts_rebuilt_from_the_log_equal_the_counters(make_workload, read_audit, tmp_path):
    """Intervention, nonfinite and halt events plus the last counters event reproduce guard.counters.snapshot()."""
    log = tmp_path / "audit.jsonl"
    guard, _, halt = _train_with_twin(
        make_workload,
        {"audit_log": log, "logger": None, "summary_every": 3},
        Policy.from_dict(yaml.safe_load(POLICY_YAML)),
        7,
        poison_last=True,
    )
    assert halt is not None
    guard.remove()
    snapshot = guard.counters.snapshot()
    events = read_audit(log)
    last_counters = [event for event in events if event["event"] == "counters"][-1]["counters"]
    assert last_counters == snapshot
    per_step = _log_counts(events)
    unlogged = {
        rule: {"scale": by_action["scale"]} for rule, by_action in last_counters.items() if "scale" in by_action
    }
    assert _merge(per_step, unlogged) == snapshot
    assert snapshot["values"]["scale"] == 2 * 6  # two parameters, six applied steps


def test_snapshot_is_a_copy():
    """Changing a snapshot changes neither the counters nor a later snapshot."""
    counters = Counters()
    counters.add("rule", "clip_norm", 2)
    snapshot = counters.snapshot()
    snapshot["rule"]["clip_norm"] = 99
    snapshot["other"] = {"zero": 1}
    assert counters.snapshot() == {"rule": {"clip_norm": 2}}
    assert counters.total() == 2


def test_counters_are_exact_under_eight_threads_at_once():
    """Eight threads adding at once (add and add_many), with snapshots taken meanwhile, lose no count."""
    counters = Counters()
    threads_n, rounds = 8, 5000
    start = threading.Barrier(threads_n + 1, timeout=60)
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible

    def hammer(index: int) -> None:
        start.wait()
        for i in range(rounds):
            counters.add("shared", "clip_norm")
            counters.add(f"own-{index}", "scale", 2)
            if i % 10 == 0:
                counters.add_many([("shared", "zero", 1), ("shared", "clip_norm", 0)])

    def snapshots() -> None:
        start.wait()
        for _ in range(200):
            taken = counters.snapshot()
            assert taken.get("shared", {}).get("clip_norm", 0) >= taken.get("shared", {}).get("zero", 0)

    try:
        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(threads_n)]
        threads.append(threading.Thread(target=snapshots))  # the barrier's last party
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
            assert not thread.is_alive()
    finally:
        sys.setswitchinterval(old_interval)
    final = counters.snapshot()
    assert final["shared"] == {"clip_norm": threads_n * rounds, "zero": threads_n * rounds // 10}
    assert all(final[f"own-{i}"] == {"scale": 2 * rounds} for i in range(threads_n))
    assert counters.total("clip_norm") == threads_n * rounds


def _structlog_state():
    config = structlog.get_config()
    return structlog.is_configured(), {
        key: list(value) if isinstance(value, list) else value for key, value in config.items()
    }


def test_library_never_configures_structlog(make_workload, make_policy, capsys):
    """Attaching, stepping, halting and removing leave structlog's configuration exactly as it was."""
    before = _structlog_state()
    processors = list(structlog.get_config()["processors"])
    workload = make_workload("mlp")
    policy = make_policy(
        {"name": "halt", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
        {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.01}]},
    )
    with GradGuard(workload.model, policy) as guard:  # the default logger: structlog.get_logger("gradguard")
        opt = torch.optim.SGD(workload.model.parameters(), lr=0.01)
        workload.backward(0)
        opt.step()
        opt.zero_grad()
        workload.backward(1)
        workload.model.out.bias.grad[0] = float("nan")
        with pytest.raises(GradientHalt):
            opt.step()
        assert guard.counters.total("clip_norm") > 0
    after = _structlog_state()
    assert after == before
    assert [id(p) for p in structlog.get_config()["processors"]] == [id(p) for p in processors]
    if not before[0]:  # unconfigured structlog prints to stdout: only warnings and errors are sent there
        out = capsys.readouterr().out
        assert "halt" in out
        assert "intervention" not in out


def test_structlog_capture_logs_sees_halt_events(make_workload, make_policy):
    """structlog.testing.capture_logs() receives the halt event with its level and parameters."""
    was_configured, config = _structlog_state()
    workload = make_workload("mlp")
    policy = make_policy({"name": "halt", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]})
    try:
        with capture_logs() as logs, GradGuard(workload.model, policy):
            workload.backward(0)
            workload.model.inp.weight.grad[0, 0] = float("inf")
            with pytest.raises(GradientHalt):
                torch.optim.SGD(workload.model.parameters(), lr=0.1).step()
    finally:
        if was_configured:
            structlog.configure(**config)
        else:
            structlog.reset_defaults()  # capture_logs() itself marks structlog as configured
    halts = [entry for entry in logs if entry["event"] == "halt"]
    assert len(halts) == 1
    assert halts[0]["log_level"] == "error"
    assert halts[0]["params"] == ["inp.weight"]
    assert halts[0]["kind"] == "inf"
    assert {entry["event"] for entry in logs} >= {"attach", "nonfinite", "halt", "detach"}


# --- the audit file survives a killed process ------------------------------------------------------

CHILD = """\
import json, os, signal, sys
import torch
from torch import nn
from gradguard import GradGuard, GradientHalt, Policy

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
policy = Policy.from_dict({"version": 1, "rules": [
    {"name": "halt", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
    {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.01}]},
    {"name": "values", "match": "*.weight", "actions": [{"action": "clip_value", "limit": 0.001}]},
]})
guard = GradGuard(model, policy, audit_log=sys.argv[1], logger=None)
mode = sys.argv[2]
step = 0
while True:
    x = torch.randn(16, 8)
    if mode == "halt-then-kill" and step == 5:
        x[0, 0] = float("nan")
    opt.zero_grad()
    model(x).pow(2).sum().backward()
    try:
        opt.step()
    except GradientHalt as exc:
        print(json.dumps({"counters": guard.counters.snapshot(), "params": list(exc.params), "step": exc.step}))
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    print(step, flush=True)
    step += 1
"""


def _child(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], Path]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    log = tmp_path / "killed.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, str(script), str(log), mode], stdout=subprocess.PIPE, text=True, env=env
    )
    return process, log


def test_audit_lines_are_complete_after_the_process_kills_itself_after_a_halt(read_audit, tmp_path):
    """A process that halts and then SIGKILLs itself leaves every line whole, up to and including the halt."""
    process, log = _child(tmp_path, "halt-then-kill")
    out, _ = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL
    report = json.loads(out.splitlines()[-1])
    events = read_audit(log)  # every line parses, and the last one is complete
    assert events[0]["event"] == "attach"
    assert events[-1]["event"] == "halt"  # no detach: the process never got to say goodbye
    assert events[-1]["params"] == report["params"]
    assert events[-1]["step"] == report["step"] == 5
    assert {event["step"] for event in events if event["event"] == "intervention"} == set(range(5))
    assert _log_counts(events) == report["counters"]


def test_audit_lines_are_complete_when_the_process_is_killed_mid_training(read_audit, tmp_path):
    """SIGKILL from outside while the guard writes every step: no torn line, no hole in the steps."""
    process, log = _child(tmp_path, "train-forever")
    assert process.stdout is not None
    deadline = time.monotonic() + 60
    steps_done = -1
    while steps_done < 30 and time.monotonic() < deadline:
        steps_done = int(process.stdout.readline())
    while (not log.exists() or log.stat().st_size < 4096) and time.monotonic() < deadline:
        time.sleep(0.01)
    # The premise, held (the deadline is a hang guard): 30 steps trained and 4 KiB of lines written before the kill.
    assert steps_done >= 30, f"the child trained {steps_done + 1} steps before the deadline"
    assert log.exists(), "the child wrote no line before the deadline"
    assert log.stat().st_size >= 4096, "the child wrote no 4 KiB of lines before the deadline"
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL
    events = read_audit(log)
    assert events[0]["event"] == "attach"
    steps = sorted({event["step"] for event in events if event["event"] == "intervention"})
    assert steps == list(range(len(steps)))  # lines are written in order: a prefix of the steps, no hole
    assert len(steps) >= 1
