"""Recovery and the LR schedulers people use (issue 36, item 3): schedulers whose position is the loop's count
(timm's ``step_update(num_updates)``, ``CosineAnnealingWarmRestarts.step(epoch)``) stepped with
``guard.applied_steps``; ``lr_factor`` in every LR a scheduler computes from (``SWALR``'s ``swa_lr``, timm's
``base_values``), once per scheduler when a composite and its parts are both handed over; a scheduler that cannot be
copied refused at attach, by name. Each run is compared with its twin: the run that never trained on the undone
batches (20 to 27: the snapshot's step to the end of the window after the NaN at 23)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from support.docs import ROOT, documented_example
from support.timm_scheduler import CosineLRScheduler
from torch import nn
from torch.optim import lr_scheduler as torch_schedulers
from torch.optim.swa_utils import SWALR

from gradguard import GradGuard, GuardStateError, Policy

STEPS, FAULT, SNAPSHOT, RESUME = 40, 23, 20, 28
KEPT = [*range(SNAPSHOT), *range(RESUME, STEPS)]
HALT = {"name": "nonfinite", "match": ["*"], "actions": [{"action": "halt_on_nonfinite"}]}
RECOVERY = {"snapshot_every": 5, "keep": 2, "min_age": 3, "skip_steps": 4}


def policy(recovery: dict[str, Any] | None) -> Policy:
    return Policy.from_dict({"version": 1, "rules": [HALT], **({"recovery": recovery} if recovery else {})})


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))


_gen = torch.Generator().manual_seed(1)
DATA = [(torch.randn(6, 8, generator=_gen), torch.randn(6, 2, generator=_gen)) for _ in range(STEPS)]


@dataclass(frozen=True)
class Kind:
    """A scheduler, what the loop hands the guard, and how the loop steps it after each update (``n``: the count of
    applied updates, the loop's own or ``guard.applied_steps``)."""

    make: Callable[[torch.optim.Optimizer], tuple[Any, list[Any]]]
    advance: Callable[[Any, int], None]


def _sequential(opt: torch.optim.Optimizer) -> tuple[Any, list[Any]]:
    parts = [
        torch_schedulers.LinearLR(opt, start_factor=0.5, total_iters=10),
        torch_schedulers.CosineAnnealingLR(opt, T_max=30, eta_min=1e-3),
    ]
    sequence = torch_schedulers.SequentialLR(opt, parts, milestones=[24])  # switches after the rewind
    return sequence, [sequence, *parts]


def _chained(opt: torch.optim.Optimizer) -> tuple[Any, list[Any]]:
    parts = [
        torch_schedulers.LambdaLR(opt, lambda s: 1 / (1 + 0.05 * s)),  # recomputed from base_lrs at every step
        torch_schedulers.MultiplicativeLR(opt, lambda s: 0.99),
    ]
    chain = torch_schedulers.ChainedScheduler(parts, optimizer=opt)
    return chain, [chain, *parts]


def _timm(opt: torch.optim.Optimizer) -> tuple[Any, list[Any]]:
    # Warm-up until the 24th update: the rewind (to the 20th) lands inside it, the cosine follows.
    schedule = CosineLRScheduler(opt, t_initial=40, lr_min=1e-3, warmup_t=24, warmup_lr_init=1e-3, t_in_epochs=False)
    return schedule, [schedule]


def _restarts(opt: torch.optim.Optimizer) -> tuple[Any, list[Any]]:
    schedule = torch_schedulers.CosineAnnealingWarmRestarts(opt, T_0=2, eta_min=1e-3)
    return schedule, [schedule]


def _swa(opt: torch.optim.Optimizer) -> tuple[Any, list[Any]]:
    schedule = SWALR(opt, swa_lr=[0.02, 0.01], anneal_epochs=25, anneal_strategy="cos")  # ends 5 updates after 20
    return schedule, [schedule]


def _step(schedule: Any, n: int) -> None:
    schedule.step()


KINDS = {
    "timm-step_update": Kind(_timm, lambda schedule, n: schedule.step_update(num_updates=n)),
    "warm-restarts-step-epoch": Kind(_restarts, lambda schedule, n: schedule.step(n / 5)),  # 5 updates an epoch
    "swalr": Kind(_swa, _step),
    "sequential-and-parts": Kind(_sequential, _step),
    "chained-and-parts": Kind(_chained, _step),
}


def train(
    kind: Kind, steps: list[int], *, recovery: dict[str, Any] | None, count: str = "applied"
) -> tuple[Net, dict[int, list[float]], GradGuard]:
    """Train on ``steps`` (a NaN at FAULT when ``recovery``); ``count``: what the loop gives a scheduler that takes a
    step number: ``applied`` (``guard.applied_steps``), ``own`` (the updates the loop made), ``loop`` (its index + 1).
    Returns the model, the LRs each update of a step from RESUME on used (per group), and the guard."""
    model = Net()
    groups = [{"params": model.inp.parameters(), "lr": 0.1}, {"params": model.out.parameters(), "lr": 0.05}]
    opt = torch.optim.SGD(groups, momentum=0.9)
    schedule, handed = kind.make(opt)
    used: dict[int, list[float]] = {}
    updates = 0
    with GradGuard(model, policy(recovery), logger=None, lr_scheduler=handed) as guard:
        for i in steps:
            x, y = DATA[i]
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            (loss * float("nan") if recovery is not None and i == FAULT else loss).backward()
            opt.step()
            updates += 1
            if i >= RESUME:
                used[i] = [group["lr"] for group in opt.param_groups]
            kind.advance(schedule, {"applied": guard.applied_steps, "own": updates, "loop": i + 1}[count])
    return model, used, guard


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("name", list(KINDS))
def test_a_rewound_run_whose_scheduler_is_stepped_with_applied_steps_ends_bitwise_equal_to_its_twin(name: str):
    """With ``guard.applied_steps`` as the step number, the schedule after a rewind goes on at the applied updates'
    count, as the twin's (which counts its own updates) does: weights and every LR used are bitwise equal."""
    kind = KINDS[name]
    got = train(kind, list(range(STEPS)), recovery=RECOVERY)
    twin = train(kind, KEPT, recovery=None, count="own")
    assert got[2].state_dict()["recovery"]["rewinds"] == 1
    assert got[2].applied_steps == twin[2].applied_steps == len(KEPT)
    assert got[1] == twin[1]
    assert same_weights(got[0], twin[0])


@pytest.mark.parametrize("name", ["timm-step_update", "warm-restarts-step-epoch"])
def test_the_loops_own_step_index_puts_such_a_schedule_ahead_of_its_twin_after_a_rewind(name: str):
    """What ``applied_steps`` is for: given the loop's index instead, the schedule goes on 8 updates ahead."""
    got = train(KINDS[name], list(range(STEPS)), recovery=RECOVERY, count="loop")
    twin = train(KINDS[name], KEPT, recovery=None, count="own")
    assert got[1] != twin[1]
    assert not same_weights(got[0], twin[0])


@pytest.mark.parametrize("name", list(KINDS))
def test_under_lr_factor_one_half_each_groups_lr_is_half_the_twins_at_every_step_after_the_rewind(name: str):
    """Every LR a scheduler computes from is scaled (SWALR's ``swa_lr``, timm's ``base_values`` and warm-up), and a
    composite handed over with its parts is scaled once, not twice: half the twin's LR in each group, every step."""
    kind = KINDS[name]
    got = train(kind, list(range(STEPS)), recovery={**RECOVERY, "lr_factor": 0.5})
    twin = train(kind, KEPT, recovery=None, count="own")
    assert got[2].state_dict()["recovery"]["lr_scale"] == 0.5
    assert got[1].keys() == twin[1].keys() == set(range(RESUME, STEPS))
    for step, lrs in got[1].items():
        want = [0.5 * lr for lr in twin[1][step]]
        assert lrs == pytest.approx(want, rel=1e-12, abs=0), f"step {step}: {lrs} against {want}"


def test_applied_steps_counts_neither_skipped_steps_nor_the_updates_a_rewind_undid():
    """Before the fault every step counts; the rewind to step 20 takes the count back to 20; the window (24-27) adds
    nothing; a skip rule's skipped step adds nothing; ``state_dict`` carries the count to a resumed guard."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    skip = {"name": "skips", "match": ["*"], "actions": [{"action": "skip_step_on_nonfinite"}]}
    rules = {"version": 1, "rules": [skip], "recovery": {**RECOVERY, "skip_steps": 4}}
    rules["rules"][0]["actions"][0]["max_consecutive_skips"] = 1  # a second skip in a row escalates: a rewind
    seen = []
    with GradGuard(model, Policy.from_dict(rules), logger=None) as guard:
        for i in range(32):
            x, y = DATA[i]
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            (loss * float("nan") if i in (12, 22, 23) else loss).backward()
            opt.step()
            seen.append(guard.applied_steps)
        state = guard.state_dict()
    assert seen[:12] == list(range(1, 13))
    assert seen[12] == 12  # skipped
    assert seen[13:22] == list(range(13, 22))
    assert seen[22] == 21  # the first of two skips in a row
    assert seen[23:28] == [19] * 5  # the second escalates: a rewind to step 20, before which 19 updates were applied
    assert seen[28:] == [20, 21, 22, 23]
    assert state["recovery"]["applied"] == 23
    with GradGuard(model, Policy.from_dict(rules), logger=None) as resumed:
        resumed.load_state_dict(state)
        assert resumed.applied_steps == 23
    older = {key: value for key, value in state["recovery"].items() if key != "applied"}
    with GradGuard(model, Policy.from_dict(rules), logger=None, start_step=7) as fresh:
        assert fresh.applied_steps == 7  # a resumed run without a state: the loop's own count
        fresh.load_state_dict({**state, "recovery": older})  # a state saved before the count existed
        assert fresh.applied_steps == 32


class _LockedFactor:
    """A LambdaLR factor as an object (its ``__dict__`` is in the scheduler's ``state_dict``) that holds a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __call__(self, step: int) -> float:
        with self.lock:
            return 1.0 / (1 + step)


def test_a_scheduler_whose_state_cannot_be_copied_is_refused_at_attach_with_its_name():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch_schedulers.LambdaLR(opt, _LockedFactor())
    with pytest.raises(GuardStateError, match=r"LR scheduler LambdaLR: its state_dict\(\) cannot be copied") as caught:
        GradGuard(model, policy(RECOVERY), logger=None, lr_scheduler=schedule)
    assert "lock" in str(caught.value)
    guard = GradGuard(model, policy(RECOVERY), logger=None)  # it attaches: the refusal left the model free
    with guard, pytest.raises(GuardStateError, match="LambdaLR"):
        guard._enforcer.recovery.add_scheduler(schedule)  # as the Lightning and HF integrations hand it over
    with GradGuard(model, policy(None), logger=None, lr_scheduler=schedule):  # nothing is copied without recovery
        pass


def test_the_documented_timm_example_runs_as_written_and_its_schedule_counts_the_applied_updates(tmp_path: Path):
    """docs/recovery.md's timm example, with this file's stand-in installed as ``timm.scheduler``."""
    package = tmp_path / "timm" / "scheduler"
    package.mkdir(parents=True)
    (tmp_path / "timm" / "__init__.py").write_text("")
    shutil.copy(Path(__file__).parent / "support" / "timm_scheduler.py", package / "__init__.py")
    script = tmp_path / "example.py"
    script.write_text(documented_example("docs/recovery.md", "timm"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["32", "[0.005]"]
