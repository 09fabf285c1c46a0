"""Where people reach DeepSpeed from (issue 49): accelerate's DeepSpeed plugin on the CPU, on 2 gloo ranks, guarded by
the existing accelerate integration; Lightning 2.6's DeepSpeed strategy, which refuses the CPU before anything is
guarded.

accelerate on CPUs: ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))`` prepares a real
``DeepSpeedEngine`` when the process group's backend is named (``InitProcessGroupKwargs(backend="gloo")``; without it
accelerate finds no device backend on a CPU and counts one process) and ``ACCELERATE_USE_DEEPSPEED`` is set, as
``accelerate launch`` sets it. ``Accelerator(cpu=True)`` would give plain DDP instead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")
pytest.importorskip("accelerate")

from support.deepspeed_ranks import loss_of, make_model, torchrun_scenarios  # noqa: E402
from support.gloo_ranks import main  # noqa: E402

from gradguard import GradientHalt, Policy  # noqa: E402

SCRIPT = Path(__file__)
CUT = "2.weight"
FAULT = 3
HALT = {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}
TIGHT = {"name": "tight", "match": CUT, "actions": [{"action": "clip_norm", "max_norm": 1e-3}]}


def accelerate_scenario(rank: int) -> dict[str, Any]:
    """Train a model prepared by accelerate's DeepSpeed plugin (ZeRO 2), guarded by ``guard_accelerator``; a NaN made
    on rank 1 at step 3 halts both ranks there, naming the parameter, before DeepSpeed's update."""
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import InitProcessGroupKwargs
    from torch.utils.data import DataLoader, TensorDataset

    from gradguard.integrations.accelerate import guard_accelerator

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # as ``accelerate launch`` sets it
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(zero_stage=2), kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")]
    )
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 5, generator=gen), torch.randn(64, 3, generator=gen))
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    engine, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=4))
    param = dict(engine.module.named_parameters())[CUT]
    steps = [0]
    handle = param.register_hook(lambda g: g * float("nan") if rank == 1 and steps[-1] == FAULT else g)
    found: dict[str, Any] = {"engine": type(engine).__name__, "stage": int(engine.zero_optimization_stage())}
    found["processes"] = accelerator.num_processes
    guard = guard_accelerator(accelerator, engine, Policy.from_dict({"version": 1, "rules": [TIGHT, HALT]}))
    with guard:
        for step, (x, y) in enumerate(loader):
            steps.append(step)
            before = param.detach().clone()
            try:
                accelerator.backward(loss_of(engine(x), y))
            except GradientHalt as halt:
                found["halted"] = {"step": halt.step, "params": halt.params, "kind": halt.kind}
                found["untouched"] = torch.equal(before, param.detach())
                break
            optimizer.step()
            optimizer.zero_grad()
        found["counters"] = guard.counters.snapshot()
    handle.remove()
    return found


def scenario(name: str, rank: int, world: int, outdir: Path) -> dict[str, Any]:
    if name == "accelerate":
        return accelerate_scenario(rank)
    raise ValueError(name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[dict[str, Any]]]:
    return torchrun_scenarios(SCRIPT, ["accelerate"], tmp_path_factory.mktemp("deepspeed_frameworks"), timeout=300)


def test_accelerate_s_deepspeed_plugin_on_the_cpu_is_guarded_by_the_accelerate_integration_on_every_rank(
    runs: Callable[[str], list[dict[str, Any]]],
) -> None:
    """A real ZeRO 2 engine on 2 ranks: the policy's clip acts at every update before the NaN, which halts both ranks
    at its step naming the parameter, with the weights untouched."""
    for found in runs("accelerate"):
        assert (found["engine"], found["stage"], found["processes"]) == ("DeepSpeedEngine", 2, 2)
        assert found["halted"] == {"step": FAULT, "params": [CUT], "kind": "nan"}
        assert found["untouched"]
        assert found["counters"]["tight"] == {"clip_norm": FAULT}
        assert found["counters"]["nonfinite"] == {"nan": 1, "halt_on_nonfinite": 1}


@pytest.fixture
def environment_kept() -> Iterator[None]:
    """Lightning's strategy writes MASTER_ADDR, MASTER_PORT, NODE_RANK and LOCAL_RANK into this process's environment;
    left there, a later test's ``accelerate.Accelerator()`` believes it was launched distributed and wraps its model
    in DDP."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.usefixtures("environment_kept")
def test_lightning_s_deepspeed_strategy_refuses_the_cpu_with_its_own_clear_error_before_the_guard_attaches() -> None:
    """Lightning 2.6 refuses ``strategy="deepspeed_stage_2"`` on a CPU at fit's start, in words docs/distributed.md
    quotes; the guard's callback has attached nothing by then."""
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    from gradguard.integrations.lightning import GradGuardCallback
    from gradguard.lifecycle import live_guards

    class Module(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
            return loss_of(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    callback = GradGuardCallback(Policy.from_dict({"version": 1, "rules": [HALT]}), logger=None)
    trainer = pl.Trainer(
        strategy="deepspeed_stage_2",
        accelerator="cpu",
        devices=1,
        max_steps=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = DataLoader(TensorDataset(torch.randn(8, 5), torch.randn(8, 3)), batch_size=4)
    with pytest.raises(RuntimeError) as refused:
        trainer.fit(Module(), data)
    assert str(refused.value) == ("The DeepSpeed strategy is only supported on CUDA GPUs but `CPUAccelerator` is used.")
    assert callback.guard is None
    assert live_guards() == []


if __name__ == "__main__":
    main(scenario, sys.argv[1:])
