"""Many guards in one process: trained, attached, removed and read from many threads at once.

Every scenario runs the same seeded trainings twice: one after another in the main thread (the
reference), and at once on threads. Each guard's counters, step count and audit-log events (modulo
run ids, timestamps and the process id) must be those of its reference run; no thread may raise.
Real models, real optimizers, a real (CPU) GradScaler.
"""

from __future__ import annotations

import copy
import math
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from support.training import SmallMLP, make_policy

from gradguard import GradGuard, GradientHalt, GuardStateError, Policy

STEPS = 20
BAD_STEPS = frozenset({3, 8})
"""Where a training makes one gradient non-finite (NaN, or Inf under a GradScaler)."""

CLIP = {"match": ["*"], "actions": [{"action": "clip_norm", "max_norm": 0.05}]}
HALT = {"match": ["*"], "actions": [{"action": "halt_on_nonfinite"}]}
SKIP = {"match": ["*"], "actions": [{"action": "skip_step_on_nonfinite"}]}
KINDS = ("clip", "skip", "scaler_clip", "scaler")
"""clip: the loop clips with torch's clip_grad_norm_; skip: a skip rule and NaN; scaler_clip: GradScaler,
unscale_, torch's clip, Inf at the bad steps; scaler: GradScaler alone, Inf at the bad steps."""
VOLATILE = frozenset({"ts", "run", "pid"})


@dataclass
class Training:
    """One seeded training of its own SmallMLP with its own Adam: made in the main thread, run anywhere."""

    kind: str
    seed: int
    model: SmallMLP
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    optimizer: torch.optim.Optimizer = field(init=False)
    scaler: torch.amp.GradScaler | None = field(init=False)

    def __post_init__(self) -> None:
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if self.kind.startswith("scaler") else None

    @classmethod
    def make(cls, kind: str, seed: int) -> Training:
        generator = torch.Generator().manual_seed(seed)
        model = SmallMLP()
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        batches = [
            (torch.randn(16, 8, generator=generator), torch.randn(16, 4, generator=generator)) for _ in range(STEPS)
        ]
        return cls(kind, seed, model, batches)

    def twin(self) -> Training:
        """The same training, not started: a copy of the model and data, a fresh optimizer and scaler."""
        return Training(self.kind, self.seed, copy.deepcopy(self.model), self.batches)

    def policy(self) -> Policy:
        return make_policy(SKIP if self.kind == "skip" else HALT, CLIP)

    def guard(self, log: Path, **options: Any) -> GradGuard:
        return GradGuard(self.model, self.policy(), audit_log=log, logger=None, scaler=self.scaler, **options)

    def run(self, after: Callable[[], None] | None = None) -> None:
        """Every step (``after()`` after each), or up to a halt (a training whose guard halts ends there)."""
        try:
            for step in range(STEPS):
                self.iteration(step)
                if after is not None:
                    after()
        except GradientHalt:
            pass

    def iteration(self, step: int) -> None:
        model, opt, scaler = self.model, self.optimizer, self.scaler
        x, y = self.batches[step]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        grad = model.hidden.weight.grad  # type: ignore[union-attr]
        assert grad is not None
        if step in BAD_STEPS:
            grad[0, self.seed % 16] = math.inf if scaler is not None else math.nan
        if scaler is None:
            if self.kind == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            return
        if self.kind == "scaler_clip":
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()


@dataclass
class Outcome:
    """What a guard left behind: the figures to compare with its reference run."""

    counters: dict[str, dict[str, int]]
    steps: int
    events: list[dict[str, Any]]
    weights: list[torch.Tensor]


def events_of(log: Path, run: str) -> list[dict[str, Any]]:
    """The run's events in ``log``, in order, without what differs between two runs of the same training."""
    import json

    lines = log.read_text(encoding="utf-8").splitlines()
    parsed = [json.loads(line) for line in lines]
    return [{k: v for k, v in event.items() if k not in VOLATILE} for event in parsed if event["run"] == run]


def outcome(guard: GradGuard, training: Training) -> Outcome:
    guard.remove()
    assert guard.audit_log is not None
    weights = [p.detach().clone() for p in training.model.parameters()]
    return Outcome(guard.counters.snapshot(), guard.step_count, events_of(guard.audit_log, guard.run_id), weights)


def reference(trainings: list[Training], tmp: Path) -> list[Outcome]:
    """Each training, one after another, in this thread, each under its own guard."""
    outcomes = []
    for i, training in enumerate(trainings):
        twin = training.twin()
        guard = twin.guard(tmp / f"reference-{i}.jsonl")
        twin.run()
        outcomes.append(outcome(guard, twin))
    return outcomes


def on_threads(targets: list[Callable[[], None]]) -> None:
    """Run every target on its own thread, all released at once; re-raise the first error any of them met."""
    errors: list[BaseException] = []
    start = threading.Barrier(len(targets))

    def body(target: Callable[[], None]) -> None:
        try:
            start.wait()
            target()
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(target,)) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), "a thread is stuck"
    if errors:
        raise errors[0]


def assert_same(got: list[Outcome], expected: list[Outcome]) -> None:
    assert len(got) == len(expected)
    for i, (mine, ref) in enumerate(zip(got, expected, strict=True)):
        assert mine.counters == ref.counters, f"training {i}"
        assert mine.steps == ref.steps, f"training {i}"
        assert mine.events == ref.events, f"training {i}"
        assert all(torch.equal(a, b) for a, b in zip(mine.weights, ref.weights, strict=True)), f"training {i}"


def eight(seed: int) -> list[Training]:
    return [Training.make(KINDS[i % len(KINDS)], seed + i) for i in range(8)]


@pytest.fixture(autouse=True)
def threads_switch_often() -> Any:
    """Python switches threads every 5 ms by default; every 20 us makes the trainings interleave inside steps."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(2e-5)
    yield
    sys.setswitchinterval(interval)


def guarded(trainings: list[Training], tmp: Path) -> list[GradGuard]:
    """A guard on each training, attached here, each with its own log."""
    return [training.guard(tmp / f"thread-{i}.jsonl") for i, training in enumerate(trainings)]


def outcomes(guards: list[GradGuard], trainings: list[Training]) -> list[Outcome]:
    return [outcome(guard, training) for guard, training in zip(guards, trainings, strict=True)]


def alongside(trainings: list[Training], *companions: Callable[[threading.Event], None]) -> None:
    """Each training on a thread of its own, and each companion on its own until they have all ended (a companion
    is given an event, set when the last training has ended, and must return soon after)."""
    done = threading.Event()

    def trainers() -> None:
        try:
            on_threads([training.run for training in trainings])
        finally:
            done.set()

    on_threads([trainers, *(partial(companion, done) for companion in companions)])


def poll(guard: GradGuard, done: threading.Event) -> None:
    """Read the guard until ``done`` (and at least three times): every figure only ever grows."""
    last_steps, last_counts, reads = -1, {}, 0
    while not done.is_set() or reads < 3:
        steps = guard.step_count
        counts = guard.counters.snapshot()
        metrics = guard.metrics()
        text = repr(guard)
        state = guard.state_dict()
        assert isinstance(steps, int)
        assert steps >= last_steps
        assert int(text.rsplit("steps=", 1)[1].rstrip(">")) >= steps
        assert state["step"] >= steps
        assert metrics["gradguard/steps"] >= steps
        for rule, by_action in counts.items():
            for action, n in by_action.items():
                assert isinstance(n, int)
                assert n >= last_counts.get((rule, action), 0)
                last_counts[(rule, action)] = n
        last_steps = steps
        reads += 1


def churn(tmp: Path, k: int, done: threading.Event) -> None:
    """Attach a guard to a new model, take one good step, remove it; again and again until ``done``."""
    count = 0
    while not done.is_set() or count < 3:
        other = Training.make(KINDS[(k + count) % len(KINDS)], 700 + count)
        with other.guard(tmp / f"churn-{k}.jsonl", summary_every=1):
            other.iteration(count % min(BAD_STEPS))  # a good step: the churn never halts
        count += 1


def test_eight_threads_with_guards_attached_before_any_trains_count_only_their_own_steps(tmp_path: Path) -> None:
    """Eight guards attached up front, eight threads training: each guard's counts and events are its run's alone."""
    trainings = eight(100)
    expected = reference(trainings, tmp_path)
    guards = guarded(trainings, tmp_path)
    on_threads([training.run for training in trainings])
    assert_same(outcomes(guards, trainings), expected)


def test_eight_threads_each_attaching_and_removing_its_own_guard_match_the_runs_one_after_another(
    tmp_path: Path,
) -> None:
    """Each thread attaches its guard, trains and removes it, while the others do the same."""
    trainings = eight(200)
    expected = reference(trainings, tmp_path)
    got: dict[int, Outcome] = {}

    def train(i: int) -> None:
        training = trainings[i]
        with training.guard(tmp_path / f"thread-{i}.jsonl") as guard:
            training.run()
        got[i] = outcome(guard, training)

    on_threads([partial(train, i) for i in range(8)])
    assert_same([got[i] for i in range(8)], expected)


def test_readers_polling_counters_step_count_and_repr_from_eight_threads_never_see_a_count_go_down(
    tmp_path: Path,
) -> None:
    """Eight trainers and eight readers at once: every figure a reader sees is a number that only grows."""
    trainings = eight(300)
    expected = reference(trainings, tmp_path)
    guards = guarded(trainings, tmp_path)
    alongside(trainings, *(partial(poll, guard) for guard in guards))
    assert_same(outcomes(guards, trainings), expected)


def test_a_guard_attached_in_the_main_thread_halts_its_model_training_in_a_worker(tmp_path: Path) -> None:
    """The halt is raised in the worker that steps; the main thread reads the guard and removes it."""
    training = Training.make("clip", 400)
    expected = reference([training], tmp_path)
    guard = training.guard(tmp_path / "worker.jsonl")
    caught: list[GradientHalt] = []

    def worker() -> None:
        try:
            for step in range(STEPS):
                training.iteration(step)
        except GradientHalt as halt:
            caught.append(halt)

    on_threads([worker])
    assert len(caught) == 1
    assert caught[0].step == min(BAD_STEPS)
    assert guard.attached
    assert_same([outcome(guard, training)], expected)


def test_two_guards_sharing_one_log_file_write_whole_lines_each_run_separable(tmp_path: Path) -> None:
    """Two guards, one audit log, lines of about 40 KB: no line torn or interleaved, each run's events intact."""
    trainings = [Training.make("clip", 500), Training.make("skip", 501)]
    big = {"note": "x" * 40_000}
    expected = reference(trainings, tmp_path)
    shared = tmp_path / "shared.jsonl"
    guards = [training.guard(shared) for training in trainings]

    def train(i: int) -> Callable[[], None]:
        def pad() -> None:
            guards[i]._events.emit("info", "padding", **big)

        return lambda: trainings[i].run(pad)

    on_threads([train(0), train(1)])
    for guard in guards:
        guard.remove()
    text = shared.read_text(encoding="utf-8")
    import json

    lines = [json.loads(line) for line in text.splitlines()]  # each one a whole JSON object
    assert {line["run"] for line in lines} == {guard.run_id for guard in guards}
    assert sum(line["event"] == "padding" for line in lines) == min(BAD_STEPS) + STEPS  # the first halts
    got = []
    for guard, training in zip(guards, trainings, strict=True):
        events = [event for event in events_of(shared, guard.run_id) if event["event"] != "padding"]
        weights = [p.detach().clone() for p in training.model.parameters()]
        got.append(Outcome(guard.counters.snapshot(), guard.step_count, events, weights))
    assert_same(got, expected)


def test_four_trainers_are_undisturbed_while_two_threads_attach_and_remove_guards_on_other_models(
    tmp_path: Path,
) -> None:
    """Attaching and removing guards elsewhere, in a loop, changes nothing in four trainings going on meanwhile."""
    trainings = [Training.make(KINDS[i], 600 + i) for i in range(4)]
    expected = reference(trainings, tmp_path)
    guards = guarded(trainings, tmp_path)
    alongside(trainings, partial(churn, tmp_path, 0), partial(churn, tmp_path, 1))
    assert_same(outcomes(guards, trainings), expected)


def remove_later(guard: GradGuard, started: threading.Event, delay: int) -> None:
    started.wait()
    for _ in range(delay):  # a little later each time: in a step, between steps, after the last
        pass
    guard.remove()


def test_a_guard_removed_from_another_thread_mid_training_logs_exactly_what_it_counted(tmp_path: Path) -> None:
    """remove() waits for a step in flight: the detach event's counters are the log's clips, and nothing follows it."""
    for attempt in range(12):
        training = Training.make("scaler_clip", 800 + attempt)
        guard = training.guard(tmp_path / f"removed-{attempt}.jsonl")
        started = threading.Event()
        on_threads([partial(training.run, started.set), partial(remove_later, guard, started, attempt * 50)])
        assert guard.audit_log is not None
        events = events_of(guard.audit_log, guard.run_id)
        detach = events[-1]
        assert detach["event"] == "detach"
        clips = sum(event["event"] == "intervention" for event in events)  # one per parameter: scope tensor
        assert detach["counters"].get("r1", {}).get("clip_norm", 0) == clips
        assert detach["counters"] == guard.counters.snapshot()
        assert detach["steps"] == guard.step_count


def attach_or_refused(training: Training, attached: list[GradGuard], refused: list[GuardStateError]) -> None:
    try:
        attached.append(GradGuard(training.model, training.policy(), logger=None))
    except GuardStateError as error:
        refused.append(error)


def test_of_two_threads_attaching_to_one_model_at_once_exactly_one_attaches() -> None:
    """Checking that no guard holds the model and claiming it are one step: the other thread is refused."""
    for attempt in range(20):
        training = Training.make("clip", 900 + attempt)
        attached: list[GradGuard] = []
        refused: list[GuardStateError] = []
        on_threads([partial(attach_or_refused, training, attached, refused)] * 2)
        assert (len(attached), len(refused)) == (1, 1)
        attached[0].remove()


def test_a_policy_reloaded_from_another_thread_takes_over_at_a_step_boundary_of_the_training(tmp_path: Path) -> None:
    """guard.reload() on a reader thread while the model trains: the new policy binds at one step, nothing raises."""
    import json

    training = Training.make("clip", 1000)
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    first.write_text(json.dumps({"version": 1, "rules": [{"name": "clip", **CLIP}]}))
    second.write_text(json.dumps({"version": 1, "rules": [{"name": "clip", **CLIP}, {"name": "halt", **HALT}]}))
    log = tmp_path / "reload.jsonl"
    guard = GradGuard(training.model, first, audit_log=log, logger=None)
    started = threading.Event()
    reloaded: list[bool] = []

    def reload() -> None:
        started.wait()
        reloaded.append(guard.reload(second))

    on_threads([partial(training.run, started.set), reload])
    guard.remove()
    events = events_of(log, guard.run_id)
    assert reloaded == [True]
    takeovers = [event for event in events if event["event"] == "policy_reload"]
    assert len(takeovers) <= 1  # none if the training ended first
    halts = [event["step"] for event in events if event["event"] == "halt"]
    # Before the halt rule, the first NaN went into the weights: every later step halts under the new policy.
    assert halts == ([max(takeovers[0]["step"], min(BAD_STEPS))] if takeovers else [])
