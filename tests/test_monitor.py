"""The monitor action: figures of the gradient as it arrives, vanishing/exploding warnings, metrics."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from gradguard import GradGuard, Policy, PolicyError
from tests.support.host_syncs import count_host_syncs

ALL_STATS = ["norm", "max_abs", "mean", "std", "grad_to_weight"]


def _clip_then_monitor(**monitor: object) -> list[dict[str, object]]:
    """A clip and a scale that change every gradient, then the monitor, later in policy order."""
    return [
        {
            "name": "clip",
            "match": "*",
            "actions": [{"action": "clip_norm", "max_norm": 1e-3}, {"action": "scale", "factor": 0.5}],
        },
        {"name": "health", "match": "*", "actions": [{"action": "monitor", "stats": ALL_STATS, **monitor}]},
    ]


def _arriving(workload, step: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Run one backward; the gradients (and parameters) as the step receives them, cloned."""
    workload.model.zero_grad()
    workload.backward(step)
    named = dict(workload.model.named_parameters())
    return {n: p.grad.clone() for n, p in named.items()}, {n: p.detach().clone() for n, p in named.items()}


def _stats_events(events: list[dict[str, object]], rule: str) -> list[dict[str, object]]:
    return [e for e in events if e["event"] == "stats" and e["rule"] == rule]


def test_tensor_figures_are_torch_s_own_on_the_gradient_before_any_action(
    make_workload, make_policy, read_audit, tmp_path
):
    """Per-tensor norm, max_abs, mean, std and grad_to_weight equal torch's bit for bit, taken before the clip."""
    work = make_workload("decoder")
    opt = torch.optim.SGD(work.model.parameters(), lr=0.1)
    log = tmp_path / "run.jsonl"
    with GradGuard(work.model, make_policy(*_clip_then_monitor()), audit_log=log) as guard:
        expected = []
        for step in range(3):
            grads, params = _arriving(work, step)
            opt.step()
            expected.append((grads, params))
            assert all(p.grad.norm() <= 1e-3 for p in work.model.parameters())  # the clip did act
        metrics = guard.metrics()
    stats = _stats_events(read_audit(log), "health")
    assert [e["step"] for e in stats] == [0, 1, 2]
    for event, (grads, params) in zip(stats, expected, strict=True):
        figures = event["figures"]
        assert event["scope"] == "tensor"
        for name, g in grads.items():
            assert figures["norm"][name] == float(torch.linalg.vector_norm(g))
            assert figures["max_abs"][name] == float(g.abs().amax())
            assert figures["mean"][name] == float(g.mean())
            assert figures["std"][name] == float(g.std())
            ratio = torch.linalg.vector_norm(g) / torch.linalg.vector_norm(params[name])
            assert float(figures["grad_to_weight"][name]) == float(ratio)  # "Infinity" for a zero bias
    last = stats[-1]["figures"]
    assert {k: v for k, v in metrics.items() if k.startswith("gradguard/health/norm/")} == {
        f"gradguard/health/norm/{name}": value for name, value in last["norm"].items()
    }


def test_group_and_module_figures_are_those_of_the_joined_gradients(make_workload, make_policy, read_audit, tmp_path):
    """Group and module figures equal torch's on the concatenated gradients of the rule or module (float64 sums)."""
    work = make_workload("decoder")
    opt = torch.optim.SGD(work.model.parameters(), lr=0.1)
    log = tmp_path / "run.jsonl"
    rules = [
        {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 1e-3}]},
        {"name": "group", "match": "*", "actions": [{"action": "monitor", "scope": "group", "stats": ALL_STATS}]},
        {
            "name": "modules",
            "match": "*",
            "actions": [{"action": "monitor", "scope": "module", "depth": 2, "stats": ALL_STATS}],
        },
    ]
    with GradGuard(work.model, make_policy(*rules), audit_log=log):
        grads, params = _arriving(work, 0)
        opt.step()
    events = read_audit(log)
    (group,) = _stats_events(events, "group")
    (modules,) = _stats_events(events, "modules")

    def joined(names: list[str]) -> dict[str, float]:
        g = torch.cat([grads[n].double().reshape(-1) for n in names])
        p = torch.cat([params[n].double().reshape(-1) for n in names])
        return {
            "norm": float(g.norm()),
            "peak": float(g.abs().max()),
            "max_abs": float(g.abs().max()),
            "mean": float(g.mean()),
            "std": float(g.std()),
            "grad_to_weight": float(g.norm() / p.norm()),
        }

    def close(got: object, want: dict[str, float], stat: str) -> bool:
        # float32 per-tensor means joined in float64: exact to float32 rounding of the largest element
        return float(got) == pytest.approx(want[stat], rel=1e-5, abs=1e-6 * want["peak"])

    want = joined(list(grads))
    for stat in ALL_STATS:
        assert close(group["figures"][stat], want, stat), stat
    by_module: dict[str, list[str]] = {}
    for name in grads:
        module = ".".join(name.split(".")[:-1][:2]) or "(root)"
        by_module.setdefault(module, []).append(name)
    assert set(modules["figures"]["norm"]) == set(by_module)
    assert "blocks.0" in by_module
    assert "(root)" in by_module  # pos_embed sits on the model itself
    for module, names in by_module.items():
        want = joined(names)
        for stat in ALL_STATS:
            assert close(modules["figures"][stat][module], want, stat), (module, stat)


class _TorchCalls(TorchFunctionMode):
    """Counts torch function calls (what a step computes, seen from Python)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _step_costs(make_workload, policy: Policy, steps: int) -> list[tuple[int, int]]:
    """(host syncs, torch calls) of each optimizer step under ``policy``."""
    work = make_workload("decoder")
    opt = torch.optim.SGD(work.model.parameters(), lr=0.01)
    out = []
    with GradGuard(work.model, policy, logger=None):
        for step in range(steps):
            opt.zero_grad()
            work.backward(step)
            calls = _TorchCalls()
            with calls:
                syncs = count_host_syncs(opt.step)
            out.append((syncs, calls.count))
    return out


def test_monitors_ride_in_the_one_host_sync_and_unsampled_steps_compute_nothing(make_workload, make_policy):
    """One host sync per step with monitors on; on steps every: 10 does not sample, not one torch call more."""
    base = [
        {
            "name": "clip",
            "match": "*",
            "actions": [{"action": "clip_norm", "max_norm": 0.5}, {"action": "halt_on_nonfinite"}],
        }
    ]
    monitors = [
        {
            "name": "tensors",
            "match": "*",
            "actions": [{"action": "monitor", "stats": ALL_STATS, "vanishing_below": 1e-9}],
        },
        {
            "name": "modules",
            "match": "*",
            "actions": [{"action": "monitor", "scope": "module", "every": 10, "stats": ALL_STATS}],
        },
    ]
    sparse = [{"name": "sparse", "match": "*", "actions": [{"action": "monitor", "every": 10, "stats": ALL_STATS}]}]
    with_all = _step_costs(make_workload, make_policy(*base, *monitors), 3)
    without = _step_costs(make_workload, make_policy(*base), 12)
    every_ten = _step_costs(make_workload, make_policy(*base, *sparse), 12)
    assert [syncs for syncs, _ in with_all] == [1, 1, 1]
    assert [syncs for syncs, _ in every_ten] == [1] * 12
    for step, ((_, plain), (_, sampled)) in enumerate(zip(without, every_ten, strict=True)):
        if step % 10 == 0:
            assert sampled > plain  # a sampled step computes the figures
        else:
            assert sampled == plain, step


class _Gain(nn.Module):
    """A linear layer whose output is multiplied by ``gain``: its gradient shrinks or grows with it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gain * self.linear(x.detach())  # the gain reaches this layer's gradient only


def test_vanishing_and_exploding_layers_are_warned_about_once_until_they_recover(make_policy, read_audit, tmp_path):
    """A crushed layer warns 'vanishing' once, a blown-up one 'exploding' once; again only after recovering."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Gain(8), _Gain(8), nn.Linear(8, 1))
    rule = {
        "name": "layers",
        "match": ["1.*", "2.*"],
        "actions": [{"action": "monitor", "scope": "module", "vanishing_below": 1e-6, "exploding_above": 1e3}],
    }
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    log = tmp_path / "run.jsonl"
    # step: gain of layer 1 (vanishing while 1e-9), gain of layer 2 (exploding while 1e6)
    schedule = [(1e-9, 1.0), (1e-9, 1e6), (1e-9, 1e6), (1.0, 1e6), (1.0, 1.0), (1e-9, 1.0), (1e-9, 1.0)]
    with GradGuard(model, make_policy(rule), audit_log=log, logger=None) as guard:
        for step, (low, high) in enumerate(schedule):
            model[1].gain, model[2].gain = low, high
            opt.zero_grad()
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).sum().backward()
            opt.step()
        counts = guard.counters.snapshot()
    events = read_audit(log)
    flagged = [
        (e["event"], e["step"], e["name"]) for e in events if e["event"] in {"vanishing", "exploding", "recovered"}
    ]
    assert flagged == [
        ("vanishing", 0, "1"),
        ("exploding", 1, "2"),
        ("recovered", 3, "1"),
        ("recovered", 4, "2"),
        ("vanishing", 5, "1"),
    ]
    warning = next(e for e in events if e["event"] == "exploding")
    assert warning["level"] == "warning"
    assert warning["threshold"] == 1e3
    assert warning["norm"] > 1e3
    assert warning["rule"] == "layers"
    assert counts == {"layers": {"vanishing": 2, "exploding": 1}}


def test_a_resumed_run_does_not_warn_again_about_a_layer_still_vanishing(make_policy, read_audit, tmp_path):
    """The monitors' flags travel in guard.state_dict(): after a resume, a layer that still vanishes is not
    warned about again; its recovery is reported, as in the uninterrupted run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Gain(8), nn.Linear(8, 1))
    rule = {
        "name": "layers",
        "match": ["1.*"],
        "actions": [{"action": "monitor", "scope": "module", "vanishing_below": 1e-6}],
    }
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def run(guard: GradGuard, gains: list[float]) -> None:
        for step, gain in enumerate(gains):
            model[1].gain = gain
            opt.zero_grad()
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).sum().backward()
            opt.step()

    with GradGuard(model, make_policy(rule), logger=None) as first:
        run(first, [1e-9, 1e-9])
        state = first.state_dict()
    assert state["health"] == [["layers", "module", "1", "vanishing"]]
    log = tmp_path / "resumed.jsonl"
    with GradGuard(model, make_policy(rule), logger=None, audit_log=log) as second:
        second.load_state_dict(state)
        run(second, [1e-9, 1.0])
    flagged = [(e["event"], e["name"]) for e in read_audit(log) if e["event"] in {"vanishing", "recovered"}]
    assert flagged == [("recovered", "1")]


def test_a_nan_gradient_s_figures_are_logged_as_nan_before_the_halt(make_workload, make_policy, read_audit, tmp_path):
    """The monitor logs a NaN figure as "NaN" (never dropped), in the step that halts, before the halt event."""
    from gradguard import GradientHalt

    work = make_workload("mlp")
    rules = [
        {"name": "halt", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
        {
            "name": "health",
            "match": "*",
            "actions": [{"action": "monitor", "stats": ["norm", "mean"], "exploding_above": 1.0}],
        },
    ]
    opt = torch.optim.SGD(work.model.parameters(), lr=0.01)
    log = tmp_path / "run.jsonl"
    with GradGuard(work.model, make_policy(*rules), audit_log=log, logger=None) as guard:
        work.backward(0)
        first = next(iter(work.model.parameters()))
        first.grad[0] = float("nan")
        with pytest.raises(GradientHalt):
            opt.step()
        metrics = guard.metrics()
    events = read_audit(log)
    names = [e["event"] for e in events]
    stats = events[names.index("stats")]
    assert names.index("stats") < names.index("halt")
    (first_name, *_) = [n for n, _ in work.model.named_parameters()]
    assert stats["figures"]["norm"][first_name] == "NaN"
    assert stats["figures"]["mean"][first_name] == "NaN"
    assert math.isnan(metrics[f"gradguard/health/norm/{first_name}"])
    assert not any(e["event"] == "exploding" and e["name"] == first_name for e in events)


def test_metrics_is_a_flat_dict_of_the_last_figures_and_the_counters(make_workload, make_policy):
    """guard.metrics(): gradguard/<rule>/<stat>[/<name>] of the last sampled step, gradguard/<rule>/<action>, steps."""
    work = make_workload("mlp")
    rules = [
        {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 1e-3}]},
        {"name": "g", "match": "*", "actions": [{"action": "monitor", "scope": "group", "every": 2}]},
        {"name": "t", "match": "*.weight", "actions": [{"action": "monitor", "stats": ["max_abs"]}]},
    ]
    opt = torch.optim.SGD(work.model.parameters(), lr=0.01)
    with GradGuard(work.model, make_policy(*rules), logger=None) as guard:
        assert guard.metrics() == {"gradguard/steps": 0.0}
        norms = []
        for step in range(2):
            opt.zero_grad()
            work.backward(step)
            grads = {n: p.grad.clone() for n, p in work.model.named_parameters()}
            norms.append(torch.cat([g.double().reshape(-1) for g in grads.values()]).norm())
            opt.step()
        metrics = guard.metrics()
        counters = guard.counters.snapshot()
    weights = [n for n in grads if n.endswith(".weight")]
    expected_keys = {"gradguard/steps", "gradguard/g/norm", "gradguard/clip/clip_norm", "gradguard/loss"}
    expected_keys |= {f"gradguard/t/max_abs/{n}" for n in weights}
    assert set(metrics) == expected_keys
    assert metrics["gradguard/steps"] == 2.0
    assert metrics["gradguard/clip/clip_norm"] == counters["clip"]["clip_norm"]
    assert metrics["gradguard/g/norm"] == pytest.approx(float(norms[0]), rel=1e-6)  # step 1 is not sampled
    for n in weights:
        assert metrics[f"gradguard/t/max_abs/{n}"] == float(grads[n].abs().amax())
    assert all(type(value) is float for value in metrics.values())


def test_a_monitor_beside_drop_is_not_a_conflicting_gradient_change(make_workload, make_policy):
    """A monitor changes no gradient: beside drop on the same tensors it is no PolicyError, and its figures come."""
    work = make_workload("mlp")
    rules = [
        {"name": "watch", "match": "*", "actions": [{"action": "monitor"}]},
        {"name": "frozen", "match": "*", "actions": [{"action": "drop"}]},
    ]
    opt = torch.optim.SGD(work.model.parameters(), lr=0.01)
    with GradGuard(work.model, make_policy(*rules), logger=None) as guard:
        work.backward(0)
        opt.step()
        assert all(p.grad is None for p in work.model.parameters())
        assert any(key.startswith("gradguard/watch/norm/") and value > 0 for key, value in guard.metrics().items())


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"vanishing_below": 2.0, "exploding_above": 1.0}, "must be less than exploding_above"),
        ({"stats": ["norm", "norm"]}, "lists a figure twice"),
        ({"stats": ["median"]}, "stats"),
        ({"every": 0}, "every"),
        ({"scope": "layer"}, "scope"),
    ],
)
def test_bad_monitor_fields_are_policy_errors(fields: dict[str, object], message: str, tmp_path: Path):
    """Thresholds out of order, a stat named twice or unknown, every < 1 and an unknown scope are refused."""
    data = {"version": 1, "rules": [{"name": "m", "match": "*", "actions": [{"action": "monitor", **fields}]}]}
    with pytest.raises(PolicyError, match=message):
        Policy.from_dict(data)


def test_a_monitored_step_frees_its_gradients_without_waiting_for_the_garbage_collector(make_workload, make_policy):
    """No reference cycle keeps a monitored step's gradients alive after zero_grad (a gradient-sized peak)."""
    import gc
    import weakref

    work = make_workload("mlp")
    rules = [{"name": "m", "match": "*", "actions": [{"action": "monitor", "stats": ALL_STATS, "scope": "module"}]}]
    opt = torch.optim.SGD(work.model.parameters(), lr=0.01)
    gc.disable()
    try:
        with GradGuard(work.model, make_policy(*rules), logger=None):
            work.backward(0)
            grads = [weakref.ref(p.grad) for p in work.model.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
            assert all(ref() is None for ref in grads)
    finally:
        gc.enable()


def test_a_sampled_step_records_the_sum_of_its_micro_batches_losses_and_an_unsampled_one_is_given_no_root(
    make_policy, read_audit, tmp_path
):
    """The loss rides a ``stats`` event at the steps a monitor samples (every 3rd, from step 1): the sum of the step's
    four micro-batches' losses, bit for bit; at the other steps the guard takes no root and no op at backward (its
    loss watch is not asked: issue 56's budget on the MLP with 4 micro-batches)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rules = [{"name": "m", "match": "*", "actions": [{"action": "monitor", "every": 3, "from_step": 1}]}]
    log = tmp_path / "run.jsonl"
    sums, asked = [], []
    with GradGuard(model, make_policy(*rules), audit_log=log) as guard:
        for _ in range(8):
            opt.zero_grad(set_to_none=True)
            total = torch.zeros(())
            for _ in range(4):
                loss = model(torch.randn(16, 8)).pow(2).mean() / 4
                asked.append(guard._loss_watch() is not None)
                loss.backward()  # type: ignore[no-untyped-call]
                total = total + loss.detach()
            sums.append(total.item())
            opt.step()
    sampled = [step for step in range(8) if step >= 1 and (step - 1) % 3 == 0]
    assert asked == [step in sampled for step in range(8) for _ in range(4)]
    stats = _stats_events(read_audit(log), "m")
    assert [event["step"] for event in stats] == sampled == [1, 4, 7]
    assert [event["loss"] for event in stats] == [sums[step] for step in sampled]
