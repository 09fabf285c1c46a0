"""The step's participants: one protocol, registered by name, called at the stages they override (issue 43)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from gradguard import GradGuard
from gradguard.enforce.step import pipeline
from gradguard.enforce.step.participants import register, registered, unregister
from gradguard.enforce.work.participant import STAGES, Participant
from tests.support.counting_participant import NAME, CountingVeto, factory_for


def _model_and_data(steps: int) -> tuple[nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), [torch.randn(6, 4) for _ in range(steps)]


def _weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def test_a_participant_in_a_module_of_its_own_counts_every_step_and_vetoes_one_with_no_edit_of_the_pipeline():
    """Registered by name, the exercise participant sees steps 0-5, vetoes step 3's update on its own ruling, and
    the run ends bitwise equal to one that left that update out by hand; the pipeline never names it."""
    model, opt, data = _model_and_data(6)
    made: list[CountingVeto] = []
    guarded, skipped = [], []
    with registered(NAME, factory_for(made, veto=3)), GradGuard(model, "default", logger=None) as guard:
        for batch in data:
            opt.zero_grad()
            model(batch).pow(2).mean().backward()
            opt.step()
            skipped.append(guard.last_step_skipped)
            guarded.append(_weights(model))
    model, opt, data = _model_and_data(6)
    reference = []
    for step, batch in enumerate(data):
        opt.zero_grad()
        model(batch).pow(2).mean().backward()
        if step == 3:
            opt.zero_grad(set_to_none=True)  # the same update, left out by hand
        opt.step()
        reference.append(_weights(model))
    (participant,) = made
    assert participant.opened == [0, 1, 2, 3, 4, 5]
    assert participant.vetoed == [3]
    assert participant.applied_steps == [0, 1, 2, 4, 5]
    assert skipped == [False, False, False, True, False, False]
    assert torch.equal(guarded[3], guarded[2])
    for ours, theirs in zip(guarded, reference, strict=True):
        assert torch.equal(ours, theirs)
    assert NAME not in inspect.getsource(pipeline)


def test_a_participant_takes_part_only_in_the_guards_attached_while_it_is_registered():
    made: list[CountingVeto] = []
    register(NAME, factory_for(made, veto=-1))
    try:
        model = nn.Linear(3, 1)
        with GradGuard(model, "default", logger=None):
            pass
    finally:
        unregister(NAME)
    with GradGuard(nn.Linear(3, 1), "default", logger=None):
        pass
    assert len(made) == 1  # the second guard was attached after it was unregistered


def test_the_pipeline_calls_a_participant_only_at_the_stages_it_overrides():
    """The base class's stages are no-ops; ``stages()`` names exactly those a participant overrides."""
    assert CountingVeto(0).stages() == {"opens", "ruling", "applied"}
    assert Participant().stages() == frozenset()
    assert set(STAGES) >= {"opens", "before_figures", "after_read", "ruling", "applied", "release"}


def test_a_name_registered_twice_is_refused_with_what_to_do():
    made: list[CountingVeto] = []
    with registered(NAME, factory_for(made, veto=0)), pytest.raises(ValueError, match="unregister it first") as error:
        register(NAME, factory_for(made, veto=1))
    assert NAME in str(error.value)
