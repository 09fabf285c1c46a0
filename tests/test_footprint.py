"""The guard's footprint: a guarded step needs no more memory than the unguarded one, no gradient outlives its step,
and what the guard holds is given back when it goes, with no help from the garbage collector (issue 41).

The peaks are the CPU profiler's allocation events summed in time order (``benchmarks/peak_memory.py``), measured
with the garbage collector off, so a reference cycle that keeps a step's tensors alive shows whenever the collector
would have run.
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gradguard import GradGuard, Policy
from gradguard.enforce.work.tensors import device_constant

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import peak_memory

CPU = torch.device("cpu")


def recovery_on_the_host() -> Policy:
    data = Policy.shipped("llm-adaptive").model_dump(mode="python", exclude_none=True)
    data["recovery"] = {"snapshot_every": 2, "keep": 2, "min_age": 1, "memory": "host"}
    return Policy.from_dict(data, source="llm-adaptive + recovery on the host")


POLICIES: dict[str, Callable[[], Policy]] = {
    **peak_memory.POLICIES,
    "llm-adaptive": lambda: Policy.shipped("llm-adaptive"),
    "llm-pretraining": lambda: Policy.shipped("llm-pretraining"),
    "adaptive + recovery on the host": recovery_on_the_host,
}


@pytest.fixture
def no_garbage_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture(scope="module")
def base() -> peak_memory.Workload:
    return peak_memory.small_gpt(CPU)


@pytest.mark.parametrize("loop_clip", [False, True], ids=["no-loop-clip", "loop-clip"])
@pytest.mark.parametrize("fused", [False, True], ids=["foreach-adamw", "fused-adamw"])
@pytest.mark.parametrize("policy", list(peak_memory.POLICIES))
def test_a_guarded_steps_peak_is_within_256_kib_or_2_percent_of_the_gradients_of_the_unguarded_steps(
    base: peak_memory.Workload, policy: str, fused: bool, loop_clip: bool
) -> None:
    row = peak_memory.measure(CPU, policy, fused=fused, loop_clip=loop_clip, base=base)
    assert row.unguarded > row.gradients  # the measure sees the step: activations and gradients
    assert row.over <= row.bound, peak_memory.table([row])


def live_tensors() -> dict[int, torch.Tensor]:
    with warnings.catch_warnings():  # isinstance() on torch.distributed's deprecated reduce_op warns
        warnings.simplefilter("ignore", FutureWarning)
        return {id(obj): obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)}


def training_state(work: peak_memory.Workload) -> set[int]:
    """The tensors a run owns without a guard: parameters, gradients, buffers, optimizer state."""
    owned = {id(p) for p in work.params} | {id(p.grad) for p in work.params if p.grad is not None}
    owned |= {id(b) for b in work.model.buffers()}
    owned |= {id(v) for state in work.opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)}
    return owned


@pytest.mark.usefixtures("no_garbage_collector")
@pytest.mark.parametrize("provenance", ["first_fault", "always", None])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_no_gradient_outlives_its_step_without_the_garbage_collector(policy: str, provenance: str | None) -> None:
    work = peak_memory.small_gpt(CPU)
    with GradGuard(work.model, POLICIES[policy](), logger=None, provenance=provenance):
        for _ in range(3):
            peak_memory.step(work, loop_clip=True)
        earlier = [weakref.ref(p.grad) for p in work.params if p.grad is not None]
        work.opt.zero_grad(set_to_none=True)
        alive = sum(1 for ref in earlier if ref() is not None)
    assert len(earlier) == 53
    assert alive == 0


def run_and_remove(
    policy: Policy, *, leave: str, provenance: str | None
) -> tuple[GradGuard, dict[str, Any], list[torch.Tensor]]:
    """Train 5 steps under a guard, let it go (``remove()`` or the end of a ``with`` block) and keep it referenced;
    its counters and state before it went, and the tensors made since that are still alive and not the run's own."""
    work = peak_memory.small_gpt(CPU)
    before = set(live_tensors())
    guard = GradGuard(work.model, policy, logger=None, provenance=provenance)
    with guard if leave == "with" else contextlib.nullcontext():
        for _ in range(5):
            peak_memory.step(work, loop_clip=True)
        held = {"counters": guard.counters.snapshot(), "state": guard.state_dict()}
    if leave == "remove":
        guard.remove()
    device_constant.cache_clear()  # a process-wide cache of 0-dim constants (bounded), not this guard's
    owned = training_state(work) | before
    return guard, held, [t for key, t in live_tensors().items() if key not in owned]


@pytest.mark.usefixtures("no_garbage_collector")
@pytest.mark.parametrize("leave", ["remove", "with"])
@pytest.mark.parametrize("provenance", ["first_fault", "always"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_removed_guard_holds_no_tensor_while_its_counters_and_state_stay_readable(
    policy: str, provenance: str, leave: str
) -> None:
    guard, held, alive = run_and_remove(POLICIES[policy](), leave=leave, provenance=provenance)
    assert [(tuple(t.shape), t.dtype) for t in alive] == []
    assert not guard.attached
    assert guard.step_count == 5
    assert guard.counters.snapshot() == held["counters"]
    assert json.dumps(guard.state_dict()) == json.dumps(held["state"])  # an empty ring slot is NaN
    assert guard.metrics().get("gradguard/recovery/snapshot_bytes", 0.0) == 0.0


def test_the_adaptive_statistics_of_a_removed_guard_are_those_it_held_and_a_new_guard_takes_them_over() -> None:
    work = peak_memory.small_gpt(CPU)
    guard = GradGuard(work.model, Policy.shipped("llm-adaptive"), logger=None)
    for _ in range(5):
        peak_memory.step(work, loop_clip=False)
    held = guard.state_dict()
    guard.remove()
    assert json.dumps(guard.state_dict()) == json.dumps(held)
    assert any(held["statistics"].values())

    resumed = GradGuard(work.model, Policy.shipped("llm-adaptive"), logger=None)
    resumed.load_state_dict(guard.state_dict())
    peak_memory.step(work, loop_clip=False)
    resumed.remove()
    assert resumed.step_count == 6


@pytest.mark.usefixtures("no_garbage_collector")
def test_a_reload_that_drops_the_recovery_section_gives_the_snapshots_back_at_the_next_step(tmp_path: Path) -> None:
    with_recovery = peak_memory.with_recovery_section(peak_memory.per_tensor_policy(1.0))
    without = tmp_path / "without-recovery.yaml"
    data = with_recovery.model_dump(mode="json", exclude_none=True)
    del data["recovery"]
    without.write_text(Policy.from_dict(data).model_dump_json())
    work = peak_memory.small_gpt(CPU)
    before = set(live_tensors())
    guard = GradGuard(work.model, with_recovery, logger=None)
    for _ in range(3):
        peak_memory.step(work, loop_clip=False)
    assert guard.metrics()["gradguard/recovery/snapshot_bytes"] > 0
    guards = set(live_tensors()) - before - training_state(work)  # the snapshots among them
    assert guard.reload(without)
    peak_memory.step(work, loop_clip=False)  # the reload takes over at this step's boundary
    device_constant.cache_clear()
    owned = training_state(work)  # a new gradient may take a freed snapshot tensor's id
    still = [t for key, t in live_tensors().items() if key in guards and key not in owned]
    assert [tuple(t.shape) for t in still] == []
    assert "gradguard/recovery/snapshot_bytes" not in guard.metrics()
    guard.remove()


@pytest.mark.usefixtures("no_garbage_collector")
def test_lightnings_callback_gives_back_every_tensor_its_guard_made_when_fitting_ends() -> None:
    """The integrations detach through ``guard.remove()``: snapshots and statistics go with it, the guard stays."""
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    from gradguard.integrations.lightning import GradGuardCallback

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 1)), batch_size=4)
    module = Module()
    before = set(live_tensors())
    policy = Policy.shipped("default").model_dump(mode="python", exclude_none=True)
    policy["recovery"] = {"snapshot_every": 2, "keep": 2, "min_age": 1, "memory": "host"}
    callback = GradGuardCallback(Policy.from_dict(policy), logger=None)
    trainer = pl.Trainer(
        max_steps=6,
        callbacks=[callback],
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data)
    guard = callback.guard
    assert guard is not None
    assert not guard.attached
    assert guard.step_count == 6
    device_constant.cache_clear()
    owned = {id(p) for p in module.parameters()} | {id(p.grad) for p in module.parameters() if p.grad is not None}
    optimizer = trainer.optimizers[0]
    owned |= {id(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)}
    left = [t for key, t in live_tensors().items() if key not in before and key not in owned]
    guards = [t for t in left if t.numel() in {p.numel() for p in module.parameters()}]
    assert [tuple(t.shape) for t in guards] == []
    assert guard.metrics().get("gradguard/recovery/snapshot_bytes", 0.0) == 0.0
