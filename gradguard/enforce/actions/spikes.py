"""``skip_step_on_spike``: skip the update when the gradient norm leaps far above its recent norms.

The rule of OLMo-core's spike skip: a step is skipped when ``norm - mean > z_thresh * std`` over the
norms of the last ``window`` applied steps (``std`` with n-1), once ``min_samples`` are known. It
observes the gradient as it arrived, before any action of any rule (so a clip earlier in the policy
cannot hide the spike), on the device; the verdict rides the step's one host read and the engine
skips the step as it skips a non-finite one (no parameter or optimizer state moves), escalating to a
halt past the action's limits. The window only takes norms of applied steps: a spike, a skipped or a
halted step, or a non-finite norm never enters it.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from gradguard.enforce.actions.adaptive import followed_norms
from gradguard.enforce.actions.base import ActionKernel
from gradguard.enforce.work.statistics import STATS_DTYPE, Init, pushed
from gradguard.enforce.work.step_work import Spike, StepWork
from gradguard.policy.matching import BoundRule
from gradguard.policy.schema import Action, SkipStepOnSpike

__all__ = ["SpikeSkipKernel", "spike_decide", "spike_empty"]


def spike_empty(window: int) -> Init:
    """``skip_step_on_spike``'s empty statistics: a ring of ``window`` norms per column (NaN: empty)."""

    def empty(columns: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {"ring": torch.full((columns, window), math.nan, dtype=STATS_DTYPE, device=device)}

    return empty


def spike_decide(
    action: SkipStepOnSpike, g: torch.Tensor, ring: torch.Tensor, slot: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spike verdict on the float64 norms ``g`` against ``ring``: the guard's maths, and replay's.

    Returns ``(spike, mean, std, count, ring after the step)``: the ring takes ``g`` in column ``slot``
    (a non-finite norm enters as empty); it is kept only if the step is applied.
    """
    known = ~torch.isnan(ring)
    count = known.sum(dim=1).to(STATS_DTYPE)
    values = torch.where(known, ring, torch.zeros_like(ring))
    mean = values.sum(dim=1) / count
    deviation = torch.where(known, ring - mean.unsqueeze(1), torch.zeros_like(ring))
    std = (deviation.square().sum(dim=1) / (count - 1)).sqrt()
    finite = torch.isfinite(g)
    spike = finite & (count >= action.min_samples) & (g - mean > action.z_thresh * std)
    proposed, _ = pushed(ring, slot, g, math.nan)
    return spike, mean, std, count, proposed


class SpikeSkipKernel(ActionKernel):
    """``skip_step_on_spike``: an observing kernel whose verdict is a skip."""

    schemas = (SkipStepOnSpike,)
    observes = True
    alarms = True

    def wants_raw_norm(self, action: Action) -> bool:
        return True

    def apply(self, work: StepWork, bound: BoundRule, action: Action, ids: list[int]) -> bool:
        return True  # its work is done in observe(), before any action

    def observe(self, work: StepWork, bound: BoundRule, action: Action, ids: list[int]) -> None:
        assert isinstance(action, SkipStepOnSpike)
        assert work.statistics is not None
        group, _, g = followed_norms(work, ids, action.scope)
        window = action.window
        series = work.statistics.series_for(bound, action, group, (window,), g.device, spike_empty(window))
        cols = None if group else series.select(ids)
        slot = series.ring_slot(window)
        spike, mean, std, count, proposed = spike_decide(action, g, series.at(cols)["ring"], slot)
        work.statistics_step.propose(series, cols, {"ring": proposed}, {"slot": slot + 1})

        figures = torch.stack([spike.to(STATS_DTYPE), g, mean, std, count])
        columns = len(g)
        spikes, names = work.outcome.spikes, work.names

        def read(host: list[float]) -> None:
            if not any(host[:columns]):
                return  # no spike: the common case, without a loop
            for column in range(columns):
                if not host[column]:
                    continue
                norm, mu, sigma, samples = (host[(k + 1) * columns + column] for k in range(4))
                params = [names[i] for i in ids] if group else [names[ids[column]]]
                z = (norm - mu) / sigma if sigma > 0 else math.inf
                spikes.append(Spike(bound.index, params, norm, mu, sigma, z, int(samples), action.z_thresh))

        work.pending.quiet_if(partial(torch.logical_not, spike))
        work.pending.add(figures, read)
