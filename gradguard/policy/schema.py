"""The policy schema: rules that map parameter-name patterns to gradient actions.

A policy is data, validated once when it is loaded; nothing here touches torch, so
``gradguard validate`` can check files without importing it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from gradguard.policy.fields import Finite, FiniteAboveOne, PositiveFinite, check_skip_window
from gradguard.policy.fields import Strict as _Strict
from gradguard.policy.patterns import check_pattern
from gradguard.policy.sections import Loss, LossSpike, Ranks, Rerun, loss_can_halt

__all__ = [
    "MONITOR_STATS",
    "Action",
    "AdaptiveGradClip",
    "AutoClip",
    "ClipNorm",
    "ClipValue",
    "Drop",
    "HaltOnNonfinite",
    "Loss",
    "LossSpike",
    "Monitor",
    "PolicyFields",
    "Ranks",
    "Recovery",
    "Rerun",
    "Rule",
    "Scale",
    "SkipStepOnNonfinite",
    "SkipStepOnSpike",
    "ZClip",
    "Zero",
]

EMPTY_STEP_WINDOW = "empty_step_window"
"""Error type of a window with ``until_step <= from_step``; the file loader re-checks it on the raw data."""
RESERVED_RULE_NAMES = {
    "loss": "the policy's loss section",
    "rerun": "the policy's rerun section",
    "grad_scaler": "GradScaler's skipped steps",
    "recovery": "the steps a rewind's window skips",
    "ranks": "the policy's ranks section",
    "pipeline": "the verdicts a pipeline's stages take for one another",
}
"""Names the guard counts under besides the rules' (``guard.counters``): no rule may take them."""
DUPLICATE_RULE_NAME = "duplicate_rule_name"
"""Error type of a rule name used twice; the file loader re-checks it on the raw data."""


class _StepWindow(_Strict):
    from_step: int | None = Field(default=None, ge=0, strict=True)
    """First step (0-based, inclusive) on which this applies; ``None`` means from the start."""
    until_step: int | None = Field(default=None, ge=0, strict=True)
    """First step on which this no longer applies (exclusive); ``None`` means forever."""

    @model_validator(mode="after")
    def _window_is_not_empty(self) -> _StepWindow:
        if self.from_step is not None and self.until_step is not None and self.until_step <= self.from_step:
            raise PydanticCustomError(
                EMPTY_STEP_WINDOW,
                "until_step ({until_step}) must be greater than from_step ({from_step}); "
                "the window [from_step, until_step) would never apply",
                {"until_step": self.until_step, "from_step": self.from_step},
            )
        return self

    def active_at(self, step: int) -> bool:
        """Whether ``step`` lies inside ``[from_step, until_step)``."""
        if self.from_step is not None and step < self.from_step:
            return False
        return self.until_step is None or step < self.until_step


class ClipNorm(_StepWindow):
    """Rescale gradients whose norm exceeds ``max_norm``, exactly as ``clip_grad_norm_`` does.

    ``scope: tensor`` clips each parameter by its own norm; ``scope: group`` clips every parameter
    the rule matches by their joint norm.
    """

    action: Literal["clip_norm"]
    max_norm: Finite = Field(gt=0, strict=True)
    """Largest norm a gradient keeps; a larger one is scaled down to it."""
    norm_type: float = Field(default=2.0, gt=0, strict=True)
    """The p of the p-norm (2.0: Euclidean; .inf: largest absolute element)."""
    scope: Literal["tensor", "group"] = "tensor"
    """``tensor``: each parameter by its own norm; ``group``: all of the rule's parameters by their joint norm."""


class AdaptiveGradClip(_StepWindow):
    """Adaptive gradient clipping (NFNets; timm's ``adaptive_clip_grad``): a unit's gradient norm is kept
    at most ``clipping * max(||W||, eps)``, ``W`` the unit's weights.

    ``scope: tensor``: the units are a parameter's output units (its slices along the first dimension;
    a parameter of at most one dimension is one unit), bitwise as timm. ``scope: group``: one unit, all
    of the rule's parameters jointly (their joint weight norm against their joint gradient norm).
    """

    action: Literal["agc"]
    clipping: Finite = Field(default=0.01, gt=0, strict=True)
    """The largest gradient norm a unit keeps, as a fraction of its weight norm (NFNets' lambda)."""
    eps: Finite = Field(default=1e-3, gt=0, strict=True)
    """The smallest weight norm counted, so units with weights near zero (fresh biases) can still move."""
    scope: Literal["tensor", "group"] = "tensor"
    """``tensor``: each output unit (row) of each parameter; ``group``: all of the rule's parameters as one unit."""


class ClipValue(_StepWindow):
    """Clamp every gradient element into ``[-limit, limit]``, exactly as ``clip_grad_value_`` does."""

    action: Literal["clip_value"]
    limit: Finite = Field(gt=0, strict=True)
    """Every element is clamped into ``[-limit, limit]``."""


class Scale(_StepWindow):
    """Multiply the gradient by ``factor`` (e.g. 0.1 to slow a part of the model down)."""

    action: Literal["scale"]
    factor: Finite = Field(ge=0, strict=True)
    """What the gradient is multiplied by."""


class Zero(_StepWindow):
    """Set the gradient to zeros. Adam's moments and weight decay still move the parameter."""

    action: Literal["zero"]


class HaltOnNonfinite(_StepWindow):
    """Raise [`GradientHalt`][gradguard.GradientHalt] before the optimizer step if a gradient holds NaN or Inf.

    Under a GradScaler an inf/NaN is the scaler's business (it skips the step and lowers the scale),
    until the scale has fallen to ``min_loss_scale`` or ``max_scaler_skips`` steps in a row were skipped:
    then the NaN is not a passing overflow but a persistent one, and the guard halts (or, with
    ``recovery``, rewinds).
    """

    action: Literal["halt_on_nonfinite"]
    min_loss_scale: PositiveFinite | None = 1.0
    """Halt when GradScaler skips a step at a loss scale at or below this (``None``: never). 1.0 is DeepSpeed's
    and Megatron's floor: from the default 65536, a NaN that persists halts at its 17th step. A search from a
    large initial scale and the single skips of a healthy run stay far above it."""
    max_scaler_skips: int | None = Field(default=None, ge=1, strict=True)
    """Halt after more than this many GradScaler skips in a row (``None``: no limit but the scale floor)."""


class Drop(_StepWindow):
    """Set the gradient to ``None``: the optimizer leaves the parameter exactly as it is.

    Unlike ``zero``, no moment, weight decay or step count moves it.
    """

    action: Literal["drop"]


class _SkipLimits(_StepWindow):
    """When skipping escalates to a halt: shared by every action that skips steps."""

    max_consecutive_skips: int | None = Field(default=None, ge=1, strict=True)
    """Halt after more than this many skipped steps in a row (``None``: no limit)."""
    max_skips: int | None = Field(default=None, ge=1, strict=True)
    """Halt after more than this many skips within the last ``window_steps`` steps (with ``window_steps``)."""
    window_steps: int | None = Field(default=None, ge=1, strict=True)
    """The window ``max_skips`` counts skips over, in steps (with ``max_skips``)."""

    @model_validator(mode="after")
    def _window_is_complete(self) -> _SkipLimits:
        check_skip_window(self.max_skips, self.window_steps)
        return self


class SkipStepOnNonfinite(_SkipLimits):
    """Skip the whole optimizer step (no parameter, no optimizer state changes) on NaN or Inf.

    Escalates to [`GradientHalt`][gradguard.GradientHalt] after ``max_consecutive_skips`` skips in a row, or
    after ``max_skips`` skips within the last ``window_steps`` steps.
    """

    action: Literal["skip_step_on_nonfinite"]


class SkipStepOnSpike(_SkipLimits):
    """Skip the whole optimizer step when the gradient norm spikes (as OLMo-core's spike skip).

    A spike: the norm is more than ``z_thresh`` standard deviations (n-1) above the mean of the
    norms of the last ``window`` applied steps, once ``min_samples`` of them are known. ``scope: group``
    (default) watches the rule's joint norm, ``tensor`` each parameter's own. Non-finite norms and
    skipped steps never enter the window. Escalates to a halt like ``skip_step_on_nonfinite``.
    """

    action: Literal["skip_step_on_spike"]
    z_thresh: Finite = Field(default=6.0, gt=0, strict=True)
    """How many standard deviations above the window's mean make a spike."""
    window: int = Field(default=128, ge=2, le=100_000, strict=True)
    """How many recent applied steps' norms the mean and standard deviation are taken over."""
    min_samples: int = Field(default=64, ge=2, strict=True)
    """No step is skipped before the window holds this many norms."""
    scope: Literal["tensor", "group"] = "group"
    """``group``: the joint norm of the rule's parameters; ``tensor``: each parameter's own norm."""

    @model_validator(mode="after")
    def _samples_fit_the_window(self) -> SkipStepOnSpike:
        if self.min_samples > self.window:
            raise ValueError(
                f"min_samples ({self.min_samples}) cannot exceed window ({self.window}); "
                "the window could never hold that many norms"
            )
        return self


class ZClip(_StepWindow):
    """Z-score clipping on an exponential moving average of the norm (ZClip, arXiv 2504.02507).

    After ``warmup_steps`` finite norms have set the mean and variance, a norm whose z-score
    ``z = (norm - mean) / (std + 1e-6)`` exceeds ``z_thresh`` is clipped to
    ``mean + z_thresh**2 / z * std``; the averages then take that clipped value. ``max_norm`` (optional)
    is a plain ceiling, also during warm-up; ``max_norm_ratio`` (optional) a ceiling relative to each
    norm's own warm-up scale (the mean of its warm-up norms, so far), never below ``ratio_floor``. Non-finite
    norms and skipped steps never enter the averages.
    """

    action: Literal["zclip"]
    alpha: float = Field(default=0.97, gt=0, lt=1, strict=True)
    """EMA smoothing factor of the mean and the variance (closer to 1: slower)."""
    z_thresh: Finite = Field(default=2.5, gt=0, strict=True)
    """The z-score above which a norm is clipped."""
    warmup_steps: int = Field(default=25, ge=1, le=100_000, strict=True)
    """How many finite norms set the first mean and variance; no adaptive clip before."""
    max_norm: PositiveFinite | None = None
    """A fixed ceiling on the norm at every step, also during warm-up (``None``: none)."""
    max_norm_ratio: FiniteAboveOne | None = None
    """A ceiling at this multiple of the norm's warm-up scale: the mean of its ``warmup_steps`` warm-up norms (the
    first mean), and before they are all known, of those so far (from the second finite norm on); none while that
    mean is 0, as for a norm whose warm-up norms were all 0 (``None``: none). Unlike
    ``max_norm`` it fits any model's scale, so it holds back a sustained climb without touching a healthy run whose
    norms are large from the start."""
    ratio_floor: PositiveFinite | None = None
    """The least ``max_norm_ratio``'s ceiling may be (``None``: no floor). A norm that starts near 0 (behind a gate
    or an adapter initialised to 0, under a learning-rate warm-up) has a warm-up scale far below its later healthy
    norms: thousands of times, measured; the floor leaves it room."""
    scope: Literal["tensor", "group"] = "tensor"
    """``tensor``: each parameter by its own norm and statistics; ``group``: the rule's joint norm."""

    @model_validator(mode="after")
    def _a_floor_needs_a_ratio(self) -> ZClip:
        if self.ratio_floor is not None and self.max_norm_ratio is None:
            raise ValueError(
                f"ratio_floor ({self.ratio_floor}) is the least max_norm_ratio's ceiling may be; "
                "set max_norm_ratio too, or use max_norm for a fixed ceiling"
            )
        return self


class AutoClip(_StepWindow):
    """Clip to a percentile of the norms seen so far (AutoClip, arXiv 2007.14469).

    The threshold is the ``percentile`` (linear interpolation, as ``numpy.percentile``) of the norms of
    the last ``history`` applied steps and the current one; a larger norm is clipped to it, as
    ``clip_grad_norm_`` would. Non-finite norms and skipped steps never enter the history.
    """

    action: Literal["autoclip"]
    percentile: float = Field(default=10.0, ge=0, le=100, strict=True)
    """Which percentile of the recent norms is the threshold (the paper's 10 clips most steps a little)."""
    history: int = Field(default=128, ge=1, le=100_000, strict=True)
    """How many recent applied steps' norms the percentile is taken over (a ring buffer)."""
    scope: Literal["tensor", "group"] = "tensor"
    """``tensor``: each parameter by its own norm and history; ``group``: the rule's joint norm."""


MONITOR_STATS: tuple[str, ...] = ("norm", "max_abs", "mean", "std", "grad_to_weight")
"""The figures a ``monitor`` can take of each gradient (``grad_to_weight``: gradient norm / parameter norm)."""

MonitorStat = Literal["norm", "max_abs", "mean", "std", "grad_to_weight"]


class Monitor(_StepWindow):
    """Watch the gradient as it arrives (before any action of any rule): figures, vanishing, exploding.

    Every ``every`` steps, takes ``stats`` of each parameter (``scope: tensor``), of the rule's
    parameters jointly (``group``), or of each module at ``depth`` of the dotted name (``module``); they
    ride in the step's one host read. A norm below ``vanishing_below`` or above ``exploding_above`` is
    warned about once per name, until it recovers. Never changes a gradient.
    """

    action: Literal["monitor"]
    every: int = Field(default=1, ge=1, strict=True)
    stats: tuple[MonitorStat, ...] = Field(default=("norm",), min_length=1)
    vanishing_below: PositiveFinite | None = None
    exploding_above: PositiveFinite | None = None
    scope: Literal["tensor", "group", "module"] = "tensor"
    depth: int = Field(default=1, ge=1, strict=True)
    """``scope: module``: how many leading segments of the dotted name make the module (1: ``blocks``,
    2: ``blocks.0``); a parameter with fewer segments belongs to the module its name gives."""

    @field_validator("stats", mode="before")
    @classmethod
    def _one_stat_is_a_list(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @field_validator("stats")
    @classmethod
    def _stats_are_unique(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise ValueError(f"stats lists a figure twice: {list(value)}; name each once")
        return value

    @model_validator(mode="after")
    def _thresholds_are_ordered(self) -> Monitor:
        low, high = self.vanishing_below, self.exploding_above
        if low is not None and high is not None and low >= high:
            raise ValueError(
                f"vanishing_below ({low}) must be less than exploding_above ({high}); no norm could be healthy"
            )
        return self

    def samples(self, step: int) -> bool:
        """Whether the monitor takes its figures at ``step`` (inside its window, every ``every`` steps)."""
        windowed = self.from_step is not None or self.until_step is not None  # asked at every step: no call if not
        return (not windowed or self.active_at(step)) and (step - (self.from_step or 0)) % self.every == 0


Action = Annotated[
    AdaptiveGradClip
    | AutoClip
    | ClipNorm
    | ClipValue
    | Drop
    | HaltOnNonfinite
    | Monitor
    | Scale
    | SkipStepOnNonfinite
    | SkipStepOnSpike
    | ZClip
    | Zero,
    Field(discriminator="action"),
]
"""One gradient action of a rule; the ``action`` field chooses which."""

ACTION_NAMES: tuple[str, ...] = (
    "agc",
    "autoclip",
    "clip_norm",
    "clip_value",
    "drop",
    "halt_on_nonfinite",
    "monitor",
    "scale",
    "skip_step_on_nonfinite",
    "skip_step_on_spike",
    "zclip",
    "zero",
)
GRADIENT_CHANGING_ACTIONS: frozenset[str] = frozenset(
    {"agc", "autoclip", "clip_norm", "clip_value", "drop", "scale", "zclip", "zero"}
)
"""Actions that change a gradient (the others only watch it: halts, skips, ``monitor``)."""


class Rule(_StepWindow):
    """Which parameters (``match`` minus ``exclude``) get which ``actions``, in order."""

    name: str = Field(min_length=1)
    """Unique name of the rule; counters and logs are keyed by it."""
    match: tuple[str, ...] = Field(min_length=1)
    """Patterns of dotted parameter names: globs (``*`` also crosses dots) or ``re:<regex>`` (full match)."""
    exclude: tuple[str, ...] = ()
    """Patterns removed from ``match``."""
    actions: tuple[Action, ...] = Field(min_length=1)
    """The actions, applied in this order."""
    allow_no_match: bool = Field(default=False, strict=True)
    """If true, a rule that matches no parameter of the model is not an error."""

    @field_validator("name")
    @classmethod
    def _name_is_not_reserved(cls, value: str) -> str:
        if value in RESERVED_RULE_NAMES:
            owner = RESERVED_RULE_NAMES[value]
            raise ValueError(f"{value!r} is the counter key of {owner}; give the rule another name")
        return value

    @field_validator("match", "exclude", mode="before")
    @classmethod
    def _one_pattern_is_a_list(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @field_validator("match", "exclude")
    @classmethod
    def _patterns_compile(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(check_pattern(pattern) for pattern in value)


class Recovery(_Strict):
    """Turn a halt into a rewind to an in-memory snapshot, and go on training (docs/recovery.md).

    Every ``snapshot_every`` steps the guard copies the parameters, buffers, optimizer state (and the
    scaler, LR schedulers and its own statistics); a step whose verdict is a halt restores the newest
    snapshot at least ``min_age`` steps old, in place, and skips the updates of the next ``skip_steps``.
    """

    snapshot_every: int = Field(ge=1, strict=True)
    """Steps between snapshots: one is taken at every step that is a multiple of it, before its update."""
    keep: int = Field(default=2, ge=1, strict=True)
    """Snapshots held (the newest). Two: the newest may be younger than ``min_age``; the one before it is
    then at least ``snapshot_every`` steps old. Each costs the parameters' and optimizer state's bytes."""
    min_age: int = Field(default=10, ge=0, strict=True)
    """A rewind goes to the newest snapshot at least this many steps older than the fault. The state just
    before a spike is often already on its way to it; 10 is the low end of the usual 10 to 100 steps."""
    skip_steps: int = Field(default=10, ge=0, strict=True)
    """Steps after the fault whose updates are skipped (their batches are not learned from): a bad stretch
    of data seldom ends at the step it broke the run. PaLM skipped 200 to 500 batches; 10 is cheap."""
    max_rewinds: int = Field(default=3, ge=0, strict=True)
    """Rewinds in a run; the next halt goes through (after restoring the snapshot). A fault that comes back
    three times is not a passing one: a person should look."""
    lr_factor: Finite = Field(default=1.0, gt=0, le=1, strict=True)
    """Each param group's LR (and a known scheduler's base LRs) is multiplied by it at every rewind. 1.0:
    the rewind and new data alone (PaLM's recipe); lowering the LR changes the rest of the run for good."""
    memory: Literal["device", "host", "auto"] = "auto"
    """Where snapshots live. ``device``: preallocated buffers on the parameters' device (a device-to-device copy;
    an error at attach if ``keep`` snapshots do not fit). ``host``: pinned host memory, copied on a side stream
    that overlaps the next steps. ``auto``: ``device`` when they fit with a margin, else ``host``."""


def can_halt(rule: Rule) -> bool:
    """Whether ``rule`` can halt a step: a ``halt_on_nonfinite``, or a skip action with a limit."""
    return any(
        isinstance(action, HaltOnNonfinite)
        or (
            isinstance(action, SkipStepOnNonfinite | SkipStepOnSpike)
            and (action.max_consecutive_skips is not None or action.max_skips is not None)
        )
        for action in rule.actions
    )


class PolicyFields(_Strict):
    """The fields of a policy document and their checks; [`gradguard.Policy`][gradguard.Policy] adds loading."""

    version: Literal[1]
    """The policy format's version: 1."""
    rules: tuple[Rule, ...] = Field(min_length=1)
    """The rules, applied in this order; a parameter matched by several gets all their actions."""
    loss: Loss | None = None
    """The step's loss as a trigger: a NaN/Inf loss, a loss spike (``None``: the loss is not watched)."""
    recovery: Recovery | None = None
    """Rewind to an in-memory snapshot instead of halting (``None``: a halt ends the run)."""
    rerun: Rerun | None = None
    """Compute a suspect step again to tell a transient fault from the model's (``None``: never)."""
    ranks: Ranks | None = None
    """Watch the data-parallel ranks against each other: outliers, replicas that drift (``None``: neither)."""

    @field_validator("recovery")
    @classmethod
    def _recovery_can_fire(cls, value: Recovery | None, info: ValidationInfo) -> Recovery | None:
        rules = info.data.get("rules")
        loss = info.data.get("loss")
        rules_halt = rules is None or any(can_halt(rule) for rule in rules)
        if value is not None and not rules_halt and (loss is None or not loss_can_halt(loss)):
            raise ValueError(
                "no rule can halt, so recovery would never rewind: add a rule with "
                "{action: halt_on_nonfinite}, or give a skip action max_consecutive_skips or max_skips, "
                "or a loss section that halts, or remove the recovery section"
            )
        return value

    _source: str = PrivateAttr(default="<dict>")
    _rule_lines: tuple[int | None, ...] = PrivateAttr(default=())

    @model_validator(mode="before")
    @classmethod
    def _schema_key_is_editor_metadata(cls, data: Any) -> Any:
        """A top-level ``$schema`` string is accepted and dropped: it only points editors at the JSON Schema.

        A JSON policy names its schema that way (``"$schema": "./gradguard-policy.schema.json"``), as
        YAML files do with a ``# yaml-language-server: $schema=...`` comment; it changes nothing else.
        """
        if isinstance(data, Mapping) and "$schema" in data:
            if not isinstance(data["$schema"], str):
                raise ValueError(f"$schema must be a string (the JSON Schema's path or URL), got {data['$schema']!r}")
            return {key: value for key, value in data.items() if key != "$schema"}
        return data

    @field_validator("version", mode="before")
    @classmethod
    def _version_is_not_a_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):  # True == 1 in Python, but 'version: true' is not version 1
            raise ValueError(f"got {value!r}; expected 1")
        return value

    @model_validator(mode="after")
    def _rule_names_are_unique(self) -> PolicyFields:
        seen: dict[str, int] = {}
        for index, rule in enumerate(self.rules):
            if rule.name in seen:
                raise PydanticCustomError(
                    DUPLICATE_RULE_NAME,
                    "rule name {name} is used by rules[{first}] and rules[{index}]; "
                    "give every rule a unique name (counters and logs are keyed by it)",
                    {"name": repr(rule.name), "first": seen[rule.name], "index": index},
                )
            seen[rule.name] = index
        return self
