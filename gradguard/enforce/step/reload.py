"""Hot reload of the policy: a new policy file takes over at a step boundary, or the old one stays.

A daemon thread (``PolicyWatcher``, only with ``reload=True`` and a policy given as a path) polls the
file's ``(mtime, size, content hash)`` every ``reload_interval`` seconds; when it changes, the thread
loads and validates the file off the training thread and puts the result (a
[`Policy`][gradguard.Policy] or the [`PolicyError`][gradguard.PolicyError] text) in a lock-protected ``PolicySlot``. The
step boundary reads one flag; only when it is set does the training thread take the candidate and bind
it to the model (``PlanBook``), then switch (``Reloader.at_boundary``).

Under ``torch.distributed`` (more than one rank) a guard made with ``reload=True`` makes one more
collective at every enforcement pass, on every rank, whether or not anything changed: an
``all_reduce(MAX)`` of five int64 numbers (whether this rank holds a candidate, its negation, whether
it failed, the content hash and its negation), plus the host read of the result. The ranks switch
at that pass only when every rank holds a candidate, all hashed the same bytes, and none failed, so
they switch at the same step or not at all. Ranks that read different versions wait (the late ones
read the newest at their next poll); a version that fails on any rank is logged once by each.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradguard.enforce.distributed.collective import Collective
from gradguard.enforce.plans.plan_book import PlanBook
from gradguard.enforce.step.engine import Enforcer
from gradguard.enforce.step.stages import RELOAD_REFUSED
from gradguard.errors import GuardStateError, PolicyError
from gradguard.events.log import EventLog
from gradguard.policy.document import Policy
from gradguard.policy.limits import MAX_FILE_BYTES
from gradguard.policy.loading import load_policy_text, read_policy_file

__all__ = ["Candidate", "PolicySlot", "PolicyWatcher", "Reloader", "load_candidate", "rule_changes"]

_HASH_BITS = 48  # exact in an int64 tensor, and in a float64 should a backend convert


@dataclass
class Candidate:
    """A policy file as read once: its content hash, and the policy or why it was refused."""

    path: str
    digest: int
    policy: Policy | None = None
    error: str | None = None
    plans: PlanBook | None = field(default=None, repr=False)
    """Bound to the model on the training thread (``Reloader.prepare``)."""
    read_at: float = field(default_factory=time.monotonic)


def _signature(path: str) -> tuple[int, int, str] | None:
    """``(mtime_ns, size, sha256)`` of the file, or ``None`` while it cannot be read."""
    try:
        stat = os.stat(path)
        with open(path, "rb") as file:
            content = file.read(MAX_FILE_BYTES + 1)  # a larger file is refused when loaded: hash no more
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size, hashlib.sha256(content).hexdigest()


def load_candidate(path: str) -> Candidate:
    """Read the policy at ``path`` once, hash and validate those same bytes; a [`PolicyError`][gradguard.PolicyError] is
    kept."""
    try:
        text, fmt = read_policy_file(path)
    except PolicyError as exc:
        return Candidate(path, 0, error=str(exc))
    digest = int(hashlib.sha256(text.encode("utf-8")).hexdigest()[: _HASH_BITS // 4], 16)
    try:
        return Candidate(path, digest, policy=load_policy_text(Policy, text, fmt, path))
    except PolicyError as exc:
        return Candidate(path, digest, error=str(exc))


class PolicySlot:
    """The newest candidate, handed from the watcher thread to the training thread under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._candidate: Candidate | None = None
        self.ready = False
        """Set while a candidate waits: the only thing the step boundary reads."""

    def put(self, candidate: Candidate) -> None:
        with self._lock:
            self._candidate = candidate
            self.ready = True

    def take(self) -> Candidate | None:
        with self._lock:
            candidate, self._candidate = self._candidate, None
            self.ready = False
            return candidate


def _watch(path: str, interval: float, slot: PolicySlot, stop: threading.Event, last: Any) -> None:
    while not stop.wait(interval):
        signature = _signature(path)
        if signature == last:
            continue
        last = signature
        slot.put(load_candidate(path))


class PolicyWatcher:
    """A daemon thread polling one policy file; it holds the slot and its stop flag, never the guard."""

    def __init__(self, path: str, interval: float, slot: PolicySlot) -> None:
        self.path = path
        self._stop = threading.Event()
        self.thread = threading.Thread(
            target=_watch,
            args=(path, interval, slot, self._stop, _signature(path)),
            name=f"gradguard-reload:{os.path.basename(path)}",
            daemon=True,
        )
        self.thread.start()

    def remove(self) -> None:
        self._stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5.0)


def rule_changes(old: Policy, new: Policy) -> tuple[list[str], list[str], list[str]]:
    """Rule names ``(added, removed, changed)`` from ``old`` to ``new``, compared by name and content."""
    before = {rule.name: rule for rule in old.rules}
    after = {rule.name: rule for rule in new.rules}
    added = [name for name in after if name not in before]
    removed = [name for name in before if name not in after]
    changed = [name for name in after if name in before and after[name] != before[name]]
    return added, removed, changed


class Reloader:
    """The guard's side of hot reload: the slot, the watcher thread, and the switch at a step boundary."""

    def __init__(
        self,
        path: str | None,
        *,
        watch: bool,
        interval: float,
        collective: Collective,
        events: EventLog,
    ) -> None:
        self.path = path
        """The file of the policy in force (``None``: the policy was given as an object)."""
        self.slot = PolicySlot()
        self._interval = interval
        self._watch = watch
        self._collective = collective
        self._events = events
        self.agrees = watch and collective.active()
        """Every enforcement pass makes the agreement collective (``reload=True`` under several ranks)."""
        self._held: Candidate | None = None
        self._reported = False
        self.check: Callable[[Policy], None] | None = None
        """What the guard refuses of any policy it runs, a reloaded one too (``GuardStateError``: DeepSpeed's
        limits); None: nothing beyond binding."""
        self._watcher: PolicyWatcher | None = None
        if watch and path is not None:
            self._watcher = PolicyWatcher(path, interval, self.slot)

    def pending(self) -> bool:
        """Whether the step boundary must call ``at_boundary`` (a flag read; no lock, no I/O)."""
        return self.agrees or self.slot.ready

    @property
    def thread(self) -> threading.Thread | None:
        return self._watcher.thread if self._watcher is not None else None

    def remove(self) -> None:
        """Stop the watcher thread (the guard is detached)."""
        if self._watcher is not None:
            self._watcher.remove()
            self._watcher = None

    def request(self, path: str | None, plans: PlanBook, step: int) -> str | None:
        """``guard.reload()``: load and bind now; on success switch at the next boundary, else say why."""
        if path is None:
            path = self.path
        if path is None:
            return "the policy was given as a Policy object, not a file: pass reload(path=...)"
        if self._collective.pipeline is not None:
            return RELOAD_REFUSED
        if self._collective.active() and not self.agrees:
            return "under torch.distributed, reloading needs GradGuard(..., reload=True) on every rank"
        candidate = self.prepare(load_candidate(os.fspath(path)), plans)
        if candidate.error is not None:
            self._failed(candidate.path, candidate.error, step)
            return candidate.error
        self.slot.put(candidate)
        return None

    def prepare(self, candidate: Candidate, plans: PlanBook) -> Candidate:
        """Bind the candidate's policy to the model (training thread); a policy that does not bind fails."""
        if candidate.policy is not None and candidate.plans is None and candidate.error is None:
            try:
                if self.check is not None:
                    self.check(candidate.policy)
                candidate.plans = plans.with_policy(candidate.policy)
            except (PolicyError, GuardStateError) as exc:
                candidate.error = str(exc)
        return candidate

    def at_boundary(self, plans: PlanBook, enforcer: Enforcer) -> PlanBook | None:
        """At a step boundary: the new plans if the guard switches now, else ``None`` (the old policy stays)."""
        if self.agrees:
            return self._agree(plans, enforcer)
        if not self.slot.ready:
            return None
        candidate = self.slot.take()
        if candidate is None:
            return None
        self.prepare(candidate, plans)
        if candidate.error is not None or candidate.plans is None:
            self._failed(candidate.path, candidate.error or "not bound", enforcer.step)
            return None
        return self._switch(candidate, plans, enforcer)

    def _agree(self, plans: PlanBook, enforcer: Enforcer) -> PlanBook | None:
        if self.slot.ready:
            taken = self.slot.take()
            if taken is not None:
                self._held = self.prepare(taken, plans)
                self._reported = False
        held = self._held
        has = int(held is not None)
        failed = int(held is not None and held.error is not None)
        digest = held.digest if held is not None else 0
        device = torch.device("cpu")
        if "nccl" in str(dist.get_backend(self._collective.group)):
            device = torch.device("cuda", torch.cuda.current_device())
        votes = torch.tensor([has, -has, failed, digest, -digest], dtype=torch.int64, device=device)
        any_held, none_missing, any_failed, high, low = self._collective.max_(votes).tolist()
        if not any_held or none_missing != -1:
            return None  # nobody has a new file, or some rank has not read it yet
        assert held is not None
        if high != -low:  # the ranks read different versions: wait until the late ones read the newest
            if not self._reported and time.monotonic() - held.read_at > max(10 * self._interval, 30.0):
                self._reported = True
                self._failed(held.path, "the ranks read different contents of the policy file", enforcer.step)
            return None
        if any_failed:
            if not self._reported:
                self._reported = True
                self._failed(held.path, held.error or "another rank could not load or bind it", enforcer.step)
            return None
        self._held = None
        return self._switch(held, plans, enforcer)

    def _failed(self, path: str, error: str, step: int) -> None:
        self._events.emit("warning", "policy_reload_failed", step=step, policy=path, error=error)

    def _switch(self, candidate: Candidate, plans: PlanBook, enforcer: Enforcer) -> PlanBook | None:
        """Put the candidate in force, carrying over what the unchanged rules have learnt."""
        new = candidate.plans
        assert new is not None
        assert candidate.policy is not None
        old_policy = plans.policy
        if candidate.policy == old_policy and candidate.path == self.path:
            return None  # the file was touched, not changed
        added, removed, changed = rule_changes(old_policy, candidate.policy)
        unchanged = {rule.name for rule in candidate.policy.rules} - set(added) - set(changed)
        carry_over(enforcer, plans, new, unchanged)
        if candidate.path != self.path:
            self.path = candidate.path
            if self._watch:
                self.remove()
                self._watcher = PolicyWatcher(candidate.path, self._interval, self.slot)
        self._events.emit(
            "info",
            "policy_reload",
            step=enforcer.step,
            policy=candidate.path,
            added=added,
            removed=removed,
            changed=changed,
            params=len(new.binding.params),
            rules={bound.name: len(bound.params) for bound in new.binding.rules},
        )
        return new


def carry_over(enforcer: Enforcer, old: PlanBook, new: PlanBook, unchanged: set[str]) -> None:
    """Switch ``enforcer`` to ``new``'s binding; skip histories and health flags of unchanged rules stay."""
    old_rules, new_rules = old.policy.rules, new.policy.rules
    new_index = {rule.name: index for index, rule in enumerate(new_rules)}
    limits = enforcer.skip_limits
    limits.history = {
        new_index[old_rules[index].name]: history
        for index, history in limits.history.items()
        if old_rules[index].name in unchanged
    }
    enforcer.health.keep_rules(unchanged)
    # Tensor indices differ between bindings: what was treated this step stays treated, by name.
    by_name = {entry.name: entry.index for entry in new.binding.params}
    keep = {entry.index: by_name[entry.name] for entry in old.binding.params if entry.name in by_name}
    enforcer.rebind(new.binding, keep)
