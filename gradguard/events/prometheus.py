"""Live metrics: a guard's counters served over HTTP in the Prometheus text format.

``GradGuard(..., metrics_port=PORT)`` starts a ``MetricsServer``: ``prometheus_client``'s own HTTP
server (``start_http_server``, a daemon thread) on a private ``CollectorRegistry`` (never the
global default one) with one collector that reads the guard's thread-safe [`Counters`][gradguard.Counters] when
Prometheus scrapes. The training thread does no work for it: nothing is updated per step, and a
scrape only takes the counters' lock for the time of a dict copy.

``prometheus_client`` is an optional extra (``pip install 'gradguard[metrics]'``) and is imported
only when a server starts: importing this module, the guard or ``gradguard`` never imports it.

Exported (every sample carries ``rank``; a count is what ``guard.counters.snapshot()`` holds):

- ``gradguard_steps_total``: the steps the guard has treated (``guard.step_count``);
- ``gradguard_interventions_total{rule,action}``: gradient changes (clip_norm, clip_value, scale,
  zero, drop), per (parameter, step) as in the counters;
- ``gradguard_nonfinite_total{rule,kind}``: NaN/Inf detections, ``kind`` ``nan`` or ``inf``;
- ``gradguard_skipped_steps_total{rule}``: steps skipped by a ``skip_step_on_nonfinite`` rule, and
  by the GradScaler under ``rule="grad_scaler"``;
- ``gradguard_halts_total{rule}``: halts (``halt_on_nonfinite``, or a skip rule past its limits);
- ``gradguard_stat{rule,stat,name}``: gauges of monitored statistics, from a provider returning
  ``{"gradguard/<rule>/<stat>[/<name>]": value}`` (see ``parse_stat_key``);
- ``gradguard_faults_by_rank_total{event,origin_rank,host}``: halts, skips and rewinds by the rank where the fault
  was made (their events' ``ranks``, before the reduction), from ``RankFaults``: every rank counts each fault, so
  a query sums over ``origin_rank`` of one ``rank``, not over ``rank``.

Series of the policy's rules start at 0 (a first NaN is then an increase, not a new series).
"""

from __future__ import annotations

import errno
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gradguard.errors import GuardStateError
from gradguard.events.counters import RECOVERY_RULE, SCALER_RULE
from gradguard.events.log import EventLog

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.metrics_core import Metric

__all__ = [
    "INSTALL_HINT",
    "MetricsServer",
    "MetricsSource",
    "RankFaults",
    "ServesMetrics",
    "check_metrics_port",
    "parse_stat_key",
    "require_prometheus_client",
]

INSTALL_HINT = "pip install 'gradguard[metrics]'"

NONFINITE_KINDS = ("nan", "inf")
HALT_ACTION = "halt_on_nonfinite"
SKIP_ACTION = "skip_step_on_nonfinite"
SPIKE_SKIP_ACTION, SPIKE_HALT = "skip_step_on_spike", "halt_on_spike"
HALT_ACTIONS = frozenset({HALT_ACTION, SPIKE_HALT})
SKIP_ACTIONS = frozenset({SKIP_ACTION, SPIKE_SKIP_ACTION})
SCALER_SKIP = "skip"
WATCH_ACTIONS = frozenset({HALT_ACTION, SKIP_ACTION})
COUNTER_NAMES = frozenset({*NONFINITE_KINDS, *HALT_ACTIONS, *SKIP_ACTIONS, SCALER_SKIP})
"""Counter keys that are not interventions (with the action names, what ``gradguard/<rule>/<x>`` may count)."""
INTERVENTION_ACTIONS = ("agc", "autoclip", "clip_norm", "clip_value", "drop", "scale", "zclip", "zero")

Counts = Mapping[str, Mapping[str, int]]
StatProvider = Callable[[], Mapping[str, Any]]


def require_prometheus_client() -> None:
    """Raise a clear ``ImportError`` when the ``metrics`` extra is not installed."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"metrics_port= serves Prometheus metrics with prometheus_client, which is not installed: {INSTALL_HINT}"
        ) from exc


def check_metrics_port(port: int | None) -> None:
    """Refuse a bad ``metrics_port``, or a missing ``metrics`` extra, before anything is attached."""
    if port is None:
        return
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"metrics_port must be a port number from 0 to 65535 (0: any free port), got {port!r}")
    require_prometheus_client()


def parse_stat_key(key: str, rules: Iterable[str]) -> tuple[str, str, str] | None:
    """``"gradguard/<rule>/<stat>[/<name>]"`` -> ``(rule, stat, name)``; ``None`` for any other key.

    ``<rule>`` must be one of ``rules`` (the longest that fits: a rule name may hold ``/``), ``<stat>``
    holds no ``/``, and ``<name>`` (usually a parameter name; ``""`` when absent) is the rest. Counter
    keys (``gradguard/<rule>/<action>``, ``nan``, ``inf``, ``skip``) and ``gradguard/steps`` are not
    statistics: they are served from the counters.
    """
    prefix = "gradguard/"
    if not key.startswith(prefix):
        return None
    rest = key[len(prefix) :]
    owners = [rule for rule in rules if rest.startswith(rule + "/") and len(rest) > len(rule) + 1]
    if not owners:
        return None
    rule = max(owners, key=len)
    stat, _, name = rest[len(rule) + 1 :].partition("/")
    if not stat or (not name and (stat in COUNTER_NAMES or stat in INTERVENTION_ACTIONS)):
        return None
    return rule, stat, name


FAULT_EVENTS = frozenset({"halt", "skip", "rewind"})
"""The events whose ``ranks`` name where a fault was made ({rank: host}, JSON keys strings)."""


class RankFaults:
    """Faults by origin rank and host, fed by the guard's ``halt``, ``skip`` and ``rewind`` events: safe to feed
    from the training thread and read from a scrape's at once.

    The counters (``guard.counters``) count by rule, not by rank: where a fault was made is only in its event's
    ``ranks``, so this tally takes the events as they are emitted (``observe``, the signature of
    ``EventLog.emit`` less the level) and the collector serves it at scrape time.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str, str], int] = {}

    def observe(self, event: str, fields: Mapping[str, Any]) -> None:
        """Count a fault event once for each rank its ``ranks`` names; any other event, or none named, is ignored."""
        if event not in FAULT_EVENTS:
            return
        ranks = fields.get("ranks")
        if not isinstance(ranks, Mapping) or not ranks:
            return
        keys = [(event, str(rank), str(host)) for rank, host in ranks.items()]
        with self._lock:
            for key in keys:
                self._counts[key] = self._counts.get(key, 0) + 1

    def snapshot(self) -> dict[tuple[str, str, str], int]:
        """``{(event, origin rank, host): count}``, a copy consistent at one instant."""
        with self._lock:
            return dict(self._counts)


@dataclass(frozen=True)
class MetricsSource:
    """What a scrape reads: nothing here refers to the guard itself, so the guard stays collectable."""

    counters: Any
    """The guard's [`Counters`][gradguard.Counters] (its ``snapshot()`` is thread-safe)."""
    steps: Callable[[], int]
    rank: int
    rule_actions: Mapping[str, tuple[str, ...]]
    """``{rule: action names}`` of the policy: its series are served from 0."""
    stats: StatProvider | None = None
    rank_faults: RankFaults | None = None
    """Faults by origin rank (``gradguard_faults_by_rank_total``); None serves no such series."""

    @classmethod
    def of_guard(cls, guard: Any) -> MetricsSource:
        """Read a guard by weak reference: its counters, ``step_count``, ``rank`` and ``metrics()`` if any."""
        ref = weakref.ref(guard)
        last = [0]

        def steps() -> int:
            current = ref()
            if current is not None:
                last[0] = int(current.step_count)
            return last[0]

        provider = getattr(guard, "metrics", None)
        stats: StatProvider | None = None
        if callable(provider) and hasattr(provider, "__self__"):
            method = weakref.WeakMethod(provider)

            def stats() -> Mapping[str, Any]:
                bound = method()
                return bound() if bound is not None else {}

        rule_actions = {rule.name: tuple(action.action for action in rule.actions) for rule in guard.policy.rules}
        return cls(guard.counters, steps, int(guard.rank), rule_actions, stats, guard.rank_faults)


class _GuardCollector:
    """A ``prometheus_client`` collector: builds every metric from the counters at scrape time."""

    def __init__(self, source: MetricsSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        source = self.source
        rank = str(source.rank)
        counts = _with_zeros(source.counters.snapshot(), source.rule_actions)
        steps = CounterMetricFamily("gradguard_steps", "Training steps the guard has treated.", labels=["rank"])
        steps.add_metric([rank], source.steps())
        interventions = CounterMetricFamily(
            "gradguard_interventions",
            "Gradients changed by an action, per (parameter, step) as in guard.counters.",
            labels=["rule", "action", "rank"],
        )
        nonfinite = CounterMetricFamily(
            "gradguard_nonfinite", "NaN/Inf gradients detected, per (parameter, step).", labels=["rule", "kind", "rank"]
        )
        skipped = CounterMetricFamily(
            "gradguard_skipped_steps",
            "Steps skipped by a skip_step_on_nonfinite or skip_step_on_spike rule, or by the GradScaler "
            "(rule grad_scaler).",
            labels=["rule", "rank"],
        )
        halts = CounterMetricFamily(
            "gradguard_halts", "Halts raised by a rule (GradientHalt).", labels=["rule", "rank"]
        )
        for rule, by_action in sorted(counts.items()):
            halted: int | None = None  # one series per rule, whichever kind of halt or skip it counts
            skips: int | None = None
            for action, count in sorted(by_action.items()):
                if action in NONFINITE_KINDS:
                    nonfinite.add_metric([rule, action, rank], count)
                elif action in HALT_ACTIONS:
                    halted = (halted or 0) + count
                elif action in SKIP_ACTIONS or (rule in (SCALER_RULE, RECOVERY_RULE) and action == SCALER_SKIP):
                    skips = (skips or 0) + count
                else:
                    interventions.add_metric([rule, action, rank], count)
            if halted is not None:
                halts.add_metric([rule, rank], halted)
            if skips is not None:
                skipped.add_metric([rule, rank], skips)
        yield from (steps, interventions, nonfinite, skipped, halts)
        if source.rank_faults is not None:
            by_rank = CounterMetricFamily(
                "gradguard_faults_by_rank",
                "Halts, skips and rewinds by the rank where the fault was made, before the reduction (their events' "
                "ranks); every rank counts each fault.",
                labels=["event", "origin_rank", "host", "rank"],
            )
            for (event, origin, host), count in sorted(source.rank_faults.snapshot().items()):
                by_rank.add_metric([event, origin, host, rank], count)
            yield by_rank
        gauges = GaugeMetricFamily(
            "gradguard_stat",
            "Statistics the guard monitors, from its gradguard/<rule>/<stat>[/<name>] metrics.",
            labels=["rule", "stat", "name", "rank"],
        )
        for (rule, stat, name), value in _stats(source):
            gauges.add_metric([rule, stat, name, rank], value)
        yield gauges


def _with_zeros(counts: Counts, rule_actions: Mapping[str, tuple[str, ...]]) -> dict[str, dict[str, int]]:
    """The counters, with a 0 for each series the policy's rules can count but have not yet."""
    full: dict[str, dict[str, int]] = {}
    for rule, actions in rule_actions.items():
        seed = full.setdefault(rule, {})
        for action in actions:
            if action in WATCH_ACTIONS:  # detections, and halts (a skip rule escalates past its limits)
                seed.update(dict.fromkeys((*NONFINITE_KINDS, HALT_ACTION), 0))
            if action == SPIKE_SKIP_ACTION:
                seed[SPIKE_HALT] = 0
            seed.setdefault(action, 0)
    for rule, by_action in counts.items():
        full.setdefault(rule, {}).update(by_action)
    return full


def _stats(source: MetricsSource) -> list[tuple[tuple[str, str, str], float]]:
    """The provider's recognisable statistics; a provider that fails or returns junk gives none."""
    if source.stats is None:
        return []
    try:
        values = dict(source.stats())
    except Exception:  # a statistic must never break the scrape of the counters
        return []
    rules = [*source.rule_actions, SCALER_RULE]
    found: dict[tuple[str, str, str], float] = {}
    for key, value in values.items():
        labels = parse_stat_key(key, rules) if isinstance(key, str) else None
        if labels is None or isinstance(value, bool):
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        found[labels] = number  # NaN and Inf are valid gauge values: a NaN norm is worth seeing
    return sorted(found.items())


class MetricsServer:
    """``prometheus_client``'s HTTP server for one guard; ``remove`` stops it and frees the port."""

    def __init__(self, source: MetricsSource, *, host: str = "127.0.0.1", port: int = 0) -> None:
        check_metrics_port(port)
        from prometheus_client import CollectorRegistry, start_http_server

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_GuardCollector(source))
        try:
            server, thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            hint = ""
            if exc.errno == errno.EADDRINUSE:
                hint = (
                    ". Under torch.distributed each rank needs its own port (metrics_port=9400 + rank), "
                    "or pass metrics_port=0 for a free one"
                )
            raise GuardStateError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}{hint}") from exc
        self._server: WSGIServer | None = server
        self._thread = thread
        self.host = host
        self.port = int(server.server_address[1])

    @property
    def url(self) -> str:
        """``http://HOST:PORT/metrics`` (prometheus_client answers on any path)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    @property
    def serving(self) -> bool:
        return self._server is not None

    def remove(self) -> None:
        """Stop serving and close the listening socket; safe to call more than once, from any thread."""
        server, self._server = self._server, None
        if server is None:
            return
        if threading.current_thread() is self._thread:
            # Garbage collection ran the guard's finalizer on the server's own thread, which cannot
            # wait for itself to stop: stop it from another one.
            threading.Thread(target=_stop, args=(server, None), daemon=True).start()
            return
        _stop(server, self._thread)


def _stop(server: WSGIServer, thread: threading.Thread | None) -> None:
    server.shutdown()  # returns once serve_forever has left its loop (within its 0.5 s poll)
    server.server_close()
    if thread is not None:
        thread.join(timeout=5)


class ServesMetrics:
    """``GradGuard``'s live-metrics endpoint, kept in this module:
    [`metrics_url`][gradguard.events.prometheus.ServesMetrics.metrics_url] and the start."""

    _metrics_server: MetricsServer | None = None
    rank_faults: RankFaults | None = None
    """While metrics are served: faults by origin rank, fed by ``rank_faults.observe(event, fields)`` for each event
    the guard emits (``gradguard_faults_by_rank_total``)."""

    @property
    def metrics_url(self) -> str | None:
        """The live Prometheus endpoint, ``http://HOST:PORT/metrics``, while it serves; else ``None``.

        Served from ``GradGuard(..., metrics_port=PORT, metrics_host=HOST)`` (port 0: any free one) until
        the guard is removed; needs ``pip install 'gradguard[metrics]'``.
        """
        server = self._metrics_server
        return server.url if server is not None and server.serving else None

    def _serve_metrics(
        self, host: str, port: int | None, register: Callable[[MetricsServer], None], *, events: EventLog
    ) -> None:
        """Start serving this guard's metrics (nothing when ``port`` is ``None``); ``register`` it for removal.

        ``events`` feeds the faults by rank, and is closed if the server cannot start (the port is taken, say) before
        the error propagates.
        """
        if port is None:
            return
        self.rank_faults = RankFaults()
        try:
            server = MetricsServer(MetricsSource.of_guard(self), host=host, port=port)
        except BaseException:
            events.close()
            raise
        events.observers.append(self.rank_faults.observe)
        self._metrics_server = server
        register(server)
