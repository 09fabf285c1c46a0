"""``GradGuardCallback`` on real Lightning ``Trainer.fit`` runs, against torch-clipped references, bit for bit."""

from __future__ import annotations

import csv
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.docs import documented_example

pytest.importorskip("lightning")

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.nn.utils import clip_grad_norm_
from torch.utils.data import DataLoader, TensorDataset

from gradguard import GradientHalt, Policy
from gradguard.integrations.lightning import GradGuardCallback

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers:UserWarning",
    "ignore:.*isinstance\\(treespec, LeafSpec\\).*",
    "ignore:.*is smaller than the logging interval.*",
    "ignore:Be aware that when using `ckpt_path`.*",
)

BATCH = 8


# --- a tiny LightningModule and its trainer -------------------------------------------------------


def dataset(batches: int = 4) -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(batches * BATCH, 8, generator=gen) * 3
    return TensorDataset(x, torch.randn(batches * BATCH, 4, generator=gen))


def loader(batches: int = 4) -> DataLoader[Any]:
    return DataLoader(dataset(batches), batch_size=BATCH, shuffle=False)


Hook = Callable[["Net", int], None]


class Net(pl.LightningModule):
    """A three-layer MLP; ``reference`` runs in on_before_optimizer_step, ``tamper`` after each backward.

    ``history`` holds the parameters after every training batch, to compare whole trajectories.
    """

    def __init__(
        self,
        optimizer: str = "sgd",
        *,
        reference: Hook | None = None,
        tamper: Hook | None = None,
        manual: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        self.optimizer_name = optimizer
        self.reference = reference
        self.tamper = tamper
        self.automatic_optimization = not manual
        self.history: list[dict[str, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y) * 10

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        loss = self.loss(batch)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        if self.tamper is not None:
            self.tamper(self, self.trainer.global_step)
        if self.reference is not None:
            self.reference(self, self.trainer.global_step)  # by hand, before the step, as a manual loop would
        opt.step()
        return None

    def on_after_backward(self) -> None:
        if self.automatic_optimization and self.tamper is not None:
            self.tamper(self, self.trainer.global_step)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.automatic_optimization and self.reference is not None:
            self.reference(self, self.trainer.global_step)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.history.append(params(self))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-2, foreach=False)
        if self.optimizer_name == "adamw_fused":
            return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
        raise AssertionError(self.optimizer_name)


def params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def trainer(*callbacks: pl.Callback, max_steps: int = 4, **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        **kwargs,
    }
    return pl.Trainer(max_steps=max_steps, callbacks=list(callbacks), **options)


def clip_all(max_norm: float) -> Hook:
    """The reference for a group clip_norm on every parameter: torch's own clip_grad_norm_."""

    def clip(module: Net, step: int) -> None:
        clip_grad_norm_(module.parameters(), max_norm)

    return clip


def poison(name: str, at_step: int, value: float = float("nan")) -> Hook:
    """Write one non-finite element into one parameter's gradient, at one optimizer step."""

    def tamper(module: Net, step: int) -> None:
        if step == at_step:
            module.get_parameter(name).grad[0, 0] = value

    return tamper


def n_params(module: nn.Module) -> int:
    return len(list(module.parameters()))


# --- automatic and manual optimization, accumulation, Lightning's clip ---------------------------


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_automatic_optimization_clips_exactly_as_clip_grad_norm_in_on_before_optimizer_step(
    make_policy, same, optimizer
):
    """Trainer.fit with a group clip_norm policy equals a module that calls clip_grad_norm_ itself, bit for bit."""
    policy = make_policy({"match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.01, "scope": "group"}]})
    callback = GradGuardCallback(policy, logger=None)
    guarded = Net(optimizer)
    ref = Net(optimizer, reference=clip_all(0.01))
    run = trainer(callback)
    run.fit(guarded, loader())
    trainer().fit(ref, loader())

    assert len(guarded.history) == 4
    same(guarded.history, ref.history)
    same(run.optimizers[0].state_dict(), ref.trainer.optimizers[0].state_dict())
    assert callback.guard is not None
    assert callback.guard.step_count == run.global_step == 4
    assert callback.guard.counters.snapshot() == {"r0": {"clip_norm": run.global_step * n_params(guarded)}}
    assert not callback.guard.attached, "the guard is removed when the fit ends, and stays readable"


def test_manual_optimization_is_treated_at_the_lightning_optimizer_step(make_policy, same):
    """self.manual_backward + opt.step(): per-tensor clip and scale, equal to torch's ops done by hand."""
    policy = make_policy(
        {"match": "*.weight", "actions": [{"action": "clip_norm", "max_norm": 0.05}]},
        {"match": "*.bias", "actions": [{"action": "scale", "factor": 0.5}]},
    )

    def by_hand(module: Net, step: int) -> None:
        for name, p in module.named_parameters():
            if name.endswith(".weight"):
                clip_grad_norm_([p], 0.05)
            else:
                p.grad.mul_(0.5)

    callback = GradGuardCallback(policy, logger=None)
    guarded = Net("adamw", manual=True)
    ref = Net("adamw", manual=True, reference=by_hand)
    run = trainer(callback)
    run.fit(guarded, loader())
    trainer().fit(ref, loader())

    same(guarded.history, ref.history)
    assert callback.guard is not None
    assert callback.guard.step_count == run.global_step == 4
    counts = callback.guard.counters.snapshot()
    assert counts["r1"] == {"scale": run.global_step * 3}  # three biases, every step
    assert 0 < counts["r0"]["clip_norm"] <= run.global_step * 3


def test_manual_optimization_with_self_clip_gradients_is_one_step_and_halts_naming_the_parameter(make_policy):
    """self.clip_gradients(...) then opt.step(): the guard acts at the clip, counts one step, names the NaN."""

    def clip_then_poison_at_2(module: Net, step: int) -> None:
        if step == 2:
            module.net[2].weight.grad[0, 0] = float("nan")
        module.clip_gradients(module.optimizers(), gradient_clip_val=1.0, gradient_clip_algorithm="norm")

    def clip(module: Net, step: int) -> None:
        module.clip_gradients(module.optimizers(), gradient_clip_val=1.0, gradient_clip_algorithm="norm")

    policy = make_policy({"match": "*", "actions": [{"action": "halt_on_nonfinite"}]})
    callback = GradGuardCallback(policy, logger=None)
    run = trainer(callback)
    run.fit(Net("adamw", manual=True, tamper=clip), loader())
    assert callback.guard is not None
    assert callback.guard.step_count == run.global_step == 4

    callback = GradGuardCallback(policy, logger=None)
    with pytest.raises(GradientHalt) as excinfo:
        trainer(callback).fit(Net("adamw", manual=True, tamper=clip_then_poison_at_2), loader())
    assert excinfo.value.step == 2
    assert excinfo.value.params == ("net.2.weight",)


def test_accumulate_grad_batches_clips_the_summed_gradient_once_per_optimizer_step(
    make_policy, same, read_audit, tmp_path
):
    """accumulate_grad_batches=2: one group clip of g1 + g2 per step, as clip_grad_norm_ does; steps numbered 0..2."""
    policy = make_policy({"match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.01, "scope": "group"}]})
    log = tmp_path / "audit.jsonl"
    callback = GradGuardCallback(policy, logger=None, audit_log=log)
    guarded = Net("sgd")
    ref = Net("sgd", reference=clip_all(0.01))
    run = trainer(callback, max_steps=3, accumulate_grad_batches=2)
    run.fit(guarded, loader(6))
    trainer(max_steps=3, accumulate_grad_batches=2).fit(ref, loader(6))

    assert len(guarded.history) == 6, "six micro-batches for three optimizer steps"
    same(guarded.history, ref.history)
    assert callback.guard is not None
    assert callback.guard.step_count == run.global_step == 3
    steps = sorted({event["step"] for event in read_audit(log) if event["event"] == "intervention"})
    assert steps == [0, 1, 2]


def test_gradient_clip_val_clips_after_the_policy(make_policy, same):
    """gradient_clip_val with a scale policy: the policy acts first, then Lightning's clip, each once per step."""
    policy = make_policy({"match": "*", "actions": [{"action": "scale", "factor": 0.1}]})

    def scale(module: Net, step: int) -> None:
        for p in module.parameters():
            p.grad.mul_(0.1)

    def clip_then_scale(module: Net, step: int) -> None:
        clip_grad_norm_(module.parameters(), 0.05)
        scale(module, step)

    callback = GradGuardCallback(policy, logger=None)
    guarded = Net("sgd")
    ref = Net("sgd", reference=scale)  # the module's hook runs before Lightning's clip
    reversed_order = Net("sgd", reference=clip_then_scale)
    run = trainer(callback, gradient_clip_val=0.05)
    run.fit(guarded, loader())
    trainer(gradient_clip_val=0.05).fit(ref, loader())
    trainer().fit(reversed_order, loader())

    same(guarded.history, ref.history)
    assert not torch.equal(guarded.history[-1]["net.0.weight"], reversed_order.history[-1]["net.0.weight"]), (
        "the order matters for this policy, so the comparison above proves the guard acted first"
    )
    assert callback.guard is not None
    assert callback.guard.counters.snapshot() == {"r0": {"scale": run.global_step * n_params(guarded)}}


# --- mixed precision ------------------------------------------------------------------------------


def test_bf16_mixed_treats_every_step_as_torch_would(make_policy, same, read_audit, tmp_path):
    """precision="bf16-mixed": every step is treated once, counted, and equals clip_grad_norm_ under bf16 too."""
    policy = make_policy(
        {"match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
        {"match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.01, "scope": "group"}]},
    )
    log = tmp_path / "audit.jsonl"
    callback = GradGuardCallback(policy, logger=None, audit_log=log)
    guarded = Net("adamw")
    ref = Net("adamw", reference=clip_all(0.01))
    run = trainer(callback, precision="bf16-mixed")
    run.fit(guarded, loader())
    trainer(precision="bf16-mixed").fit(ref, loader())

    assert getattr(run.precision_plugin, "scaler", None) is None
    same(guarded.history, ref.history)
    assert callback.guard is not None
    assert callback.guard.step_count == run.global_step == 4
    assert callback.guard.counters.snapshot() == {"r1": {"clip_norm": run.global_step * n_params(guarded)}}
    events = read_audit(log)
    assert sorted({e["step"] for e in events if e["event"] == "intervention"}) == list(range(run.global_step))


def fp16_on_cpu() -> MixedPrecision:
    """precision="16-mixed" with a real GradScaler on the CPU (the string alone becomes bf16-mixed on CPU)."""
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))


def test_16_mixed_with_a_grad_scaler_treats_unscaled_gradients_before_lightnings_clip(make_policy, same):
    """16-mixed + GradScaler: the guard acts after unscale_, before gradient_clip_val, like torch's clip there."""
    policy = make_policy({"match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.02, "scope": "group"}]})
    callback = GradGuardCallback(policy, logger=None)
    guarded = Net("sgd")
    ref = Net("sgd", reference=clip_all(0.02))
    run = trainer(callback, plugins=[fp16_on_cpu()], gradient_clip_val=0.01)
    run.fit(guarded, loader())
    trainer(plugins=[fp16_on_cpu()], gradient_clip_val=0.01).fit(ref, loader())

    assert isinstance(run.precision_plugin.scaler, torch.amp.GradScaler)
    same(guarded.history, ref.history)
    assert callback.guard is not None
    assert callback.guard.step_count == run.global_step == 4
    # max_norm 0.02 on unscaled gradients clips every tensor; on scaled (x1024) ones too, but differently:
    assert callback.guard.counters.snapshot() == {"r0": {"clip_norm": run.global_step * n_params(guarded)}}


def test_16_mixed_step_that_the_scaler_skips_is_counted_not_halted(make_policy, same, read_audit, tmp_path):
    """An Inf the GradScaler finds is its business: no halt, a grad_scaler skip counted, training goes on."""
    policy = make_policy({"match": "*", "actions": [{"action": "halt_on_nonfinite"}]})
    log = tmp_path / "audit.jsonl"
    callback = GradGuardCallback(policy, logger=None, audit_log=log)
    guarded = Net("sgd", tamper=poison("net.2.weight", 1, float("inf")))
    run = trainer(callback, plugins=[fp16_on_cpu()])
    run.fit(guarded, loader())

    same(guarded.history[1], guarded.history[0])  # the scaler skipped step 1
    assert not torch.equal(guarded.history[2]["net.0.weight"], guarded.history[1]["net.0.weight"])
    assert callback.guard is not None
    assert callback.guard.step_count == run.global_step == 4
    assert callback.guard.counters.snapshot() == {"grad_scaler": {"skip": 1}}
    assert [e["step"] for e in read_audit(log) if e["event"] == "scaler_skip"] == [1]


def test_16_mixed_with_a_fused_optimizer_falls_back_to_the_optimizer_step(make_policy):
    """A fused AdamW unscales in its kernel: the callback leaves it to the guard's pre-hook, which still treats it."""
    probe = nn.Parameter(torch.ones(2))
    probe.grad = torch.ones(2)
    try:
        torch.optim.AdamW([probe], fused=True).step()
    except RuntimeError:
        pytest.skip("AdamW(fused=True) is not supported on the CPU by this torch build")
    policy = make_policy({"match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.01}]})
    callback = GradGuardCallback(policy, logger=None)
    guarded = Net("adamw_fused")
    run = trainer(callback, plugins=[fp16_on_cpu()])
    run.fit(guarded, loader())

    assert callback.guard is not None
    assert callback.guard.step_count == run.global_step == 4
    assert callback.guard.counters.snapshot() == {"r0": {"clip_norm": run.global_step * n_params(guarded)}}


# --- halts and skips ------------------------------------------------------------------------------


@pytest.mark.parametrize("gradient_clip_val", [None, 1.0])
def test_nan_in_one_gradient_halts_fit_naming_exactly_that_parameter(make_policy, same, gradient_clip_val):
    """A NaN in net.2.weight at step 2 ends fit with GradientHalt naming it alone; weights are as after step 1."""
    policy = make_policy(
        {"match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
        {"match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.5}]},
    )
    callback = GradGuardCallback(policy, logger=None)
    guarded = Net("adamw", tamper=poison("net.2.weight", 2))
    run = trainer(callback, gradient_clip_val=gradient_clip_val)
    with pytest.raises(GradientHalt) as excinfo:
        run.fit(guarded, loader())

    assert excinfo.value.params == ("net.2.weight",)
    assert excinfo.value.step == 2
    assert len(guarded.history) == 2
    same(params(guarded), guarded.history[-1])
    assert run.global_step == 2
    assert callback.guard is not None
    assert not callback.guard.attached, "on_exception removed the guard"
    assert callback.guard.counters.snapshot()["r0"] == {"nan": 1, "halt_on_nonfinite": 1}


def test_skip_rule_skips_the_poisoned_step_and_training_goes_on(make_policy, same):
    """skip_step_on_nonfinite: the bad step changes nothing (AdamW state included), the others train as torch would."""
    policy = make_policy({"match": "*", "actions": [{"action": "skip_step_on_nonfinite"}]})

    def drop_all_if_nonfinite(module: Net, step: int) -> None:
        if any(not torch.isfinite(p.grad).all() for p in module.parameters()):
            module.zero_grad(set_to_none=True)

    callback = GradGuardCallback(policy, logger=None)
    guarded = Net("adamw", tamper=poison("net.4.weight", 1))
    ref = Net("adamw", tamper=poison("net.4.weight", 1), reference=drop_all_if_nonfinite)
    run = trainer(callback, gradient_clip_val=1.0)
    run.fit(guarded, loader())
    trainer(gradient_clip_val=1.0).fit(ref, loader())

    same(guarded.history[1], guarded.history[0])
    same(guarded.history, ref.history)
    same(run.optimizers[0].state_dict(), ref.trainer.optimizers[0].state_dict())
    assert callback.guard is not None
    assert callback.guard.step_count == run.global_step == 4
    assert callback.guard.counters.snapshot() == {"r0": {"nan": 1, "skip_step_on_nonfinite": 1}}


def test_last_step_skipped_is_still_true_when_the_skipped_batch_ends(make_policy):
    """After the guard skipped a step, guard.last_step_skipped is True in on_train_batch_end (scheduler logic)."""
    policy = make_policy({"match": "*", "actions": [{"action": "skip_step_on_nonfinite"}]})
    seen: list[bool] = []

    class Watch(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            assert callback.guard is not None
            seen.append(callback.guard.last_step_skipped)

    callback = GradGuardCallback(policy, logger=None)
    trainer(callback, Watch(), max_steps=3).fit(Net("sgd", tamper=poison("net.0.weight", 1)), loader())
    assert callback.guard is not None
    assert callback.guard.counters.snapshot()["r0"]["skip_step_on_nonfinite"] == 1
    assert seen == [False, True, False]


# --- logging --------------------------------------------------------------------------------------


class RecordingLogger(Logger):
    """Keeps every log_metrics call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((step, dict(metrics)))


def test_counters_reach_the_loggers_under_gradguard_keys(make_policy, tmp_path):
    """gradguard/steps and gradguard/<rule>/<action> arrive in a CSVLogger and a Logger, every log_every_n_steps."""
    policy = make_policy(
        {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.05}]},
        {"name": "bias-scale", "match": "*.bias", "actions": [{"action": "scale", "factor": 0.5}]},
    )
    callback = GradGuardCallback(policy, logger=None)
    recording = RecordingLogger()
    csv_logger = CSVLogger(tmp_path, name="run")
    run = trainer(callback, max_steps=6, logger=[csv_logger, recording], log_every_n_steps=2)
    run.fit(Net("sgd"), loader(6))

    assert callback.guard is not None
    final = callback.metrics()
    assert set(final) == {"gradguard/steps", "gradguard/clip/clip_norm", "gradguard/bias-scale/scale"}
    logged = [(step, m) for step, m in recording.calls if "gradguard/steps" in m]
    assert [step for step, _ in logged] == [1, 3, 5], "every second step"
    for step, metrics in logged:
        assert metrics["gradguard/steps"] == step + 1  # logged after the step, with that many steps done
        assert metrics["gradguard/bias-scale/scale"] == 3 * (step + 1)
    assert {key: value for key, value in logged[-1][1].items() if key.startswith("gradguard/")} == final

    with open(Path(csv_logger.log_dir) / "metrics.csv", newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("gradguard/steps")]
    assert [float(row["gradguard/steps"]) for row in rows] == [2.0, 4.0, 6.0]
    assert float(rows[-1]["gradguard/clip/clip_norm"]) == final["gradguard/clip/clip_norm"] > 0


def test_a_monitors_figures_reach_the_loggers_beside_the_counters(make_policy):
    """A monitor rule's last figures (gradguard/<rule>/norm/<name>) reach the loggers, equal to guard.metrics()."""
    policy = make_policy({"name": "health", "match": "*", "actions": [{"action": "monitor", "stats": ["norm"]}]})
    callback = GradGuardCallback(policy, logger=None)
    recording = RecordingLogger()
    module = Net("sgd")
    run = trainer(callback, max_steps=4, logger=[recording], log_every_n_steps=1)
    run.fit(module, loader(4))
    names = [name for name, _ in module.named_parameters()]
    final = callback.metrics()
    assert {f"gradguard/health/norm/{name}" for name in names} <= set(final)
    logged = [m for _, m in recording.calls if "gradguard/steps" in m]
    assert {key: value for key, value in logged[-1].items() if key.startswith("gradguard/health/norm/")} == {
        key: value for key, value in final.items() if key.startswith("gradguard/health/norm/")
    }
    assert all(value > 0 for key, value in final.items() if key.startswith("gradguard/health/norm/"))


# --- checkpoints ----------------------------------------------------------------------------------


def test_resumed_fit_continues_the_guards_step_numbers_and_matches_an_uninterrupted_run(
    make_policy, same, read_audit, tmp_path
):
    """Stopped after 3 steps and resumed from the checkpoint: steps 3..5, step windows hold, weights as one run."""
    # The rule starts at step 4: only a guard that knows it resumed at step 3 clips at the right steps.
    policy = make_policy(
        {"match": "*", "from_step": 4, "actions": [{"action": "clip_norm", "max_norm": 0.01, "scope": "group"}]}
    )
    straight = GradGuardCallback(policy, logger=None)
    reference = Net("sgd")
    trainer(straight, max_steps=6).fit(reference, loader(3))

    first_log, second_log = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first = GradGuardCallback(policy, logger=None, audit_log=first_log)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer(first, saver, max_steps=3, enable_checkpointing=True).fit(Net("sgd"), loader(3))
    checkpoint = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    assert checkpoint.exists(), sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert torch.load(checkpoint, weights_only=False)["callbacks"]["GradGuardCallback"]["guard"]["step"] == 3

    second = GradGuardCallback(policy, logger=None, audit_log=second_log)
    resumed = Net("sgd", seed=1)  # other initial weights: the checkpoint must replace them
    run = trainer(second, max_steps=6)
    run.fit(resumed, loader(3), ckpt_path=checkpoint)

    assert second.guard is not None
    assert straight.guard is not None
    assert second.guard.step_count == run.global_step == 6
    same(params(resumed), params(reference))
    assert second.guard.counters.snapshot() == {"r0": {"clip_norm": 2 * n_params(resumed)}}
    assert straight.guard.counters.snapshot() == second.guard.counters.snapshot()
    events = read_audit(second_log)
    attach = next(e for e in events if e["event"] == "attach")
    assert attach["start_step"] == 3
    assert [e["step"] for e in events if e["event"] == "state_loaded"] == [3]
    assert sorted({e["step"] for e in events if e["event"] == "intervention"}) == [4, 5]
    assert [e["steps"] for e in events if e["event"] == "detach"] == [6]
    assert not any(e["event"] == "intervention" for e in read_audit(first_log)), "no clip before step 4"


def test_a_resumed_fit_carries_the_adaptive_statistics_and_decides_as_an_uninterrupted_run(make_policy, same, tmp_path):
    """zclip, autoclip and a spike watch: resumed from the step-3 checkpoint, statistics and weights as one run."""
    policy = make_policy(
        {"match": "*", "actions": [{"action": "zclip", "warmup_steps": 2, "z_thresh": 0.5, "alpha": 0.5}]},
        {"match": "*", "actions": [{"action": "autoclip", "history": 3, "percentile": 30.0, "scope": "group"}]},
        {"match": "*", "actions": [{"action": "skip_step_on_spike", "window": 4, "min_samples": 2}]},
    )
    straight = GradGuardCallback(policy, logger=None)
    reference = Net("adamw")
    trainer(straight, max_steps=8).fit(reference, loader(3))
    assert straight.guard is not None
    assert straight.guard.counters.snapshot()["r1"]["autoclip"] > 0

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer(GradGuardCallback(policy, logger=None), saver, max_steps=3, enable_checkpointing=True).fit(
        Net("adamw"), loader(3)
    )
    checkpoint = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    saved = torch.load(checkpoint, weights_only=False)["callbacks"]["GradGuardCallback"]["guard"]
    assert set(saved["statistics"]) == {"r0", "r1", "r2"}

    second = GradGuardCallback(policy, logger=None)
    resumed = Net("adamw", seed=1)
    trainer(second, max_steps=8).fit(resumed, loader(3), ckpt_path=checkpoint)
    assert second.guard is not None
    same(params(resumed), params(reference))
    assert second.guard.state_dict() == straight.guard.state_dict()


def test_resuming_a_checkpoint_without_guard_state_starts_at_its_global_step(make_policy, read_audit, tmp_path):
    """A checkpoint saved without the callback: the guard starts at the checkpoint's global_step."""
    policy = make_policy({"match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.01}]})
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer(saver, max_steps=3, enable_checkpointing=True).fit(Net("sgd"), loader(3))
    log = tmp_path / "audit.jsonl"
    callback = GradGuardCallback(policy, logger=None, audit_log=log)
    run = trainer(callback, max_steps=5)
    run.fit(Net("sgd"), loader(3), ckpt_path=tmp_path / "ckpt" / "epoch=0-step=3.ckpt")

    assert callback.guard is not None
    assert callback.guard.step_count == run.global_step == 5
    events = read_audit(log)
    assert next(e for e in events if e["event"] == "attach")["start_step"] == 3
    assert not any(e["event"] == "state_loaded" for e in events)
    assert sorted({e["step"] for e in events if e["event"] == "intervention"}) == [3, 4]


class TwoOptimizers(pl.LightningModule):
    """Manual optimization with two optimizers (encoder, head), each stepped once per batch."""

    def __init__(self, reference: Hook | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 4)
        self.reference = reference
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        enc_opt, head_opt = self.optimizers()
        enc_opt.zero_grad()
        head_opt.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self.head(self.encoder(x)), y) * 10)
        if self.reference is not None:
            self.reference(self, self.trainer.global_step)  # type: ignore[arg-type]
        enc_opt.step()
        head_opt.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.SGD(self.encoder.parameters(), lr=0.05),
            torch.optim.AdamW(self.head.parameters(), lr=1e-2, foreach=False),
        ]


def test_two_optimizers_in_manual_optimization_are_each_treated_once_per_batch(make_policy, same):
    """Each optimizer's step treats its own gradients; the guard counts batches, Lightning counts optimizer steps."""
    policy = make_policy({"match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.05}]})

    def by_hand(module: nn.Module, step: int) -> None:
        for p in module.parameters():
            clip_grad_norm_([p], 0.05)

    callback = GradGuardCallback(policy, logger=None)
    guarded, ref = TwoOptimizers(), TwoOptimizers(reference=by_hand)
    run = trainer(callback, max_steps=6)
    run.fit(guarded, loader())
    trainer(max_steps=6).fit(ref, loader())

    same(params(guarded), params(ref))
    assert callback.guard is not None
    assert run.global_step == 6, "Lightning counts each optimizer's step"
    assert callback.guard.step_count == 3, "the guard counts training steps (batches)"
    assert callback.guard.counters.snapshot() == {"r0": {"clip_norm": 3 * n_params(guarded)}}


# --- the module itself ----------------------------------------------------------------------------


def test_importing_without_lightning_says_how_to_install(monkeypatch):
    """With lightning missing, importing the integration raises ImportError naming gradguard[lightning]."""
    for name in [n for n in sys.modules if n == "lightning" or n.startswith("lightning.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.delitem(sys.modules, "gradguard.integrations.lightning")
    with pytest.raises(ImportError, match=re.escape("pip install 'gradguard[lightning]'")):
        import gradguard.integrations.lightning  # noqa: F401


def test_a_second_fit_gets_a_new_guard_and_none_is_left_attached(make_policy):
    """Each fit attaches a fresh guard and removes it at the end; callback.guard is the last one."""
    policy = make_policy({"match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.01}]})
    callback = GradGuardCallback(policy, logger=None)
    module = Net("sgd")
    trainer(callback, max_steps=2).fit(module, loader())
    first = callback.guard
    trainer(callback, max_steps=3).fit(module, loader())
    assert first is not None
    assert callback.guard is not None
    assert callback.guard is not first
    assert not first.attached
    assert not callback.guard.attached
    assert (first.step_count, callback.guard.step_count) == (2, 3)


def test_policy_file_path_is_accepted(tmp_path):
    """GradGuardCallback takes a policy file path, like GradGuard."""
    path = tmp_path / "policy.yaml"
    path.write_text("version: 1\nrules:\n  - name: all\n    match: ['*']\n    actions: [{action: halt_on_nonfinite}]\n")
    callback = GradGuardCallback(path, logger=None)
    assert isinstance(callback.policy, Policy)
    run = trainer(callback, max_steps=2)
    run.fit(Net("sgd"), loader())
    assert callback.guard is not None
    assert callback.guard.step_count == 2


# --- the documented example (docs/frameworks.md) -------------------------------------------------

DOCUMENTED_EXAMPLE = """\
import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradguard import Policy
from gradguard.integrations.lightning import GradGuardCallback


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


policy = Policy.from_dict({
    "version": 1,
    "rules": [
        {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
        {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.5}]},
    ],
})
torch.manual_seed(0)
x = torch.randn(256, 16)
data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32)
guard_callback = GradGuardCallback(policy, audit_log="lightning-run.jsonl")
trainer = pl.Trainer(
    max_epochs=2,
    callbacks=[guard_callback],
    gradient_clip_val=1.0,  # applied after the policy, to the gradients it treated
    accelerator="cpu",
    logger=False,
    enable_checkpointing=False,
)
trainer.fit(Regressor(), data)  # a NaN or Inf raises GradientHalt before the optimizer step
print(guard_callback.guard.step_count, guard_callback.guard.counters.snapshot())
"""


def test_the_documented_lightning_example_runs(tmp_path, monkeypatch, capsys):
    """docs/frameworks.md's Lightning example is this code, and it runs: 16 steps, clips counted, a log written."""
    assert documented_example("docs/frameworks.md", "lightning") == DOCUMENTED_EXAMPLE
    monkeypatch.chdir(tmp_path)
    exec(compile(DOCUMENTED_EXAMPLE, "documented-lightning-example", "exec"), {"__name__": "__example__"})
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed.startswith("16 {")
    assert "'clip': {'clip_norm':" in printed
    assert (tmp_path / "lightning-run.jsonl").stat().st_size > 0
