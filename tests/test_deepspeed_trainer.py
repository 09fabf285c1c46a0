"""guard_trainer on a real Hugging Face Trainer with a DeepSpeed ZeRO-2 config, 2 gloo ranks on CPU.

The file is also the ranks' script: the tests launch it once under torchrun (``--torchrun NAMES OUTDIR``), every
scenario builds its own Trainer in the same two processes and writes each rank's findings as JSON, and the tests judge
them. The Trainer wraps the model into a DeepSpeedEngine before ``on_train_begin`` and updates inside
``accelerator.backward``; the guard must act inside DeepSpeed's update, on the reduced partitions. The optimizer is
torch's SGD, named by ``optim="sgd"``: with a DeepSpeed config the Trainer drops an optimizer passed as
``optimizers=(...)`` and builds its own from the arguments (transformers' ``deepspeed_init``), and a DeepSpeed
``optimizer`` section would build CPU-Adam.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from support.deepspeed_ranks import torchrun_scenarios  # noqa: E402
from support.gloo_ranks import main  # noqa: E402

from gradguard import GradientHalt, GuardStateError, Policy  # noqa: E402
from gradguard.integrations.transformers import GradGuardCallback, guard_trainer  # noqa: E402

SCRIPT = Path(__file__)
POISONED = "second.weight"
LR = 0.05
STEPS = 5
SCENARIOS = ["halt", "clip", "skip", "bare_callback"]
HALT = {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}
ZERO_2 = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 2},
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 10**9,
}


# --- the ranks ------------------------------------------------------------------------------------


class TinyLM(nn.Module):
    """An embedding and two linear layers (250 elements: ZeRO-2's partition boundary cuts ``second.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 5)
        self.first = nn.Linear(5, 7)
        self.second = nn.Linear(7, 16)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.second(torch.tanh(self.first(self.emb(input_ids))))
        return {"loss": nn.functional.cross_entropy(logits.reshape(-1, 16), labels.reshape(-1))}


def token_data(n: int = 32) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 16, (6,), generator=gen)
        out.append({"input_ids": ids, "labels": ids.roll(1)})
    return out


def make_trainer(outdir: Path, callbacks: list[Any] | None = None) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(outdir / "out"),
        report_to=[],
        use_cpu=True,  # without it, TrainingArguments counts one process and DeepSpeed's batch sizes disagree
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        logging_steps=1,
        optim="sgd",
        learning_rate=LR,
        lr_scheduler_type="constant",
        seed=0,
        deepspeed=dict(ZERO_2),
    )
    return transformers.Trainer(model=TinyLM(), args=args, train_dataset=token_data(), callbacks=callbacks)


def poison(trainer: Any, rank: int, at: int) -> Any:
    """A NaN in one element of ``second.weight``'s local gradient on rank 1 during the backward of global step ``at``
    (DeepSpeed reduces it into both ranks' partitions)."""
    param = dict(trainer.model.named_parameters())[POISONED]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if rank != 1 or trainer.state.global_step != at:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad

    return param.register_hook(hook)


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


class StepWeights(transformers.TrainerCallback):
    """The model's weights after each completed step, keyed by ``global_step``."""

    def __init__(self) -> None:
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.after[state.global_step] = weights(model)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.after[state.global_step] = weights(model)


def halt_scenario(rank: int, outdir: Path) -> dict[str, Any]:
    steps = StepWeights()
    trainer = make_trainer(outdir, [steps])
    callback = guard_trainer(trainer, Policy.from_dict({"version": 1, "rules": [HALT]}), logger=None)
    handle = poison(trainer, rank, 3)
    result: dict[str, Any] = {"halted": None}
    try:
        trainer.train()
    except GradientHalt as halt:
        last = steps.after[max(steps.after)]
        now = weights(trainer.model)
        result["halted"] = {"step": halt.step, "params": halt.params, "kind": halt.kind}
        result["global_step"] = trainer.state.global_step
        result["untouched"] = all(torch.equal(last[name], now[name]) for name in now)
    handle.remove()
    result["engine"] = type(trainer.model_wrapped).__name__
    result["optimizer"] = type(getattr(trainer.model_wrapped.optimizer, "optimizer", None)).__name__
    assert callback.guard is not None
    result["counters"] = callback.guard.counters.snapshot()
    result["attached"] = callback.guard.attached
    return result


def clip_scenario(rank: int, outdir: Path) -> dict[str, Any]:
    steps = StepWeights()
    trainer = make_trainer(outdir, [steps])
    tight = {"name": "tight", "match": POISONED, "actions": [{"action": "clip_norm", "max_norm": 1e-3}]}
    guard_trainer(trainer, Policy.from_dict({"version": 1, "rules": [tight, HALT]}), logger=None)
    trainer.train()
    moved, others = [], []
    for step in range(1, STEPS + 1):
        before, after = steps.after[step - 1], steps.after[step]
        moved.append(float((after[POISONED] - before[POISONED]).double().norm()))
        others.append(min(float((after[n] - before[n]).double().norm()) for n in after if n != POISONED))
    final = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()]).double()
    gathered = [torch.empty_like(final) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, final)
    return {
        "log_history": trainer.state.log_history,
        "moved": moved,
        "others": others,
        "same": all(torch.equal(gathered[0], other) for other in gathered[1:]),
    }


def skip_scenario(rank: int, outdir: Path) -> dict[str, Any]:
    trainer = make_trainer(outdir)
    skip = {"name": "skip", "match": "*", "actions": [{"action": "skip_step_on_nonfinite"}]}
    callback = guard_trainer(trainer, Policy.from_dict({"version": 1, "rules": [skip]}), logger=None)
    handle = poison(trainer, rank, 2)
    trainer.train()
    handle.remove()
    assert callback.guard is not None
    finite = all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())
    return {
        "counters": callback.guard.counters.snapshot(),
        "finite": finite,
        "deepspeed_skipped": int(trainer.model_wrapped.skipped_steps),
        "global_step": trainer.state.global_step,
        "scheduler_steps": trainer.lr_scheduler.last_epoch,  # 0 when created, +1 at each step() the Trainer made
    }


def bare_callback_scenario(outdir: Path) -> dict[str, Any]:
    trainer = make_trainer(outdir, [GradGuardCallback(Policy.from_dict({"version": 1, "rules": [HALT]}))])
    try:
        trainer.train()
    except GuardStateError as error:
        return {"refused": str(error), "global_step": trainer.state.global_step}
    return {"refused": "", "global_step": trainer.state.global_step}


def scenario(name: str, rank: int, world: int, outdir: Path) -> dict[str, Any]:
    if name == "halt":
        return halt_scenario(rank, outdir)
    if name == "clip":
        return clip_scenario(rank, outdir)
    if name == "skip":
        return skip_scenario(rank, outdir)
    return bare_callback_scenario(outdir)


# --- the tests ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[dict[str, Any]]]:
    return torchrun_scenarios(SCRIPT, SCENARIOS, tmp_path_factory.mktemp("deepspeed_trainer"), timeout=300)


def test_a_nan_on_one_rank_halts_trainer_train_on_every_rank_at_that_step_naming_the_parameter(
    runs: Callable[[str], list[dict[str, Any]]],
) -> None:
    for result in runs("halt"):
        assert result["halted"] == {"step": 3, "params": [POISONED], "kind": "nan"}
        assert (result["engine"], result["optimizer"]) == ("DeepSpeedEngine", "SGD")
        assert result["global_step"] == 3
        assert result["untouched"]  # the weights are those after step 2's update: DeepSpeed did not apply step 3
        assert result["counters"]["nonfinite"] == {"nan": 1, "halt_on_nonfinite": 1}
        assert not result["attached"]  # guard_trainer removed it when train() raised


def test_a_per_tensor_clip_inside_deepspeeds_update_is_counted_in_the_trainers_logs_and_ranks_stay_equal(
    runs: Callable[[str], list[dict[str, Any]]],
) -> None:
    """Under SGD at a constant lr the clipped parameter moves by lr x max_norm at every step, the others freely."""
    for result in runs("clip"):
        counts = [entry["gradguard/tight/clip_norm"] for entry in result["log_history"] if "loss" in entry]
        assert counts == [1, 2, 3, 4, 5]
        bound = LR * 1e-3
        assert all(bound * (1 - 5e-3) < moved <= bound * (1 + 5e-3) for moved in result["moved"]), result["moved"]
        assert all(other > 10 * bound for other in result["others"]), result["others"]
        assert result["same"]


def test_a_skip_takes_deepspeeds_overflow_path_so_the_trainer_does_not_step_its_scheduler_and_training_goes_on(
    runs: Callable[[str], list[dict[str, Any]]],
) -> None:
    for result in runs("skip"):
        assert result["counters"]["skip"]["skip_step_on_nonfinite"] == 1
        assert result["deepspeed_skipped"] == 1
        assert result["global_step"] == STEPS
        assert result["scheduler_steps"] == STEPS - 1
        assert result["finite"]


def test_the_callback_alone_under_deepspeed_is_refused_before_any_step_pointing_to_guard_trainer(
    runs: Callable[[str], list[dict[str, Any]]],
) -> None:
    for result in runs("bare_callback"):
        assert "guard_trainer(trainer, policy)" in result["refused"]
        assert "DeepSpeed" in result["refused"]
        assert result["global_step"] == 0


if __name__ == "__main__":
    main(scenario, sys.argv[1:])
