"""Recovery where people live (issue 36): an EMA of the weights rewound with the model (``averages=``), and a
rewind that is all or nothing (a buffer that changed shape since the snapshot halts, restoring nothing).

A NaN at step 23 with ``recovery: {snapshot_every: 5, keep: 2, min_age: 3, skip_steps: 4}`` rewinds to step 20's
snapshot and skips steps 24-27: the run (its EMA included) ends bitwise equal to the twin that trained on the
batches of steps 0-19 and 28-39 only, whose guard is told step 28 before batch 28.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.training import BatchNormNet
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from gradguard import GradGuard, GradientHalt, GuardStateError, Policy

STEPS = 40
FAULT = 23
RECOVERY = {"snapshot_every": 5, "keep": 2, "min_age": 3, "skip_steps": 4}
NEVER_LEARNED = range(20, 28)  # the snapshot's step (20) to the end of the window (23 + 4)
KEPT = [i for i in range(STEPS) if i not in NEVER_LEARNED]
HALT = {"name": "nonfinite", "match": ["*"], "actions": [{"action": "halt_on_nonfinite"}]}


def policy(recovery: dict[str, Any] | None = RECOVERY) -> Policy:
    data: dict[str, Any] = {"version": 1, "rules": [HALT]}
    if recovery is not None:
        data["recovery"] = recovery
    return Policy.from_dict(data)


class ModelEmaV3(nn.Module):
    """timm's ``timm.utils.ModelEmaV3`` (timm/utils/model_ema.py), its API and update rule, as timm is no test
    dependency: a deep copy of the model whose floating-point parameters and buffers are lerped towards the model's
    (the others copied) by ``update(model, step=None)``, with timm's decay warm-up by step."""

    def __init__(
        self,
        model: nn.Module,
        decay: float = 0.9999,
        min_decay: float = 0.0,
        update_after_step: int = 0,
        use_warmup: bool = False,
        warmup_gamma: float = 1.0,
        warmup_power: float = 2 / 3,
        device: torch.device | None = None,
        foreach: bool = True,
        exclude_buffers: bool = False,
    ) -> None:
        super().__init__()
        self.module = copy.deepcopy(model)
        self.module.eval()
        self.decay = decay
        self.min_decay = min_decay
        self.update_after_step = update_after_step
        self.use_warmup = use_warmup
        self.warmup_gamma = warmup_gamma
        self.warmup_power = warmup_power
        self.foreach = foreach
        self.device = device
        self.exclude_buffers = exclude_buffers
        if self.device is not None and device != next(model.parameters()).device:
            self.foreach = False
            self.module.to(device=device)

    def get_decay(self, step: int | None = None) -> float:
        if step is None:
            return self.decay
        step = max(0, step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        if self.use_warmup:
            decay = 1 - (1 + step / self.warmup_gamma) ** -self.warmup_power
            return max(min(decay, self.decay), self.min_decay)
        return self.decay

    @torch.no_grad()
    def update(self, model: nn.Module, step: int | None = None) -> None:
        decay = self.get_decay(step)
        if self.exclude_buffers:
            self.apply_update_no_buffers_(model, decay)
        else:
            self.apply_update_(model, decay)

    def apply_update_(self, model: nn.Module, decay: float) -> None:
        if self.foreach:
            ema_lerp_values, model_lerp_values = [], []
            for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values(), strict=True):
                if ema_v.is_floating_point():
                    ema_lerp_values.append(ema_v)
                    model_lerp_values.append(model_v)
                else:
                    ema_v.copy_(model_v)
            torch._foreach_lerp_(ema_lerp_values, model_lerp_values, weight=1.0 - decay)
        else:
            for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values(), strict=True):
                if ema_v.is_floating_point():
                    ema_v.lerp_(model_v.to(device=self.device), weight=1.0 - decay)
                else:
                    ema_v.copy_(model_v.to(device=self.device))

    def apply_update_no_buffers_(self, model: nn.Module, decay: float) -> None:
        ema_params, model_params = tuple(self.module.parameters()), tuple(model.parameters())
        if self.foreach:
            torch._foreach_lerp_(ema_params, model_params, weight=1.0 - decay)
        else:
            for ema_p, model_p in zip(ema_params, model_params, strict=True):
                ema_p.lerp_(model_p.to(device=self.device), weight=1.0 - decay)
        for ema_b, model_b in zip(self.module.buffers(), model.buffers(), strict=True):
            ema_b.copy_(model_b.to(device=self.device))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def batches(count: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=gen), torch.randn(6, 2, generator=gen)) for _ in range(count)]


DATA = batches()


@torch.no_grad()
def plain_ema_update(average: nn.Module, model: nn.Module, step: int) -> None:
    """A loop's own EMA: a deep copy of the model, each tensor moved 10% of the way at every step."""
    for mine, theirs in zip(average.state_dict().values(), model.state_dict().values(), strict=True):
        mine.lerp_(theirs, 0.1) if mine.is_floating_point() else mine.copy_(theirs)


AVERAGES: dict[str, tuple[Callable[[nn.Module], nn.Module], Callable[[Any, nn.Module, int], None]]] = {
    "timm-ModelEmaV3": (lambda m: ModelEmaV3(m, decay=0.9), lambda ema, m, i: ema.update(m, step=i)),
    "timm-ModelEmaV3-warmup-no-buffers": (
        lambda m: ModelEmaV3(m, decay=0.99, use_warmup=True, foreach=False, exclude_buffers=True),
        lambda ema, m, i: ema.update(m),  # no step: the decay warm-up would count the loop's steps
    ),
    "AveragedModel-ema": (
        lambda m: AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True),
        lambda ema, m, i: ema.update_parameters(m),
    ),
    "AveragedModel-swa": (lambda m: AveragedModel(m), lambda ema, m, i: ema.update_parameters(m)),
    "plain-module": (lambda m: copy.deepcopy(m), plain_ema_update),
}


def ema_run(
    kind: str, steps: list[int], *, pass_steps: bool = False, recovery: dict[str, Any] | None = RECOVERY
) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, GradGuard]:
    """Train ``steps`` (batch indices), the EMA updated after every optimizer step; with recovery a NaN at 23 and
    ``averages=[ema]``; without, the twin: the guard's step set to 28 before batch 28."""
    model = BatchNormNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    make, update = AVERAGES[kind]
    average = make(model)
    averages = [average] if recovery is not None else []
    with GradGuard(model, policy(recovery), logger=None, averages=averages) as guard:
        for i in steps:
            if recovery is None and i == NEVER_LEARNED.stop:
                state = guard.state_dict()
                state["step"] = i
                guard.load_state_dict(state)
            if pass_steps and guard.pass_step():
                continue
            x, y = DATA[i]
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            (loss * float("nan") if recovery is not None and i == FAULT else loss).backward()
            opt.step()
            update(average, model, i)
    return model, opt, average, guard


def assert_equal_tensors(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert got.keys() == want.keys(), what
    for name, value in got.items():
        assert torch.equal(value, want[name]), f"{what}: {name} differs"


@pytest.mark.parametrize("pass_steps", [False, True], ids=["window-computed", "window-passed"])
@pytest.mark.parametrize("kind", list(AVERAGES))
def test_an_ema_given_in_averages_ends_bitwise_equal_to_the_twins_after_a_rewind(kind: str, pass_steps: bool) -> None:
    """The EMA is snapshotted with the model, restored in place by the rewind, and its updates on the fault step and
    in the skip window (computed or passed) are undone: it ends as the EMA of the run that never saw steps 20-27."""
    model, opt, average, guard = ema_run(kind, list(range(STEPS)), pass_steps=pass_steps)
    want_model, want_opt, want_average, _ = ema_run(kind, KEPT, recovery=None)
    assert guard.state_dict()["recovery"]["rewinds"] == 1
    assert_equal_tensors(model.state_dict(), want_model.state_dict(), "model")
    assert_equal_tensors(average.state_dict(), want_average.state_dict(), "EMA")
    for index, entry in opt.state_dict()["state"].items():
        assert_equal_tensors(entry, want_opt.state_dict()["state"][index], "optimizer state")
    if isinstance(average, AveragedModel):
        assert int(average.n_averaged) == len(KEPT)


def test_without_averages_the_ema_keeps_the_undone_steps_contributions() -> None:
    """What the issue saw: an EMA the guard does not know is not rewound (so the test above tests something)."""
    model = BatchNormNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    average = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    with GradGuard(model, policy(), logger=None):
        for i in range(STEPS):
            x, y = DATA[i]
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            (loss * float("nan") if i == FAULT else loss).backward()
            opt.step()
            average.update_parameters(model)
    assert int(average.n_averaged) == STEPS


def test_a_rewind_restores_the_averages_in_place() -> None:
    """Every tensor of the EMA keeps its identity through a rewind: references the loop (or a compiled update) holds
    stay valid."""
    model = BatchNormNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    average = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ids = [id(t) for t in (*average.parameters(), *average.buffers())]
    with GradGuard(model, policy(), logger=None, averages=[average]) as guard:
        for i in range(FAULT + 1):
            x, y = DATA[i]
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            (loss * float("nan") if i == FAULT else loss).backward()
            opt.step()
            if i == FAULT:
                assert guard.state_dict()["recovery"]["rewinds"] == 1
                assert int(average.n_averaged) == 20  # the snapshot's: updates 0-19
            average.update_parameters(model)
    assert ids == [id(t) for t in (*average.parameters(), *average.buffers())]


def test_the_averages_bytes_are_counted_in_snapshot_bytes(tmp_path: Path) -> None:
    def run(averages: bool) -> tuple[dict[str, Any], dict[str, float], int]:
        model = BatchNormNet()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        average = AveragedModel(model)
        log = tmp_path / f"{averages}.jsonl"
        with GradGuard(model, policy(), logger=None, audit_log=log, averages=[average] if averages else []) as g:
            for i in range(12):
                x, y = DATA[i]
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                average.update_parameters(model)
            metrics = g.metrics()  # while attached: a removed guard holds no snapshot
        (attach,) = [e for line in log.read_text().splitlines() if (e := json.loads(line))["event"] == "attach"]
        ema_bytes = sum(t.numel() * t.element_size() for t in (*average.parameters(), *average.buffers()))
        return attach["recovery"], metrics, ema_bytes

    without, with_ = run(False), run(True)
    ema_bytes = with_[2]
    assert with_[0]["snapshot_bytes"] == without[0]["snapshot_bytes"] + 2 * ema_bytes  # keep: 2
    got, want = with_[1]["gradguard/recovery/snapshot_bytes"], without[1]["gradguard/recovery/snapshot_bytes"]
    assert got == want + 2 * ema_bytes


def test_averages_must_be_modules_other_than_the_model() -> None:
    model = BatchNormNet()
    with pytest.raises(TypeError, match=r"averages must be nn\.Modules.*got Tensor"):
        GradGuard(model, policy(), logger=None, averages=[torch.zeros(1)])
    with pytest.raises(ValueError, match=r"averages: BatchNormNet is the guarded model itself"):
        GradGuard(model, policy(), logger=None, averages=[model])


# --- a rewind is all or nothing -------------------------------------------------------------------


class CacheNet(nn.Module):
    """A cache buffer, as older rotary-embedding code keeps one: re-registered larger for a longer sequence."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 2)
        self.register_buffer("cache", torch.ones(4, 16))

    def grow(self) -> None:
        self.register_buffer("cache", torch.ones(8, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)) * self.cache[0])


def cache_run(steps: range, *, guarded: bool, recovery: dict[str, Any] = RECOVERY) -> tuple[CacheNet, Any, Any]:
    """Train ``steps``, the cache grown at step 22 and (guarded) a NaN at 23; returns what the halt raised."""
    model = CacheNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = GradGuard(model, policy(recovery), logger=None) if guarded else None
    raised = None
    try:
        for i in steps:
            if i == 22:
                model.grow()
            x, y = DATA[i]
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            (loss * float("nan") if guarded and i == FAULT else loss).backward()
            opt.step()
    except (GradientHalt, GuardStateError) as error:
        raised = error
    finally:
        if guard is not None:
            guard.remove()
    return model, opt, (raised, guard)


@pytest.mark.parametrize("max_rewinds", [3, 0], ids=["rewind", "max-rewinds-reached"])
def test_a_buffer_that_grew_since_the_snapshot_halts_with_the_state_of_the_last_good_step(max_rewinds: int) -> None:
    """The cache re-registered larger at step 22, a NaN at 23: the snapshot of step 20 does not fit, so nothing of it
    is restored (not the parameters, not the optimizer state) and the run halts with a GradientHalt naming the
    buffer and its shapes, its state exactly the unguarded twin's after step 22."""
    model, opt, (raised, guard) = cache_run(
        range(STEPS), guarded=True, recovery={**RECOVERY, "max_rewinds": max_rewinds}
    )
    assert isinstance(raised, GradientHalt), raised
    assert raised.step == FAULT
    assert raised.restored_to is None
    message = str(raised)
    assert "buffer 'cache' is [8, 16] float32 on cpu, [4, 16] float32 on cpu in the snapshot" in message
    assert "the snapshot of step 20 cannot be restored" in message
    assert "as they were after the last good step" in message
    assert guard.state_dict()["recovery"]["rewinds"] == 0
    want_model, want_opt, _ = cache_run(range(FAULT), guarded=False)
    assert_equal_tensors(model.state_dict(), want_model.state_dict(), "model")
    got_state, want_state = opt.state_dict(), want_opt.state_dict()
    assert got_state["param_groups"] == want_state["param_groups"]
    for index, entry in got_state["state"].items():
        assert_equal_tensors(entry, want_state["state"][index], "optimizer state")


def test_an_optimizer_view_sharing_another_ones_state_is_counted_once_in_snapshot_bytes() -> None:
    """DeepSpeed ZeRO 3's ``Stage3Partitions`` shares the inner optimizer's state, whose own groups are empty outside
    its step: the snapshot copies that state once (the view's parameters'), and the estimate counts it once."""
    import weakref

    from gradguard.enforce.recovery.snapshot_places import snapshot_bytes
    from gradguard.enforce.recovery.snapshots import LiveState
    from gradguard.enforce.work.skips import SkipBook
    from gradguard.enforce.work.statistics import Statistics

    model = nn.Linear(4, 4)
    masters = [nn.Parameter(torch.zeros(64)), nn.Parameter(torch.zeros(32))]
    inner = torch.optim.Adam(masters, lr=0.1)
    for master in masters:
        master.grad = torch.ones_like(master)
    inner.step()  # exp_avg, exp_avg_sq (and step) for each master
    view = torch.optim.SGD(masters, lr=0.1)
    view.state = inner.state  # the view's state is the inner optimizer's own dict
    inner.param_groups[0]["params"] = []  # outside its step, ZeRO 3's inner groups hold nothing
    live = LiveState(weakref.ref(model), Statistics(), SkipBook())  # type: ignore[arg-type]
    live.known_optimizers = [weakref.ref(inner), weakref.ref(view)]
    weights = sum(p.numel() * 4 for p in model.parameters())
    state = sum(v.numel() * v.element_size() for entry in inner.state.values() for v in entry.values())
    masters_bytes = sum(m.numel() * 4 for m in masters)  # the view's parameters, outside the model
    assert snapshot_bytes(live) == weights + state + masters_bytes
