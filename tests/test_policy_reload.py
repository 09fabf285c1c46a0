"""Hot reload of the policy: a changed file takes over at the next step boundary, a bad one changes nothing."""

from __future__ import annotations

import json
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from support.training import SmallMLP, events_of, mlp_pair

from gradguard import GradGuard, GuardWarning


def write_policy(path: Path, *rules: dict[str, Any]) -> Path:
    path.write_text(json.dumps({"version": 1, "rules": list(rules)}))
    return path


def clip(max_norm: float, name: str = "clip") -> dict[str, Any]:
    return {"name": name, "match": "*", "actions": [{"action": "clip_norm", "max_norm": max_norm, "scope": "group"}]}


SKIP = {"name": "skip", "match": "*", "actions": [{"action": "skip_step_on_nonfinite", "max_consecutive_skips": 2}]}


def one_step(model: SmallMLP, opt: torch.optim.Optimizer, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    opt.zero_grad()
    model(torch.randn(6, 8, generator=generator) * 3).pow(2).sum().backward()
    opt.step()


def reference_step(model: SmallMLP, opt: torch.optim.Optimizer, step: int, max_norm: float) -> None:
    generator = torch.Generator().manual_seed(step)
    opt.zero_grad()
    model(torch.randn(6, 8, generator=generator) * 3).pow(2).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
    opt.step()


def test_a_reload_between_steps_switches_the_clip_threshold_at_the_next_step(tmp_path: Path) -> None:
    """guard.reload() after step 1 clips at the new max_norm from step 2 on, bitwise as torch's clip_grad_norm_."""
    path = write_policy(tmp_path / "p.json", clip(1.0))
    log = tmp_path / "log.jsonl"
    model, reference = mlp_pair()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, reference))
    with GradGuard(model, path, logger=None, audit_log=log) as guard:
        for step in range(4):
            if step == 2:
                write_policy(path, clip(0.05))
                assert guard.reload() is True
                assert guard.policy.rules[0].actions[0].max_norm == 1.0  # not before the step boundary
            one_step(model, opt, step)
            reference_step(reference, ref_opt, step, 1.0 if step < 2 else 0.05)
        assert guard.policy.rules[0].actions[0].max_norm == 0.05
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    (event,) = events_of(log, "policy_reload")
    assert (event["step"], event["added"], event["removed"], event["changed"]) == (2, [], [], ["clip"])


def test_a_reload_logs_the_rules_added_removed_and_changed(tmp_path: Path) -> None:
    """Rules are compared by name and content: one added, one removed, one changed, one unchanged (not listed)."""
    keep = {"name": "keep", "match": "out.*", "actions": [{"action": "clip_value", "limit": 10.0}]}
    path = write_policy(tmp_path / "p.json", clip(1.0), keep, {**clip(2.0, "gone")})
    log = tmp_path / "log.jsonl"
    model = SmallMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradGuard(model, path, logger=None, audit_log=log) as guard:
        one_step(model, opt, 0)
        new = write_policy(tmp_path / "q.json", clip(0.5), keep, SKIP)
        assert guard.reload(new)
        one_step(model, opt, 1)
        assert list(guard.guarded["out.bias"]) == ["clip", "keep", "skip"]
    (event,) = events_of(log, "policy_reload")
    assert (event["added"], event["removed"], event["changed"]) == (["skip"], ["gone"], ["clip"])
    assert event["policy"] == str(new)
    assert event["rules"] == {"clip": 6, "keep": 2, "skip": 6}


def nan_step(model: SmallMLP, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(6, 8)).pow(2).sum().backward()
    assert model.out.bias.grad is not None
    model.out.bias.grad[0] = float("nan")
    opt.step()


def test_an_unchanged_skip_rule_keeps_its_history_across_a_reload(tmp_path: Path) -> None:
    """Two skips before a reload that changes another rule, one after: max_consecutive_skips 2 escalates to a halt."""
    from gradguard import GradientHalt

    path = write_policy(tmp_path / "p.json", clip(1.0), SKIP)
    model = SmallMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradGuard(model, path, logger=None) as guard:
        nan_step(model, opt)
        nan_step(model, opt)
        write_policy(path, SKIP, clip(0.5))  # the skip rule moves to index 0: carried over by name
        assert guard.reload()
        with pytest.raises(GradientHalt, match="3 consecutive skipped steps"):
            nan_step(model, opt)


def test_a_changed_skip_rule_starts_a_fresh_history(tmp_path: Path) -> None:
    """A skip rule whose content changed does not inherit the old skips: the third NaN step is skipped, not halted."""
    path = write_policy(tmp_path / "p.json", SKIP)
    model = SmallMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradGuard(model, path, logger=None) as guard:
        nan_step(model, opt)
        nan_step(model, opt)
        changed = {**SKIP, "actions": [{"action": "skip_step_on_nonfinite", "max_consecutive_skips": 1}]}
        write_policy(path, changed)
        assert guard.reload()
        nan_step(model, opt)
        assert guard.last_step_skipped


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"version": 1, "rules": [', "invalid policy"),
        (json.dumps({"version": 1, "rules": [clip(0.5), {**clip(0.1, "ghost"), "match": "nothing.*"}]}), "ghost"),
    ],
    ids=["syntax-error", "rule-matching-nothing"],
)
def test_a_bad_file_keeps_the_old_policy_and_logs_why(tmp_path: Path, content: str, expected: str) -> None:
    """A file that does not parse or bind: reload() is False and warns, the watcher logs it, training goes on."""
    path = write_policy(tmp_path / "p.json", clip(1.0))
    log = tmp_path / "log.jsonl"
    model, reference = mlp_pair()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, reference))
    with GradGuard(model, path, logger=None, audit_log=log, reload=True, reload_interval=0.02) as guard:
        one_step(model, opt, 0)
        path.write_text(content)
        with pytest.warns(GuardWarning, match=expected):
            assert guard.reload() is False
        deadline = time.monotonic() + 5
        while not guard._reloader.slot.ready and time.monotonic() < deadline:
            time.sleep(0.01)  # the watcher noticed the file too
        for step in range(1, 4):
            one_step(model, opt, step)
        guard.flush()
        failures = events_of(log, "policy_reload_failed")
    for step in range(4):
        reference_step(reference, ref_opt, step, 1.0)
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    assert len(failures) == 2  # reload() on demand, then the watcher's own load at step 1
    assert all(expected in event["error"] and event["level"] == "warning" for event in failures)
    assert failures[1]["step"] == 1
    assert not events_of(log, "policy_reload")


def test_reload_true_notices_a_rewritten_file_and_a_later_step_switches(tmp_path: Path) -> None:
    """With reload_interval 0.05 s the watcher has the rewritten file ready, and the step after switches to it (60 s
    is a hang guard, not a speed claim)."""
    path = write_policy(tmp_path / "p.json", clip(1.0))
    model = SmallMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradGuard(model, path, logger=None, reload=True, reload_interval=0.05) as guard:
        one_step(model, opt, 0)
        write_policy(path, clip(0.25))
        started = time.monotonic()
        while guard.policy.rules[0].actions[0].max_norm != 0.25:
            assert time.monotonic() - started < 60, "hung: the rewritten file was never noticed"
            time.sleep(0.02)
            one_step(model, opt, 1)


def test_the_watcher_thread_is_gone_after_remove(tmp_path: Path) -> None:
    """guard.remove() stops and joins the daemon thread that polls the file."""
    path = write_policy(tmp_path / "p.json", clip(1.0))
    guard = GradGuard(SmallMLP(), path, logger=None, reload=True, reload_interval=0.05)
    thread = guard._reloader.thread
    assert thread is not None
    assert thread.is_alive()
    assert thread.daemon
    guard.remove()
    assert not thread.is_alive()
    assert thread not in threading.enumerate()


def test_no_watcher_thread_without_reload_or_for_a_policy_object(tmp_path: Path) -> None:
    """reload=False starts no thread; a Policy object has no file to watch, and reload() needs a path then."""
    from gradguard import Policy

    path = write_policy(tmp_path / "p.json", clip(1.0))
    model = SmallMLP()
    with GradGuard(model, path, logger=None) as guard:
        assert guard._reloader.thread is None
    with GradGuard(model, Policy.from_file(path), logger=None, reload=True) as guard:
        assert guard._reloader.thread is None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert guard.reload() is False
        assert "pass reload(path=...)" in str(caught[0].message)
        assert guard.reload(path)


def test_a_guard_with_a_watcher_is_still_garbage_collected(tmp_path: Path) -> None:
    """The thread holds no reference to the guard: a dropped guard is collected, and its thread stops."""
    import gc
    import weakref

    path = write_policy(tmp_path / "p.json", clip(1.0))
    model = SmallMLP()
    guard = GradGuard(model, path, logger=None, reload=True, reload_interval=0.05)
    thread = guard._reloader.thread
    ref = weakref.ref(guard)
    holder = [guard]
    del guard
    holder.clear()
    gc.collect()
    assert ref() is None
    assert thread is not None
    assert not thread.is_alive()


def test_per_micro_batch_hooks_follow_the_reloaded_policy(tmp_path: Path) -> None:
    """With per_micro_batch=True a reloaded clip_value limit is applied by the hooks during the next backward."""
    limit = {"name": "limit", "match": "*", "actions": [{"action": "clip_value", "limit": 1.0}]}
    path = write_policy(tmp_path / "p.json", limit)
    model = SmallMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with GradGuard(model, path, logger=None, per_micro_batch=True) as guard:
        one_step(model, opt, 0)
        write_policy(path, {**limit, "actions": [{"action": "clip_value", "limit": 1e-3}]})
        assert guard.reload()
        one_step(model, opt, 1)  # the boundary of step 1 switches; its backward ran under the old hooks
        opt.zero_grad()
        model(torch.randn(6, 8) * 3).pow(2).sum().backward()
        peaks = [p.grad.abs().max().item() for p in model.parameters() if p.grad is not None]
        assert max(peaks) <= torch.tensor(1e-3).item()  # the limit as a float32
        assert max(peaks) > 0


def watch(name: str, scope: str, below: float) -> dict[str, Any]:
    return {"name": name, "match": "*", "actions": [{"action": "monitor", "scope": scope, "vanishing_below": below}]}


def test_an_unchanged_monitor_keeps_its_vanishing_flags_and_a_changed_one_warns_again(tmp_path: Path) -> None:
    """Every norm is below 1e6: after a reload that changes only 'fresh', 'kept' does not warn again, 'fresh' does."""
    path = write_policy(tmp_path / "p.json", watch("kept", "group", 1e6), watch("fresh", "group", 1e6))
    log = tmp_path / "log.jsonl"
    model = SmallMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with GradGuard(model, path, logger=None, audit_log=log) as guard:
        one_step(model, opt, 0)
        write_policy(path, watch("fresh", "group", 1e7), watch("kept", "group", 1e6))
        assert guard.reload()
        one_step(model, opt, 1)
        one_step(model, opt, 2)
        metrics = guard.metrics()
    warned = [(event["step"], event["rule"]) for event in events_of(log, "vanishing")]
    assert sorted(warned) == [(0, "fresh"), (0, "kept"), (1, "fresh")]
    assert guard.counters.snapshot()["kept"] == {"vanishing": 1}
    assert guard.counters.snapshot()["fresh"] == {"vanishing": 2}  # counters continue across the reload
    assert "gradguard/kept/norm" in metrics


def test_ranks_that_disagree_on_reload_differ_in_their_attach_fingerprint() -> None:
    """reload=True is part of the options every rank must share: its per-pass collective must be on every rank."""
    from gradguard import Policy
    from gradguard.enforce.distributed.agreement import fingerprint
    from gradguard.policy.matching import bind

    policy = Policy.from_dict({"version": 1, "rules": [clip(1.0)]})
    binding = bind(policy, SmallMLP())
    off, on = (fingerprint(policy, binding, False, 0, reload) for reload in (False, True))
    assert off["options"] == "per_micro_batch=False, start_step=0"
    assert on["options"] == "per_micro_batch=False, start_step=0, reload=True"
