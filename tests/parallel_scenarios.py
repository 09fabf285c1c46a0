"""Tensor, sequence and 2-D parallel scenarios for tests/test_tensor_parallel.py, on real gloo process groups.

Every scenario trains ``support.parallel_models``' decoder for ``STEPS`` SGD steps on the full batch under each policy
of ``POLICIES`` and writes, per policy, the whole model's weights after the steps (``full_tensor()``) and the
``stats`` events of its monitor; the test compares them with the same decoder trained in one process.
Run as ``python tests/parallel_scenarios.py NAMES WORLD OUTDIR PORT`` (support.gloo_ranks).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from support.gloo_ranks import main
from support.parallel_models import apply_plain_tp, apply_torchtitan_tp, batch, loss_of, make_decoder, titan_clip
from torch import nn

from gradguard import GradGuard, GradientHalt, Policy

STEPS = 3
LR = 0.5


def rule(name: str, actions: list[dict[str, Any]], match: str = "*") -> dict[str, Any]:
    return {"name": name, "match": match, "actions": actions}


MONITOR = {"action": "monitor", "every": 1, "stats": ["norm", "mean", "std", "max_abs", "grad_to_weight"]}
POLICIES: dict[str, dict[str, Any]] = {
    "per_tensor_clip": {"version": 1, "rules": [rule("clip", [{"action": "clip_norm", "max_norm": 0.05}])]},
    "group_clip": {
        "version": 1,
        "rules": [rule("clip", [{"action": "clip_norm", "max_norm": 0.2, "scope": "group"}])],
    },
    "monitor": {"version": 1, "rules": [rule("health", [MONITOR])]},
    "agc": {"version": 1, "rules": [rule("agc", [{"action": "agc", "clipping": 0.01}])]},
    "clip_value": {"version": 1, "rules": [rule("value", [{"action": "clip_value", "limit": 0.002}])]},
    "default": {"shipped": "default"},
    "halt_then_titan_clip": {"version": 1, "rules": [rule("nonfinite", [{"action": "halt_on_nonfinite"}])]},
    "clip_then_titan_clip": {"version": 1, "rules": [rule("clip", [{"action": "clip_norm", "max_norm": 0.05}])]},
}
"""Each policy a layout is checked under (``{"shipped": NAME}``: a shipped one)."""
LOOP_CLIPS = {"halt_then_titan_clip": 0.2, "clip_then_titan_clip": 0.1}
"""The policies whose loop clips with torchtitan's ``clip_grad_norm_`` after the guard's step, and its max_norm."""


def policy_of(name: str) -> Policy:
    spec = POLICIES[name]
    return Policy.shipped(spec["shipped"]) if "shipped" in spec else Policy.from_dict(spec)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def local(tensor: torch.Tensor | None) -> torch.Tensor:
    assert tensor is not None
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def train(model: nn.Module, name: str, log: Path | None, rows: slice = slice(None)) -> dict[str, Any]:
    """``STEPS`` SGD steps on ``rows`` of each full batch under policy ``name``; the whole weights after them, and
    the norms torchtitan's clip returned where the loop clips."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    with GradGuard(model, policy_of(name), audit_log=log, logger=None):
        for step in range(STEPS):
            opt.zero_grad()
            tokens, targets = batch(step)
            loss_of(model(tokens[rows]), targets[rows]).backward()
            if name in LOOP_CLIPS:
                norms.append(float(titan_clip(model.parameters(), LOOP_CLIPS[name])))
            opt.step()
    weights = {key: full(param).detach().reshape(-1).tolist() for key, param in model.named_parameters()}
    return {"final": weights, "norms": norms}


def stats_of(log: Path) -> list[dict[str, Any]]:
    return [event for line in log.read_text().splitlines() if (event := json.loads(line))["event"] == "stats"]


def tensor_parallel(layout: str, rank: int, world: int, outdir: Path) -> dict[str, Any]:
    """Every policy under one layout: ``plain`` (the blocks' Linears parallel, the rest plain tensors), ``titan``
    (torchtitan's plan with SequenceParallel norms) or ``fsdp2_titan`` (FSDP2 over torchtitan's plan, dp x tp)."""
    from torch.distributed.device_mesh import init_device_mesh

    two_d = layout.startswith("fsdp2")
    shape, names = ((2, world // 2), ("dp", "tp")) if two_d else ((world,), ("tp",))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    result: dict[str, Any] = {}
    for name in POLICIES:
        if layout == "plain" and name in LOOP_CLIPS:
            continue  # torchtitan's clip needs every gradient a DTensor (torch: "mixed torch.Tensor and DTensor")
        model = make_decoder()
        (apply_plain_tp if layout == "plain" else apply_torchtitan_tp)(model, mesh["tp"] if two_d else mesh)
        rows = slice(None)
        if two_d:
            from torch.distributed.fsdp import fully_shard

            for block in model.layers.values():
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            half = 4 // 2
            dp_rank = mesh["dp"].get_local_rank()
            rows = slice(dp_rank * half, (dp_rank + 1) * half)
        log = outdir / f"{name}-rank{rank}.jsonl"
        result[name] = train(model, name, log, rows) | {"stats": stats_of(log)}
        dist.barrier()
    result["halt"] = nan_in_one_shard(layout, rank, world, mesh, two_d)
    result["kept_gradients"] = kept_gradients(layout, rank, world, mesh, two_d)
    result["rerun"] = transient_nan_in_one_shard(layout, rank, world, mesh, two_d, outdir / f"rerun-rank{rank}.jsonl")
    return result


def sharded_decoder(layout: str, mesh: Any, two_d: bool) -> nn.Module:
    """The decoder under the layout's tensor parallel plan, and under FSDP2 over it where the mesh is 2-D."""
    model = make_decoder()
    (apply_plain_tp if layout == "plain" else apply_torchtitan_tp)(model, mesh["tp"] if two_d else mesh)
    if two_d:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh["dp"])
    return model


def nan_in_last_shard(model: nn.Module) -> None:
    """A NaN written into this rank's shard of ``layers.0.attention.q.weight``'s gradient."""
    grad = model.layers["0"].attention.q.weight.grad
    grad.to_local().view(-1)[0] = float("nan")  # type: ignore[union-attr]


def transient_nan_in_one_shard(layout: str, rank: int, world: int, mesh: Any, two_d: bool, log: Path) -> dict[str, Any]:
    """``optimizer.step(closure)`` under a ``rerun`` section with ``transient: halt``: a NaN written into the last
    rank's shard of ``layers.0.attention.q.weight``'s gradient in the first computation of step 1 only."""
    model = sharded_decoder(layout, mesh, two_d)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    policy = {**POLICIES["halt_then_titan_clip"], "rerun": {"on": ["nonfinite"], "transient": "halt"}}
    out: dict[str, Any] = {"halted": None, "closures": 0}
    with GradGuard(model, Policy.from_dict(policy), audit_log=log, logger=None) as guard:
        try:
            for step in range(3):

                def closure(step: int = step) -> torch.Tensor:
                    opt.zero_grad()
                    tokens, targets = batch(step)
                    loss = loss_of(model(tokens), targets)
                    loss.backward()
                    out["closures"] += 1
                    if step == 1 and rank == world - 1 and out["closures"] == 2:
                        nan_in_last_shard(model)
                    return loss

                opt.step(closure)
        except GradientHalt as halt:
            out["halted"] = {"step": halt.step, "kind": halt.kind, "rule": halt.rule, "params": list(halt.params)}
        out["counters"] = guard.counters.snapshot()
    out["reruns"] = [event for line in log.read_text().splitlines() if (event := json.loads(line))["event"] == "rerun"]
    return out


def nan_in_one_shard(layout: str, rank: int, world: int, mesh: Any, two_d: bool) -> dict[str, Any]:
    """A NaN written into the last rank's shard of ``layers.0.attention.q.weight``'s gradient at step 1."""
    model = sharded_decoder(layout, mesh, two_d)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict[str, Any] = {"halted": None}
    with GradGuard(model, Policy.shipped("default"), logger=None):
        for step in range(3):
            opt.zero_grad()
            tokens, targets = batch(step)
            loss_of(model(tokens), targets).backward()
            if step == 1 and rank == world - 1:
                nan_in_last_shard(model)
            before = [full(p).detach().clone() for p in model.parameters()]
            try:
                opt.step()
            except GradientHalt as halt:
                after = [full(p).detach() for p in model.parameters()]
                out["halted"] = {
                    "step": halt.step,
                    "params": list(halt.params),
                    "ranks": {str(k): v for k, v in halt.ranks.items()},
                    "unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
                    "message": str(halt),
                }
                break
    return out


KEPT_STEPS = 4
CLIP_EVERY_TENSOR = {
    "version": 1,
    "rules": [
        rule("halt", [{"action": "halt_on_nonfinite"}]),
        rule("tiny", [{"action": "clip_norm", "max_norm": 1e-4}]),
    ],
}


def kept_gradients(layout: str, rank: int, world: int, mesh: Any, two_d: bool) -> dict[str, Any]:
    """``zero_grad(set_to_none=False)``: backward accumulates into the same DTensor gradients every step (DTensor's
    in-place ops leave their local tensors' versions as they were). Every step's gradients must be treated: a clip of
    every tensor at each clean step, and a NaN in the last rank's shard at the last step halts at that step."""
    model = sharded_decoder(layout, mesh, two_d)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict[str, Any] = {"halted_at": None, "first": None}
    with GradGuard(model, Policy.from_dict(CLIP_EVERY_TENSOR), logger=None) as guard:
        for step in range(KEPT_STEPS):
            if step == 1:
                out["first"] = guard.counters.snapshot()["tiny"]["clip_norm"]
            opt.zero_grad(set_to_none=False)
            tokens, targets = batch(step)
            loss_of(model(tokens), targets).backward()
            if step == KEPT_STEPS - 1 and rank == world - 1:
                nan_in_last_shard(model)
            try:
                opt.step()
            except GradientHalt as halt:
                out["halted_at"] = halt.step
                break
        out["clips"] = guard.counters.snapshot().get("tiny", {}).get("clip_norm", 0)
    return out


TWIN_CLIPS = {"torch_clip": torch.nn.utils.clip_grad_norm_, "titan_clip": titan_clip}
"""The loop clips the twins may call after ``backward`` (the guard's step runs at it: ``before_clip``'s default)."""
TWIN_MAX_NORM = 0.3
"""Below every step's total norm (about 1.2): the loop's clip scales every gradient."""


def unguarded_twin(world: int, clip: str | None = None) -> dict[str, Any]:
    """torchtitan's plan over ``world`` tensor-parallel ranks (4 heads, so four ranks fit), trained unguarded and then
    under the shipped default, from the same weights on the same batches, the loop calling ``TWIN_CLIPS[clip]`` (if
    any) before each update in both: which parameters end differently (none: a healthy run is left untouched, to the
    last bit; a sum over three ranks or more rounds by where it is made, and a clip's scaling of a Partial gradient's
    addends rounds otherwise than its scaling of their sum)."""
    import support.parallel_models as models
    from torch.distributed.device_mesh import init_device_mesh

    models.HEADS, models.TOKENS = 4, 8  # this scenario's own launch: no other in its process
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    weights, norms, steps = [], [], 0
    for guarded in (False, True):
        model = make_decoder()
        apply_torchtitan_tp(model, mesh)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        guard = GradGuard(model, Policy.shipped("default"), logger=None) if guarded else None
        for step in range(STEPS + 1):
            opt.zero_grad()
            tokens, targets = batch(step)
            loss_of(model(tokens), targets).backward()
            if clip is not None:
                norms.append(float(full(TWIN_CLIPS[clip](model.parameters(), TWIN_MAX_NORM))))
            opt.step()
        if guard is not None:
            steps = guard.step_count  # one a step: the optimizer's step found the gradients the clip's step treated
            guard.remove()
        weights.append({name: full(param).detach().clone() for name, param in model.named_parameters()})
    plain, guarded_weights = weights
    differing = sorted(name for name in plain if not torch.equal(plain[name], guarded_weights[name]))
    return {"differing": differing, "norms": norms, "steps": steps}


def scenario(name: str, rank: int, world: int, outdir: Path) -> dict[str, Any]:
    if name.startswith("tp_unguarded_twin"):
        return unguarded_twin(world, name.removeprefix("tp_unguarded_twin").removeprefix("_") or None)
    layout = name.removeprefix("tp_")
    return tensor_parallel(layout, rank, world, outdir)


if __name__ == "__main__":
    main(scenario, sys.argv[1:])
