"""A guard's life: attach, remove (idempotent, leaves nothing behind), context manager, garbage
collection, weak hold on the model, one guard per model."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest
import torch
from torch.optim.optimizer import _global_optimizer_pre_hooks

import gradguard.enforce.hooks.torch_hooks as torch_hooks
from gradguard import GradGuard, GuardStateError, GuardWarning

TINY_CLIP = [{"action": "clip_norm", "max_norm": 1e-3}]


def _guard_hooks(guard=None) -> list:
    """The guards the process-wide optimizer hooks dispatch to (``guard`` only, if given)."""
    live = [ref() for ref in torch_hooks._guards]
    return [g for g in live if g is not None and (guard is None or g is guard)]


def _huge_step(workload, opt) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A step with a gradient far above the clip threshold; returns the gradients before and after it."""
    opt.zero_grad()
    loss = workload.loss(workload.batch(0)) * 1e4
    loss.backward()
    before = {name: p.grad.clone() for name, p in workload.model.named_parameters()}
    opt.step()
    after = {name: p.grad.clone() for name, p in workload.model.named_parameters()}
    return before, after


def test_remove_is_idempotent_and_leaves_no_hook_behind(make_workload, make_policy, same, read_audit, tmp_path):
    """After remove() (called twice), no hook remains, a huge gradient is not clipped and counters stay put."""
    workload = make_workload("mlp")
    opt = torch.optim.SGD(workload.model.parameters(), lr=1e-6)
    log = tmp_path / "audit.jsonl"
    guard = GradGuard(workload.model, make_policy({"name": "clip", "match": "*", "actions": TINY_CLIP}), audit_log=log)
    assert len(_guard_hooks(guard)) == 1
    hooks_attached = dict(_global_optimizer_pre_hooks)  # gradguard's one dispatcher, registered once
    before, after = _huge_step(workload, opt)
    assert not any(torch.equal(before[name], after[name]) for name in before)  # attached: everything clipped
    counted = guard.counters.snapshot()
    assert counted == {"clip": {"clip_norm": 6}}

    guard.remove()
    guard.remove()
    assert not guard.attached
    assert _guard_hooks(guard) == []
    assert dict(_global_optimizer_pre_hooks) == hooks_attached  # never mutated: another thread may be stepping
    before, after = _huge_step(workload, opt)
    same(after, before)  # removed: the optimizer sees the raw gradient
    assert guard.counters.snapshot() == counted
    assert guard.step_count == 1
    with pytest.raises(GuardStateError):
        guard.step()
    events = read_audit(log)
    assert [event["event"] for event in events].count("detach") == 1
    assert events[-1]["reason"] == "removed"


def test_context_manager_exit_removes_the_guard_even_on_error(make_workload, make_policy):
    """Leaving the with-block removes the guard, also when the block raises."""
    workload = make_workload("mlp")
    policy = make_policy({"match": "*", "actions": TINY_CLIP})
    with GradGuard(workload.model, policy, logger=None) as guard:
        assert guard.attached
        assert _guard_hooks(guard)
    assert not guard.attached
    assert _guard_hooks(guard) == []

    with pytest.raises(KeyError), GradGuard(workload.model, policy, logger=None) as second:
        raise KeyError("boom")
    assert not second.attached
    assert _guard_hooks(second) == []


def test_guard_does_not_keep_the_model_alive(make_workload, make_policy):
    """With the guard still referenced, deleting the model frees it: the guard holds it weakly."""
    workload = make_workload("decoder")
    model_ref = weakref.ref(workload.model)
    param_ref = weakref.ref(workload.model.embed.weight)
    guard = GradGuard(workload.model, make_policy({"match": "*", "actions": TINY_CLIP}), logger=None)
    del workload
    gc.collect()
    assert model_ref() is None
    assert param_ref() is None
    assert guard.attached  # the guard object is alive and can still be removed cleanly
    guard.remove()


def test_guard_garbage_collected_while_its_model_trains_on_unhooks_itself_and_warns_at_the_next_backward(
    make_workload, make_policy, same, read_audit, tmp_path
):
    """A guard dropped while attached unhooks itself and logs a garbage-collected detach; the model's next
    backward (it trains on, unguarded) emits one GuardWarning."""
    workload = make_workload("mlp")
    opt = torch.optim.SGD(workload.model.parameters(), lr=1e-6)
    log = tmp_path / "audit.jsonl"
    guard = GradGuard(workload.model, make_policy({"match": "*", "actions": TINY_CLIP}), audit_log=log, logger=None)
    guard_ref = weakref.ref(guard)
    del guard  # the last reference: freed at once, no gc.collect() needed; no warning yet
    assert guard_ref() is None
    assert _guard_hooks() == []
    with pytest.warns(GuardWarning, match="MLP was garbage-collected while still attached") as caught:
        before, after = _huge_step(workload, opt)
    assert len(caught) == 1
    same(after, before)
    _huge_step(workload, opt)  # once only: a second backward is quiet (filterwarnings turns a warning into an error)
    assert read_audit(log)[-1]["reason"] == "garbage-collected"
    # A new guard on the same model is welcome: the collected one no longer claims it.
    with GradGuard(workload.model, make_policy({"match": "*", "actions": TINY_CLIP}), logger=None) as again:
        assert again.attached


def test_second_guard_on_the_same_model_is_refused_unless_replace(make_workload, make_policy, make_optimizer, same):
    """A second guard raises GuardStateError; replace=True removes the first, so a 0.5 scale applies once."""
    workload = make_workload("mlp")
    reference = workload.clone()
    policy = make_policy({"name": "half", "match": "*", "actions": [{"action": "scale", "factor": 0.5}]})
    first = GradGuard(workload.model, policy, logger=None)
    try:
        with pytest.raises(GuardStateError, match="already has a GradGuard"):
            GradGuard(workload.model, policy, logger=None)
        assert first.attached
        second = GradGuard(workload.model, policy, logger=None, replace=True)
    finally:
        first.remove()
    with second:
        assert not first.attached
        assert second.attached
        assert _guard_hooks(first) == []
        assert len(_guard_hooks(second)) == 1
        opts = [make_optimizer("sgd_plain", side.model.parameters()) for side in (workload, reference)]
        for side in (workload, reference):
            side.backward(0)
        for p in reference.model.parameters():
            p.grad.mul_(0.5)
        for opt in opts:
            opt.step()
        same(dict(workload.model.named_parameters()), dict(reference.model.named_parameters()))
        assert second.counters.snapshot() == {"half": {"scale": 6}}
        assert first.counters.snapshot() == {}


def test_guards_on_different_models_coexist(make_workload, make_policy):
    """One guard per model: guards on two different models are both attached and each treats its own."""
    a, b = make_workload("mlp", seed=1), make_workload("mlp", seed=2)
    policy = make_policy({"name": "half", "match": "*", "actions": [{"action": "scale", "factor": 0.5}]})
    with GradGuard(a.model, policy, logger=None) as guard_a, GradGuard(b.model, policy, logger=None) as guard_b:
        a.backward(0)
        torch.optim.SGD(a.model.parameters(), lr=0.1).step()
        assert guard_a.counters.snapshot() == {"half": {"scale": 6}}
        assert guard_b.counters.snapshot() == {}


def test_a_guard_and_its_model_dropped_together_at_the_end_of_a_run_are_quiet(make_workload, make_policy):
    """The three-line attach in the function that builds the model and trains it (timm's train.py, nanoGPT's):
    when that function returns, guard and model go together, and nothing warns."""

    def main() -> weakref.ReferenceType[torch.nn.Module]:
        workload = make_workload("mlp")
        opt = torch.optim.SGD(workload.model.parameters(), lr=1e-3)
        guard = GradGuard(workload.model, make_policy({"match": "*", "actions": TINY_CLIP}), logger=None)  # noqa: F841
        _huge_step(workload, opt)
        return weakref.ref(workload.model)

    model_ref = main()  # filterwarnings turns a GuardWarning into an error
    gc.collect()
    assert model_ref() is None


def test_a_guard_still_attached_at_interpreter_exit_is_quiet(tmp_path):
    """A script that never removes its guard ends without a warning (the guard covered the whole run)."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "from gradguard import GradGuard, Policy\n"
        "model = torch.nn.Linear(4, 1)\n"
        "guard = GradGuard(model, Policy.shipped('default'), logger=None)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    opt.zero_grad(); model(torch.randn(2, 4)).sum().backward(); opt.step()\n"
        "print('done', guard.step_count)\n"
    )
    run = subprocess.run(
        [sys.executable, "-W", "error::gradguard.GuardWarning", str(script)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "done 3"
    assert "GuardWarning" not in run.stderr
