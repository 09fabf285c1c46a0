"""Live metrics: ``GradGuard(..., metrics_port=)`` serves the guard's counters to Prometheus over HTTP."""

from __future__ import annotations

import gc
import math
import socket
import sys
import threading
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import pytest
import torch
from support.docs import documented_example
from torch import nn

from gradguard import GradGuard, GuardStateError, Policy
from gradguard.events.prometheus import parse_stat_key

prometheus_parser = pytest.importorskip("prometheus_client.parser")

POLICY = Policy.from_dict(
    {
        "version": 1,
        "rules": [
            {"name": "nonfinite", "match": "*", "actions": [{"action": "skip_step_on_nonfinite"}]},
            {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.01}]},
        ],
    }
)
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str, timeout: float = 10) -> Samples:
    """Every sample of the endpoint, parsed by prometheus_client's own parser: {(name, labels): value}."""
    assert urlsplit(url).hostname == "127.0.0.1"
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode("utf-8")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in prometheus_parser.text_string_to_metric_families(text)
        for sample in family.samples
    }


def labels(**values: str) -> frozenset[tuple[str, str]]:
    return frozenset({"rank": "0", **values}.items())


def expected_samples(counters: Mapping[str, Mapping[str, int]], steps: int) -> Samples:
    """What the endpoint must say for this policy, given the guard's counters (absent counts are 0)."""

    def count(rule: str, action: str) -> float:
        return float(counters.get(rule, {}).get(action, 0))

    return {
        ("gradguard_steps_total", labels()): float(steps),
        ("gradguard_interventions_total", labels(rule="clip", action="clip_norm")): count("clip", "clip_norm"),
        ("gradguard_nonfinite_total", labels(rule="nonfinite", kind="nan")): count("nonfinite", "nan"),
        ("gradguard_nonfinite_total", labels(rule="nonfinite", kind="inf")): count("nonfinite", "inf"),
        ("gradguard_skipped_steps_total", labels(rule="nonfinite")): count("nonfinite", "skip_step_on_nonfinite"),
        ("gradguard_halts_total", labels(rule="nonfinite")): count("nonfinite", "halt_on_nonfinite"),
    }


def train(guard: GradGuard, model: nn.Module, opt: torch.optim.Optimizer, steps: int, nan_at: int = -1) -> None:
    for step in range(steps):
        opt.zero_grad()
        x = torch.randn(8, 4)
        nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        if step == nan_at:
            model[0].weight.grad[0, 0] = float("nan")
        opt.step()


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def refused(url: str) -> bool:
    """Whether nothing listens at the URL's port any more (a connect is refused)."""
    parts = urlsplit(url)
    with socket.socket() as sock:
        sock.settimeout(5)
        try:
            sock.connect((parts.hostname, parts.port))
        except ConnectionRefusedError:
            return True
    return False


def test_a_scrape_reports_the_guards_counters_and_steps_with_the_rank_label():
    """Scraped over HTTP mid-run and at the end, every sample equals guard.counters and step_count (rank 0)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradGuard(model, POLICY, logger=None, metrics_port=0) as guard:
        url = guard.metrics_url
        assert url is not None
        assert url.startswith("http://127.0.0.1:")
        assert url.endswith("/metrics")
        assert scrape(url) == expected_samples({}, 0)  # every series of the policy starts at 0
        train(guard, model, opt, 6, nan_at=3)
        counters = guard.counters.snapshot()
        assert counters["nonfinite"] == {"nan": 1, "skip_step_on_nonfinite": 1}
        assert counters["clip"]["clip_norm"] > 0
        assert scrape(url) == expected_samples(counters, guard.step_count)
        assert guard.step_count == 6


def test_the_port_is_closed_and_the_url_gone_after_remove():
    """After guard.remove() a connect to the metrics port is refused and guard.metrics_url is None."""
    guard = GradGuard(make_model(), POLICY, logger=None, metrics_port=0)
    url = guard.metrics_url
    assert url is not None
    assert not refused(url)
    guard.remove()
    assert guard.metrics_url is None
    assert refused(url)
    guard.remove()  # idempotent


def test_a_guard_without_metrics_port_serves_nothing():
    """Without metrics_port there is no server and metrics_url is None."""
    with GradGuard(make_model(), POLICY, logger=None) as guard:
        assert guard.metrics_url is None


def test_a_garbage_collected_guard_frees_its_port():
    """A guard dropped while attached stops its server too: the port is refused after collection."""
    guard = GradGuard(make_model(), POLICY, logger=None, metrics_port=0)
    url = guard.metrics_url
    assert url is not None
    ref = weakref.ref(guard)
    del guard  # the last reference: the serving thread must not keep the guard alive
    gc.collect()
    assert ref() is None
    assert refused(url)


class BlockingStatsGuard(GradGuard):
    """A guard whose statistics provider blocks until released: a stuck scrape."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        super().__init__(*args, **kwargs)

    def metrics(self) -> dict[str, float]:
        self.entered.set()
        self.release.wait(timeout=30)
        return {"gradguard/clip/grad_norm/0.weight": 0.5}


def test_a_scrape_in_progress_never_blocks_a_training_step():
    """While a scrape is stuck in another thread, training steps run to the end; the scrape then completes."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with BlockingStatsGuard(model, POLICY, logger=None, metrics_port=0) as guard:
        url = guard.metrics_url
        assert url is not None
        scraped: list[Samples] = []
        scraper = threading.Thread(target=lambda: scraped.append(scrape(url, timeout=30)), daemon=True)
        scraper.start()
        assert guard.entered.wait(timeout=10)  # the scrape is now inside the server, waiting
        trainer = threading.Thread(target=train, args=(guard, model, opt, 5), daemon=True)
        trainer.start()
        trainer.join(timeout=60)  # a hang guard: a step that waited for the scrape would wait until release
        if trainer.is_alive():
            guard.release.set()
            pytest.fail("a training step hung behind the scrape")
        assert guard.step_count == 5
        assert scraper.is_alive()
        guard.release.set()
        scraper.join(timeout=10)
        assert not scraper.is_alive()
    (samples,) = scraped
    assert samples[("gradguard_stat", labels(rule="clip", stat="grad_norm", name="0.weight"))] == 0.5
    assert samples[("gradguard_steps_total", labels())] == 0.0  # the counters were read before it blocked


def test_concurrent_scrapes_while_training_see_counts_that_only_grow():
    """Scrapes in a loop during training all succeed, and each one's steps and clips never go backwards."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: list[Samples] = []
    with GradGuard(model, POLICY, logger=None, metrics_port=0) as guard:
        url = guard.metrics_url
        assert url is not None
        done = threading.Event()

        def loop() -> None:
            while not done.is_set():
                seen.append(scrape(url))

        scraper = threading.Thread(target=loop, daemon=True)
        scraper.start()
        train(guard, model, opt, 30)
        done.set()
        scraper.join(timeout=15)
        assert not scraper.is_alive()
        final = scrape(url)
    assert seen
    steps = [samples[("gradguard_steps_total", labels())] for samples in [*seen, final]]
    assert steps == sorted(steps)
    assert steps[-1] == 30.0
    clip_key = ("gradguard_interventions_total", labels(rule="clip", action="clip_norm"))
    clips = [samples[clip_key] for samples in [*seen, final]]
    assert clips == sorted(clips)


class StatsGuard(GradGuard):
    def metrics(self) -> dict[str, Any]:
        return {
            "gradguard/steps": 3,  # a counter: served from the counters
            "gradguard/clip/clip_norm": 7,  # a counter key, not a statistic
            "gradguard/clip/grad_norm/0.weight": 2.5,
            "gradguard/clip/grad_norm/2.bias": math.inf,
            "gradguard/clip/max_grad_norm": 4,
            "gradguard/no-such-rule/grad_norm": 1.0,  # not a rule of the policy: not recognised
            "gradguard/clip/label": "text",  # not a number
            "other/clip/grad_norm": 1.0,
        }


def test_statistic_gauges_come_from_the_guards_metrics_provider():
    """guard.metrics() stat keys become gradguard_stat{rule,stat,name} gauges; counter and foreign keys do not."""
    with StatsGuard(make_model(), POLICY, logger=None, metrics_port=0) as guard:
        assert guard.metrics_url is not None
        samples = scrape(guard.metrics_url)
    gauges = {
        dict(key[1])["stat"] + "/" + dict(key[1])["name"]: value
        for key, value in samples.items()
        if key[0] == "gradguard_stat"
    }
    assert gauges == {"grad_norm/0.weight": 2.5, "grad_norm/2.bias": math.inf, "max_grad_norm/": 4.0}
    assert all(dict(key[1])["rule"] == "clip" for key in samples if key[0] == "gradguard_stat")


def test_stat_keys_are_parsed_against_the_policys_rule_names():
    """A rule name may hold '/': the longest known rule wins; counters, steps and unknown rules are not stats."""
    rules = ["a", "a/b", "grad_scaler"]
    assert parse_stat_key("gradguard/a/b/grad_norm/layer.weight", rules) == ("a/b", "grad_norm", "layer.weight")
    assert parse_stat_key("gradguard/a/grad_norm", rules) == ("a", "grad_norm", "")
    assert parse_stat_key("gradguard/a/clip_norm", rules) is None
    assert parse_stat_key("gradguard/a/nan", rules) is None
    assert parse_stat_key("gradguard/grad_scaler/skip", rules) is None
    assert parse_stat_key("gradguard/steps", rules) is None
    assert parse_stat_key("gradguard/zzz/grad_norm", rules) is None
    assert parse_stat_key("gradguard/a/", rules) is None


def test_a_port_in_use_is_refused_with_the_per_rank_hint_and_leaves_nothing_attached():
    """A taken port raises GuardStateError naming metrics_port=9400 + rank; the model can be guarded again."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        model = make_model()
        with pytest.raises(GuardStateError, match=r"9400 \+ rank"):
            GradGuard(model, POLICY, logger=None, metrics_port=port)
    with GradGuard(model, POLICY, logger=None) as guard:  # the failed guard claimed nothing
        assert guard.attached


@pytest.mark.parametrize("port", [-1, 65536, 1.5, True, "9400"])
def test_a_bad_metrics_port_is_a_value_error(port: Any):
    """metrics_port must be an int from 0 to 65535."""
    with pytest.raises(ValueError, match="metrics_port must be a port number"):
        GradGuard(make_model(), POLICY, logger=None, metrics_port=port)


def test_without_the_metrics_extra_metrics_port_says_what_to_install(monkeypatch: pytest.MonkeyPatch):
    """With prometheus_client missing, metrics_port= raises ImportError naming gradguard[metrics]; nothing attaches."""
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    model = make_model()
    with pytest.raises(ImportError, match=r"pip install 'gradguard\[metrics\]'"):
        GradGuard(model, POLICY, logger=None, metrics_port=0)
    with GradGuard(model, POLICY, logger=None) as guard:
        assert guard.attached
        assert guard.metrics_url is None


def test_the_documented_metrics_example_runs_as_written(capsys: pytest.CaptureFixture[str]):
    """The live-metrics page's example trains, scrapes its own endpoint and prints 20 steps in Prometheus text."""
    example = documented_example("docs/live-metrics-and-hot-reload.md", "metrics")
    exec(compile(example, "documented-metrics-example", "exec"), {"__name__": "__example__"})
    families = {
        family.name: family for family in prometheus_parser.text_string_to_metric_families(capsys.readouterr().out)
    }
    assert families["gradguard_steps"].samples[0].value == 20.0
    assert {sample.labels["rule"] for sample in families["gradguard_halts"].samples} == {"nonfinite"}


def test_a_monitors_figures_are_served_as_gauges_equal_to_guard_metrics():
    """A real monitor rule: every gradguard_stat sample equals the same key of guard.metrics() after the step."""
    policy = Policy.from_dict(
        {
            "version": 1,
            "rules": [
                {"name": "clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 0.01}]},
                {"name": "health", "match": "*", "actions": [{"action": "monitor", "stats": ["norm", "max_abs"]}]},
            ],
        }
    )
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradGuard(model, policy, logger=None, metrics_port=0) as guard:
        assert guard.metrics_url is not None
        train(guard, model, opt, steps=3)
        samples = scrape(guard.metrics_url)
        figures = {key: value for key, value in guard.metrics().items() if parse_stat_key(key, {"clip", "health"})}
    gauges = {
        f"gradguard/{dict(found)['rule']}/{dict(found)['stat']}/{dict(found)['name']}": value
        for (name, found), value in samples.items()
        if name == "gradguard_stat"
    }
    assert len(gauges) == 2 * len(list(model.parameters()))
    assert gauges == figures


def test_faults_are_served_by_origin_rank_and_host_counted_exactly_from_several_threads():
    """``RankFaults`` fed with halt/skip/rewind events from 4 threads at once: the scrape has each (event, origin
    rank, host) exactly as often as fed; events naming no rank, and other events, add nothing."""
    from gradguard.events.counters import Counters
    from gradguard.events.prometheus import MetricsServer, MetricsSource, RankFaults

    faults = RankFaults()
    source = MetricsSource(Counters(), lambda: 0, 1, {}, rank_faults=faults)
    fed = [
        ("skip", {"ranks": {"2": "host-a"}}),
        ("halt", {"ranks": {"2": "host-a", "3": "host-b"}}),
        ("skip", {"ranks": {}}),  # made after the reduction: no rank to name
        ("intervention", {"ranks": {"2": "host-a"}}),  # not a fault
    ]

    def feed() -> None:
        for _ in range(250):
            for event, fields in fed:
                faults.observe(event, fields)

    threads = [threading.Thread(target=feed) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    server = MetricsServer(source, port=0)
    try:
        samples = scrape(server.url)
    finally:
        server.remove()
    by_rank = {key: value for key, value in samples.items() if key[0] == "gradguard_faults_by_rank_total"}

    def key(event: str, origin: str, host: str) -> tuple[str, frozenset[tuple[str, str]]]:
        labelled = {"event": event, "origin_rank": origin, "host": host, "rank": "1"}
        return "gradguard_faults_by_rank_total", frozenset(labelled.items())

    assert by_rank == {
        key("skip", "2", "host-a"): 1000.0,
        key("halt", "2", "host-a"): 1000.0,
        key("halt", "3", "host-b"): 1000.0,
    }


def test_a_guard_serving_metrics_serves_its_rank_faults():
    """A guard's endpoint has the faults its ``rank_faults`` was fed, labelled with the guard's own rank too."""
    model = nn.Linear(4, 2)
    with GradGuard(model, POLICY, metrics_port=0, logger=None) as guard:
        assert guard.rank_faults is not None
        assert guard.metrics_url is not None
        before = scrape(guard.metrics_url)
        guard.rank_faults.observe("rewind", {"ranks": {"5": "node-7"}})
        after = scrape(guard.metrics_url)
    name = "gradguard_faults_by_rank_total"
    assert not any(key[0] == name for key in before)
    assert after[(name, labels(event="rewind", origin_rank="5", host="node-7"))] == 1.0
