"""The ``rerun`` section under gradient accumulation (issue 42, item 1): the second computation of a suspect step is
the whole step again, the micro-batches accumulated before the closure included, so a fault that repeats in an
earlier micro-batch halts as it would without the section (never transient), and a transient fault in the closure's
micro-batch ends bitwise equal to the clean run. Where the step cannot be computed again, the guard says so and the
halt says it was not computed again (a plain loop, Hugging Face's ``Trainer``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gradguard import GradGuard, GradientHalt, Policy

HALT = {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}
STEPS = 12
FAULT = 7
MICRO = 2


def policy(rerun: dict[str, Any] | None) -> Policy:
    return Policy.from_dict({"version": 1, "rules": [HALT], **({"rerun": rerun} if rerun is not None else {})})


class Net(nn.Module):
    """With dropout: a second computation is the same only if the random numbers are; ``spare`` gets a gradient
    from the first micro-batch only, so the closure's backward never reaches it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(32, 1)
        self.spare = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, spare: bool = False) -> torch.Tensor:
        y = self.out(self.drop(torch.tanh(self.inp(x))))
        return y + self.spare(x) if spare else y


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * MICRO + micro)
    return torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)


def events(log: Path, kind: str) -> list[dict[str, Any]]:
    return [e for line in log.read_text().splitlines() if (e := json.loads(line))["event"] == kind]


Faults = Callable[[int, int, int], bool]
"""``(step, micro-batch, computation) -> poison``: computation 1 is the first run of the closure, 2 the second (the
micro-batches before the closure run once)."""


class Run:
    def __init__(self, model: Net, opt: torch.optim.Optimizer, guard: GradGuard, losses: dict[int, float]) -> None:
        self.model, self.opt, self.guard, self.losses = model, opt, guard, losses


def train(faults: Faults, rerun: dict[str, Any] | None, log: Path | None = None, zero: str = "after") -> Run:
    """``MICRO`` micro-batches a step: every one but the last backward before ``opt.step(closure)``, the last inside
    the closure. ``zero``: where the gradients are cleared, ``after`` the step (set to None) or ``in-place`` (zeroed,
    ``set_to_none=False``, before the first micro-batch). ``losses``: each step's loss as the guard sums it."""
    torch.manual_seed(1)  # the dropout masks' stream
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses: dict[int, float] = {}
    with GradGuard(model, policy(rerun), logger=None, audit_log=log) as guard:
        for step in range(STEPS):
            total: torch.Tensor | None = None
            if zero == "in-place":
                opt.zero_grad(set_to_none=False)
            for micro in range(MICRO - 1):
                x, y = batch(step, micro)
                loss = nn.functional.mse_loss(model(x, spare=True), y) / MICRO
                if faults(step, micro, 1):
                    loss = loss * float("nan")
                loss.backward()
                total = loss.detach().float() if total is None else total + loss.detach().float()
            calls: list[torch.Tensor] = []

            def closure(step: int = step, calls: list[torch.Tensor] = calls) -> torch.Tensor:
                x, y = batch(step, MICRO - 1)
                loss = nn.functional.mse_loss(model(x), y) / MICRO
                if faults(step, MICRO - 1, len(calls) + 1):
                    loss = loss * float("nan")
                loss.backward()
                calls.append(loss.detach().float())
                return loss

            opt.step(closure)
            if zero == "after":
                opt.zero_grad()
            losses[step] = (
                calls[-1] if total is None else total + calls[-1]
            ).item()  # as the guard sums the roots, the last computation's
    return Run(model, opt, guard, losses)


def assert_bitwise_equal(a: Run, b: Run) -> None:
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q)
    for x, y in zip(a.opt.state.values(), b.opt.state.values(), strict=True):
        assert all(torch.equal(x[key], y[key]) for key in x)


def test_a_nan_that_repeats_in_an_earlier_micro_batch_halts_as_without_the_section_and_is_never_transient(
    tmp_path: Path,
) -> None:
    def nan_in_the_first_micro_batch(step: int, micro: int, computation: int) -> bool:
        return step == FAULT and micro == 0

    with pytest.raises(GradientHalt) as without:
        train(nan_in_the_first_micro_batch, None)
    log = tmp_path / "run.jsonl"
    with pytest.raises(GradientHalt, match="reproducible") as caught:
        train(nan_in_the_first_micro_batch, {}, log)
    assert (caught.value.step, caught.value.rule) == (without.value.step, without.value.rule)
    assert sorted(caught.value.params) == sorted(without.value.params)
    assert caught.value.step == FAULT
    (rerun,) = events(log, "rerun")
    assert rerun["verdict"] == "reproducible"
    (halt,) = events(log, "halt")
    assert "transient" not in halt["counters"].get("rerun", {})


def test_a_transient_nan_in_the_closures_micro_batch_ends_bitwise_equal_to_the_clean_run(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    got = train(lambda step, micro, computation: step == FAULT and micro == MICRO - 1 and computation == 1, {}, log)
    clean = train(lambda step, micro, computation: False, {}, None)
    assert_bitwise_equal(got, clean)
    (rerun,) = events(log, "rerun")
    assert (rerun["step"], rerun["verdict"], rerun["loss_first"]) == (FAULT, "transient", "NaN")
    # The second computation's loss is the whole step's (the earlier micro-batch's root, put back, and the closure's):
    # the clean run's, bitwise.
    assert rerun["loss_second"] == clean.losses[FAULT] == got.losses[FAULT]
    assert got.guard.counters.snapshot()["rerun"] == {"transient": 1}
    assert not events(log, "halt")
    assert not events(log, "rerun_unavailable")


@pytest.mark.parametrize("zero", ["after", "in-place"])
def test_a_transient_nan_ends_bitwise_equal_whether_the_loop_clears_or_zeroes_its_gradients(zero: str) -> None:
    fault: Faults = lambda step, micro, computation: step == FAULT and micro == MICRO - 1 and computation == 1  # noqa: E731
    got = train(fault, {}, zero=zero)
    clean = train(lambda step, micro, computation: False, {}, zero=zero)
    assert got.guard.counters.snapshot()["rerun"] == {"transient": 1}
    assert_bitwise_equal(got, clean)


def test_a_closure_that_clears_its_gradients_first_reruns_exactly_without_accumulation() -> None:
    """The common closure (``zero_grad()`` first, the previous step's gradients still there when it begins)."""

    def run(fault: bool, set_to_none: bool) -> tuple[Net, GradGuard]:
        torch.manual_seed(1)
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with GradGuard(model, policy({}), logger=None) as guard:
            for step in range(STEPS):
                calls = [0]

                def closure(step: int = step, calls: list[int] = calls) -> torch.Tensor:
                    calls[0] += 1
                    opt.zero_grad(set_to_none=set_to_none)
                    x, y = batch(step, 0)
                    loss = nn.functional.mse_loss(model(x), y)
                    if fault and step == FAULT and calls[0] == 1:
                        loss = loss * float("nan")
                    loss.backward()
                    return loss

                opt.step(closure)
        return model, guard

    for set_to_none in (True, False):
        (got, guard), (clean, _) = run(True, set_to_none), run(False, set_to_none)
        assert guard.counters.snapshot()["rerun"] == {"transient": 1}
        for p, q in zip(got.parameters(), clean.parameters(), strict=True):
            assert torch.equal(p, q)


def lightning_fit(
    fault: Callable[[int, int], bool], rerun: dict[str, Any] | None, log: Path | None, accumulate: int = 2
) -> Any:
    """A Lightning fit with automatic optimization and ``accumulate_grad_batches``; ``fault(batch index, call)``."""
    pl = pytest.importorskip("lightning.pytorch")
    from gradguard.integrations.lightning import GradGuardCallback

    class Module(pl.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()
            self.calls: dict[int, int] = {}

        def training_step(self, data: Any, index: int) -> torch.Tensor:
            x, y = data
            self.calls[index] = self.calls.get(index, 0) + 1
            loss = nn.functional.mse_loss(self.net(x, spare=index % 2 == 0), y)
            return loss * float("nan") if fault(index, self.calls[index]) else loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(2)
    xs, ys = zip(*(batch(step, micro) for step in range(6) for micro in range(MICRO)), strict=True)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=16)
    module = Module()
    callback = GradGuardCallback(policy(rerun), logger=None, audit_log=log)
    trainer = pl.Trainer(
        max_epochs=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=accumulate,
    )
    trainer.fit(module, loader)
    return module, callback, trainer


def test_lightning_accumulating_two_batches_halts_on_a_nan_that_repeats_in_the_first_and_never_calls_it_transient(
    tmp_path: Path,
) -> None:
    def in_the_first_batch_of_step_3(index: int, call: int) -> bool:
        return index == 6  # batches 6 and 7 make step 3; 6 runs before the optimizer's step(closure)

    with pytest.raises(GradientHalt) as without:
        lightning_fit(in_the_first_batch_of_step_3, None, None)
    log = tmp_path / "run.jsonl"
    with pytest.raises(GradientHalt, match="reproducible") as caught:
        lightning_fit(in_the_first_batch_of_step_3, {}, log)
    assert caught.value.step == without.value.step
    assert sorted(caught.value.params) == sorted(without.value.params)
    assert caught.value.step == 3
    (rerun,) = events(log, "rerun")
    assert rerun["verdict"] == "reproducible"
    assert "transient" not in events(log, "halt")[0]["counters"].get("rerun", {})


def test_lightning_accumulating_two_batches_ends_bitwise_equal_after_a_transient_nan_in_the_closures_batch(
    tmp_path: Path,
) -> None:
    log = tmp_path / "run.jsonl"
    faulty, callback, _ = lightning_fit(lambda index, call: index == 7 and call == 1, {}, log)
    clean, _, _ = lightning_fit(lambda index, call: False, {}, None)
    (rerun,) = events(log, "rerun")
    assert (rerun["step"], rerun["verdict"]) == (3, "transient")
    assert callback.guard.counters.snapshot()["rerun"] == {"transient": 1}
    for p, q in zip(faulty.parameters(), clean.parameters(), strict=True):
        assert torch.equal(p, q)


def plain_loop(log: Path) -> None:
    """``loss.backward(); opt.step()``: no closure for the guard to run again; a NaN at step 3."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradGuard(model, policy({}), logger=None, audit_log=log):
        for step in range(6):
            x, y = batch(step, 0)
            opt.zero_grad()
            (nn.functional.mse_loss(model(x), y) * (float("nan") if step == 3 else 1.0)).backward()
            opt.step()


def test_a_plain_loops_halt_says_the_step_was_not_computed_again(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    with pytest.raises(GradientHalt, match="not computed again") as caught:
        plain_loop(log)
    assert "no closure" in str(caught.value)
    (note,) = events(log, "rerun_unavailable")
    assert "no closure" in note["why"]
    (halt,) = events(log, "halt")
    assert "not computed again" in halt["reason"]
    assert not events(log, "rerun")


def test_a_hugging_face_trainers_halt_says_the_step_was_not_computed_again(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from support.training import hf_training_args

    from gradguard.integrations.transformers import guard_trainer

    class Regressor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(4, 8)
            self.second = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            loss = nn.functional.mse_loss(self.second(torch.tanh(self.first(x))), y)
            return {"loss": loss * float("nan") if bool((x[:, 0] > 100).any()) else loss}

    gen = torch.Generator().manual_seed(1)
    data = [{"x": torch.randn(4, generator=gen), "y": torch.randn(1, generator=gen)} for _ in range(16)]
    data[9]["x"][0] = 1000.0  # the fifth step's batch (two examples a batch, two batches a step: step 2)
    torch.manual_seed(0)
    args = hf_training_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4)
    trainer = transformers.Trainer(model=Regressor(), args=args, train_dataset=data)
    log = tmp_path / "run.jsonl"
    guard_trainer(trainer, policy({}), logger=None, audit_log=log)
    with pytest.raises(GradientHalt, match="not computed again") as caught:
        trainer.train()
    assert "no closure" in str(caught.value)
    (note,) = events(log, "rerun_unavailable")
    assert "Hugging Face's Trainer has none" in note["why"]
    (halt,) = events(log, "halt")
    assert halt["step"] == caught.value.step
    assert "not computed again" in halt["reason"]


def test_a_closure_that_clears_its_gradients_first_frees_the_previous_ones_at_once_as_without_the_section() -> None:
    """Nothing was accumulated before the closure: the guard keeps no copy, nor the last step's gradients alive."""
    import weakref

    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    freed: list[bool] = []
    with GradGuard(model, policy({}), logger=None):
        for step in range(3):
            before = [weakref.ref(p.grad) for p in model.parameters() if p.grad is not None]

            def closure(step: int = step, before: list[Any] = before) -> torch.Tensor:
                opt.zero_grad()
                freed.append(all(ref() is None for ref in before))
                x, y = batch(step, 0)
                loss = nn.functional.mse_loss(model(x, spare=True), y)
                loss.backward()
                return loss

            opt.step(closure)
    assert freed == [True, True, True]
