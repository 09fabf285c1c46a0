"""Before a fused Adam/AdamW update, the step's read waits for the update (``gradguard.enforce.step.fused_update``).

The guard hands its verdict to the optimizer's kernel as ``found_inf`` and reads after the kernel is queued: the
weights, the optimizer's state, the counters and the events must be bitwise those of the read-first order in every
case (nothing to do, clips, clamps, a chain of clips, a skip, a halt), a halt must leave the weights and moments as
they were, and where something else needs the host first (a GradScaler, another optimizer, a ``loss`` section) the
guard must read first as before.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import read_jsonl
from support.fused import reading_first
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradguard import GradGuard, GradientHalt, GuardStateError, Policy
from gradguard.cli.demo import TinyDecoder
from gradguard.enforce.triggers import loss as loss_module
from gradguard.enforce.triggers.loss import LossWatch, _unjudged
from gradguard.enforce.work.step_work import Pending

FUSED_OPS = ("_fused_adamw_", "_fused_adam_")


GROUP = "group"
SPIKE_SKIP = {"action": "skip_step_on_spike", "min_samples": 3, "z_thresh": 2.0}


def _policy(*rules: dict[str, Any], **sections: Any) -> Policy:
    return Policy.from_dict({"version": 1, "rules": list(rules), **sections})


HALT = {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}
SKIP = {"name": "nonfinite", "match": "*", "actions": [{"action": "skip_step_on_nonfinite"}]}


def _clip(max_norm: float, scope: str = "tensor", match: Any = "*", name: str = "clip") -> dict[str, Any]:
    return {"name": name, "match": match, "actions": [{"action": "clip_norm", "max_norm": max_norm, "scope": scope}]}


POLICIES: dict[str, Callable[[], Policy]] = {
    "halt, nothing clipped": lambda: _policy(HALT, _clip(1e9)),
    "halt, every tensor clipped": lambda: _policy(HALT, _clip(1e-3)),
    "a group clip that clips": lambda: _policy(HALT, _clip(1e-2, "group")),
    "a clamp": lambda: _policy(HALT, {"name": "v", "match": "*", "actions": [{"action": "clip_value", "limit": 1e-3}]}),
    "a chain: per-tensor clips, then a group clip": lambda: _policy(
        HALT, _clip(0.05, match="*embed*", name="embed"), _clip(0.02, "group", name="all")
    ),
    "skip, monitor, scale, zero and drop": lambda: _policy(
        SKIP,
        {"name": "m", "match": "*", "actions": [{"action": "monitor", "stats": ["norm"], "every": 2}]},
        {"name": "s", "match": "blocks.0.*", "actions": [{"action": "scale", "factor": 0.5}]},
        {"name": "z", "match": "pos_embed", "actions": [{"action": "zero"}]},
        {"name": "d", "match": "norm.bias", "actions": [{"action": "drop"}]},
    ),
    "the shipped default": lambda: Policy.shipped("default"),
    "the shipped llm-pretraining (a chain of clips held for the read)": lambda: Policy.shipped("llm-pretraining"),
    "the shipped llm-adaptive": lambda: Policy.shipped("llm-adaptive"),
    "zclip, autoclip, agc and spike skips": lambda: _policy(
        SKIP,
        {"name": "spikes", "match": "*", "actions": [SPIKE_SKIP]},
        {"name": "z", "match": "blocks.1.*", "actions": [{"action": "zclip", "warmup_steps": 2, "max_norm": 1e-6}]},
        {"name": "auto", "match": "*embed*", "actions": [{"action": "autoclip", "percentile": 50, "history": 8}]},
        {"name": "unit", "match": "norm.*", "actions": [{"action": "agc", "clipping": 0.01}]},
        {"name": "group", "match": "blocks.0.mlp.*", "actions": [{"action": "agc", "clipping": 0.01, "scope": GROUP}]},
    ),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return TinyDecoder(vocab=32, width=16, depth=2, heads=2, context=8)


class _Order(TorchDispatchMode):
    """Records the fused update's kernel and the step's read, in the order they come."""

    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.__name__.split(".")[0] in FUSED_OPS:
            self.seen.append("update")
        return func(*args, **(kwargs or {}))


@contextmanager
def _watching_order() -> Iterator[list[str]]:
    seen: list[str] = []
    original = Pending.sync

    def sync(self: Pending) -> None:
        if self.parts:
            seen.append("read")
        original(self)

    Pending.sync = sync  # type: ignore[method-assign]
    try:
        with _Order(seen):
            yield seen
    finally:
        Pending.sync = original  # type: ignore[method-assign]


def _train(
    policy: Policy,
    opt_factory: Callable[[Any], torch.optim.Optimizer],
    *,
    steps: int = 6,
    poison: int | None = None,
    log: Path | None = None,
    losses: Callable[[int], float] = lambda step: 1.0,
) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any], str | None]:
    model = _model()
    opt = opt_factory(model.parameters())
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    halted = None
    with GradGuard(model, policy, logger=None, audit_log=log) as guard:
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            (model(tokens).float().square().mean() * losses(step)).backward()
            if poison is not None and step >= poison:
                model.get_parameter("blocks.1.mlp.0.weight").grad[0, 0] = float("nan")
            try:
                opt.step()
            except GradientHalt as halt:
                halted = f"step {halt.step}: {halt.rule}"
                break
    return model, opt, guard.counters.snapshot(), halted


def _events(log: Path) -> list[dict[str, Any]]:
    """The log's events without their times and run ids (two runs are compared)."""
    return [{k: v for k, v in event.items() if k not in ("ts", "run")} for event in read_jsonl(log)]


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, fused=True)


def _adam_amsgrad(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2, fused=True, amsgrad=True, weight_decay=0.1)


def _same_events(after: Path, first: Path) -> None:
    """The two runs' events are equal; the standard deviations and z-scores zclip reports to the last bits only:
    reading first, zclip per tensor decides on the host (actions/zclip.py), whose square roots are correctly rounded;
    after the fused update, on the device, where torch's vectorised float64 sqrt may differ in the last bit."""
    after_events, first_events = _events(after), _events(first)
    assert len(after_events) == len(first_events)
    for mine, theirs in zip(after_events, first_events, strict=True):
        assert mine.keys() == theirs.keys()
        for key, value in mine.items():
            expected = pytest.approx(theirs[key], rel=1e-12, abs=0.0) if key in ("std", "z") else theirs[key]
            assert value == expected, key


def _same_training(a: tuple[Any, ...], b: tuple[Any, ...], same: Callable[..., None]) -> None:
    same(a[0].state_dict(), b[0].state_dict())
    same(a[1].state_dict(), b[1].state_dict())
    assert a[2:] == b[2:]


@pytest.mark.parametrize("optimizer", [_adamw, _adam_amsgrad], ids=["AdamW", "Adam amsgrad"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_a_read_after_the_fused_update_trains_bit_for_bit_as_the_read_first(name, optimizer, same, tmp_path):
    after = _train(POLICIES[name](), optimizer, log=tmp_path / "after.jsonl")
    with reading_first():
        first = _train(POLICIES[name](), optimizer, log=tmp_path / "first.jsonl")
    _same_training(after, first, same)
    _same_events(tmp_path / "after.jsonl", tmp_path / "first.jsonl")


REWIND = {"snapshot_every": 2, "keep": 2, "min_age": 1, "skip_steps": 2}


@pytest.mark.parametrize(
    "policy",
    [_policy(HALT, _clip(1e9)), _policy(SKIP, _clip(1e-3)), _policy(HALT, _clip(1e-3), recovery=REWIND)],
    ids=["halt", "skip", "rewind"],
)
def test_a_nan_stops_the_fused_update_and_the_verdict_after_it_is_the_read_firsts(policy, same):
    """A NaN from step 5 on: a halt, skips, or a rewind to the snapshot before it (weights, moments and the guard's
    own state restored after the update the flag stopped)."""
    after = _train(policy, _adamw, poison=5, steps=9)
    with reading_first():
        first = _train(policy, _adamw, poison=5, steps=9)
    _same_training(after, first, same)
    if policy.recovery is not None:
        assert after[2]["nonfinite"]["rewind"] >= 1
        assert after[2]["recovery"]["skip"] >= 1
    elif policy.rules[0].actions[0].action == "halt_on_nonfinite":
        assert after[3] == "step 5: nonfinite"
    else:
        assert after[2]["nonfinite"]["skip_step_on_nonfinite"] == 4


LOSSES = {
    "a spike skipped": ({"spike": {"factor": 3.0, "window": 4, "warmup": 2, "action": "skip"}}, {5: 20.0}),
    "a spike halts": ({"spike": {"factor": 3.0, "window": 4, "warmup": 2, "action": "halt"}}, {5: 20.0}),
    "a spike just above the limit": ({"spike": {"factor": 3.0, "window": 4, "warmup": 2}}, {5: 3.01, 6: 2.99}),
    "a NaN loss skipped": ({"nonfinite": "skip"}, {4: float("nan")}),
    "no spike": ({"spike": {"factor": 3.0, "window": 4, "warmup": 2}}, {}),
}


@pytest.mark.parametrize("case", list(LOSSES))
def test_a_loss_section_judges_after_the_fused_update_as_before_it(case, same, tmp_path):
    """The loss section's verdict is a condition on the device too: a non-finite loss, or one above the spike limit
    (factor x the median of the window, rounded down to float32), stops the update for the host to judge."""
    section, scaled = LOSSES[case]
    policy = _policy(_clip(1e9), loss=section)  # a clip that never clips: the loss alone raises the flag
    after = _train(policy, _adamw, steps=9, log=tmp_path / "after.jsonl", losses=lambda step: scaled.get(step, 1.0))
    with reading_first():
        first = _train(policy, _adamw, steps=9, log=tmp_path / "first.jsonl", losses=lambda step: scaled.get(step, 1.0))
    _same_training(after, first, same)
    assert _events(tmp_path / "after.jsonl") == _events(tmp_path / "first.jsonl")
    if case != "no spike" and case != "a spike just above the limit":
        assert "loss" in after[2]


def test_adaptive_clips_and_spike_skips_judge_after_the_fused_update_as_before_it(same, tmp_path):
    """Gradient spikes (the loss x30 at steps 6 and 9): skip_step_on_spike's verdict is a device condition too."""
    policy = POLICIES["zclip, autoclip, agc and spike skips"]
    spikes = {6: 30.0, 9: 30.0}
    after = _train(policy(), _adamw, steps=12, log=tmp_path / "after.jsonl", losses=lambda k: spikes.get(k, 1.0))
    with reading_first():
        first = _train(policy(), _adamw, steps=12, log=tmp_path / "first.jsonl", losses=lambda k: spikes.get(k, 1.0))
    _same_training(after, first, same)
    _same_events(tmp_path / "after.jsonl", tmp_path / "first.jsonl")
    assert after[2]["spikes"]["skip_step_on_spike"] >= 1
    assert {"z", "auto", "unit"} <= set(after[2])


def test_a_halt_after_the_fused_update_leaves_the_weights_and_moments_as_they_were(same):
    model = _model()
    opt = _adamw(model.parameters())
    tokens = torch.randint(0, 32, (2, 8))
    with GradGuard(model, _policy(HALT, _clip(1e-3)), logger=None):
        for step in range(3):
            _backward(model, opt, tokens)
            if step == 2:
                model.get_parameter("embed.weight").grad[1, 1] = float("inf")
                weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
                with _watching_order() as seen, pytest.raises(GradientHalt):
                    opt.step()
                assert seen == ["update", "read"]  # the kernel ran, stopped by the flag, before the read
                same(model.state_dict(), weights)
                same(opt.state_dict(), state)
            else:
                opt.step()


def _backward(model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    model(tokens).float().square().mean().backward()


def test_the_read_comes_after_the_fused_kernel_and_an_update_to_make_again_comes_after_the_read():
    """The first update reads first (it makes the optimizer's state, which a stopped update would make too); then a
    quiet step is the kernel and the read, and a step that clips the kernel (stopped), the read, the kernel again."""
    model = _model()
    opt = _adamw(model.parameters())
    tokens = torch.randint(0, 32, (2, 8))
    orders = []
    with GradGuard(model, _policy(HALT, _clip(1e-3, match="embed.weight")), logger=None):
        for step in range(3):
            _backward(model, opt, tokens)
            if step == 2:
                model.get_parameter("embed.weight").grad.mul_(1e-9)  # this step clips nothing
            with _watching_order() as seen:
                opt.step()
            orders.append(seen)
    assert orders == [["read", "update"], ["update", "read", "update"], ["update", "read"]]


def _with_scaler(model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, unscale: bool) -> list[str]:
    scaler = torch.amp.GradScaler("cpu")
    opt.zero_grad(set_to_none=True)
    scaler.scale(model(tokens).float().square().mean()).backward()
    if unscale:
        scaler.unscale_(opt)
    with _watching_order() as seen:
        scaler.step(opt)
    scaler.update()
    return seen


@pytest.mark.parametrize(
    "case",
    [
        "a GradScaler",
        "a GradScaler after unscale_",
        "unfused AdamW",
        "a second computation asked (rerun)",
    ],
)
def test_where_something_else_needs_the_host_first_the_guard_reads_before_the_update(case):
    model = _model()
    tokens = torch.randint(0, 32, (2, 8))
    fused = case != "unfused AdamW"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    rules: list[dict[str, Any]] = [HALT, _clip(1e-3)]
    sections: dict[str, Any] = {}
    if case == "a second computation asked (rerun)":
        sections["rerun"] = {"on": ["nonfinite"]}
    with GradGuard(model, _policy(*rules, **sections), logger=None):
        for _ in range(2):  # the second: the optimizer's state is made, so only the case keeps the read first
            if case.startswith("a GradScaler"):
                seen = _with_scaler(model, opt, tokens, unscale=case.endswith("unscale_"))
            else:
                _backward(model, opt, tokens)
                with _watching_order() as seen:
                    opt.step()
    assert seen == (["read", "update"] if fused else ["read"])


def test_the_same_loop_without_the_case_reads_after_the_update():
    """The control of the test above: its loop, with nothing that needs the host first."""
    model = _model()
    tokens = torch.randint(0, 32, (2, 8))
    opt = _adamw(model.parameters())
    with GradGuard(model, _policy(HALT, _clip(1e-3)), logger=None):
        for _ in range(2):
            _backward(model, opt, tokens)
            with _watching_order() as seen:
                opt.step()
    assert seen == ["update", "read", "update"]


class _Failing(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.__name__.split(".")[0] in FUSED_OPS:
            raise RuntimeError("the kernel failed")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("then", ["trains on", "removes the guard"])
def test_a_fused_step_that_raised_leaves_no_flag_to_stop_the_next_update(then):
    model = _model()
    opt = _adamw(model.parameters())
    tokens = torch.randint(0, 32, (2, 8))
    guard = GradGuard(model, _policy(HALT, _clip(1e-3)), logger=None)
    _backward(model, opt, tokens)
    opt.step()  # the optimizer's state is made: the next update's read waits for it
    _backward(model, opt, tokens)
    with _Failing(), pytest.raises(RuntimeError, match="the kernel failed"):
        opt.step()
    assert "found_inf" in vars(opt)  # the flag the failed step was given (set: this step clips)
    if then == "removes the guard":
        guard.remove()
    before = copy.deepcopy(model.state_dict())
    _backward(model, opt, tokens)
    opt.step()
    assert "found_inf" not in vars(opt)
    assert not torch.equal(model.state_dict()["embed.weight"], before["embed.weight"])
    guard.remove()


def test_an_optimizers_own_step_hooks_keep_the_read_first(same):
    """Its post-hooks run before the guard's (an EMA there would see the update the flag stopped), its pre-hooks
    after the guard's: with either, the guard reads before the update, and the hooks see what they always saw."""
    seen_by_hook: list[torch.Tensor] = []
    model = _model()
    opt = _adamw(model.parameters())
    handle = opt.register_step_post_hook(lambda *_: seen_by_hook.append(model.embed.weight.detach().clone()))
    tokens = torch.randint(0, 32, (2, 8))
    with GradGuard(model, _policy(HALT, _clip(1e-3)), logger=None):
        for _ in range(3):
            _backward(model, opt, tokens)
            with _watching_order() as seen:
                opt.step()
            assert seen == ["read", "update"]
            same(seen_by_hook[-1], model.embed.weight.detach())
    handle.remove()


def test_a_change_due_before_the_update_that_raised_no_alarm_is_refused_loudly(monkeypatch):
    """Never true by construction (every eligible kernel raises its alarms); if a kernel forgot, the guard must say
    so rather than let an unclipped update stand."""
    model = _model()
    opt = _adamw(model.parameters())
    tokens = torch.randint(0, 32, (2, 8))
    with GradGuard(model, _policy(HALT, _clip(1e-3)), logger=None):
        _backward(model, opt, tokens)
        opt.step()
        monkeypatch.setattr(Pending, "quiet_if", lambda self, condition: None)
        _backward(model, opt, tokens)
        with pytest.raises(GuardStateError, match="flag did not stop"):
            opt.step()


@pytest.mark.parametrize("factor", [3.0, 2.5, 1.1, 10.0])
def test_a_loss_the_device_finds_within_the_spike_limit_is_one_the_host_finds_fine(factor):
    """The device compares float32 losses with the limit rounded down to float32: whatever it lets through, the
    host's verdict (in float64) lets through too, and at the limit itself the two agree."""
    config = Policy.from_dict(
        {"version": 1, "rules": [HALT], "loss": {"spike": {"factor": factor, "window": 5, "warmup": 1}}}
    ).loss
    assert config is not None
    watch = LossWatch()
    for loss in (0.7, 0.9000001, 1.3, 0.8, 1.1):
        watch.accept(config, loss)
    limit = watch.spike_limit(config)
    assert limit is not None
    threshold = factor * statistics.median(watch.history)
    assert limit <= threshold
    near = torch.tensor(threshold, dtype=torch.float64).float()
    candidates = torch.cat([near + torch.arange(-64, 65) * torch.finfo(torch.float32).eps * near, near.reshape(1)])
    for value in candidates.float():
        device_fine = bool(_unjudged(value, limit))
        host_fine = watch.peek(config, float(value)) is None
        assert not device_fine or host_fine, (float(value), limit, threshold)
    assert bool(_unjudged(torch.tensor(limit, dtype=torch.float32), limit))
    assert not bool(_unjudged(torch.tensor(float("nan")), limit))
    assert not bool(_unjudged(torch.tensor(float("inf")), None))


def test_a_loss_verdict_whose_condition_was_missed_is_refused_loudly(monkeypatch, tmp_path):
    """The check after the read counts the loss section's verdict too (made after it): a spike the device let
    through (here: its condition disabled) stops the run with GuardStateError, not a skip after the update."""
    monkeypatch.setattr(loss_module, "_unjudged", lambda loss, limit: torch.ones(1, dtype=torch.bool))
    policy = _policy(_clip(1e9), loss={"spike": {"factor": 3.0, "window": 4, "warmup": 2, "action": "skip"}})
    with pytest.raises(GuardStateError, match="flag did not stop"):
        _train(policy, _adamw, steps=9, losses=lambda step: 20.0 if step == 5 else 1.0)


def test_a_tensor_asked_for_again_is_read_once_and_each_reader_gets_its_own_values() -> None:
    """The shipped default's zclip reads the raw norms' very stack: the one read copies it once (no ``cat`` of it with
    itself, one torch op a step fewer), and every reader still gets its values, in the order the readers came."""

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    norms, other, more = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0]), torch.tensor([5.0, 6.0])
    got: dict[str, list[float]] = {}
    alone = Pending()
    alone.add(norms, lambda values: got.setdefault("first", values))
    alone.add(norms, lambda values: got.setdefault("again", values))
    with Ops() as ops:
        alone.sync()
    assert got == {"first": [1.0, 2.0, 3.0], "again": [1.0, 2.0, 3.0]}
    assert not any("cat" in name for name in ops.names), ops.names
    got.clear()
    mixed = Pending()
    mixed.add(norms, lambda values: got.setdefault("norms", values))
    mixed.add(other, lambda values: got.setdefault("other and more", values), more)
    mixed.add(more, lambda values: got.setdefault("more, alone", values))  # a part of a reader's span, read again
    mixed.add(norms, lambda values: got.setdefault("norms again", values))
    mixed.add(other, lambda values: got.setdefault("other again", values))
    mixed.sync()
    assert got == {
        "norms": [1.0, 2.0, 3.0],
        "other and more": [4.0, 5.0, 6.0],
        "more, alone": [5.0, 6.0],
        "norms again": [1.0, 2.0, 3.0],
        "other again": [4.0],
    }


@pytest.mark.parametrize("floor", [None, 0.05], ids=["no floor", "a floor"])
def test_zclip_s_ceiling_relative_to_the_warm_up_scale_decides_on_the_device_bit_for_bit_as_on_the_host(
    floor, same, tmp_path
):
    """Read after the fused update, zclip decides on the device (``zclip_decide``); read first, on the host: the same
    clips where the loss grows 4x a step past 1.5 times each tensor's warm-up scale (the mean of its norms so far in
    warm-up, then the first mean; no z-score ever acts), or past ``floor`` where that is more."""
    zclip = {"action": "zclip", "warmup_steps": 2, "z_thresh": 1e6, "max_norm_ratio": 1.5, "ratio_floor": floor}
    policy = _policy(HALT, {"name": "z", "match": "*", "actions": [zclip]})

    def growing(step: int) -> float:
        return 4.0**step

    after = _train(policy, _adamw, steps=8, log=tmp_path / "after.jsonl", losses=growing)
    with reading_first():
        first = _train(policy, _adamw, steps=8, log=tmp_path / "first.jsonl", losses=growing)
    _same_training(after, first, same)
    _same_events(tmp_path / "after.jsonl", tmp_path / "first.jsonl")
    clips = [event for event in read_jsonl(tmp_path / "after.jsonl") if event["event"] == "adaptive_clip"]
    assert {event["step"] for event in clips} == set(range(1, 8))  # from the second step (its scale: the first's)
