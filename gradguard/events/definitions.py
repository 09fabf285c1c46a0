"""Every event the guard writes, defined once: its name, level, fields and their types.

Each event is a [`msgspec.Struct`](https://jcristharif.com/msgspec/structs.html) tagged by the line's
`event` field, so one decode of a line gives the typed event or says why the line does not fit:
``gradguard audit``, ``suggest`` and ``replay`` (``recorded_steps``) read lines with ``EVENT_DECODER``;
the writer's tests hold every line a real run writes against these definitions; `docs/log-events.md`
lists the same names, levels and fields (a test holds the two equal).

Every line also has `ts`, `level`, `run` and `rank` (``Event``). Numbers the guard may write
non-finite are ``Number``: a float, or one of the strings `"NaN"`, `"Infinity"`, `"-Infinity"`
(``as_float`` makes them floats). A field the definition does not name is ignored (a later guard may
add one); an event name no definition has is a ``ForeignEvent`` (a callback's, a later guard's),
counted by name.

This module imports msgspec only (no structlog, no torch): the audit imports it.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Final, Literal, Union, get_args

import msgspec

__all__ = [
    "EVENTS",
    "EVENT_DECODER",
    "FOREIGN_DECODER",
    "LEVELS",
    "AdaptiveClip",
    "Attach",
    "Counters",
    "Counts",
    "Detach",
    "Event",
    "Exploding",
    "ForeignEvent",
    "GuardEvent",
    "Halt",
    "Intervention",
    "LossNonfinite",
    "LossSpike",
    "LossUnseen",
    "Nonfinite",
    "NonfiniteGroupNorm",
    "NonfiniteUnhalted",
    "NormOverflow",
    "Number",
    "PolicyReload",
    "PolicyReloadFailed",
    "RankFailure",
    "RankOutlier",
    "Rebind",
    "Recovered",
    "ReplicaDivergence",
    "Rerun",
    "RerunUnavailable",
    "Rewind",
    "ScalerSkip",
    "Skip",
    "SnapshotFallback",
    "SnapshotPlacement",
    "SpikeSkip",
    "StateLoaded",
    "StateMissing",
    "Stats",
    "StepEvent",
    "UnexpectedOptimizer",
    "Vanishing",
    "Verdict",
    "as_float",
    "event_name",
    "fields_of",
]

NonFinite = Literal["NaN", "Infinity", "-Infinity"]
"""How the guard writes a non-finite float (JSON has no NaN or Infinity)."""
Number = Union[float, NonFinite]  # noqa: UP007 - msgspec reads the annotation at runtime (Python 3.10)
"""A float (a JSON integer is read as one), or a non-finite one written as a string."""
Numbers = Union[float, NonFinite, list[Union[float, NonFinite]]]  # noqa: UP007
"""A number, or one per parameter (``adaptive_clip`` at ``scope: tensor``)."""
Step = Annotated[int, msgspec.Meta(ge=0)]
"""A step: an integer >= 0."""
Counts = dict[str, dict[str, int]]
"""``guard.counters.snapshot()``: ``{rule: {action: count}}``."""
Origin = Union[dict[str, Any], None]  # noqa: UP007
"""Where a non-finite gradient started (``phase``, ``module``, ``kind``, ...; see docs/provenance.md), or null."""

_NON_FINITE: Final = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def as_float(value: float | str) -> float:
    """A ``Number`` as a float (the strings become NaN and infinities)."""
    return value if type(value) is float else _NON_FINITE[value]  # type: ignore[index]


class Event(msgspec.Struct, kw_only=True, tag_field="event", gc=False):
    """The fields every line has. ``ts`` and ``level`` are optional here (lines written by hand lack them)."""

    LEVEL: ClassVar[str] = "info"
    """The level the guard writes this event at."""

    # Fields in the order the guard writes them: msgspec looks a key up from the field after the last one found, so a
    # line in that order finds each at the first try (a tenth of a clip line's decoding; see the audit's reader).
    # Only the order of the required fields shows (which one a line missing several is said to lack): kept.
    ts: str | None = None
    """ISO-8601, UTC."""
    level: str | None = None
    run: str
    """The guard's id (one per guard)."""
    rank: int = 0


class StepEvent(Event, kw_only=True):
    """An event of one step."""

    step: Step


class Attach(Event, tag="attach", kw_only=True):
    """The guard attached to a model."""

    schema: int
    policy: str | None
    model: str
    boundary: str | None = None
    start_step: Step = 0
    params: int
    rules: dict[str, int]
    pid: int | None = None
    recovery: dict[str, Any] | None = None
    """A policy's ``recovery`` section, ``snapshot_bytes`` and ``schedulers``."""
    loss: dict[str, Any] | None = None
    """A policy's ``loss`` section: the loss was watched (a clean run's log says so)."""
    rerun: dict[str, Any] | None = None
    """A policy's ``rerun`` section."""
    ranks: dict[str, Any] | None = None
    """Under ``torch.distributed``: ``world`` (the ranks the guard agrees over), ``seen`` (where each rank's own
    gradient is read before the reduction, or null) and ``unseen`` (why it cannot be, or null); a policy's
    ``ranks`` section's keys. Null in one process."""


class Intervention(StepEvent, tag="intervention", kw_only=True):
    LEVEL: ClassVar[str] = "debug"
    # In the order the guard writes them (see ``Event``): most lines of a long log are these.
    rule: str
    action: str
    param: str | None
    params: list[str] | None = None
    n_params: int | None = None
    scope: str | None = None
    norm_type: Number | None = None
    max_norm: Number | None = None
    limit: Number | None = None
    before: Number
    after: Number
    coef: Number | None = None
    micro_batch: bool = False
    overflowed: bool = False


class Nonfinite(StepEvent, tag="nonfinite", kw_only=True):
    rule: str
    param: str
    kind: str
    halts: bool
    skips: bool


class NonfiniteUnhalted(StepEvent, tag="nonfinite_unhalted", kw_only=True):
    LEVEL: ClassVar[str] = "warning"
    params: list[str]
    kinds: list[str]


class NonfiniteGroupNorm(StepEvent, tag="nonfinite_group_norm", kw_only=True):
    LEVEL: ClassVar[str] = "warning"
    rule: str
    action: str
    kind: str
    n_params: int


class Verdict(StepEvent, kw_only=True):
    """A step the guard did not let through: the rule, the tensors at fault, what each held, where it started."""

    rule: str
    params: list[str]
    kinds: dict[str, str]
    kind: str
    origin: Origin = None
    ranks: dict[str, str] = msgspec.field(default_factory=dict)
    """The ranks where it was made, before the reduction ({rank: host}, JSON keys strings); empty in one process,
    where no rank's own gradient was at fault (made after the reduction), or where the ranks' own gradients are
    unseen (the attach event's ``ranks`` says why)."""


class Halt(Verdict, tag="halt", kw_only=True):
    LEVEL: ClassVar[str] = "error"
    reason: str | None = None
    restored_to: Step | None = None
    counters: Counts


class Rewind(Verdict, tag="rewind", kw_only=True):
    """A halt that recovery turned into a rewind: its fields, and where the run went back to."""

    LEVEL: ClassVar[str] = "warning"
    reason: str | None = None
    to_step: Step
    rewinds: int
    skip_until: Step
    lr_scale: Number


class Skip(Verdict, tag="skip", kw_only=True):
    LEVEL: ClassVar[str] = "warning"


class AdaptiveClip(StepEvent, tag="adaptive_clip", kw_only=True):
    """Lists (one entry per clipped parameter, in ``params`` order) at ``scope: tensor``; numbers at ``group``."""

    LEVEL: ClassVar[str] = "debug"
    rule: str
    action: str
    scope: str
    param: str | None = None
    params: list[str]
    n_params: int
    before: Numbers
    after: Numbers
    coef: Numbers | None = None
    threshold: Numbers | None = None
    mean: Numbers | None = None
    std: Numbers | None = None
    z: Numbers | None = None
    samples: Numbers | None = None
    clipping: Number | None = None
    eps: Number | None = None
    units: Numbers | None = None
    units_clipped: Numbers | None = None
    max_ratio: Numbers | None = None


class SpikeSkip(StepEvent, tag="spike_skip", kw_only=True):
    LEVEL: ClassVar[str] = "warning"
    rule: str
    params: list[str]
    norm: Number
    mean: Number
    std: Number
    z: Number
    z_thresh: Number
    samples: Number


class LossSpike(StepEvent, tag="loss_spike", kw_only=True):
    """The step's loss above ``factor`` x ``reference`` (the median of recent applied steps' losses)."""

    LEVEL: ClassVar[str] = "warning"
    loss: Number
    reference: Number
    factor: Number
    action: str


class LossNonfinite(StepEvent, tag="loss_nonfinite", kw_only=True):
    LEVEL: ClassVar[str] = "warning"
    loss: Number
    action: str


class LossUnseen(StepEvent, tag="loss_unseen", kw_only=True):
    """The ``loss`` section cannot judge what the guard saw (``why``), said once: nothing is judged then."""

    LEVEL: ClassVar[str] = "warning"
    why: str


class Rerun(StepEvent, tag="rerun", kw_only=True):
    """A suspect step computed again (the policy's ``rerun`` section): ``transient`` if the two differ."""

    LEVEL: ClassVar[str] = "warning"
    verdict: str
    asked: str
    loss_first: Number | None = None
    loss_second: Number | None = None
    max_rel_diff: Number
    params: list[str]
    ranks: list[int]
    origin_ranks: dict[str, str] = msgspec.field(default_factory=dict)
    """Where the first computation's fault was made, before the reduction ({rank: host})."""
    recurred: dict[str, str] = msgspec.field(default_factory=dict)
    """Those of ``origin_ranks`` where the second computation made it again (a transient fault: none)."""


class RerunUnavailable(StepEvent, tag="rerun_unavailable", kw_only=True):
    """Once: a suspect step that could not be computed again (``why``); its verdict stood."""

    LEVEL: ClassVar[str] = "warning"
    why: str


class RankOutlier(StepEvent, tag="rank_outlier", kw_only=True):
    """The policy's ``ranks`` section: a rank whose own gradient norm, before the reduction, exceeded
    ``outlier_factor`` times the median of the ranks'."""

    LEVEL: ClassVar[str] = "warning"
    ranks: dict[str, str]
    norms: dict[str, Number]
    median: Number
    outlier_factor: float
    action: str


class ReplicaDivergence(StepEvent, tag="replica_divergence", kw_only=True):
    """The policy's ``ranks.check_replicas_every``: replicas whose parameters differ bitwise from the majority's."""

    LEVEL: ClassVar[str] = "error"
    ranks: dict[str, str]
    params: list[str]
    checked: int
    action: str


class RankFailure(StepEvent, tag="rank_failure", kw_only=True):
    """An exception inside the guard's step on one rank, as every rank learned it (no rank left waiting)."""

    LEVEL: ClassVar[str] = "error"
    failed_rank: int
    host: str
    error: str


class SnapshotPlacement(StepEvent, tag="snapshot_placement", kw_only=True):
    """Where recovery's snapshots live, decided at the first snapshot (``memory: auto``, from the run's measured
    peak)."""

    where: str
    device: str
    staged: bool
    needed_bytes: int
    free_bytes: int | None = None
    why: str


class SnapshotFallback(SnapshotPlacement, tag="snapshot_fallback", kw_only=True):
    """A snapshot's allocation on the device failed: it and the later ones go to pinned host memory, the run goes
    on."""

    LEVEL: ClassVar[str] = "warning"


class ScalerSkip(StepEvent, tag="scaler_skip", kw_only=True):
    fused: bool


class NormOverflow(StepEvent, tag="norm_overflow", kw_only=True):
    LEVEL: ClassVar[str] = "warning"
    rule: str
    param: str
    note: str


class UnexpectedOptimizer(StepEvent, tag="unexpected_optimizer", kw_only=True):
    LEVEL: ClassVar[str] = "warning"
    optimizer: str


class PolicyReload(StepEvent, tag="policy_reload", kw_only=True):
    policy: str
    added: list[str]
    removed: list[str]
    changed: list[str]
    params: int
    rules: dict[str, int]


class PolicyReloadFailed(StepEvent, tag="policy_reload_failed", kw_only=True):
    LEVEL: ClassVar[str] = "warning"
    policy: str
    error: str


class Rebind(StepEvent, tag="rebind", kw_only=True):
    LEVEL: ClassVar[str] = "warning"
    replaced: list[str]
    params: int
    rules: dict[str, int]


class Stats(StepEvent, tag="stats", kw_only=True):
    """``figures``: ``{stat: {name: value}}``, or ``{stat: value}`` at ``scope: group``."""

    rule: str
    scope: str
    figures: dict[str, Union[dict[str, Number], Number]]  # noqa: UP007
    loss: Number | None = None
    """The step's loss, where the guard saw it."""


class _HealthFlag(StepEvent, kw_only=True):
    LEVEL: ClassVar[str] = "warning"
    rule: str
    scope: str
    name: str
    norm: Number
    threshold: Number


class Vanishing(_HealthFlag, tag="vanishing", kw_only=True):
    pass


class Exploding(_HealthFlag, tag="exploding", kw_only=True):
    pass


class Recovered(StepEvent, tag="recovered", kw_only=True):
    rule: str
    name: str
    norm: Number
    was: str


class Counters(StepEvent, tag="counters", kw_only=True):
    steps: int
    counters: Counts


class Detach(Event, tag="detach", kw_only=True):
    reason: str
    steps: int
    counters: Counts


class StateLoaded(StepEvent, tag="state_loaded", kw_only=True):
    """``guard.load_state_dict`` resumed the guard at ``step``."""


class StateMissing(StepEvent, tag="state_missing", kw_only=True):
    """A framework resumed a run at ``step`` from a checkpoint that holds no guard state: the guard starts afresh."""

    LEVEL: ClassVar[str] = "warning"
    why: str


GuardEvent = Union[  # noqa: UP007
    Attach,
    Intervention,
    Nonfinite,
    NonfiniteUnhalted,
    NonfiniteGroupNorm,
    Halt,
    Rewind,
    Skip,
    AdaptiveClip,
    SpikeSkip,
    LossSpike,
    LossNonfinite,
    LossUnseen,
    Rerun,
    RerunUnavailable,
    RankOutlier,
    ReplicaDivergence,
    RankFailure,
    SnapshotPlacement,
    SnapshotFallback,
    ScalerSkip,
    NormOverflow,
    UnexpectedOptimizer,
    PolicyReload,
    PolicyReloadFailed,
    Rebind,
    Stats,
    Vanishing,
    Exploding,
    Recovered,
    Counters,
    Detach,
    StateLoaded,
    StateMissing,
]
"""Any event the guard writes."""


class ForeignEvent(msgspec.Struct, kw_only=True):
    """A line with an ``event`` name no definition has, and a ``run``: counted by name, its other fields unread."""

    event: str
    run: str
    ts: str | None = None
    rank: int = 0
    step: Step | None = None
    rule: Any = None
    param: Any = None


def event_name(cls: type[Event]) -> str:
    """The ``event`` field of a definition's lines."""
    tag = cls.__struct_config__.tag
    assert isinstance(tag, str)
    return tag


EVENTS: Final[dict[str, type[Event]]] = {event_name(cls): cls for cls in get_args(GuardEvent)}
"""Every definition, by event name, in the order of docs/log-events.md."""
LEVELS: Final[dict[str, str]] = {name: cls.LEVEL for name, cls in EVENTS.items()}
"""The level of each event."""

EVENT_DECODER: Final[msgspec.json.Decoder[GuardEvent]] = msgspec.json.Decoder(GuardEvent)
"""Decodes one line (bytes) into its typed event; raises ``msgspec.ValidationError`` or ``DecodeError``."""
FOREIGN_DECODER: Final[msgspec.json.Decoder[ForeignEvent]] = msgspec.json.Decoder(ForeignEvent)
"""Decodes a line whose name no definition has."""


def fields_of(cls: type[Event]) -> tuple[str, ...]:
    """The fields of a definition, those every line has (``ts``, ``level``, ``run``, ``rank``) left out."""
    return tuple(name for name in cls.__struct_fields__ if name not in Event.__struct_fields__)
