"""Every policy the guard accepts reads the device once per step and sends it nothing made from Python data.

On a GPU, each read of a device value waits for the device, and a tensor made from a Python list is a copy from
pageable host memory that waits too. The step's one read is the guard's whole budget: the shipped LLM policies
and a policy mixing every action, scope, window, monitor and provenance stay within it, on the steps that clip
and on the steps that do not.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.host_syncs import count_host_syncs, count_python_data_tensors

from gradguard import GradGuard, Policy

MIXED: dict[str, Any] = {
    "version": 1,
    "rules": [
        {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
        {"name": "embeddings", "match": "*embed*", "actions": [{"action": "clip_norm", "max_norm": 0.05}]},
        {
            "name": "norms",
            "match": "*norm*",
            "allow_no_match": True,
            "actions": [{"action": "clip_value", "limit": 0.01}],
        },
        {
            "name": "attention",
            "match": "re:.*attn.*weight",
            "actions": [{"action": "clip_norm", "max_norm": 0.1, "scope": "group"}],
        },
        {"name": "warmup", "match": "*", "until_step": 3, "actions": [{"action": "scale", "factor": 0.5}]},
        {"name": "everything", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 1.0, "scope": "group"}]},
        {
            "name": "adaptive",
            "match": "*",
            "actions": [{"action": "zclip", "max_norm": 5.0, "warmup_steps": 2}, {"action": "agc", "clipping": 0.1}],
        },
        {"name": "spikes", "match": "*", "actions": [{"action": "skip_step_on_spike", "min_samples": 2}]},
        {"name": "health", "match": "*", "actions": [{"action": "monitor", "scope": "module", "every": 1}]},
    ],
}


def _default_warmed_up_in_two_steps() -> Policy:
    """The shipped default, its zclip warmed up in 2 steps: within the test's 10 steps its z-score and its ceiling
    (relative to the warm-up scale) act, as the default's do only after 25."""
    data = Policy.shipped("default").model_dump(mode="json", exclude_defaults=True)
    data["rules"][1]["actions"][0]["warmup_steps"] = 2
    return Policy.from_dict(data, source="the shipped default, warmed up in 2 steps")


def policies() -> list[tuple[str, Policy]]:
    return [
        ("default", _default_warmed_up_in_two_steps()),
        *((name, Policy.shipped(name)) for name in ("llm-pretraining", "llm-adaptive")),
        ("mixed", Policy.from_dict(MIXED)),
    ]


@pytest.mark.parametrize("fused", [False, True], ids=["SGD", "fused AdamW"])
@pytest.mark.parametrize("provenance", ["first_fault", "always", None])
@pytest.mark.parametrize(("name", "policy"), policies(), ids=[name for name, _ in policies()])
def test_each_step_reads_the_device_once_and_makes_no_tensor_from_python_data(
    make_workload: Any, name: str, policy: Policy, provenance: str | None, fused: bool
) -> None:
    """Ten steps of a MoE decoder (embeddings, attention, routers), every third with its loss scaled up 1000x so
    that the clips clip: one host read per optimizer step more than the unguarded step, none in backward. With a
    fused AdamW the read comes after its update (enforce/step/fused_update.py), which may run twice: still one."""
    workload = make_workload("moe")
    # SGD or a fused AdamW: torch's other AdamW reads its step counters on a CPU, and not on a skipped step, which
    # would blur the count.
    params = workload.model.parameters()
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True) if fused else torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    kwargs: dict[str, Any] = {"provenance": provenance}

    def backward(step: int) -> None:
        loss = workload.loss(workload.batch(step))
        (loss * (1000.0 if step % 3 == 0 else 1.0)).backward()

    def step_counted() -> tuple[int, int]:
        made: list[int] = []
        syncs = count_host_syncs(lambda: made.append(count_python_data_tensors(opt.step)))
        return syncs, made[0]

    opt.zero_grad()
    backward(0)
    unguarded, _ = step_counted()
    assert unguarded == 0 or fused  # torch's fused AdamW on the CPU reads the same values at every step
    with GradGuard(workload.model, policy, logger=None, **kwargs) as guard:
        for step in range(1, 11):
            opt.zero_grad()
            assert count_host_syncs(lambda step=step: backward(step)) == 0, f"{name}: a read in backward"
            syncs, made = step_counted()
            own = 0 if guard.last_step_skipped else unguarded  # a skipped update reads nothing of its own
            assert syncs - own == 1, f"{name}, step {step}: {syncs - own} reads"
            if step > 1:  # the first step makes the plan's constant index tensors, once
                assert made == 0, f"{name}, step {step}: {made} tensors from Python data"
        assert guard.step_count == 10
    assert guard.counters.snapshot(), "the policy acted"
