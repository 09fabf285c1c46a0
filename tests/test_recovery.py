"""Recovery: a halt becomes a rewind to an in-memory snapshot, and the run ends bitwise equal to one that
never trained on the undone batches, in every loop the guard supports (issue 25's contract)."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from support.training import BatchNormNet
from torch import nn

from gradguard import GradGuard, GradientHalt, Policy, PolicyError
from gradguard.enforce.recovery import snapshot_memory

STEPS = 40
FAULT = 23
RECOVERY = {"snapshot_every": 5, "keep": 2, "min_age": 3, "skip_steps": 4}
NEVER_LEARNED = range(20, 28)  # the snapshot's step (20) to the end of the window (23 + 4)

HALT = {"name": "nonfinite", "match": ["*"], "actions": [{"action": "halt_on_nonfinite"}]}
STATEFUL = [
    HALT,
    {"name": "adaptive", "match": ["*"], "actions": [{"action": "zclip", "max_norm": 5.0, "warmup_steps": 3}]},
    {
        "name": "spikes",
        "match": ["*"],
        "actions": [{"action": "skip_step_on_spike", "z_thresh": 4.0, "window": 8, "min_samples": 4}],
    },
]


IMPLEMENTATIONS: dict[str, dict[str, bool]] = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}}
IMPLEMENTATIONS["fused"] = {"fused": True}
_implementation: dict[str, bool] = {}


@pytest.fixture(autouse=True, params=list(IMPLEMENTATIONS))
def implementation(request: pytest.FixtureRequest) -> Any:
    """Every scenario with torch's three optimizer implementations: a fused optimizer under a GradScaler still
    has its ``step()`` called on a skipped step (its kernel skips on ``found_inf``), which must not count twice."""
    _implementation.clear()
    _implementation.update(IMPLEMENTATIONS[request.param])
    yield request.param
    _implementation.clear()


MEMORY: dict[str, tuple[int, int] | None] = {
    "device": None,  # the CPU's figures (none): device buffers, copied directly
    "host": (2**40, 2**40),  # a roomy device: host memory through the staging buffer (the side stream's path)
    "auto": (0, 2**40),  # a full device: auto falls back to host memory, copied directly
}
_memory: list[str] = []


@pytest.fixture(autouse=True, params=list(MEMORY))
def memory(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Every scenario with each ``recovery.memory``, the device's memory figures faked so that each path runs."""
    figures = MEMORY[request.param]
    if figures is not None:
        monkeypatch.setattr(snapshot_memory, "device_memory", lambda device: figures)
    _memory[:] = [request.param]
    yield request.param
    _memory.clear()


def adamw(params: Any, lr: float = 1e-2) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=lr, **_implementation)


def sgd(params: Any, lr: float, momentum: float = 0.0) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=lr, momentum=momentum, **_implementation)


def policy(rules: list[dict[str, Any]] | None = None, recovery: dict[str, Any] | None = RECOVERY) -> Policy:
    data: dict[str, Any] = {"version": 1, "rules": rules or STATEFUL}
    if recovery is not None:
        data["recovery"] = {"memory": _memory[0], **recovery} if _memory else recovery
    return Policy.from_dict(data)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.inp(x))))


def batches(count: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=gen), torch.randn(6, 2, generator=gen)) for _ in range(count)]


DATA = batches()


class Loop:
    """One training loop style; ``step(i, poison)`` trains on batch ``i`` (poisoned: a NaN loss)."""

    def __init__(self, style: str, model: Net, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None):
        self.style, self.model, self.opt, self.scaler = style, model, opt, scaler

    def loss(self, i: int, poison: bool, part: slice = slice(None)) -> torch.Tensor:
        x, y = DATA[i]
        dtype = {"bf16": torch.bfloat16, "scaler": torch.float16}.get(self.style)
        with torch.autocast("cpu", dtype=dtype) if dtype is not None else nullcontext():
            out = self.model(x[part])
        loss = nn.functional.mse_loss(out.float(), y[part])
        return loss * float("nan") if poison else loss

    def step(self, i: int, poison: bool) -> None:
        model, opt, style = self.model, self.opt, self.style
        if style == "closure":

            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = self.loss(i, poison)
                loss.backward()
                return loss

            opt.step(closure)
            return
        opt.zero_grad()
        if style == "accumulation":
            for part in (slice(0, 3), slice(3, 6)):
                (self.loss(i, poison, part) / 2).backward()
        elif self.scaler is not None:
            self.scaler.scale(self.loss(i, poison)).backward()
            self.scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # timm's order: unscale, clip, step
            self.scaler.step(opt)
            self.scaler.update()
            return
        else:
            self.loss(i, poison).backward()
        if style == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


def train(
    style: str,
    steps: list[int],
    *,
    poison: Callable[[int], bool] = lambda i: False,
    rules: list[dict[str, Any]] | None = None,
    recovery: dict[str, Any] | None = RECOVERY,
    jump: tuple[int, int] | None = None,
    log: Path | None = None,
    init_scale: float = 2.0**10,
) -> tuple[Net, torch.optim.Optimizer, GradGuard, torch.amp.GradScaler | None]:
    """Train ``steps`` (batch indices) in ``style``; ``jump=(i, step)`` sets the guard's step before batch ``i``."""
    model = Net()
    opt = adamw(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale) if style == "scaler" else None
    loop = Loop(style, model, opt, scaler)
    with GradGuard(model, policy(rules, recovery), logger=None, scaler=scaler, audit_log=log) as guard:
        for i in steps:
            if jump is not None and i == jump[0]:
                state = guard.state_dict()
                state["step"] = jump[1]
                guard.load_state_dict(state)
            loop.step(i, poison(i))
    return model, opt, guard, scaler  # removed: its state, counters and metrics stay readable


def assert_same_training(
    got: tuple[Net, torch.optim.Optimizer, GradGuard, torch.amp.GradScaler | None],
    want: tuple[Net, torch.optim.Optimizer, GradGuard, torch.amp.GradScaler | None],
) -> None:
    for (name, p), q in zip(got[0].state_dict().items(), want[0].state_dict().values(), strict=True):
        assert torch.equal(p, q), f"{name} differs"
    a, b = got[1].state_dict(), want[1].state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index, entry in a["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, b["state"][index][key]), f"optimizer state {index}.{key} differs"
    mine, theirs = got[2].state_dict(), want[2].state_dict()
    assert mine["statistics"] == theirs["statistics"]
    assert mine["skips"] == theirs["skips"]
    assert mine["step"] == theirs["step"] == STEPS
    if got[3] is not None and want[3] is not None:
        assert got[3].state_dict() == want[3].state_dict()


def reference(style: str, **kwargs: Any) -> Any:
    """The run that never trained on the batches of steps 20..27: 0-19, then 28-39 with the guard's step at 28."""
    kept = [i for i in range(STEPS) if i not in NEVER_LEARNED]
    return train(style, kept, jump=(NEVER_LEARNED.stop, NEVER_LEARNED.stop), recovery=None, **kwargs)


def events(log: Path, kind: str) -> list[dict[str, Any]]:
    return [e for line in log.read_text().splitlines() if (e := json.loads(line))["event"] == kind]


@pytest.mark.parametrize("style", ["plain", "clip", "closure", "accumulation", "bf16"])
def test_a_nan_at_step_23_rewinds_to_20_and_ends_equal_to_the_run_that_never_saw_batches_20_to_27(
    style: str, tmp_path: Path
) -> None:
    log = tmp_path / "run.jsonl"
    got = train(style, list(range(STEPS)), poison=lambda i: i == FAULT, log=log)
    assert_same_training(got, reference(style))
    (rewind,) = events(log, "rewind")
    assert (rewind["step"], rewind["to_step"], rewind["skip_until"]) == (23, 20, 28)
    assert rewind["rule"] == "nonfinite"
    assert rewind["kind"] == "nan"
    assert rewind["rewinds"] == 1
    assert rewind["level"] == "warning"
    assert rewind["params"]
    assert got[2].counters.snapshot()["nonfinite"]["rewind"] == 1
    assert got[2].state_dict()["recovery"] == {"rewinds": 1, "skip_until": 28, "lr_scale": 1.0, "applied": 32}
    assert not events(log, "halt")


def test_under_a_grad_scaler_a_persisting_nan_rewinds_at_max_scaler_skips_and_ends_exact(tmp_path: Path) -> None:
    """fp16 autocast, GradScaler, timm's unscale-clip-step order: NaN at steps 21-23, max_scaler_skips 2."""
    rules = [{"name": "nonfinite", "match": ["*"], "actions": [{"action": "halt_on_nonfinite", "max_scaler_skips": 2}]}]
    log = tmp_path / "run.jsonl"
    got = train("scaler", list(range(STEPS)), poison=lambda i: 21 <= i <= FAULT, rules=rules, log=log)
    assert_same_training(got, reference("scaler", rules=rules))
    (rewind,) = events(log, "rewind")
    assert (rewind["step"], rewind["to_step"], rewind["kind"]) == (23, 20, "overflow")
    assert "3 steps in a row (max_scaler_skips: 2)" in rewind["reason"]
    assert len(events(log, "scaler_skip")) == 3


@pytest.mark.parametrize("recovery", [None, RECOVERY], ids=["halts", "rewinds"])
def test_a_nan_that_persists_under_a_grad_scaler_stops_at_the_default_scale_floor_instead_of_stalling(
    recovery: dict[str, Any] | None, tmp_path: Path
) -> None:
    """timm's case: the default scale (65536), a NaN from step 6 on. The scaler skips 6, 7, ... halving the scale;
    the skip at scale 1 (min_loss_scale's default), the 17th, halts, or with recovery rewinds."""
    log = tmp_path / "run.jsonl"
    if recovery is not None:
        got = train("scaler", list(range(STEPS)), poison=lambda i: 6 <= i <= 22, log=log, init_scale=2.0**16)
        (rewind,) = events(log, "rewind")
        assert (rewind["step"], rewind["to_step"], rewind["kind"]) == (22, 15, "overflow")
        assert got[2].state_dict()["recovery"]["rewinds"] == 1
        return
    with pytest.raises(GradientHalt, match=r"skipped 17 steps in a row, the last at loss scale 1 ") as caught:
        train("scaler", list(range(STEPS)), poison=lambda i: i >= 6, rules=[HALT], recovery=None, init_scale=2.0**16)
    assert caught.value.step == 22
    assert caught.value.kind == "overflow"


def test_an_ordinary_fp16_run_whose_scaler_skips_its_first_steps_never_halts() -> None:
    """A scale far too large at the start (2**40 skips many steps in a row) is the scaler's business below the limit;
    each applied step resets the count, so scattered later skips never add up."""
    model = Net()
    opt = adamw(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**25, growth_interval=2)  # grows back: skips now and then
    loop = Loop("scaler", model, opt, scaler)
    with GradGuard(model, policy([HALT], None), logger=None, scaler=scaler) as guard:
        for i in range(STEPS):
            loop.step(i, False)
        skips = guard.counters.snapshot()["grad_scaler"]["skip"]
    assert skips >= 10, "the scaler really skipped at its start and later"
    assert guard.step_count == STEPS


def test_the_rewind_goes_to_the_newest_snapshot_at_least_min_age_steps_old(tmp_path: Path) -> None:
    """A NaN at 21 with min_age 3: the snapshot of 20 is too young, so the one of 15 (keep 2 holds 15 and 20)."""
    log = tmp_path / "run.jsonl"
    got = train("plain", list(range(STEPS)), poison=lambda i: i == 21, log=log)
    (rewind,) = events(log, "rewind")
    assert (rewind["step"], rewind["to_step"], rewind["skip_until"]) == (21, 15, 26)
    kept = [i for i in range(STEPS) if not 15 <= i < 26]
    assert_same_training(got, train("plain", kept, jump=(26, 26), recovery=None))


def test_with_no_snapshot_old_enough_the_halt_goes_through_and_says_why() -> None:
    with pytest.raises(GradientHalt, match=r"no snapshot at least 3 steps older than step 2 \(held: \[0\]\)") as caught:
        train("plain", list(range(STEPS)), poison=lambda i: i == 2)
    assert caught.value.restored_to is None


def test_past_max_rewinds_the_halt_restores_the_snapshot_first() -> None:
    """max_rewinds 1: the NaN at 23 rewinds to 20; a second at 33 halts, with the weights of the snapshot of 30
    (taken after the window, so equal to the run that trained 0-19 and 28-29)."""
    recovery = {**RECOVERY, "max_rewinds": 1}
    with pytest.raises(GradientHalt, match=r"max_rewinds \(1\) reached") as caught:
        train("plain", list(range(STEPS)), poison=lambda i: i in (FAULT, 33), recovery=recovery)
    assert caught.value.step == 33
    assert caught.value.restored_to == 30
    assert "restored to the recovery snapshot of step 30" in str(caught.value)


def test_the_halted_run_holds_exactly_the_snapshots_state() -> None:
    recovery = {**RECOVERY, "max_rewinds": 0}
    model = Net()
    opt = adamw(model.parameters())
    loop = Loop("plain", model, opt, None)
    with GradGuard(model, policy(recovery=recovery), logger=None) as guard:
        for i in range(20):
            loop.step(i, False)
        at_20 = {k: v.clone() for k, v in model.state_dict().items()}
        for i in range(20, FAULT):
            loop.step(i, False)
        with pytest.raises(GradientHalt):
            loop.step(FAULT, True)
        assert guard.state_dict()["recovery"]["rewinds"] == 0
    assert all(torch.equal(v, at_20[k]) for k, v in model.state_dict().items())
    want = train("plain", list(range(20)), recovery=None)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), want[0].parameters(), strict=True))


def test_a_skip_rule_escalating_past_its_limit_rewinds(tmp_path: Path) -> None:
    """skip_step_on_nonfinite with max_consecutive_skips 2: NaN at 21, 22, 23; the third skip escalates at 23."""
    rules = [
        {
            "name": "skips",
            "match": ["*"],
            "actions": [{"action": "skip_step_on_nonfinite", "max_consecutive_skips": 2}],
        }
    ]
    log = tmp_path / "run.jsonl"
    got = train("plain", list(range(STEPS)), poison=lambda i: 21 <= i <= FAULT, rules=rules, log=log)
    (rewind,) = events(log, "rewind")
    assert (rewind["step"], rewind["to_step"], rewind["rule"]) == (23, 20, "skips")
    assert "3 consecutive skipped steps" in rewind["reason"]
    assert_same_training(got, reference("plain", rules=rules))


def test_in_place_restore_keeps_every_tensor_object_the_loop_holds() -> None:
    model = Net()
    opt = adamw(model.parameters())
    loop = Loop("plain", model, opt, None)
    with GradGuard(model, policy(), logger=None) as guard:
        for i in range(FAULT):
            loop.step(i, False)
        params = [id(p) for p in model.parameters()]
        state = [id(t) for entry in opt.state.values() for t in entry.values()]
        loop.step(FAULT, True)
        assert guard.state_dict()["recovery"]["rewinds"] == 1
        assert params == [id(p) for p in model.parameters()]
        assert state == [id(t) for entry in opt.state.values() for t in entry.values()]


def test_two_rewinds_to_the_same_snapshot_restore_it_as_it_was_taken() -> None:
    """A snapshot is never handed to the optimizer: after a first rewind to 20 trains on, a second to 20 is exact."""
    recovery = {"snapshot_every": 20, "keep": 1, "min_age": 1, "skip_steps": 0}
    got = train("plain", list(range(STEPS)), poison=lambda i: i in (22, 25), recovery=recovery)
    assert got[2].state_dict()["recovery"]["rewinds"] == 2
    kept = [i for i in range(STEPS) if not 20 <= i <= 25]
    assert_same_training(got, train("plain", kept, jump=(26, 26), recovery=None))


def test_lr_factor_multiplies_the_lr_at_each_rewind_and_a_known_scheduler_keeps_it() -> None:
    model = Net()
    opt = sgd(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    loop = Loop("plain", model, opt, None)
    recovery = {**RECOVERY, "lr_factor": 0.5, "skip_steps": 0}
    lrs = []
    with GradGuard(model, policy(recovery=recovery), logger=None, lr_scheduler=scheduler) as guard:
        for i in range(30):
            loop.step(i, i in (FAULT, 27))
            lrs.append(opt.param_groups[0]["lr"])
            scheduler.step()
        assert guard.state_dict()["recovery"]["lr_scale"] == 0.25
    # The schedule goes on from the snapshot's step (20) at half the LR; the NaN at 27 rewinds to 20 again
    # (the snapshot of 25 is younger than min_age), at a quarter.
    assert lrs[22] == pytest.approx(0.1 / 23)
    assert lrs[24] == pytest.approx(0.5 * 0.1 / 21)  # step 24 is the schedule's 21st applied step
    assert lrs[26] == pytest.approx(0.5 * 0.1 / 23)
    assert lrs[28] == pytest.approx(0.25 * 0.1 / 21)
    assert lrs[29] == pytest.approx(0.25 * 0.1 / 22)


def test_pass_step_lets_a_loop_skip_the_compute_of_the_window_with_the_same_result() -> None:
    model = Net()
    opt = adamw(model.parameters())
    loop = Loop("plain", model, opt, None)
    passed = []
    with GradGuard(model, policy(), logger=None) as guard:
        for i in range(STEPS):
            if guard.pass_step():
                passed.append(i)
                continue
            loop.step(i, i == FAULT)
        assert guard.step_count == STEPS
    assert passed == [24, 25, 26, 27]
    want = reference("plain")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), want[0].parameters(), strict=True))


def test_snapshot_bytes_are_in_the_attach_event_and_the_metrics_and_given_back_at_removal(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    model = Net()
    loop = Loop("plain", model, adamw(model.parameters()), None)
    with GradGuard(model, policy(None, RECOVERY), logger=None, audit_log=log) as guard:
        for i in range(12):
            loop.step(i, False)
        metrics = guard.metrics()
    (attach,) = events(log, "attach")
    params = sum(p.numel() * 4 for p in model.parameters())
    assert attach["recovery"]["snapshot_bytes"] == 2 * params  # keep 2, before the optimizer holds state
    assert attach["recovery"]["snapshot_every"] == 5
    step_tensors = 6 * 4  # AdamW's step, one float32 per parameter tensor
    assert metrics["gradguard/recovery/snapshot_bytes"] == 2 * (3 * params + step_tensors)
    assert metrics["gradguard/recovery/snapshots"] == 2
    given_back = guard.metrics()
    assert given_back["gradguard/recovery/snapshot_bytes"] == given_back["gradguard/recovery/snapshots"] == 0
    assert given_back["gradguard/recovery/rewinds"] == 0


def test_a_recovery_section_that_can_never_fire_is_refused_naming_the_key() -> None:
    rules = [{"name": "clip", "match": ["*"], "actions": [{"action": "clip_norm", "max_norm": 1.0}]}]
    with pytest.raises(PolicyError, match=r"recovery: no rule can halt"):
        policy(rules)
    with pytest.raises(PolicyError, match=r"recovery.keep: got 0"):
        policy(recovery={"snapshot_every": 5, "keep": 0})
    with pytest.raises(PolicyError, match=r"recovery.lr_factor"):
        policy(recovery={"snapshot_every": 5, "lr_factor": 0})
    with pytest.raises(PolicyError, match=r"recovery.snapshot_evry: unknown field .*did you mean 'snapshot_every'"):
        policy(recovery={"snapshot_evry": 5})


def test_a_hot_reload_keeps_the_snapshots(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"version": 1, "rules": [HALT], "recovery": RECOVERY}))
    model = Net()
    opt = adamw(model.parameters())
    loop = Loop("plain", model, opt, None)
    with GradGuard(model, path, logger=None) as guard:
        for i in range(22):
            loop.step(i, False)
        path.write_text(json.dumps({"version": 1, "rules": [HALT], "recovery": {**RECOVERY, "skip_steps": 1}}))
        assert guard.reload()
        loop.step(22, False)  # the new policy takes over here
        loop.step(FAULT, True)
        assert guard.state_dict()["recovery"] == {"rewinds": 1, "skip_until": 25, "lr_scale": 1.0, "applied": 20}


def test_replacing_the_models_parameters_drops_the_snapshots_of_the_old_ones() -> None:
    """After ``module.weight = nn.Parameter(...)`` (a rebind), a snapshot of the old tensors is not restored into the
    new ones: a NaN before the next snapshot halts, saying none is held."""
    model = Net()
    opt = sgd(model.parameters(), lr=1e-2)
    loop = Loop("plain", model, opt, None)
    with GradGuard(model, policy([HALT]), logger=None) as guard:
        for i in range(12):
            loop.step(i, False)
        model.out.weight = nn.Parameter(model.out.weight.detach().clone())
        opt.param_groups[0]["params"][-2] = model.out.weight
        loop.step(12, False)
        assert guard._enforcer.recovery.snapshots == []
        with pytest.raises(GradientHalt, match=r"no snapshot at least 3 steps older than step 13 \(held: \[\]\)"):
            loop.step(13, True)


def _batchnorm_run(steps: list[int], *, pass_steps: bool, recovery: dict[str, Any] | None, jump: int | None = None):
    model = BatchNormNet()
    opt = sgd(model.parameters(), lr=0.05, momentum=0.9)
    with GradGuard(model, policy([HALT], recovery), logger=None) as guard:
        for i in steps:
            if jump is not None and i == jump:
                state = guard.state_dict()
                state["step"] = jump
                guard.load_state_dict(state)
            if pass_steps and guard.pass_step():
                continue
            x, y = DATA[i]
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            (loss * float("nan") if recovery is not None and i == FAULT else loss).backward()
            opt.step()
    return model, opt


@pytest.mark.parametrize("pass_steps", [False, True], ids=["window-computed", "window-passed"])
def test_batchnorm_running_statistics_rewind_exactly(pass_steps: bool) -> None:
    """The snapshot holds the buffers as they were before the snapshot step's forward, and the window's forwards
    (if the loop computes them) are undone: BatchNorm's running mean, variance and count end as in the run that
    never saw batches 20-27."""
    got = _batchnorm_run(list(range(STEPS)), pass_steps=pass_steps, recovery=RECOVERY)
    kept = [i for i in range(STEPS) if i not in NEVER_LEARNED]
    want = _batchnorm_run(kept, pass_steps=False, recovery=None, jump=NEVER_LEARNED.stop)
    for (name, a), b in zip(got[0].state_dict().items(), want[0].state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert got[0].norm.num_batches_tracked.item() == len(kept)


def test_a_one_cycle_schedules_momentum_is_held_through_the_window_too() -> None:
    """OneCycleLR cycles SGD's momentum with the LR: the first applied step after the window uses the momentum of
    the snapshot's point of the cycle, as the run that never saw the undone batches does."""

    def run(
        steps: list[int], recovery: dict[str, Any] | None, jump: int | None = None
    ) -> list[tuple[int, float, float]]:
        model = Net()
        opt = sgd(model.parameters(), lr=0.1, momentum=0.9)
        schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS + 1)
        loop = Loop("plain", model, opt, None)
        used = []
        with GradGuard(model, policy([HALT], recovery), logger=None, lr_scheduler=schedule) as guard:
            for i in steps:
                if jump is not None and i == jump:
                    state = guard.state_dict()
                    state["step"] = jump
                    guard.load_state_dict(state)
                loop.step(i, recovery is not None and i == FAULT)
                if not guard.last_step_skipped and i not in NEVER_LEARNED:  # 20-22 were applied, then undone
                    used.append((i, opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]))
                schedule.step()
        return used

    kept = [i for i in range(STEPS) if i not in NEVER_LEARNED]
    assert run(list(range(STEPS)), RECOVERY) == run(kept, None, jump=NEVER_LEARNED.stop)


def test_a_run_resumed_inside_a_skip_window_holds_its_schedule_as_the_uninterrupted_one() -> None:
    """guard.state_dict() taken at step 25 (inside the window 24-27) carries what the window holds: a new guard
    loaded with it ends with the same schedule and weights as the run that was never interrupted."""

    def run(resume_at: int | None) -> tuple[Net, torch.optim.lr_scheduler.LRScheduler]:
        model = Net()
        opt = sgd(model.parameters(), lr=0.1)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        loop = Loop("plain", model, opt, None)
        guard = GradGuard(model, policy([HALT]), logger=None, lr_scheduler=schedule)
        try:
            for i in range(STEPS):
                if i == resume_at:
                    state = guard.state_dict()
                    guard.remove()
                    guard = GradGuard(model, policy([HALT]), logger=None, lr_scheduler=schedule)
                    guard.load_state_dict(state)
                loop.step(i, i == FAULT)
                schedule.step()
        finally:
            guard.remove()
        return model, schedule

    straight, resumed = run(None), run(25)
    assert resumed[1].last_epoch == straight[1].last_epoch == STEPS - 8
    assert all(torch.equal(a, b) for a, b in zip(straight[0].parameters(), resumed[0].parameters(), strict=True))


def test_each_memory_case_runs_the_copy_path_it_names(memory: str) -> None:
    """device: device buffers; host (a roomy device): through the staging buffer; auto (a full device): host, direct."""
    placement = train("plain", list(range(12)))[2]._enforcer.recovery.placement
    assert placement is not None
    assert (placement.memory, placement.where, placement.staged) == {
        "device": ("device", "device", False),
        "host": ("host", "host", True),
        "auto": ("auto", "host", False),
    }[memory]
