"""Recovery in the frameworks: Lightning (automatic and manual), the Hugging Face Trainer, accelerate.

A NaN at step 23 with ``recovery: {snapshot_every: 5, keep: 2, min_age: 3, skip_steps: 4}`` rewinds to
step 20's snapshot and skips steps 24-27; the run ends bitwise equal to one that trained on the batches
of steps 0-19 and 28-39 only (the reference, whose guard is told step 28 before batch 28). The
integrations hand the guard their LR schedulers, so a schedule goes back to step 20 with the weights,
and ``lr_factor`` holds through a scheduler that recomputes the LR at every step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.training import TinyRegressor, assert_same, events_of, hf_poison_at, hf_training_args, model_state
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from gradguard import GradGuard, Policy

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers:UserWarning",
    "ignore:.*isinstance\\(treespec, LeafSpec\\).*",
    "ignore:.*is smaller than the logging interval.*",
    "ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`:UserWarning",  # fp16's first skip
)

STEPS = 40
FAULT = 23
SNAPSHOT = 20
RESUME = 28
"""The first step applied again: FAULT + skip_steps + 1."""
KEPT = [*range(SNAPSHOT), *range(RESUME, STEPS)]
"""The steps whose batches the reference trains on: every one the rewinding run learns from."""
RECOVERY = {"snapshot_every": 5, "keep": 2, "min_age": 3, "skip_steps": 4}
RULES = [
    {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
    {"name": "z", "match": "*", "actions": [{"action": "zclip", "max_norm": 5.0}]},
]


def policy(*, recovery: dict[str, Any] | None = None) -> Policy:
    """Halt on NaN and a zclip (adaptive statistics a rewind must restore); with ``recovery``, a rewind instead."""
    spec: dict[str, Any] = {"version": 1, "rules": copy.deepcopy(RULES)}
    if recovery is not None:
        spec["recovery"] = recovery
    return Policy.from_dict(spec)


def decay(step: int) -> float:
    """A schedule that changes the LR at every step, so a scheduler off by one step would show."""
    return 1.0 / (1.0 + 0.1 * step)


def jump_guard(guard: GradGuard, to_step: int) -> None:
    """The reference's guard skips the step numbers of the undone batches, as the rewinding run's counts them."""
    state = guard.state_dict()
    state["step"] = to_step
    guard.load_state_dict(state)


def assert_rewound_once(guard: GradGuard, audit: Path) -> None:
    """One rewind at the fault, to step 20's snapshot, told and counted, and no halt."""
    (rewind,) = events_of(audit, "rewind")
    assert (rewind["step"], rewind["to_step"], rewind["skip_until"]) == (FAULT, SNAPSHOT, RESUME)
    assert rewind["rule"] == "nonfinite"
    assert rewind["rewinds"] == 1
    assert guard.counters.snapshot()["nonfinite"]["rewind"] == 1
    assert guard.state_dict()["recovery"]["rewinds"] == 1
    assert events_of(audit, "halt") == []


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's per-parameter state and its groups' hyper-parameters (LRs included)."""
    state = copy.deepcopy(optimizer.state_dict())
    return {
        "state": state["state"],
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]],
    }


def record_applied_lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    """The LR of the first group at every ``step()`` the optimizer takes: the LR its update used."""
    applied: list[float] = []
    optimizer.register_step_post_hook(lambda opt, args, kwargs: applied.append(float(opt.param_groups[0]["lr"])))
    return applied


def assert_lr_factor_holds(applied: list[float], scheduled: Callable[[int], float], factor: float) -> None:
    """Before the fault the schedule's LR; from the first step applied again on, ``factor`` x the schedule's LR at
    the point the rewind took it back to (step 20 for step 28, 21 for 29, ...)."""
    assert len(applied) == STEPS
    assert applied[:FAULT] == [scheduled(step) for step in range(FAULT)]
    assert applied[RESUME:] == [factor * scheduled(step - (RESUME - SNAPSHOT)) for step in range(RESUME, STEPS)]
    assert applied[RESUME] != applied[FAULT - 1]  # the schedule goes on after the rewind (not a constant LR)


# --- Lightning ------------------------------------------------------------------------------------

pl = pytest.importorskip("lightning.pytorch")

from gradguard.integrations.lightning import GradGuardCallback  # noqa: E402

BATCH = 8


def lightning_data() -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS * BATCH, 8, generator=gen) * 3
    return TensorDataset(x, torch.randn(STEPS * BATCH, 4, generator=gen))


def lightning_loader(steps: list[int]) -> DataLoader[Any]:
    """The batches of ``steps``, in order (the reference's loader leaves the undone ones out)."""
    rows = [step * BATCH + i for step in steps for i in range(BATCH)]
    return DataLoader(Subset(lightning_data(), rows), batch_size=BATCH, shuffle=False)


class Net(pl.LightningModule):
    """An MLP with AdamW and a per-step LambdaLR; ``nan_at``: a NaN in one gradient at these global steps."""

    def __init__(self, *, manual: bool = False, nan_at: int | range | None = None, lr: float = 1e-2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        self.automatic_optimization = not manual
        self.nan_at = range(nan_at, nan_at + 1) if isinstance(nan_at, int) else nan_at or range(0)
        self.lr = lr
        self.applied: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y) * 10
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        self.poison()
        self.clip_gradients(opt, gradient_clip_val=1.0)  # the guard's boundary comes first, at this clip
        opt.step()
        self.lr_schedulers().step()  # type: ignore[union-attr]
        return None

    def on_after_backward(self) -> None:
        if self.automatic_optimization:
            self.poison()

    def poison(self) -> None:
        if self.trainer.global_step in self.nan_at:
            self.net[2].weight.grad[0, 0] = float("nan")

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, foreach=False)
        self.applied = record_applied_lrs(optimizer)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class JumpGuard(pl.Callback):
    """The reference fit: before its 21st batch (the batch of step 28), the guard's step becomes 28."""

    def __init__(self, guarded: GradGuardCallback) -> None:
        self.guarded = guarded

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == SNAPSHOT:
            assert self.guarded.guard is not None
            jump_guard(self.guarded.guard, RESUME)


def lightning_fit(module: Net, steps: list[int], *callbacks: pl.Callback, **options: Any) -> pl.Trainer:
    trainer = pl.Trainer(
        max_steps=len(steps),
        callbacks=list(callbacks),
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **options,
    )
    trainer.fit(module, lightning_loader(steps))
    return trainer


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_a_lightning_fit_rewinds_at_a_nan_and_ends_bitwise_equal_to_the_fit_that_never_saw_the_undone_batches(
    manual, tmp_path
):
    audit = tmp_path / "audit.jsonl"
    clip = {} if manual else {"gradient_clip_val": 1.0}  # manual: self.clip_gradients in training_step
    module = Net(manual=manual, nan_at=FAULT)
    callback = GradGuardCallback(policy(recovery=RECOVERY), logger=None, audit_log=audit)
    trainer = lightning_fit(module, list(range(STEPS)), callback, **clip)

    reference = Net(manual=manual)
    guarded = GradGuardCallback(policy(), logger=None)
    reference_trainer = lightning_fit(reference, KEPT, guarded, JumpGuard(guarded), **clip)

    assert callback.guard is not None
    assert guarded.guard is not None
    assert trainer.global_step == STEPS  # every step ran; the undone ones made no update
    assert_rewound_once(callback.guard, audit)
    assert_same(model_state(module), model_state(reference), "parameters")
    assert_same(
        optimizer_tensors(trainer.optimizers[0]), optimizer_tensors(reference_trainer.optimizers[0]), "optimizer"
    )
    scheduler, reference_scheduler = (
        trainer.lr_scheduler_configs[0].scheduler,
        reference_trainer.lr_scheduler_configs[0].scheduler,
    )
    assert scheduler.last_epoch == reference_scheduler.last_epoch == len(KEPT)  # type: ignore[union-attr]
    state, reference_state = callback.guard.state_dict(), guarded.guard.state_dict()
    assert state["step"] == reference_state["step"] == STEPS
    assert_same(state["statistics"], reference_state["statistics"], "zclip statistics")
    assert module.applied == [
        *reference.applied[:SNAPSHOT],
        *module.applied[SNAPSHOT:RESUME],
        *reference.applied[SNAPSHOT:],
    ]


def test_lightnings_lambda_lr_gives_half_the_scheduled_lr_after_a_rewind_with_lr_factor_one_half():
    module = Net(nan_at=FAULT)
    callback = GradGuardCallback(policy(recovery={**RECOVERY, "lr_factor": 0.5}), logger=None)
    trainer = lightning_fit(module, list(range(STEPS)), callback)

    assert callback.guard is not None
    recovery = {"rewinds": 1, "skip_until": RESUME, "lr_scale": 0.5, "applied": len(KEPT)}
    assert callback.guard.state_dict()["recovery"] == recovery
    assert trainer.global_step == STEPS
    assert_lr_factor_holds(module.applied, lambda step: module.lr * decay(step), 0.5)


def test_a_16_mixed_lightning_fit_whose_nan_persists_rewinds_at_max_scaler_skips_and_restores_the_scale(tmp_path):
    """A NaN in steps 21-23: the scaler skips them and cuts its scale; past ``max_scaler_skips: 2`` the halt at
    step 23 becomes a rewind to step 20, scale included, and the fit ends as the one that never saw those batches."""
    audit = tmp_path / "audit.jsonl"
    scaled_rules = copy.deepcopy(RULES)
    scaled_rules[0]["actions"][0]["max_scaler_skips"] = 2
    make = lambda **extra: Policy.from_dict({"version": 1, "rules": copy.deepcopy(scaled_rules), **extra})  # noqa: E731

    def mixed() -> Any:
        return pl.plugins.MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))

    module = Net(nan_at=range(FAULT - 2, FAULT + 1))
    callback = GradGuardCallback(make(recovery=RECOVERY), logger=None, audit_log=audit)
    trainer = lightning_fit(module, list(range(STEPS)), callback, plugins=[mixed()])
    reference = Net()
    guarded = GradGuardCallback(make(), logger=None)
    reference_trainer = lightning_fit(reference, KEPT, guarded, JumpGuard(guarded), plugins=[mixed()])

    assert callback.guard is not None
    assert guarded.guard is not None
    live = callback.guard._enforcer.recovery.live
    assert live.scaler is trainer.precision_plugin.scaler  # type: ignore[attr-defined]
    assert live.schedulers == [trainer.lr_scheduler_configs[0].scheduler]
    assert_rewound_once(callback.guard, audit)
    assert events_of(audit, "rewind")[0]["kind"] == "overflow"
    scaler, reference_scaler = trainer.precision_plugin.scaler, reference_trainer.precision_plugin.scaler  # type: ignore[attr-defined]
    assert_same(scaler.state_dict(), reference_scaler.state_dict(), "scaler")
    assert_same(model_state(module), model_state(reference), "parameters")
    assert_same(
        optimizer_tensors(trainer.optimizers[0]), optimizer_tensors(reference_trainer.optimizers[0]), "optimizer"
    )


# --- the Hugging Face Trainer ---------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from gradguard.integrations.accelerate import guard_accelerator  # noqa: E402
from gradguard.integrations.transformers import GradGuardCallback as TrainerCallback  # noqa: E402

HF_BATCH = 2
NAN_PARAM = "second.weight"


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """accelerate's process-wide singletons: each test starts (and leaves) them fresh."""
    GradientState._reset_state()
    AcceleratorState._reset_state()
    yield
    GradientState._reset_state()
    AcceleratorState._reset_state()


def regression_examples(steps: list[int]) -> list[dict[str, torch.Tensor]]:
    """The examples of ``steps``' batches, in order."""
    gen = torch.Generator().manual_seed(1)
    every = [
        {"x": torch.randn(4, generator=gen) * 3, "y": torch.randn(1, generator=gen) * 20}
        for _ in range(STEPS * HF_BATCH)
    ]
    return [every[step * HF_BATCH + i] for step in steps for i in range(HF_BATCH)]


class AppliedLRs(transformers.TrainerCallback):
    """The LR of the first group at every optimizer step of the Trainer."""

    def __init__(self) -> None:
        self.applied: list[float] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self.applied = record_applied_lrs(optimizer.optimizer)  # inside accelerate's AcceleratedOptimizer


class JumpTrainerGuard(transformers.TrainerCallback):
    """The reference run: at its 21st step (the batch of step 28), the guard's step becomes 28."""

    def __init__(self, guarded: TrainerCallback) -> None:
        self.guarded = guarded

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == SNAPSHOT:
            assert self.guarded.guard is not None
            jump_guard(self.guarded.guard, RESUME)


def hf_train(tmp_path: Path, steps: list[int], callbacks: list[Any], **overrides: Any) -> Any:
    options: dict[str, Any] = {
        "per_device_train_batch_size": HF_BATCH,
        "max_steps": len(steps),
        "logging_steps": 10,
        "learning_rate": 1e-2,
        "train_sampling_strategy": "sequential",
        **overrides,
    }
    model = TinyRegressor()
    trainer = transformers.Trainer(
        model=model,
        args=hf_training_args(tmp_path, **options),
        train_dataset=regression_examples(steps),
        callbacks=callbacks,
    )
    trainer.train()
    return trainer


def test_a_trainer_fit_with_the_callback_alone_rewinds_and_ends_bitwise_equal_to_the_fit_without_the_undone_batches(
    tmp_path,
):
    audit = tmp_path / "audit.jsonl"
    callback = TrainerCallback(policy(recovery=RECOVERY), logger=None, audit_log=audit)
    trainer = hf_train(
        tmp_path / "a", list(range(STEPS)), [callback, hf_poison_at(FAULT)], lr_scheduler_type="constant"
    )
    guarded = TrainerCallback(policy(), logger=None)
    reference = hf_train(tmp_path / "b", KEPT, [guarded, JumpTrainerGuard(guarded)], lr_scheduler_type="constant")

    assert callback.guard is not None
    assert guarded.guard is not None
    assert trainer.state.global_step == STEPS
    assert_rewound_once(callback.guard, audit)
    assert callback.guard._enforcer.recovery.live.schedulers == [trainer.lr_scheduler]
    assert_same(model_state(trainer.model), model_state(reference.model), "parameters")
    assert_same(optimizer_tensors(trainer.optimizer), optimizer_tensors(reference.optimizer), "optimizer")
    assert_same(callback.guard.state_dict()["statistics"], guarded.guard.state_dict()["statistics"], "zclip statistics")


def test_a_trainer_linear_schedule_gives_half_its_lr_after_a_rewind_with_lr_factor_one_half(tmp_path):
    callback = TrainerCallback(policy(recovery={**RECOVERY, "lr_factor": 0.5}), logger=None)
    lrs = AppliedLRs()
    trainer = hf_train(tmp_path, list(range(STEPS)), [callback, hf_poison_at(FAULT), lrs], lr_scheduler_type="linear")

    assert callback.guard is not None
    assert callback.guard.state_dict()["recovery"]["rewinds"] == 1
    assert trainer.state.global_step == STEPS
    schedule = trainer.lr_scheduler.lr_lambdas[0]  # HF's linear schedule is a LambdaLR
    assert_lr_factor_holds(lrs.applied, lambda step: 1e-2 * schedule(step), 0.5)
    assert trainer.lr_scheduler.last_epoch == len(KEPT)


# --- accelerate -----------------------------------------------------------------------------------


def accelerate_loop(
    steps: list[int],
    policy_: Policy,
    *,
    nan_at: int | None = None,
    jump: bool = False,
    pass_steps: bool = False,
    audit: Path | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer, Any, GradGuard, list[float]]:
    """A plain accelerate loop: AdamW and a LambdaLR prepared, accelerate's clip, a guard from guard_accelerator."""
    accelerator = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    applied = record_applied_lrs(optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
    guard = guard_accelerator(accelerator, model, policy_, logger=None, audit_log=audit)  # before prepare
    model, opt, sched = accelerator.prepare(model, optimizer, scheduler)
    gen = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 4, generator=gen) * 3, torch.randn(4, 1, generator=gen) * 20) for _ in range(STEPS)]
    for position, step in enumerate(steps):
        if jump and position == SNAPSHOT:
            jump_guard(guard, RESUME)
        if pass_steps and guard.pass_step():
            continue  # inside a rewind's window: no forward, backward or update
        x, y = data[step]
        opt.zero_grad()
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        if step == nan_at:
            model[2].weight.grad[0, 1] = float("nan")
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    guard.remove()
    return model, optimizer, scheduler, guard, applied


@pytest.mark.parametrize("pass_steps", [False, True], ids=["every-step-run", "window-passed"])
def test_an_accelerate_loop_rewinds_and_ends_bitwise_equal_to_the_loop_without_the_undone_batches(pass_steps, tmp_path):
    audit = tmp_path / "audit.jsonl"
    model, optimizer, scheduler, guard, _ = accelerate_loop(
        list(range(STEPS)), policy(recovery=RECOVERY), nan_at=FAULT, pass_steps=pass_steps, audit=audit
    )
    ref_model, ref_optimizer, ref_scheduler, ref_guard, _ = accelerate_loop(KEPT, policy(), jump=True)

    assert_rewound_once(guard, audit)
    assert guard._enforcer.recovery.live.schedulers == [scheduler]  # unwrapped from accelerate's AcceleratedScheduler
    assert_same(model_state(model), model_state(ref_model), "parameters")
    assert_same(optimizer_tensors(optimizer), optimizer_tensors(ref_optimizer), "optimizer")
    assert scheduler.last_epoch == ref_scheduler.last_epoch == len(KEPT)
    assert guard.state_dict()["step"] == ref_guard.state_dict()["step"] == STEPS
    assert_same(guard.state_dict()["statistics"], ref_guard.state_dict()["statistics"], "zclip statistics")


def test_an_accelerate_lambda_lr_gives_half_the_scheduled_lr_after_a_rewind_with_lr_factor_one_half():
    _, _, scheduler, guard, applied = accelerate_loop(
        list(range(STEPS)), policy(recovery={**RECOVERY, "lr_factor": 0.5}), nan_at=FAULT
    )
    assert guard.state_dict()["recovery"]["lr_scale"] == 0.5
    assert_lr_factor_holds(applied, lambda step: 1e-2 * decay(step), 0.5)
    assert scheduler.base_lrs == [0.5e-2]
