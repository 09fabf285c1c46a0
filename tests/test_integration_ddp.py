"""Lightning's and Hugging Face's Trainers under DDP (and Lightning's FSDP2) name the rank a NaN came from (#58).

The frameworks wrap the model into ``DistributedDataParallel`` themselves (Lightning's ``trainer.strategy.model``, the
Trainer's ``model_wrapped``) and hand their callbacks the plain model; the integrations guard the wrapper, where each
rank's own gradient is read before the all-reduce. Lightning's ``ModelParallelStrategy`` shards the module in place
with FSDP2 (``configure_model``), where the guard on the module finds the reduce-scatter by itself. The file is also
the ranks' script: the tests launch it once under torchrun on 2 gloo ranks (``--torchrun NAMES OUTDIR``), each
scenario trains a tiny model with a NaN made in rank 1's backward of one step, and writes each rank's halt as JSON.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from support.deepspeed_ranks import torchrun_scenarios  # noqa: E402
from support.gloo_ranks import main  # noqa: E402

from gradguard import GradientHalt, Policy  # noqa: E402

SCRIPT = Path(__file__)
HOST = socket.gethostname()
POISONED = "first.weight"
BAD_STEP = 2
SCENARIOS = ["lightning", "lightning_fsdp2", "trainer_guard_trainer", "trainer_callback"]
EXPECTED = {"lightning_fsdp2": ("ShardedRegressor", [POISONED, "first.bias"])}
"""What the guard attached to and the parameters a halt names, where not the DDP wrapper and ``POISONED`` alone:
FSDP2 (Lightning's ``ModelParallelStrategy``) shards the module in place, and the NaN goes into the gradient handed
back to ``first`` (a sharded parameter's own hooks never fire), so into both of its parameters."""
HALT = Policy.from_dict(
    {"version": 1, "rules": [{"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}]}
)


# --- the ranks ------------------------------------------------------------------------------------


def poison(param: nn.Parameter, rank: int, step_now: Callable[[], int]) -> Any:
    """A NaN in one element of ``param``'s gradient, in rank 1's own backward of step ``BAD_STEP`` (before DDP's
    all-reduce carries it to rank 0)."""

    return param.register_hook(lambda grad: poison_grad(grad, rank, step_now()))


def poison_grad(grad: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    if rank != 1 or step != BAD_STEP:
        return grad
    grad = grad.clone()
    grad.view(-1)[0] = float("nan")
    return grad


def halt_found(train: Callable[[], Any], callback: Any, seen: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``train`` to its halt; with the type of the model the callback's guard attached to (as ``seen`` noted it
    during training, where given: Lightning drops its DDP wrapper when ``fit`` raises, and only a garbage cycle may
    still hold it then)."""
    guarded = lambda: seen["guarded"] if seen else type(callback.guard._model_ref()).__name__  # noqa: E731
    try:
        train()
    except GradientHalt as halt:
        origin = halt.origin or {}
        return {
            "step": halt.step,
            "params": list(halt.params),
            "ranks": {str(rank): host for rank, host in halt.ranks.items()},
            "phase": origin.get("phase"),
            "message": str(halt),
            "guarded": guarded(),
        }
    return {"step": None, "guarded": guarded()}


class TinyRegressor(pl.LightningModule):  # type: ignore[misc,name-defined]
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 8)
        self.second = nn.Linear(8, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.second(torch.tanh(self.first(x))), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class ShardedRegressor(TinyRegressor):
    """The same model, sharded by FSDP2 over the data-parallel mesh in ``configure_model`` (ModelParallelStrategy)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in (self.first, self.second):  # not the module itself: Lightning calls training_step, not forward
            fully_shard(layer, mesh=mesh)


def lightning_scenario(rank: int, *, sharded: bool) -> dict[str, Any]:
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from gradguard.integrations.lightning import GradGuardCallback

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=gen)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    module = ShardedRegressor() if sharded else TinyRegressor()
    callback = GradGuardCallback(HALT, logger=None)
    seen: dict[str, str] = {}

    class NoteTheGuarded(pl.Callback):  # type: ignore[misc,name-defined]
        def on_train_batch_start(self, *args: Any) -> None:
            seen["guarded"] = type(callback.guard._model_ref()).__name__

    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if sharded else "ddp"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=4,
        callbacks=[callback, NoteTheGuarded()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if sharded:  # a sharded parameter's own hooks never fire: the gradient handed back to the layer, on this rank
        step_now = lambda: trainer.global_step  # noqa: E731
        module.first.register_full_backward_pre_hook(lambda _, grads: (poison_grad(grads[0], rank, step_now()),))
    else:
        poison(module.first.weight, rank, lambda: trainer.global_step)
    return halt_found(lambda: trainer.fit(module, data), callback, seen)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 4)
        self.first = nn.Linear(4, 16)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.first(self.emb(input_ids))
        return {"loss": nn.functional.cross_entropy(logits.reshape(-1, 16), labels.reshape(-1))}


def trainer_scenario(outdir: Path, rank: int, *, alone: bool) -> dict[str, Any]:
    from gradguard.integrations.transformers import GradGuardCallback, guard_trainer

    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids.roll(1)} for ids in torch.randint(0, 16, (32, 6), generator=gen)]
    args = transformers.TrainingArguments(
        output_dir=str(outdir / "out"),
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        per_device_train_batch_size=2,
        max_steps=4,
        optim="sgd",
        learning_rate=0.01,
        seed=0,
    )
    callback = GradGuardCallback(HALT, logger=None)
    trainer = transformers.Trainer(
        model=TinyLM(), args=args, train_dataset=data, callbacks=[callback] if alone else None
    )
    if not alone:
        callback = guard_trainer(trainer, HALT, logger=None)
    poison(trainer.model.first.weight, rank, lambda: trainer.state.global_step)
    found = halt_found(trainer.train, callback)
    callback.remove()  # the callback alone cannot see the halt leave train()
    return found


def scenario(name: str, rank: int, world: int, outdir: Path) -> dict[str, Any]:
    if name.startswith("lightning"):
        return lightning_scenario(rank, sharded=name == "lightning_fsdp2")
    return trainer_scenario(outdir, rank, alone=name == "trainer_callback")


# --- the tests ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[dict[str, Any]]]:
    return torchrun_scenarios(SCRIPT, SCENARIOS, tmp_path_factory.mktemp("integration_ddp"), timeout=300)


@pytest.mark.parametrize("name", SCENARIOS)
def test_a_nan_made_on_rank_1_under_the_framework_s_ddp_or_fsdp2_is_named_with_its_host_on_both_ranks(
    runs: Callable[[str], list[dict[str, Any]]], name: str
) -> None:
    guarded, params = EXPECTED.get(name, ("DistributedDataParallel", [POISONED]))
    for rank, halt in enumerate(runs(name)):
        assert halt["guarded"] == guarded
        assert (halt["step"], halt["params"]) == (BAD_STEP, params), halt
        assert halt["ranks"] == {"1": HOST}, halt
        assert f"made on rank 1 (host {HOST})" in halt["message"]
        if rank == 0:
            assert halt["phase"] == "received", halt
            assert "It was not made on this rank (rank 0)" in halt["message"]
            assert "own parameters" not in halt["message"]
        else:
            assert halt["phase"] != "received", halt


if __name__ == "__main__":
    main(scenario, sys.argv[1:])
