"""``monitor``: figures of the gradient as it arrives, before any action of any rule.

An observing kernel (``observes``): the engine calls ``MonitorKernel.observe`` for every monitor
that samples the step, after the raw 2-norms are taken and before any rule acts, so the figures
are those of the gradient the step received. The figures are computed on the device (reusing the
raw 2-norms where the step took them), queued into the step's one host read, and recorded as an
``Observation`` for ``gradguard.enforce.triggers.health``. A step the monitor does not sample costs
nothing: it is never called.
"""

from __future__ import annotations

import functools

import torch

from gradguard.enforce.actions.base import ActionKernel
from gradguard.enforce.distributed.collective import Collective
from gradguard.enforce.work.step_work import Observation, StepWork
from gradguard.enforce.work.tensors import LOW_PRECISION, device_constant, stack_on
from gradguard.policy.matching import BoundRule
from gradguard.policy.schema import Action, Monitor

__all__ = ["ROOT_MODULE", "MonitorKernel", "module_of"]

ROOT_MODULE = "(root)"
"""The module name of parameters that belong to the model itself (``scope: module``)."""


def module_of(name: str, depth: int) -> str:
    """The module a parameter belongs to at ``depth``: the first ``depth`` segments of its module path."""
    path = name.split(".")[:-1][:depth]
    return ".".join(path) if path else ROOT_MODULE


@functools.lru_cache(maxsize=64)
def _modules(params: tuple[str, ...], depth: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The modules of ``params`` at ``depth`` in first-seen order, and each parameter's position among them: the
    same at every sampled step (a cache hit is no Python call; working them out, one per parameter)."""
    slots: dict[str, int] = {}
    segments = tuple([slots.setdefault(module_of(name, depth), len(slots)) for name in params])
    return tuple(slots), segments


class MonitorKernel(ActionKernel):
    """``monitor``: per-tensor, per-group or per-module figures; never changes a gradient."""

    alarms = True

    schemas = (Monitor,)
    observes = True

    def samples(self, action: Action, step: int) -> bool:
        assert isinstance(action, Monitor)
        return action.samples(step)

    def apply(self, work: StepWork, bound: BoundRule, action: Action, ids: list[int]) -> bool:
        return True  # observing is done in observe(), before any action

    def observe(self, work: StepWork, bound: BoundRule, action: Action, ids: list[int]) -> None:
        assert isinstance(action, Monitor)
        gs = [work.grads[i] for i in ids]
        device = gs[0].device
        stats = action.stats
        thresholds = action.vanishing_below is not None or action.exploding_above is not None
        wanted = set(stats) | ({"norm"} if thresholds else set())
        joint = action.scope != "tensor"
        base: dict[str, torch.Tensor] = {}
        if wanted & {"norm", "std", "grad_to_weight"} or (joint and "mean" in wanted):
            raw = work.raw
            if all(map(raw.__contains__, ids)):  # the step took them already (untouched: no action ran yet)
                base["norm"] = work.pending.stack([raw[i] for i in ids], device).float()
            else:
                base["norm"] = stack_on(work.norms(gs, 2.0, ids), device).float()
        if "max_abs" in wanted:
            base["max_abs"] = stack_on(work.norms(gs, float("inf"), ids), device).float()
        if wanted & {"mean", "std"} and work.sharded and work.collective is not None:
            base |= _moments(
                work.collective, gs, device, "std" in wanted and not joint, work.share_weights(ids, device)
            )
        elif wanted & {"mean", "std"}:
            base["mean"] = torch.stack([_mean(g).to(device) for g in gs])
            if "std" in wanted and not joint:
                base["std"] = torch.stack([_std(g).to(device) for g in gs])
        if "grad_to_weight" in wanted:  # the weights where the gradients are (shards, pieces): combined as they are
            params = [weight.detach() for weight in work.weights(ids)]
            base["weight"] = stack_on(work.norms(params, 2.0, ids), device).float()
        if joint:
            names, figures = _joint(work, action, bound.name, ids, gs, base)
        else:
            names = [work.names[i] for i in ids]
            figures = {stat: _per_tensor(stat, base) for stat in wanted}
        order = list(stats) + (["norm"] if thresholds and "norm" not in stats else [])
        count = len(names)
        scope = action.scope
        observed = work.outcome.observed  # not ``work``: a reader holding the step's gradients would keep them alive

        def read(values: list[float]) -> None:
            by_stat = {stat: values[k * count : (k + 1) * count] for k, stat in enumerate(order)}
            norms = by_stat["norm"] if thresholds else None
            logged: dict[str, list[float]] = {stat: by_stat[stat] for stat in stats}
            observed.append(Observation(bound.name, action, scope, names, logged, norms))

        work.pending.add(torch.cat([figures[stat].reshape(-1) for stat in order]), read)


def _mean(grad: torch.Tensor) -> torch.Tensor:
    return grad.mean(dtype=torch.float32) if grad.dtype in LOW_PRECISION else grad.mean()


def _std(grad: torch.Tensor) -> torch.Tensor:
    if grad.numel() < 2:  # torch.std: NaN, with a warning; the same NaN, without it
        return torch.full((), float("nan"), device=grad.device)
    # std_mean's std is Tensor.std's, bit for bit, without the host read Tensor.std makes on a CPU.
    return torch.std_mean(grad.float() if grad.dtype in LOW_PRECISION else grad)[0]


def _moments(
    collective: Collective, gs: list[torch.Tensor], device: torch.device, std: bool, shares: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The whole tensors' means (and standard deviations) where each rank holds a part of each (FSDP2's shards,
    DeepSpeed's pieces): every part's count, sum and sum of squares, in float64, summed over the ranks in one
    collective, so a part's mean is never averaged as if the parts were equal. ``count``: the whole tensors' sizes."""
    rows = [
        torch.stack([g.new_tensor(float(g.numel()), dtype=torch.float64), g.sum(dtype=torch.float64), _squares(g)])
        if g.numel()
        else torch.zeros(3, dtype=torch.float64, device=g.device)
        for g in gs
    ]
    local = stack_on(rows, device)
    if shares is not None:  # replicas' parts counted once (``StepWork.shares``)
        local = local * shares.double().unsqueeze(1)
    count, total, squares = collective.sum_(local).unbind(1)
    mean = total / count
    out = {"mean": mean, "count": count}
    if std:  # torch's (Bessel-corrected) std of the whole tensor; NaN below two elements, as torch.std's
        out["std"] = ((squares - total * mean).clamp(min=0) / (count - 1)).sqrt().where(count > 1, torch.nan)
    return out


def _squares(grad: torch.Tensor) -> torch.Tensor:
    wide = grad.double()
    return torch.dot(wide.reshape(-1), wide.reshape(-1))


def _per_tensor(stat: str, base: dict[str, torch.Tensor]) -> torch.Tensor:
    if stat == "grad_to_weight":
        return base["norm"] / base["weight"]
    return base[stat]


def _joint(
    work: StepWork,
    action: Monitor,
    rule: str,
    ids: list[int],
    gs: list[torch.Tensor],
    base: dict[str, torch.Tensor],
) -> tuple[list[str], dict[str, torch.Tensor]]:
    """Figures of each module (or of the whole group): every tensor's elements taken together."""
    device = gs[0].device
    if action.scope == "group":
        names = [rule]
        segments = (0,) * len(ids)
    else:
        modules, segments = _modules(tuple(map(work.names.__getitem__, ids)), action.depth)
        names = list(modules)
    n = len(names)
    seg = device_constant(tuple(segments), torch.int64, device)
    # The whole tensors' sizes where each rank holds parts of them (``_moments``), else the tensors'.
    sizes = base.get("count")
    if sizes is None:
        sizes = device_constant(tuple(map(float, map(torch.Tensor.numel, gs))), torch.float64, device)
    numel = torch.zeros(n, dtype=torch.float64, device=device).index_add_(0, seg, sizes)

    def total(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.float64, device=device).index_add_(0, seg, values.double())

    out: dict[str, torch.Tensor] = {}
    sumsq = total(base["norm"].double().square()) if "norm" in base else None
    if sumsq is not None:
        out["norm"] = sumsq.sqrt()
    if "max_abs" in base:
        peaks = base["max_abs"]
        out["max_abs"] = torch.zeros(n, dtype=peaks.dtype, device=device).scatter_reduce(
            0, seg, peaks, "amax", include_self=False
        )
    if "mean" in base:
        mean = total(base["mean"].double() * sizes) / numel
        out["mean"] = mean
        if sumsq is not None:
            out["std"] = ((sumsq - numel * mean.square()).clamp(min=0) / (numel - 1)).sqrt()
    if "weight" in base and sumsq is not None:
        out["grad_to_weight"] = sumsq.sqrt() / total(base["weight"].double().square()).sqrt()
    return names, out
