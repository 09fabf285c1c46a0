"""The ``agc`` action (adaptive gradient clipping): timm's formula bit for bit, the group scope, NaN never
hidden, one host sync per step, events, counters and the audit, policy errors."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from support.gloo_ranks import free_port
from torch import nn

from gradguard import GradGuard, GradientHalt, Policy, PolicyError
from gradguard.audit.fields import per_parameter
from gradguard.cli import main
from tests.support.host_syncs import count_host_syncs

# --- the references -----------------------------------------------------------------------------------


def unitwise_norm(x: torch.Tensor, norm_type: float = 2.0) -> torch.Tensor:
    """timm.utils.agc.unitwise_norm, verbatim."""
    if x.ndim <= 1:
        return x.norm(norm_type)
    return x.norm(norm_type, dim=tuple(range(1, x.ndim)), keepdim=True)


def adaptive_clip_grad(
    parameters: Iterable[nn.Parameter], clip_factor: float = 0.01, eps: float = 1e-3, norm_type: float = 2.0
) -> None:
    """timm.utils.agc.adaptive_clip_grad, verbatim."""
    for p in parameters:
        if p.grad is None:
            continue
        p_data, g_data = p.detach(), p.grad.detach()
        max_norm = unitwise_norm(p_data, norm_type=norm_type).clamp_(min=eps).mul_(clip_factor)
        grad_norm = unitwise_norm(g_data, norm_type=norm_type)
        clipped_grad = g_data * (max_norm / grad_norm.clamp(min=1e-6))
        new_grads = torch.where(grad_norm < max_norm, g_data, clipped_grad)
        p.grad.detach().copy_(new_grads)


def group_agc(parameters: list[nn.Parameter], clipping: float, eps: float) -> None:
    """The group scope as documented: one unit, the parameters' joint weight norm against their joint
    gradient norm (each the norm of the per-tensor norms, as ``clip_grad_norm_`` takes a joint norm)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    weights = [p.detach() for p in parameters if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    weight = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(w) for w in weights]))
    limit = weight.clamp(min=eps) * clipping
    if total >= limit:
        for g in grads:
            g.mul_(limit / total.clamp(min=1e-6))


# --- a model with every kind of unit -------------------------------------------------------------------


class Zoo(nn.Module):
    """Embedding, Conv2d (4-D weight), Linear layers with biases, LayerNorm, a free 1-D and a 0-d parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.conv = nn.Conv2d(1, 3, kernel_size=3, padding=1)
        self.proj = nn.Linear(6 + 3 * 2 * 2, 8)
        self.norm = nn.LayerNorm(8)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.temperature = nn.Parameter(torch.tensor(0.7))
        self.head = nn.Linear(8, 3, bias=False)
        with torch.no_grad():
            self.proj.bias.zero_()  # a zero weight norm: eps decides its units' limit

    def forward(self, tokens: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        pooled = nn.functional.adaptive_avg_pool2d(self.conv(image), 2).flatten(1)
        h = torch.cat([self.embed(tokens).mean(1), pooled], dim=1)
        h = torch.tanh(self.norm(self.proj(h))) * self.gain
        return self.head(h) * self.temperature  # type: ignore[no-any-return]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Inputs, targets and a loss scale: small steps where few units reach the limit, large ones where most do."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 10, (5, 4), generator=g)
    image = torch.randn(5, 1, 4, 4, generator=g)
    target = torch.randn(5, 3, generator=g)
    return tokens, image, target, (1e-4, 1.0, 1e-2, 30.0, 1e-3, 3.0)[step % 6]


def _backward(model: nn.Module, step: int) -> None:
    tokens, image, target, scale = _batch(step)
    loss = nn.functional.mse_loss(model(tokens, image), target) * scale
    loss.backward()  # type: ignore[no-untyped-call]


def _policy(*agc: dict[str, Any], halt: str | None = None, match: str | list[str] = "*") -> Policy:
    rules: list[dict[str, Any]] = [{"name": "agc", "match": match, "actions": [{"action": "agc", **a} for a in agc]}]
    watch = {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}
    if halt == "before":
        rules.insert(0, watch)
    elif halt == "after":
        rules.append(watch)
    return Policy.from_dict({"version": 1, "rules": rules})


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    for name in got:
        assert torch.equal(got[name], want[name]), f"{what}: {name} differs"


def _train_pair(
    policy: Policy,
    reference: Callable[[nn.Module], None],
    *,
    steps: int = 6,
    wrap: Callable[[nn.Module], nn.Module] = lambda m: m,
    micro_batches: int = 1,
    audit_log: Path | None = None,
) -> tuple[dict[str, dict[str, int]], list[dict[str, tuple[int, int]]]]:
    """A guarded Zoo and an unguarded copy under AdamW; the copy gets ``reference`` by hand before each step.

    Checks treated gradients and parameters bitwise after every step. Returns the guard's counters and,
    per step, (units clipped, units) per parameter as the reference saw them.
    """
    torch.manual_seed(0)
    guarded = Zoo()
    ref = copy.deepcopy(guarded)
    run = wrap(guarded)
    opt_g = torch.optim.AdamW(guarded.parameters(), lr=1e-2)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    seen = []
    with GradGuard(run, policy, logger=None, audit_log=audit_log) as guard:
        for step in range(steps):
            for model, opt in ((run, opt_g), (ref, opt_r)):
                opt.zero_grad()
                for micro in range(micro_batches):
                    _backward(model, step * micro_batches + micro)
            _assert_bitwise(_grads(guarded), _grads(ref), f"raw gradients, step {step}")
            seen.append(_units_over(ref))
            reference(ref)
            opt_r.step()
            opt_g.step()
            _assert_bitwise(_grads(guarded), _grads(ref), f"treated gradients, step {step}")
            _assert_bitwise(dict(guarded.named_parameters()), dict(ref.named_parameters()), f"parameters, step {step}")
        counters = guard.counters.snapshot()
    return counters, seen


def _units_over(model: nn.Module, clipping: float = 0.01, eps: float = 1e-3) -> dict[str, tuple[int, int]]:
    """(units at or over the limit, units) per parameter, by timm's rule (before any clip)."""
    out = {}
    for name, p in model.named_parameters():
        limit = unitwise_norm(p.detach()).clamp(min=eps) * clipping
        over = ~(unitwise_norm(p.grad) < limit)
        out[name] = (int(over.sum()), over.numel())
    return out


# --- tensor scope: timm's formula -----------------------------------------------------------------------


def test_tensor_scope_equals_timm_adaptive_clip_grad_bit_for_bit_over_adamw_steps() -> None:
    """Embedding, Conv2d, Linear, LayerNorm, biases, a 1-D and a 0-d parameter: the treated gradients and the
    parameters after AdamW equal timm's adaptive_clip_grad applied by hand, on steps where no unit, some
    units and every unit of a tensor reach the limit."""
    counters, seen = _train_pair(_policy({}), lambda m: adaptive_clip_grad(m.parameters()))
    figures = [units for step in seen for units in step.values()]
    assert any(0 < over < units for over, units in figures), "some units of a tensor clipped, others left"
    assert any(over == units > 1 for over, units in figures), "every unit of a tensor clipped"
    assert any(over == 0 for over, _ in figures), "a tensor left exactly as it was"
    clipped_tensors = sum(1 for step in seen for over, _ in step.values() if over)
    assert counters == {"agc": {"agc": clipped_tensors}}


def test_other_clipping_and_eps_values_and_a_step_window_follow_timm_too() -> None:
    """clipping 0.1, eps 0.05, from step 2: timm's formula with those values, nothing before step 2."""

    def reference(model: nn.Module) -> None:
        reference.calls += 1  # type: ignore[attr-defined]
        if reference.calls > 2:  # type: ignore[attr-defined]
            adaptive_clip_grad(model.parameters(), clip_factor=0.1, eps=0.05)

    reference.calls = 0  # type: ignore[attr-defined]
    _train_pair(_policy({"clipping": 0.1, "eps": 0.05, "from_step": 2}), reference)


def test_a_compiled_model_and_accumulated_gradients_are_clipped_as_timm_clips_their_sum() -> None:
    """torch.compile (eager backend) through _orig_mod, and three micro-batches accumulated: agc acts once,
    on the summed gradient, as timm applied to it before the step."""
    _train_pair(
        _policy({}),
        lambda m: adaptive_clip_grad(m.parameters()),
        steps=4,
        wrap=lambda m: torch.compile(m, backend="eager"),  # type: ignore[return-value]
        micro_batches=3,
    )


# --- group scope ----------------------------------------------------------------------------------------


def test_group_scope_clips_the_rule_s_parameters_by_their_joint_weight_norm() -> None:
    """scope: group: one unit, all of the rule's parameters: clipping * max(||W_group||, eps) against the
    joint gradient norm, bitwise as the reference; other parameters untouched."""
    match = ["proj.*", "head.*", "gain"]
    clipped: list[bool] = []

    def reference(model: nn.Module) -> None:
        params = [p for name, p in model.named_parameters() if name.split(".")[0] in ("proj", "head", "gain")]
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        weight = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.detach()) for p in params]))
        clipped.append(bool(total >= weight.clamp(min=0.02) * 0.05))
        group_agc(params, clipping=0.05, eps=0.02)

    counters, _ = _train_pair(_policy({"clipping": 0.05, "eps": 0.02, "scope": "group"}, match=match), reference)
    assert any(clipped), "the run should clip the group on some steps"
    assert not all(clipped), "and leave it on others"
    assert counters == {"agc": {"agc": 4 * sum(clipped)}}  # proj.weight, proj.bias, head.weight, gain


def test_group_scope_with_a_halt_rule_reuses_the_raw_norms_and_still_matches() -> None:
    """With halt_on_nonfinite first, the group's gradient norms are the watch's raw norms: same result."""

    def reference(model: nn.Module) -> None:
        group_agc(list(model.parameters()), clipping=0.01, eps=1e-3)

    _train_pair(_policy({"scope": "group"}, halt="before"), reference)


# --- non-finite gradients -------------------------------------------------------------------------------


@pytest.mark.parametrize("halt", ["before", "after"])
@pytest.mark.parametrize("scope", ["tensor", "group"])
def test_a_nan_gradient_still_halts_and_is_never_made_finite(halt: str, scope: str) -> None:
    """A NaN in one row of a gradient: the halt rule (before or after the agc rule) halts before the
    optimizer step, the NaN is still there, and no parameter moved."""
    torch.manual_seed(0)
    model = Zoo()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with GradGuard(model, _policy({"scope": scope}, halt=halt), logger=None):
        _backward(model, 3)
        model.proj.weight.grad[2, 1] = float("nan")
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(GradientHalt) as info:
            opt.step()
        assert list(info.value.params) == ["proj.weight"]
        assert torch.isnan(model.proj.weight.grad[2, 1])
        assert not torch.isfinite(model.proj.weight.grad).all()
        for name, value in model.state_dict().items():
            assert torch.equal(value, before[name]), name


def test_an_inf_gradient_without_a_halt_rule_is_reported_and_stays_non_finite(read_audit, tmp_path: Path) -> None:
    """No halt rule: the Inf unit is left as it is (timm would turn it into NaN and zeros), the other units
    are still clipped, and the step logs it as non-finite, unhalted."""
    torch.manual_seed(0)
    model = Zoo()
    log = tmp_path / "run.jsonl"
    with GradGuard(model, _policy({}), logger=None, audit_log=log) as guard:
        _backward(model, 3)
        model.head.weight.grad[1, 0] = float("inf")
        row = model.head.weight.grad[1].clone()
        guard.step()
        counters = guard.counters.snapshot()
    assert torch.equal(model.head.weight.grad[1], row)
    assert counters["agc"]["inf"] == 1
    events = read_audit(log)
    assert [e["param"] for e in events if e["event"] == "nonfinite"] == ["head.weight"]
    assert [e["params"] for e in events if e["event"] == "nonfinite_unhalted"] == [["head.weight"]]


# --- one host sync, events, counters, audit --------------------------------------------------------------


@pytest.mark.parametrize("scope", ["tensor", "group"])
def test_agc_rides_in_the_step_s_one_host_sync(scope: str) -> None:
    """Exactly one host sync per optimizer step, whether units are clipped or not, with a halt rule."""
    torch.manual_seed(0)
    model = Zoo()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradGuard(model, _policy({"scope": scope}, halt="before"), logger=None) as guard:
        for step in range(4):
            opt.zero_grad()
            _backward(model, step)
            assert count_host_syncs(opt.step) == 1, f"step {step}"
        assert guard.counters.total("agc") > 0


def test_each_clipped_tensor_is_an_adaptive_clip_entry_and_a_count(read_audit, tmp_path: Path) -> None:
    """Every tensor with a clipped unit is an entry of its step's adaptive_clip event, with its figures; the
    counter counts them. One event per step lists them all."""
    log = tmp_path / "run.jsonl"
    counters, seen = _train_pair(_policy({}), lambda m: adaptive_clip_grad(m.parameters()), audit_log=log)
    lines = [e for e in read_audit(log) if e["event"] == "adaptive_clip"]
    assert len({e["step"] for e in lines}) == len(lines)
    events = [one for e in lines for one in per_parameter(e)]
    expected = [(step, name, over, units) for step, s in enumerate(seen) for name, (over, units) in s.items() if over]
    assert sorted((e["step"], e["param"], e["units_clipped"], e["units"]) for e in events) == sorted(expected)
    assert counters["agc"]["agc"] == len(events)
    for e in events:
        assert e["rule"] == "agc"
        assert e["action"] == "agc"
        assert e["scope"] == "tensor"
        assert e["clipping"] == 0.01
        assert e["eps"] == 1e-3
        assert e["max_ratio"] >= 1.0
        assert e["after"] < e["before"]


def test_group_events_name_the_parameters(read_audit, tmp_path: Path) -> None:
    """A group clip is one event with param null, the parameters and their number."""
    log = tmp_path / "run.jsonl"
    _train_pair(_policy({"scope": "group"}), lambda m: group_agc(list(m.parameters()), 0.01, 1e-3), audit_log=log)
    events = [e for e in read_audit(log) if e["event"] == "adaptive_clip"]
    assert events
    names = [name for name, _ in Zoo().named_parameters()]
    for e in events:
        assert e["param"] is None
        assert e["params"] == names
        assert e["n_params"] == len(names)
        assert e["units"] == 1
        assert e["units_clipped"] == 1
        assert e["scope"] == "group"
        assert e["after"] == pytest.approx(e["before"] / e["max_ratio"], rel=1e-5)


def test_gradguard_audit_counts_agc_clips_as_interventions(tmp_path: Path) -> None:
    """The audit of a run with agc: its totals equal the guard's counters, and agc is an intervention row."""
    log = tmp_path / "run.jsonl"
    policy = Policy.from_dict(
        {
            "version": 1,
            "rules": [
                {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
                {"name": "agc", "match": ["proj.*", "conv.*"], "actions": [{"action": "agc"}]},
                {"name": "joint", "match": ["head.*", "embed.*"], "actions": [{"action": "agc", "scope": "group"}]},
            ],
        }
    )
    torch.manual_seed(0)
    model = Zoo()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with GradGuard(model, policy, logger=None, audit_log=log, summary_every=3) as guard:
        for step in range(6):
            opt.zero_grad()
            _backward(model, step)
            opt.step()
        counters = guard.counters.snapshot()
    assert counters["agc"]["agc"] > 0
    assert counters["joint"]["agc"] > 0
    result = CliRunner().invoke(main, ["audit", "--format", "json", str(log)])
    data = json.loads(result.stdout)
    assert data["totals"] == counters
    assert data["mismatches_total"] == 0
    text = json.dumps(data)
    assert '"agc"' in text
    markdown = CliRunner().invoke(main, ["audit", "--format", "markdown", str(log)]).stdout
    assert "| agc | agc |" in markdown.replace("`", "")
    assert "joint" in markdown


# --- the policy -----------------------------------------------------------------------------------------


def test_defaults_are_timm_s() -> None:
    """clipping 0.01, eps 1e-3, scope tensor."""
    action = _policy({}).rules[0].actions[0]
    assert action.model_dump() == {
        "action": "agc",
        "clipping": 0.01,
        "eps": 1e-3,
        "scope": "tensor",
        "from_step": None,
        "until_step": None,
    }


@pytest.mark.parametrize(
    ("setting", "path", "message"),
    [
        ("clipping: 0", "rules[0].actions[0].clipping", "greater than 0"),
        ("eps: -1", "rules[0].actions[0].eps", "greater than 0"),
        ("clipping: .inf", "rules[0].actions[0].clipping", "finite"),
        ("scope: layer", "rules[0].actions[0].scope", "tensor"),
        ("clip_factor: 0.01", "rules[0].actions[0].clip_factor", "clipping"),
    ],
)
def test_bad_agc_fields_are_policy_errors_naming_the_field_and_line(
    setting: str, path: str, message: str, tmp_path: Path
) -> None:
    """clipping 0, eps -1, an infinite clipping, an unknown scope or field: one PolicyError with file, line, field."""
    text = f"version: 1\nrules:\n  - name: agc\n    match: '*'\n    actions:\n      - action: agc\n        {setting}\n"
    file = tmp_path / "bad.yaml"
    file.write_text(text)
    with pytest.raises(PolicyError) as info:
        Policy.from_file(file)
    (issue,) = info.value.issues
    assert issue.path == path
    assert issue.line == 7
    assert message in str(info.value)
    assert f"{file}:7: {path}: " in str(info.value)


# --- FSDP2 ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scope", ["tensor", "group"])
def test_under_fsdp2_agc_clips_the_full_units_as_timm_on_the_unsharded_model(scope: str, tmp_path: Path) -> None:
    """torchrun, 2 ranks, gloo, uneven dim-0 shards: the sharded run follows timm's formula (or the group
    reference) on an unsharded copy trained on the whole batch, and both ranks count the same clips."""
    root = Path(__file__).resolve().parent.parent
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]
    command += [str(root / "tests" / "agc_fsdp2_scenario.py"), scope]
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    reports = {str(rank): json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)}
    assert reports["0"]["counters"] == reports["1"]["counters"]
    assert reports["0"]["counters"]["agc"]["agc"] == reports["0"]["expected"] > 0
