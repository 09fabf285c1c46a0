"""The policy's top-level sections besides its rules: ``loss`` (the loss as a trigger), ``rerun`` (a suspect
step computed again) and ``ranks`` (the data-parallel ranks watched against each other).

Kept apart from ``gradguard.policy.schema`` (the rules and their actions), which imports and re-exports them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from gradguard.policy.fields import Finite, Strict, check_skip_window

__all__ = ["Loss", "LossSpike", "Ranks", "Rerun", "loss_can_halt"]


class LossSpike(Strict):
    """A loss above ``factor`` times the reference: the median of the last ``window`` losses of applied steps.

    A median, not a mean: one bad loss that got through, or a noisy one, moves it little, and a falling loss
    carries it down with it (Megatron-LM's largest of the first 100 losses goes stale as the loss falls;
    metaseq's exponentially weighted mean follows the noise). Spiked, skipped and rewound steps never enter it.
    """

    factor: Finite = Field(default=10.0, gt=1, strict=True)
    """A loss above ``factor`` x the reference is a spike."""
    window: int = Field(default=100, ge=1, le=100_000, strict=True)
    """How many recent applied steps' losses the reference (their median) is taken over."""
    warmup: int = Field(default=100, ge=0, strict=True)
    """Losses of applied steps seen before the first judgement (at least one always is)."""
    action: Literal["skip", "halt"] = "skip"
    """``skip``: no update at that step; ``halt``: a halt (a rewind under ``recovery``)."""
    max_consecutive_skips: int | None = Field(default=None, ge=1, strict=True)
    """With ``skip``: halt after more than this many loss skips in a row (``None``: no limit)."""
    max_skips: int | None = Field(default=None, ge=1, strict=True)
    """With ``skip``: halt after more than this many loss skips within the last ``window_steps`` steps."""
    window_steps: int | None = Field(default=None, ge=1, strict=True)
    """The window ``max_skips`` counts over, in steps (with ``max_skips``)."""

    @model_validator(mode="after")
    def _window_is_complete(self) -> LossSpike:
        check_skip_window(self.max_skips, self.window_steps)
        return self


class Loss(Strict):
    """The step's loss as a trigger (docs/policy-reference.md#the-loss-section): a NaN/Inf loss, or a spike.

    The guard learns the loss with no change to the loop: the root of each ``backward()`` of a step, summed
    over an accumulating loop's micro-batches, unscaled where a GradScaler scaled it.
    """

    nonfinite: Literal["halt", "skip", "ignore"] = "halt"
    """A NaN or Inf loss: ``halt`` (a rewind under ``recovery``), ``skip`` the update, or ``ignore``."""
    spike: LossSpike | None = None
    """A loss far above the recent ones (``None``: not watched)."""


def loss_can_halt(loss: Loss) -> bool:
    """Whether the loss section can halt a step: on a non-finite loss, on a spike, or past its skip limits."""
    spike = loss.spike
    limited = spike is not None and (spike.max_consecutive_skips is not None or spike.max_skips is not None)
    return loss.nonfinite == "halt" or (spike is not None and spike.action == "halt") or limited


class Rerun(Strict):
    """Compute a suspect step again before acting on it: a fault that does not come back was transient (a flipped
    bit, a bad device), and training goes on (docs/policy-reference.md#the-rerun-section).

    Only where the guard holds the step's computation: ``optimizer.step(closure)`` and Lightning's automatic
    optimization. The random number generators are put back before the second computation, so dropout and other
    sampling repeat exactly.
    """

    on: tuple[Literal["nonfinite", "spike", "loss"], ...] = Field(default=("nonfinite", "spike", "loss"), min_length=1)
    """Which verdicts are checked again: a non-finite gradient (``nonfinite``), a ``skip_step_on_spike`` spike
    (``spike``), a verdict of the ``loss`` section (``loss``)."""
    tolerance: float = Field(default=0.0, ge=0, strict=False)
    """The relative difference of the loss and of every gradient norm under which the two computations agree (0:
    bitwise; kernels that are not deterministic need more)."""
    transient: Literal["continue", "halt"] = "continue"
    """A transient fault: ``continue`` with the second computation's gradients (judged as the step's own), or
    ``halt`` saying it was transient (drain the node)."""

    @model_validator(mode="before")
    @classmethod
    def _yaml_reads_on_as_true(cls, data: Any) -> Any:
        """YAML 1.1 reads the key ``on`` as the boolean true (PyYAML does): take it as ``on``."""
        if isinstance(data, dict) and True in data and "on" not in data:
            return {("on" if key is True else key): value for key, value in data.items()}
        return data

    @field_validator("on", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value


class Ranks(Strict):
    """Watch the data-parallel ranks against each other (docs/policy-reference.md#the-ranks-section): a rank whose own
    gradient is far off the others' (a finite fault: most silent data corruption is finite), and replicas whose
    weights no longer agree bitwise. The rank where a NaN or Inf was made is named without this section."""

    outlier_factor: float | None = Field(default=None, gt=1, strict=False)
    """A rank whose own gradient 2-norm, before the reduction, exceeds this many times the median of the other
    ranks' (with two ranks, the other's) is an outlier (``None``: not watched). The norms ride the step's existing
    collective (a float per rank)."""
    on_outlier: Literal["warn", "skip", "halt"] = "warn"
    """An outlier: ``warn`` (a ``rank_outlier`` event and a warning), ``skip`` the step on every rank, or ``halt``
    (a rewind, with a ``recovery`` section)."""
    check_replicas_every: int | None = Field(default=None, ge=1, strict=True)
    """Every this many steps, before the update, the replicas compare a bitwise fingerprint of every parameter,
    computed on the device (``None``: never). DDP and DeepSpeed ZeRO 0-2, whose parameters are replicated."""
    on_divergence: Literal["warn", "halt"] = "halt"
    """Replicas that differ: ``warn`` (a ``replica_divergence`` event and a warning) or ``halt`` (before the
    update; a rewind, with a ``recovery`` section)."""

    @model_validator(mode="after")
    def _asks_for_something(self) -> Ranks:
        if self.outlier_factor is None and self.check_replicas_every is None:
            raise ValueError(
                "a ranks section asks for nothing: give outlier_factor (e.g. 10.0) or check_replicas_every "
                "(e.g. 100), or remove the section (the rank where a NaN was made is named without it)"
            )
        return self
