"""The policy's ``loss`` section: a loss spike or a NaN loss skips the step or halts (rewinds under recovery), learned
from the roots of ``backward()`` with no change to the loop, in one host read per step."""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.host_syncs import count_host_syncs
from torch import nn

from gradguard import GradGuard, GradientHalt, Policy, PolicyError
from gradguard.events.counters import BUILT_IN_RULES
from gradguard.policy.schema import RESERVED_RULE_NAMES

HALT = {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}
SPIKE = {"spike": {"factor": 10, "window": 20, "warmup": 10}}
STEPS = 40
SPIKED = 30


def policy(loss: dict[str, Any] | None = None, recovery: dict[str, Any] | None = None) -> Policy:
    data: dict[str, Any] = {"version": 1, "rules": [HALT], "loss": SPIKE if loss is None else loss}
    if recovery is not None:
        data["recovery"] = recovery
    return Policy.from_dict(data)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def batch(step: int, rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(rows, 8, generator=gen), torch.randn(rows, 1, generator=gen)


def events(log: Path, kind: str) -> list[dict[str, Any]]:
    return [e for line in log.read_text().splitlines() if (e := json.loads(line))["event"] == kind]


def state_of(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    return tensors + [t.clone() for entry in opt.state.values() for t in entry.values() if isinstance(t, torch.Tensor)]


def unchanged(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    return len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def plain(model: nn.Module, opt: torch.optim.Optimizer, step: int, scale: float) -> float:
    x, y = batch(step)
    loss = nn.functional.mse_loss(model(x), y) * scale
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def accumulating(model: nn.Module, opt: torch.optim.Optimizer, step: int, scale: float) -> float:
    x, y = batch(step)
    opt.zero_grad()
    total = 0.0
    for part in range(4):
        rows = slice(4 * part, 4 * part + 4)
        loss = nn.functional.mse_loss(model(x[rows]), y[rows]) * scale / 4
        loss.backward()
        total += float(loss)
    opt.step()
    return total


def make_scaled() -> Callable[[nn.Module, torch.optim.Optimizer, int, float], float]:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)

    def scaled(model: nn.Module, opt: torch.optim.Optimizer, step: int, scale: float) -> float:
        x, y = batch(step)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y) * scale
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)
        scaler.step(opt)
        scaler.update()
        return float(loss.detach())

    return scaled


LOOPS = {"plain": lambda: plain, "accumulation": lambda: accumulating, "grad-scaler-fp16": make_scaled}


@pytest.mark.parametrize("loop", list(LOOPS))
def test_a_50x_loss_spike_after_warm_up_is_skipped_with_no_change_to_the_loop(loop: str, tmp_path: Path) -> None:
    train = LOOPS[loop]()
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    log = tmp_path / "run.jsonl"
    losses = []
    with GradGuard(model, policy(), logger=None, audit_log=log) as guard:
        for step in range(STEPS):
            before = state_of(model, opt)
            losses.append(train(model, opt, step, 50.0 if step == SPIKED else 1.0))
            assert guard.last_step_skipped == (step == SPIKED), step
            if step == SPIKED:
                assert unchanged(before, state_of(model, opt)), "the spiked step changed no parameter or state"
        assert guard.counters.snapshot()["loss"] == {"spike": 1}
        assert guard.step_count == STEPS
    (spike,) = events(log, "loss_spike")
    assert spike["step"] == SPIKED
    assert spike["action"] == "skip"
    assert spike["factor"] == 10
    assert spike["loss"] == pytest.approx(losses[SPIKED], rel=1e-6), "the unscaled loss, summed over micro-batches"
    recent = sorted(losses[SPIKED - 20 : SPIKED])
    assert spike["reference"] == pytest.approx((recent[9] + recent[10]) / 2, rel=1e-6), "the median of 20 losses"


def test_an_ordinary_run_of_300_steps_with_a_falling_noisy_loss_flags_no_spike(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    target = nn.Linear(8, 1)
    strict = {"spike": {"factor": 10, "window": 100, "warmup": 20}}
    with GradGuard(model, policy(strict), logger=None) as guard:
        for step in range(300):
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
            with torch.no_grad():
                y = target(x) + 0.3 * torch.randn(8, 1, generator=torch.Generator().manual_seed(10_000 + step))
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        assert "loss" not in guard.counters.snapshot()
        assert guard.state_dict()["loss"]["seen"] == 300


def test_a_nan_loss_with_finite_gradients_halts_before_the_update() -> None:
    """A NaN added to the loss leaves every gradient finite: only the loss section can see it."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradGuard(model, policy({"nonfinite": "halt"}), logger=None) as guard:
        for step in range(5):
            plain(model, opt, step, 1.0)
        x, y = batch(5)
        loss = nn.functional.mse_loss(model(x), y) + torch.tensor(float("nan"))
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        before = state_of(model, opt)
        with pytest.raises(GradientHalt, match="the loss is nan") as caught:
            opt.step()
        assert unchanged(before, state_of(model, opt))
        assert (caught.value.rule, caught.value.kind, caught.value.step) == ("loss", "nan", 5)
        assert guard.counters.snapshot()["loss"] == {"nonfinite": 1, "halt": 1}


def test_a_step_the_loss_halts_counts_and_logs_none_of_its_clips(tmp_path: Path) -> None:
    """The clips of a step that a ruling halts (the loss's here; the ranks' and a re-run's alike) did not happen: not
    counted, not logged, as for a gradient's own halt. Every tensor is clipped at every step before it."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tmp_path / "audit.jsonl"
    clip = {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 1e-6}]}
    clipping = Policy.from_dict({"version": 1, "rules": [HALT, clip], "loss": {"nonfinite": "halt"}})
    with GradGuard(model, clipping, logger=None, audit_log=log) as guard:
        for step in range(5):
            plain(model, opt, step, 1.0)
        x, y = batch(5)
        opt.zero_grad()
        (nn.functional.mse_loss(model(x), y) + torch.tensor(float("nan"))).backward()
        with pytest.raises(GradientHalt, match="the loss is nan"):
            opt.step()
        counters = guard.counters.snapshot()
    tensors = len(list(model.parameters()))
    assert counters["clip"] == {"clip_norm": 5 * tensors}
    assert sorted({event["step"] for event in events(log, "intervention")}) == [0, 1, 2, 3, 4]


RECOVERY = {"snapshot_every": 5, "keep": 2, "min_age": 3, "skip_steps": 4}


def run(
    steps: list[int], poison: Callable[[int], float], loss: dict[str, Any], recovery: dict[str, Any] | None
) -> tuple[nn.Module, torch.optim.Optimizer, GradGuard]:
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with GradGuard(model, policy(loss, recovery), logger=None) as guard:
        for step in steps:
            if step == 28 and recovery is None and 20 not in steps:
                state = guard.state_dict()
                state["step"] = 28
                guard.load_state_dict(state)
            x, y = batch(step)
            bad = poison(step)  # NaN: added (the gradients stay finite); else a factor
            value = nn.functional.mse_loss(model(x), y) * (1.0 if math.isnan(bad) else bad) + (
                bad if math.isnan(bad) else 0
            )
            opt.zero_grad()
            value.backward()
            opt.step()
    return model, opt, guard


@pytest.mark.parametrize(
    ("loss", "poison"),
    [
        ({"nonfinite": "halt"}, lambda step: math.nan if step == 23 else 1.0),
        ({"spike": {"factor": 10, "window": 10, "warmup": 5, "action": "halt"}}, lambda s: 50.0 if s == 23 else 1.0),
    ],
    ids=["nan-loss", "spike"],
)
def test_under_recovery_a_bad_loss_rewinds_and_the_run_equals_the_one_that_never_trained_the_stretch(
    loss: dict[str, Any], poison: Callable[[int], float]
) -> None:
    got = run(list(range(STEPS)), poison, loss, RECOVERY)
    assert got[2].counters.snapshot()["loss"]["rewind"] == 1
    kept = [step for step in range(STEPS) if not 20 <= step < 28]
    want = run(kept, lambda step: 1.0, loss, None)
    for p, q in zip(got[0].parameters(), want[0].parameters(), strict=True):
        assert torch.equal(p, q)
    for a, b in zip(got[1].state.values(), want[1].state.values(), strict=True):
        assert all(torch.equal(a[key], b[key]) for key in a)
    assert got[2].state_dict()["loss"]["history"] == want[2].state_dict()["loss"]["history"]


def test_the_reference_round_trips_through_the_guards_state_dict() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with GradGuard(model, policy(), logger=None) as guard:
        for step in range(12):
            plain(model, opt, step, 1.0)
        saved = guard.state_dict()
    assert saved["loss"]["seen"] == 12
    assert len(saved["loss"]["history"]) == 12
    resumed_model = copy.deepcopy(model)
    resumed_opt = torch.optim.SGD(resumed_model.parameters(), lr=0.05)
    with GradGuard(resumed_model, policy(), logger=None) as resumed:
        resumed.load_state_dict(saved)
        assert resumed.state_dict()["loss"] == saved["loss"]
        plain(resumed_model, resumed_opt, 12, 50.0)  # judged at once: the reference came with the state
        assert resumed.counters.snapshot()["loss"] == {"spike": 1}


def test_the_loss_rides_the_steps_one_host_read() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = batch(0)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    unguarded = count_host_syncs(opt.step)
    with GradGuard(model, policy(), logger=None) as guard:
        for step in range(1, 15):
            x, y = batch(step)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            assert count_host_syncs(loss.backward) == 0
            assert count_host_syncs(opt.step) - unguarded == 1
        assert guard.metrics()["gradguard/loss"] == pytest.approx(float(loss))


def test_a_backward_of_a_tensor_that_is_not_a_scalar_is_said_once_and_judged_never(tmp_path: Path) -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    log = tmp_path / "run.jsonl"
    with GradGuard(model, policy(), logger=None, audit_log=log) as guard:
        for step in range(3):
            x, _ = batch(step)
            opt.zero_grad()
            model(x).backward(torch.ones(16, 1))
            opt.step()
        assert "loss" not in guard.counters.snapshot()
    (unseen,) = events(log, "loss_unseen")
    assert "shape (16, 1)" in unseen["why"]


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"spike": {"factor": 1.0}}, "loss.spike.factor"),
        ({"spike": {"window": 0}}, "loss.spike.window"),
        ({"nonfinite": "rewind"}, "loss.nonfinite"),
        ({"spike": {"action": "clip"}}, "loss.spike.action"),
        ({"spike": {"max_skips": 2}}, "max_skips and window_steps go together"),
        ({"spike": {"max_skips": 5, "window_steps": 2}}, "max_skips (5) cannot exceed window_steps (2)"),
    ],
)
def test_a_bad_loss_section_is_a_policy_error_naming_its_field(section: dict[str, Any], field: str) -> None:
    with pytest.raises(PolicyError, match=re.escape(field)):
        Policy.from_dict({"version": 1, "rules": [HALT], "loss": section})


def test_a_loss_section_that_halts_lets_recovery_fire_without_a_halting_rule() -> None:
    clip = {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 1.0}]}
    data = {"version": 1, "rules": [clip], "loss": {"nonfinite": "halt"}, "recovery": {"snapshot_every": 5}}
    assert Policy.from_dict(data).loss is not None
    with pytest.raises(PolicyError, match="recovery would never rewind"):
        Policy.from_dict(data | {"loss": {"nonfinite": "skip"}})


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_a_lightning_fit_skips_a_loss_spike_with_the_callback_alone(manual: bool, tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from gradguard.integrations.lightning import GradGuardCallback

    class Spiky(pl.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = net()
            self.automatic_optimization = not manual
            self.params_at: list[list[torch.Tensor]] = []

        def training_step(self, data: Any, index: int) -> torch.Tensor | None:
            x, y = data
            loss = nn.functional.mse_loss(self.net(x), y) * (50.0 if self.global_step == SPIKED else 1.0)
            if not manual:
                return loss
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return None

        def on_train_batch_end(self, *args: Any) -> None:
            self.params_at.append([p.detach().clone() for p in self.parameters()])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    xs, ys = zip(*(batch(step) for step in range(STEPS)), strict=True)
    data = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    module = Spiky()
    callback = GradGuardCallback(policy(), audit_log=tmp_path / "run.jsonl", logger=None)
    trainer = pl.Trainer(
        max_epochs=1, callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.fit(module, loader)
    (spike,) = events(tmp_path / "run.jsonl", "loss_spike")
    step = spike["step"]
    assert step in (SPIKED, SPIKED + 1)
    assert all(torch.equal(a, b) for a, b in zip(module.params_at[step - 1], module.params_at[step], strict=True))


@pytest.mark.parametrize("accumulation", [1, 4])
def test_a_hugging_face_trainer_skips_a_loss_spike_with_the_callback_alone(accumulation: int, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from support.training import hf_training_args

    from gradguard.integrations.transformers import GradGuardCallback

    class Regressor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net()
            self.calls = 0

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            self.calls += 1  # one call per micro-batch: the spike is the whole of optimizer step SPIKED's batches
            spiked = (self.calls - 1) // accumulation == 12
            return {"loss": nn.functional.mse_loss(self.net(x), y) * (50.0 if spiked else 1.0)}

    xs, ys = batch(0, rows=16 * 20 * accumulation)
    data = [{"x": x, "y": y} for x, y in zip(xs, ys, strict=True)]
    model = Regressor()
    log = tmp_path / "run.jsonl"
    loss = {"spike": {"factor": 10, "window": 10, "warmup": 5}}
    callback = GradGuardCallback(policy(loss), logger=None, audit_log=log)
    args = hf_training_args(
        tmp_path, max_steps=20, per_device_train_batch_size=16, gradient_accumulation_steps=accumulation
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    (spike,) = events(log, "loss_spike")
    assert spike["step"] == 12
    assert spike["action"] == "skip"


def test_a_monitor_records_the_loss_beside_the_norms_without_a_loss_section(tmp_path: Path) -> None:
    """What ``gradguard suggest`` reads to propose a loss section: the loss in each ``stats`` event."""
    record = {"name": "record", "match": "*", "actions": [{"action": "monitor", "stats": ["norm"], "every": 1}]}
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    log = tmp_path / "run.jsonl"
    losses = []
    with GradGuard(model, Policy.from_dict({"version": 1, "rules": [record]}), logger=None, audit_log=log):
        for step in range(5):
            losses.append(plain(model, opt, step, 1.0))
    assert [e["loss"] for e in events(log, "stats")] == pytest.approx(losses, rel=1e-6)


def test_a_closure_step_judges_the_loss_its_closure_computed(tmp_path: Path) -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    log = tmp_path / "run.jsonl"
    with GradGuard(model, policy(), logger=None, audit_log=log) as guard:
        for step in range(STEPS):

            def closure(step: int = step) -> torch.Tensor:
                x, y = batch(step)
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y) * (50.0 if step == SPIKED else 1.0)
                loss.backward()
                return loss

            opt.step(closure)
            assert guard.last_step_skipped == (step == SPIKED)
    assert [e["step"] for e in events(log, "loss_spike")] == [SPIKED]


def test_a_step_whose_backward_the_guard_cannot_see_is_said_once(tmp_path: Path) -> None:
    """``torch.autograd.backward`` bound by name before the guard attached is torch's own: the guard never sees it."""
    backward = torch.autograd.backward
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    log = tmp_path / "run.jsonl"
    with GradGuard(model, policy(), logger=None, audit_log=log) as guard:
        for step in range(4):
            x, y = batch(step)
            opt.zero_grad()
            backward(nn.functional.mse_loss(model(x), y))
            opt.step()
        assert guard.step_count == 4
    (unseen,) = events(log, "loss_unseen")
    assert unseen["step"] == 1
    assert "no backward() was seen" in unseen["why"]


@pytest.mark.parametrize("name", sorted(BUILT_IN_RULES))
def test_a_rule_may_not_take_a_name_the_guard_counts_under(name: str) -> None:
    with pytest.raises(PolicyError, match=rf"rules\[0\]\.name: '{name}' is the counter key of"):
        Policy.from_dict({"version": 1, "rules": [HALT | {"name": name}]})


def test_the_policy_reserves_exactly_the_keys_the_guard_counts_under_besides_its_rules() -> None:
    """The policy room cannot import the events room's keys: the two lists are held equal here (a rule named
    ``recovery`` once shared its counter with the rewinds' skips)."""
    assert set(RESERVED_RULE_NAMES) == BUILT_IN_RULES


def test_each_guard_judges_only_its_own_models_loss_when_two_models_train_in_one_loop() -> None:
    """A GAN-like loop: two guarded models, each with its own backward; B's NaN loss is B's alone, and an unguarded
    third model's backward is nobody's."""
    models = {name: net() for name in ("a", "b", "free")}
    opts = {name: torch.optim.SGD(model.parameters(), lr=0.05) for name, model in models.items()}
    guards = {name: GradGuard(models[name], policy(), logger=None) for name in ("a", "b")}
    try:
        for step in range(4):
            x, y = batch(step)
            losses = {}
            for name, model in models.items():
                opts[name].zero_grad()
                bad = math.nan if name != "a" and step == 3 else 0.0  # added: the gradients stay finite
                losses[name] = nn.functional.mse_loss(model(x), y) + bad
                losses[name].backward()
            opts["a"].step()
            assert guards["a"].metrics()["gradguard/loss"] == pytest.approx(float(losses["a"].detach()))
            if step < 3:
                opts["b"].step()
                assert guards["b"].metrics()["gradguard/loss"] == pytest.approx(float(losses["b"].detach()))
        with pytest.raises(GradientHalt, match="non-finite loss"):
            opts["b"].step()
    finally:
        for guard in guards.values():
            guard.remove()


@pytest.mark.parametrize("shipped", ["per-tensor-clip", "default"])
def test_the_losses_a_grad_scaler_scaled_are_let_go_when_no_guard_watches_them(shipped: str) -> None:
    """``GradScaler.scale`` notes each scaled loss for the guards' loss section; a backward no guard watches the loss
    of (a policy without a loss section or monitor; the default's nine steps in ten) takes nothing out, so the notes
    of losses gone since are let go at the next ``scale``: over 300 steps at most the live one and the last are held,
    whatever ids Python gives the new losses."""
    from gradguard.enforce.hooks import torch_hooks

    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    shifting = []
    with GradGuard(model, shipped, logger=None, scaler=scaler):
        for _ in range(300):
            opt.zero_grad()
            scaled = scaler.scale(model(torch.randn(2, 4)).sum())
            shifting.append(torch.zeros(1))  # a new object between the losses: their ids do not repeat
            scaled.backward()  # type: ignore[no-untyped-call]
            scaler.step(opt)
            scaler.update()
            assert len(torch_hooks._unscaled_roots) <= 2
