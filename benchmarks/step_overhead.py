"""What gradguard costs per training step, side by side with the usual ways of treating gradients.

    python benchmarks/step_overhead.py                 # CPU, about 5 minutes; prints Markdown tables
    python benchmarks/step_overhead.py --quick         # tiny models, a few seconds (the smoke test runs this)
    python benchmarks/step_overhead.py --device cuda   # the same on a GPU
    python benchmarks/step_overhead.py --json out.json # also keep every measurement

Every row is a full training step (zero_grad, forward, backward, the treatment, AdamW step) of one
model that all treatments share, so they see the same weights, data and allocator:

- ``none``: no treatment;
- ``global``: ``clip_grad_norm_(params, 1.0, foreach=True)``;
- ``loop``: ``clip_grad_norm_([p], 1.0)`` for every parameter, in a Python loop;
- ``item-hook``: a tensor hook per parameter that reads its norm with ``.item()`` and clips (the
  tutorial approach; one host sync per parameter, inside backward);
- ``anomaly``: ``torch.autograd.set_detect_anomaly(True)``;
- ``gg-a``: gradguard, per-tensor ``clip_norm`` (1.0) on every parameter plus ``halt_on_nonfinite``
  (``policies/default.yaml``); ``gg-a0`` the same with a ``max_norm`` nothing reaches;
- ``gg-b``: gradguard, a mixed policy of five rules (halt; embeddings clip 0.5; attention weights
  clip 1.0; norm layers ``clip_value`` 0.1; a group clip 1.0 over everything);
- ``gg-agc``: gradguard, ``agc`` (adaptive gradient clipping, defaults) on every parameter plus
  ``halt_on_nonfinite``: the same shape of policy as ``gg-a``, compared with it;
- ``gg-c0`` / ``gg-c``: ``gg-a0`` / ``gg-a`` with the audit log on; ``gg-c-caller`` (deep model): as
  ``gg-c`` with the log lines rendered on the training thread instead of the writer thread;
- adaptive actions on every parameter, each against ``gg-a`` (paired, update-phase estimate):
  ``gg-zclip`` (``zclip`` with its defaults, per tensor, plus ``halt_on_nonfinite``: ``gg-a`` with
  ``zclip`` in place of ``clip_norm``), ``gg-autoclip`` (the same with ``autoclip``), ``gg-spike``
  (``gg-a`` plus ``skip_step_on_spike`` with its defaults, the joint norm: the pair isolates the spike
  watch). Each runs ``PRIME_STEPS`` untimed steps after it attaches, so that zclip's warm-up (25 norms)
  is over and the timed steps are those of a long run.
- recovery, against ``gg-a`` (paired, update-phase estimate): ``gg-r`` is ``gg-a`` with
  ``recovery: {snapshot_every: 100}`` (every other key its default: ``keep: 2``), ``gg-r1`` the same
  with ``snapshot_every: 1`` (a snapshot at every step: what one snapshot costs), and ``gg-a-2`` is
  ``gg-a`` again, the A/A control of the pair. A snapshot is a step in 100, which a median leaves out:
  the cost of ``gg-r`` over a long run is the estimate of its steps without one plus a hundredth of
  the extra of a snapshot step (``gg-r1`` over ``gg-r``), and, where the rounds reach a snapshot, the
  mean of the paired differences (snapshot steps included) is given as well. The bytes the snapshots
  hold are ``guard.metrics()``'s ``gradguard/recovery/snapshot_bytes``, against the model's parameters,
  buffers and AdamW state.

How it measures:

- Rounds: each round runs every treatment once, in a shuffled order, as one segment (attach, one
  warm-up step, then ``steps`` timed steps, detach); a segment's time is the median of its steps. A
  treatment's ratio against a reference is the median over rounds of the ratio of the two segments of
  the same round (paired, so machine noise that hits a round hits both); ``[p25-p75]`` shows the spread.
- Host syncs per step (one profiled step per treatment, ``torch.profiler``): ``aten::_local_scalar_dense``
  events (``.item()``, ``bool(t)``, ...) plus calls of ``Tensor.tolist()``, which read device values
  without that event (gradguard's one read is a ``tolist``). ``bwd`` counts those inside
  ``loss.backward()``. Extra = the treatment's count minus ``none``'s (AdamW reads its CPU step counters).
- Memory: the peak of tensor bytes allocated during one step above the level at its start, from the
  profiler's allocation events on CPU (``profile_memory=True``; exact, not RSS), or
  ``torch.cuda.max_memory_allocated`` on CUDA. Reported against ``none``.
- Sweep: chains of ``Linear(16, 16)`` with 10 to 2,000 parameter tensors; a treatment's cost at a size is
  the median over rounds of (its segment - ``none``'s segment); the per-tensor cost is the least-squares
  slope of that cost over the number of tensors.

On CPU the suite runs torch on one thread (``--threads``): on a small machine shared with other jobs,
two OpenMP threads stall each other and step times swing several-fold.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional

import gradguard.enforce.hooks.torch_hooks as torch_hooks
import gradguard.events.log
from gradguard import GradGuard, Policy

ROOT = Path(__file__).resolve().parent.parent
MAX_NORM = 1.0
NEVER = 1e12  # a max_norm no gradient reaches: nothing is clipped
PRIME_STEPS = 30  # untimed steps of an adaptive guard before the rounds: past zclip's 25-step warm-up
RECOVERY_EVERY = 100  # gg-r's snapshot_every

# --- models ---------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        qkv = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        out = functional.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        projected: torch.Tensor = self.proj(out.transpose(1, 2).reshape(batch, length, width))
        return projected


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        mixed: torch.Tensor = self.mlp(self.norm2(x))
        return x + mixed


class Decoder(nn.Module):
    """GPT-style: token and position embeddings, pre-norm blocks, an untied head; 12 tensors a block."""

    def __init__(self, vocab: int, width: int, depth: int, heads: int, context: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, width)
        self.pos_embed = nn.Parameter(torch.randn(context, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos_embed[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


class Chain(nn.Module):
    """``links`` layers of ``Linear(width, width)`` and tanh: 2 tensors a link, almost no arithmetic."""

    def __init__(self, links: int, width: int = 16) -> None:
        super().__init__()
        self.links = nn.ModuleList(nn.Linear(width, width) for _ in range(links))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for link in self.links:
            x = torch.tanh(link(x))
        return x


@dataclass
class Workload:
    """A model, its AdamW optimizer, and a fresh batch for every step."""

    name: str
    model: nn.Module
    loss: Callable[[], torch.Tensor]
    device: torch.device
    description: str
    opt: torch.optim.Optimizer = field(init=False)

    def __post_init__(self) -> None:
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)

    @property
    def params(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def decoder_workload(
    name: str, device: torch.device, *, vocab: int, width: int, depth: int, heads: int, batch: int, length: int
) -> Workload:
    torch.manual_seed(0)
    model = Decoder(vocab, width, depth, heads, length).to(device)
    generator = torch.Generator(device=device).manual_seed(0)

    def loss() -> torch.Tensor:
        tokens = torch.randint(0, vocab, (batch, length + 1), generator=generator, device=device)
        logits = model(tokens[:, :-1])
        return functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))

    count = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    description = (
        f"{depth} layers, width {width}, vocab {vocab}, {count / 1e6:.1f}M parameters in {tensors} tensors, "
        f"batch {batch}x{length} tokens"
    )
    return Workload(name, model, loss, device, description)


def chain_workload(links: int, device: torch.device, batch: int = 8) -> Workload:
    torch.manual_seed(0)
    model = Chain(links).to(device)
    generator = torch.Generator(device=device).manual_seed(0)

    def loss() -> torch.Tensor:
        x = torch.randn(batch, 16, generator=generator, device=device)
        out: torch.Tensor = model(x)
        return out.square().mean()

    return Workload(f"chain-{2 * links}", model, loss, device, f"{links} x Linear(16, 16), {2 * links} tensors")


# --- treatments -------------------------------------------------------------------------------------


def per_tensor_policy(max_norm: float) -> Policy:
    """``policies/default.yaml``, with its ``max_norm`` as given."""
    return Policy.from_dict(
        {
            "version": 1,
            "rules": [
                {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
                {"name": "per-tensor-clip", "match": "*", "actions": [{"action": "clip_norm", "max_norm": max_norm}]},
            ],
        },
        source=f"default.yaml (max_norm {max_norm:g})",
    )


def agc_policy() -> Policy:
    """``policies/default.yaml`` with ``agc`` (timm's defaults) in place of the per-tensor ``clip_norm``."""
    return Policy.from_dict(
        {
            "version": 1,
            "rules": [
                {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
                {"name": "agc", "match": "*", "actions": [{"action": "agc"}]},
            ],
        },
        source="default.yaml with agc",
    )


def monitored_policy(every: int) -> Policy:
    """``per_tensor_policy(NEVER)`` plus a ``monitor`` of the norm of every tensor, every ``every`` steps."""
    data = per_tensor_policy(NEVER).model_dump(mode="python")
    monitor = {"name": "health", "match": "*", "actions": [{"action": "monitor", "every": every}]}
    data["rules"] = [*data["rules"], monitor]
    return Policy.from_dict(data, source=f"default.yaml + monitor every {every}")


def recovery_policy(every: int) -> Policy:
    """``per_tensor_policy(MAX_NORM)`` with ``recovery: {snapshot_every: every}`` (its other keys: defaults)."""
    data = per_tensor_policy(MAX_NORM).model_dump(mode="python")
    data["recovery"] = {"snapshot_every": every}
    return Policy.from_dict(data, source=f"default.yaml + recovery every {every}")


def adaptive_policy(action: dict[str, Any], *, with_clip: bool = False) -> Policy:
    """``halt_on_nonfinite`` and ``action`` on every parameter (after ``clip_norm`` 1.0 per tensor if ``with_clip``)."""
    actions = [{"action": "clip_norm", "max_norm": MAX_NORM}] if with_clip else []
    return Policy.from_dict(
        {
            "version": 1,
            "rules": [
                {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
                {"name": "adaptive", "match": "*", "actions": [*actions, action]},
            ],
        },
        source=f"default.yaml with {action['action']}{' after clip_norm' if with_clip else ''}",
    )


MIXED_POLICY: dict[str, Any] = {
    "version": 1,
    "rules": [
        {"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]},
        {"name": "embeddings", "match": ["*embed*"], "actions": [{"action": "clip_norm", "max_norm": 0.5}]},
        {
            "name": "attention",
            "match": [r"re:blocks\.\d+\.attn\..*"],
            "exclude": ["*.bias"],
            "actions": [{"action": "clip_norm", "max_norm": 1.0}],
        },
        {"name": "norms", "match": ["*norm*"], "actions": [{"action": "clip_value", "limit": 0.1}]},
        {"name": "global", "match": "*", "actions": [{"action": "clip_norm", "max_norm": 1.0, "scope": "group"}]},
    ],
}


class Treatment:
    """One way of treating the gradients; ``treat`` runs between backward and the optimizer step."""

    name = ""
    label = ""
    update_only = True
    """Whether all its work happens in the update phase (after backward): then its cost can be read
    from the update phase alone, which is far less noisy than the whole step."""

    def setup(self, work: Workload, scratch: Path) -> None:
        del work, scratch

    def before_step(self) -> None:
        pass

    def treat(self, work: Workload) -> None:
        del work

    def after_step(self) -> None:
        pass

    def teardown(self, work: Workload) -> None:
        del work

    def note(self) -> str:
        return ""


class NoTreatment(Treatment):
    name, label = "none", "no treatment"


class GlobalClip(Treatment):
    name, label = "global", "`clip_grad_norm_(foreach=True)`, global"

    def treat(self, work: Workload) -> None:
        torch.nn.utils.clip_grad_norm_(work.params, MAX_NORM, foreach=True)


class LoopClip(Treatment):
    name, label = "loop", "`clip_grad_norm_([p])` per parameter, Python loop"

    def treat(self, work: Workload) -> None:
        for param in work.params:
            if param.grad is not None:
                torch.nn.utils.clip_grad_norm_([param], MAX_NORM)


class ItemHook(Treatment):
    name, label = "item-hook", "tensor hook per parameter with `.item()`"
    update_only = False

    def __init__(self) -> None:
        self.handles: list[torch.utils.hooks.RemovableHandle] = []

    def setup(self, work: Workload, scratch: Path) -> None:
        def clip(grad: torch.Tensor) -> torch.Tensor:
            norm = grad.norm().item()  # one host sync per parameter, inside backward
            if not math.isfinite(norm):
                raise FloatingPointError("non-finite gradient")
            return grad * (MAX_NORM / (norm + 1e-6)) if norm > MAX_NORM else grad

        self.handles = [param.register_hook(clip) for param in work.params]  # type: ignore[no-untyped-call]

    def teardown(self, work: Workload) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class Anomaly(Treatment):
    name, label = "anomaly", "`set_detect_anomaly(True)`"
    update_only = False

    def before_step(self) -> None:
        torch.autograd.set_detect_anomaly(True)

    def after_step(self) -> None:
        torch.autograd.set_detect_anomaly(False)


class Guarded(Treatment):
    """gradguard on this treatment's model copy; it acts inside ``opt.step()``, so ``treat`` does nothing.

    Every guard is reached from gradguard's process-wide optimizer hook (and, while any guard is attached,
    from torch's clip functions) and checks in a few microseconds per tensor whether a step or a clip is
    its own. So that the guards of other rows cost the steps of a row nothing, a guard is enlisted there
    only during its own row's steps (and torch's clips are unwrapped during the other rows).
    """

    def __init__(
        self,
        name: str,
        label: str,
        policy: Callable[[], Policy],
        *,
        audit_log: bool = False,
        render_on_writer: bool = True,
        guard_options: dict[str, Any] | None = None,
        prime: int = 0,
    ) -> None:
        self.name, self.label = name, label
        self.guard_options = guard_options or {}
        self.policy = policy
        self.audit_log = audit_log
        self.render_on_writer = render_on_writer
        self.prime = prime
        """Untimed steps run right after attaching (adaptive actions: past their warm-up)."""
        self.guard: GradGuard | None = None
        self.enlisted: Any = None

    def setup(self, work: Workload, scratch: Path) -> None:
        log = scratch / f"{work.name}-{self.name}.jsonl" if self.audit_log else None
        saved = gradguard.events.log.RENDER_ON_WRITER
        gradguard.events.log.RENDER_ON_WRITER = self.render_on_writer
        try:
            self.guard = GradGuard(work.model, self.policy(), audit_log=log, logger=None, **self.guard_options)
        finally:
            gradguard.events.log.RENDER_ON_WRITER = saved
        self.enlisted = next(h for h in self.guard._attachment.handles if isinstance(h, torch_hooks.Enlisted))
        for _ in range(self.prime):
            train_step(work, self)  # before_step/after_step enlist and delist it around each
        self.after_step()

    def before_step(self) -> None:
        assert self.guard is not None
        if self.enlisted is None:
            self.enlisted = torch_hooks.enlist(self.guard)

    def after_step(self) -> None:
        if self.enlisted is not None:
            self.enlisted.remove()
            self.enlisted = None

    def teardown(self, work: Workload) -> None:
        assert self.guard is not None
        self.before_step()
        self.guard.remove()
        self.after_step()
        counters = self.guard.counters
        kinds = ("clip_norm", "clip_value", "agc", "zclip", "autoclip")
        self._clips = sum(counters.total(kind) for kind in kinds)
        self._skips = counters.total("skip_step_on_spike")
        self._steps = self.guard.step_count
        self.recovery = {
            key.rsplit("/", 1)[1]: value
            for key, value in self.guard.metrics().items()
            if key.startswith("gradguard/recovery/")
        }
        self._lines = 0
        log = self.guard.audit_log
        if log is not None:
            with log.open("rb") as lines:
                self._lines = sum(1 for _ in lines)

    def note(self) -> str:
        steps = max(getattr(self, "_steps", 0), 1)
        text = f"{getattr(self, '_clips', 0) / steps:.0f} clips/step"
        if getattr(self, "_skips", 0):
            text += f", {self._skips} spike skips"
        recovery = getattr(self, "recovery", {})
        if recovery.get("snapshots"):
            each = recovery["snapshot_bytes"] / recovery["snapshots"] / 2**20
            text += f", {recovery['snapshots']:.0f} snapshot(s) held, {each:.1f} MiB each"
        if self.audit_log:
            text += f", {getattr(self, '_lines', 0) / steps:.2f} log lines/step"
        return text


class GuardedLoopClip(Guarded):
    """A guard in a loop that clips globally itself (nanoGPT's ``clip_grad_norm_(params, 1.0)`` before the step)."""

    def treat(self, work: Workload) -> None:
        torch.nn.utils.clip_grad_norm_(work.params, MAX_NORM, foreach=True)


class SecondCopy(NoTreatment):
    """No treatment either, on another copy of the model: the A/A control, the measurement's floor."""

    name, label = "none-2", "no treatment, again (A/A control)"


def decoder_treatments(with_caller_render: bool) -> list[Treatment]:
    treatments: list[Treatment] = [
        NoTreatment(),
        SecondCopy(),
        GlobalClip(),
        LoopClip(),
        ItemHook(),
        Anomaly(),
        Guarded("gg-a", "gradguard (a) per-tensor clip 1.0 + halt", lambda: per_tensor_policy(MAX_NORM)),
        Guarded("gg-a0", "gradguard (a), nothing clipped", lambda: per_tensor_policy(NEVER)),
        Guarded(
            "gg-a-np",
            "(a) with provenance=None (no gradient flags)",
            lambda: per_tensor_policy(MAX_NORM),
            guard_options={"provenance": None},
        ),
        GuardedLoopClip(
            "gg-a0-lc",
            "(a), nothing clipped, + the loop's global clip (the guard acts before it)",
            lambda: per_tensor_policy(NEVER),
        ),
        GuardedLoopClip(
            "gg-a0-lc-off",
            "the same, before_clip=False (the guard acts at step(): the A/A of acting before the clip)",
            lambda: per_tensor_policy(NEVER),
            guard_options={"before_clip": False},
        ),
        Guarded("gg-b", "gradguard (b) mixed policy, 5 rules", lambda: Policy.from_dict(MIXED_POLICY, source="mixed")),
        Guarded("gg-agc", "gradguard agc (clipping 0.01) + halt", agc_policy),
        Guarded("gg-m", "(a), nothing clipped, + monitor norm per tensor, every step", lambda: monitored_policy(1)),
        Guarded("gg-m10", "(a), nothing clipped, + monitor norm per tensor, every: 10", lambda: monitored_policy(10)),
        Guarded(
            "gg-ml",
            "(a) + monitor every step + audit log (a stats line per step)",
            lambda: monitored_policy(1),
            audit_log=True,
        ),
        Guarded(
            "gg-c0",
            "gradguard (c) = (a) + audit log, nothing clipped",
            lambda: per_tensor_policy(NEVER),
            audit_log=True,
        ),
        Guarded("gg-c", "gradguard (c) = (a) + audit log", lambda: per_tensor_policy(MAX_NORM), audit_log=True),
        Guarded(
            "gg-zclip",
            "`zclip` (defaults) per tensor + halt",
            lambda: adaptive_policy({"action": "zclip"}),
            prime=PRIME_STEPS,
        ),
        Guarded(
            "gg-autoclip",
            "`autoclip` (defaults) per tensor + halt",
            lambda: adaptive_policy({"action": "autoclip"}),
            prime=PRIME_STEPS,
        ),
        Guarded(
            "gg-spike",
            "(a) + `skip_step_on_spike` (defaults, group)",
            lambda: adaptive_policy({"action": "skip_step_on_spike"}, with_clip=True),
            prime=PRIME_STEPS,
        ),
    ]
    treatments += [
        Guarded(
            "gg-a-2", "gradguard (a) again (A/A control of the recovery rows)", lambda: per_tensor_policy(MAX_NORM)
        ),
        Guarded("gg-r", "(a) + `recovery: {snapshot_every: 100}`", lambda: recovery_policy(RECOVERY_EVERY)),
        Guarded("gg-r1", "(a) + `recovery: {snapshot_every: 1}` (a snapshot every step)", lambda: recovery_policy(1)),
    ]
    if with_caller_render:
        treatments.append(
            Guarded(
                "gg-c-caller",
                "(c), log lines rendered on the training thread",
                lambda: per_tensor_policy(MAX_NORM),
                audit_log=True,
                render_on_writer=False,
            )
        )
    return treatments


# --- measuring ---------------------------------------------------------------------------------------


@dataclass
class StepTime:
    wall: float
    """Seconds for the whole step: zero_grad, forward, backward, treatment, optimizer step."""
    cpu: float
    """CPU seconds of the process over the step (all its threads: the audit log writer's too)."""
    update: float
    """Seconds for the treatment and the optimizer step alone (gradguard works inside the latter)."""


def train_step(work: Workload, treatment: Treatment) -> StepTime:
    treatment.before_step()
    try:
        work.sync()
        wall, cpu = time.perf_counter(), time.process_time()
        work.opt.zero_grad(set_to_none=True)
        work.loss().backward()  # type: ignore[no-untyped-call]
        update = time.perf_counter()
        treatment.treat(work)
        work.opt.step()
        work.sync()
        end = time.perf_counter()
        return StepTime(end - wall, time.process_time() - cpu, end - update)
    finally:
        treatment.after_step()


def share_memory(works: Sequence[Workload]) -> None:
    """Let every copy of a model use the first copy's parameter and AdamW state tensors.

    Each row has its own copy of the model (its own parameter objects, so each can carry its own
    hooks or guard), but they all read and write the same memory: otherwise each copy's placement in
    memory (huge pages, alignment) makes some copies several percent faster than others in the
    memory-bound optimizer step, whatever the treatment.
    """
    master = works[0]
    for work in works[1:]:
        for param, shared in zip(work.params, master.params, strict=True):
            param.data = shared.data
    if any(param not in master.opt.state for param in master.params):
        train_step(master, NoTreatment())  # AdamW creates its state on its first step
    for work in works[1:]:
        for param, shared in zip(work.params, master.params, strict=True):
            work.opt.state[param] = master.opt.state[shared]


@contextlib.contextmanager
def set_up(works: Sequence[Workload], treatments: Sequence[Treatment], scratch: Path) -> Iterator[None]:
    done: list[tuple[Treatment, Workload]] = []
    try:
        for work, treatment in zip(works, treatments, strict=True):
            treatment.setup(work, scratch)
            done.append((treatment, work))
        yield
    finally:
        for treatment, work in reversed(done):
            treatment.teardown(work)


def interleaved(
    works: Sequence[Workload], treatments: Sequence[Treatment], rounds: int, warmup: int, seed: int, what: str
) -> list[list[StepTime]]:
    """``rounds`` rounds of one step of every (workload, treatment), in a new shuffled order each round."""
    times: list[list[StepTime]] = [[] for _ in treatments]
    order = list(range(len(treatments)))
    shuffle = random.Random(seed)
    for index in range(warmup + rounds):
        shuffle.shuffle(order)
        gc.collect()
        for k in order:
            step = train_step(works[k], treatments[k])
            if index >= warmup:
                times[k].append(step)
        if index >= warmup and (index - warmup + 1) % 10 == 0:
            print(f"  {what}: {index - warmup + 1}/{rounds} rounds", file=sys.stderr, flush=True)
    return times


@dataclass
class Probe:
    syncs: int
    backward_syncs: int
    peak_bytes: int
    update_bytes: int


@contextlib.contextmanager
def counting_tolist(phase: list[str], counts: dict[str, int]) -> Iterator[None]:
    """Count ``Tensor.tolist()`` calls by phase: a read of device values the profiler does not name."""
    original = torch.Tensor.tolist

    def tolist(self: torch.Tensor) -> list[Any]:
        counts[phase[0]] = counts.get(phase[0], 0) + 1
        return original(self)

    torch.Tensor.tolist = tolist  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.tolist = original  # type: ignore[method-assign]


def probe(work: Workload, treatment: Treatment) -> Probe:
    """Host syncs (all, and inside backward) and memory of one profiled step.

    Two steps run under the profiler and the second is measured: the profiler knows the size of a
    tensor only if it was allocated while profiling, so the first step makes everything the second
    one frees (the previous gradients, activations) known to it.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if work.device.type == "cuda" else [])
    phase, reads = ["outside"], dict[str, int]()
    with profile(activities=activities, profile_memory=True) as prof, counting_tolist(phase, reads):
        train_step(work, treatment)
        treatment.before_step()
        try:
            with record_function("bench::step"):
                phase[0] = "step"
                work.opt.zero_grad(set_to_none=True)
                loss = work.loss()
                with record_function("bench::backward"):
                    phase[0] = "backward"
                    loss.backward()  # type: ignore[no-untyped-call]
                    phase[0] = "step"
                with record_function("bench::update"):
                    treatment.treat(work)
                    work.opt.step()
                del loss
                work.sync()
        finally:
            treatment.after_step()
            phase[0] = "outside"
    events = prof.profiler.kineto_results.events()
    step, backward, update = (_window(events, f"bench::{name}") for name in ("step", "backward", "update"))
    scalars = [e.start_ns() for e in events if e.name() == "aten::_local_scalar_dense"]
    peak = _peak_allocated(events, step)
    update_bytes = sum(
        e.nbytes()
        for e in events
        if e.name() == "[memory]" and e.nbytes() > 0 and update[0] <= e.start_ns() <= update[1]
    )
    if work.device.type == "cuda":
        work.opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(work.device)
        start = torch.cuda.memory_allocated(work.device)
        torch.cuda.reset_peak_memory_stats(work.device)
        train_step(work, treatment)
        peak = torch.cuda.max_memory_allocated(work.device) - start
    return Probe(
        syncs=sum(1 for t in scalars if step[0] <= t <= step[1]) + reads.get("step", 0) + reads.get("backward", 0),
        backward_syncs=sum(1 for t in scalars if backward[0] <= t <= backward[1]) + reads.get("backward", 0),
        peak_bytes=peak,
        update_bytes=update_bytes,
    )


def _window(events: Sequence[Any], name: str) -> tuple[int, int]:
    """The host-side span of a ``record_function`` range (with CUDA, the GPU has one of that name too)."""
    host = torch._C._autograd.DeviceType.CPU
    found = next(e for e in events if e.name() == name and e.device_type() == host)
    return found.start_ns(), found.end_ns()


def _peak_allocated(events: Sequence[Any], window: tuple[int, int]) -> int:
    """The most tensor bytes live at once during ``window``, above the level at its start."""
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    level = 0
    start_level: int | None = None
    peak = 0
    for time_ns, nbytes in memory:
        if time_ns > window[1]:
            break
        if time_ns >= window[0] and start_level is None:
            start_level = peak = level
        level += nbytes
        if start_level is not None:
            peak = max(peak, level)
    return peak - (start_level if start_level is not None else level)


@dataclass
class Ratio:
    median: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.median:.3f} [{self.low:.3f}-{self.high:.3f}]"


def paired(values: Sequence[float], reference: Sequence[float]) -> Ratio:
    ratios = sorted(a / b for a, b in zip(values, reference, strict=True))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return Ratio(statistics.median(ratios), quartiles[0], quartiles[2])


@dataclass
class ModelResult:
    workload: str
    description: str
    rounds: int
    rows: list[dict[str, Any]]
    comparisons: dict[str, dict[str, Any]]
    state_bytes: dict[str, int] = field(default_factory=dict)
    """The model's parameters, buffers and AdamW state, in bytes (what a snapshot copies)."""


def run_model(
    make: Callable[[], Workload], treatments: list[Treatment], rounds: int, scratch: Path, seed: int, warmup: int = 2
) -> ModelResult:
    works = [make() for _ in treatments]
    share_memory(works)
    names = [t.name for t in treatments]
    with set_up(works, treatments, scratch):
        times = interleaved(works, treatments, rounds, warmup, seed, works[0].name)
        probes = [probe(work, t) for work, t in zip(works, treatments, strict=True)]
    wall = {name: [s.wall for s in steps] for name, steps in zip(names, times, strict=True)}
    cpu = {name: [s.cpu for s in steps] for name, steps in zip(names, times, strict=True)}
    update = {name: [s.update for s in steps] for name, steps in zip(names, times, strict=True)}
    base = probes[names.index("none")]

    def estimate(name: str, reference: str) -> float | None:
        """1 + (median paired extra update-phase time) / (median step time of the reference)."""
        if not treatments[names.index(name)].update_only:
            return None
        extra = statistics.median(a - b for a, b in zip(update[name], update[reference], strict=True))
        return 1.0 + extra / statistics.median(wall[reference])

    rows = []
    for t, p in zip(treatments, probes, strict=True):
        rows.append(
            {
                "name": t.name,
                "label": t.label,
                "median_ms": statistics.median(wall[t.name]) * 1e3,
                "vs_global": paired(wall[t.name], wall["global"]),
                "vs_none": paired(wall[t.name], wall["none"]),
                "cpu_vs_global": paired(cpu[t.name], cpu["global"]),
                "cpu_vs_none": paired(cpu[t.name], cpu["none"]),
                "update_ms": statistics.median(update[t.name]) * 1e3,
                "est_vs_global": estimate(t.name, "global"),
                "est_vs_none": estimate(t.name, "none"),
                "syncs": p.syncs,
                "extra_syncs": p.syncs - base.syncs,
                "backward_syncs": p.backward_syncs,
                "peak_bytes": p.peak_bytes,
                "extra_peak_bytes": p.peak_bytes - base.peak_bytes,
                "extra_peak_pct": 100.0 * (p.peak_bytes - base.peak_bytes) / max(base.peak_bytes, 1),
                "update_bytes": p.update_bytes,
                "extra_update_bytes": p.update_bytes - base.update_bytes,
                "note": t.note(),
                "snapshots": getattr(t, "recovery", {}).get("snapshots", 0.0),
                "snapshot_bytes": getattr(t, "recovery", {}).get("snapshot_bytes", 0.0),
                "wall": wall[t.name],
                "cpu": cpu[t.name],
            }
        )
    comparisons: dict[str, dict[str, Any]] = {}
    pairs = (
        ("gg-c0", "gg-a0"),
        ("gg-c", "gg-a"),
        ("gg-c-caller", "gg-c"),
        ("gg-m", "gg-a0"),
        ("gg-m10", "gg-a0"),
        ("gg-ml", "gg-m"),
        ("gg-agc", "gg-a"),
        ("gg-a", "gg-a-np"),
        ("gg-a0-lc", "gg-a0-lc-off"),
        ("gg-zclip", "gg-a"),
        ("gg-autoclip", "gg-a"),
        ("gg-spike", "gg-a"),
        ("gg-a-2", "gg-a"),
        ("gg-r", "gg-a"),
        ("gg-r1", "gg-a"),
    )
    for a, b in pairs:
        if a in wall and b in wall:
            extra = statistics.median(x - y for x, y in zip(update[a], update[b], strict=True))
            mean_extra = statistics.fmean(x - y for x, y in zip(update[a], update[b], strict=True))
            comparisons[f"{a} / {b}"] = {
                "wall": paired(wall[a], wall[b]),
                "cpu": paired(cpu[a], cpu[b]),
                "update": 1.0 + extra / statistics.median(wall[b]),
                "update_mean": 1.0 + mean_extra / statistics.median(wall[b]),
            }
    if "gg-r / gg-a" in comparisons and "gg-r1 / gg-a" in comparisons:
        every = comparisons["gg-r / gg-a"]["update"]
        snapshot = comparisons["gg-r1 / gg-a"]["update"] - every
        comparisons["gg-r / gg-a"]["amortized"] = every + snapshot / RECOVERY_EVERY
        comparisons["gg-r / gg-a"]["snapshot_ms"] = snapshot * statistics.median(wall["gg-a"]) * 1e3
        timed = range(warmup, warmup + rounds)  # the guard's step indices of the timed rounds
        comparisons["gg-r / gg-a"]["snapshot_steps"] = sum(1 for step in timed if step % RECOVERY_EVERY == 0)
    state = state_bytes(works[0])
    return ModelResult(works[0].name, works[0].description, rounds, rows, comparisons, state)


def state_bytes(work: Workload) -> dict[str, int]:
    """What a snapshot must copy: the model's parameters and buffers, and its optimizer's state tensors."""
    params = sum(p.numel() * p.element_size() for p in work.model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in work.model.buffers())
    optimizer = sum(
        value.numel() * value.element_size()
        for per_param in work.opt.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    )
    return {"params": params, "buffers": buffers, "optimizer": optimizer}


@dataclass
class SweepResult:
    sizes: list[int]
    rounds: int
    none_ms: list[float]
    cost_us: dict[str, list[float]]
    """Treatment -> median extra time of the update phase (treatment + AdamW step) per size, in us."""
    step_cost_us: dict[str, list[float]]
    """The same for the whole step."""
    slope_us: dict[str, float]
    r_squared: dict[str, float]
    step_slope_us: dict[str, float]


def run_sweep(links: list[int], device: torch.device, rounds: int, scratch: Path, seed: int) -> SweepResult:
    kinds: list[Callable[[], Treatment]] = [
        NoTreatment,
        GlobalClip,
        lambda: Guarded("gg-a", "gradguard (a)", lambda: per_tensor_policy(MAX_NORM)),
    ]
    pairs = [(chain_workload(n, device), kind()) for n in links for kind in kinds]
    works = [work for work, _ in pairs]
    treatments = [treatment for _, treatment in pairs]
    for start in range(0, len(works), len(kinds)):
        share_memory(works[start : start + len(kinds)])
    with set_up(works, treatments, scratch):
        times = interleaved(works, treatments, rounds, 2, seed, "sweep")
    by_key = {(w.name, t.name): steps for w, t, steps in zip(works, treatments, times, strict=True)}
    names = [w.name for w in works[:: len(kinds)]]
    sizes = [len(w.params) for w in works[:: len(kinds)]]
    none_ms = [statistics.median(s.wall for s in by_key[(n, "none")]) * 1e3 for n in names]

    def cost(treatment: str, part: Callable[[StepTime], float]) -> list[float]:
        return [
            statistics.median(
                part(a) - part(b) for a, b in zip(by_key[(n, treatment)], by_key[(n, "none")], strict=True)
            )
            * 1e6
            for n in names
        ]

    cost_us = {t: cost(t, lambda s: s.update) for t in ("global", "gg-a")}
    step_cost_us = {t: cost(t, lambda s: s.wall) for t in ("global", "gg-a")}
    fits = {t: _least_squares(sizes, cost_us[t]) for t in cost_us}
    step_fits = {t: _least_squares(sizes, step_cost_us[t]) for t in step_cost_us}
    return SweepResult(
        sizes,
        rounds,
        none_ms,
        cost_us,
        step_cost_us,
        {t: fit[0] for t, fit in fits.items()},
        {t: fit[1] for t, fit in fits.items()},
        {t: fit[0] for t, fit in step_fits.items()},
    )


def _least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Slope of the line through the points, and its R^2."""
    if len(xs) < 2:
        return (ys[0] / xs[0] if xs and xs[0] else 0.0), 1.0
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    intercept = mean_y - slope * mean_x
    total = sum((y - mean_y) ** 2 for y in ys)
    residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return slope, (1.0 - residual / total) if total else 1.0


# --- report ------------------------------------------------------------------------------------------


def _estimate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def model_table(result: ModelResult) -> str:
    lines = [
        f"**{result.workload}**: {result.description}; {result.rounds} rounds.",
        "",
        "| treatment | step ms | update ms | vs global: step | vs global: update est. | vs none: step "
        "| vs none: update est. | syncs/step: extra (in bwd) | memory vs none: step peak; allocated in update "
        "| note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in result.rows:
        memory = (
            f"{row['extra_peak_bytes'] / 2**20:+.2f} MiB ({row['extra_peak_pct']:+.2f}%); "
            f"{row['extra_update_bytes'] / 2**10:+.0f} KiB"
        )
        lines.append(
            f"| {row['label']} | {row['median_ms']:.1f} | {row['update_ms']:.1f} | {row['vs_global']} | "
            f"{_estimate(row['est_vs_global'])} | {row['vs_none']} | {_estimate(row['est_vs_none'])} | "
            f"{row['extra_syncs']} ({row['backward_syncs']}) | {memory} | {row['note']} |"
        )
    for name, ratios in result.comparisons.items():
        lines.append(
            f"\n`{name}` (paired): step {ratios['wall']}; update est. {ratios['update']:.4f}; "
            f"process CPU time (includes the log writer thread) {ratios['cpu']}"
        )
        if name.startswith(("gg-r", "gg-a-2")):
            lines[-1] += f"; update est. from the mean difference (every step counts) {ratios['update_mean']:.4f}"
        if "amortized" in ratios:
            lines[-1] += (
                f"; a snapshot step costs {ratios['snapshot_ms']:.1f} ms more (gg-r1 over gg-r), so over a long run "
                f"with a snapshot every {RECOVERY_EVERY} steps: {ratios['amortized']:.4f} "
                f"({ratios['snapshot_steps']} snapshot step(s) among the timed rounds)"
            )
    snapshots = [row for row in result.rows if row.get("snapshots")]
    if snapshots and result.state_bytes:
        state = result.state_bytes
        total = sum(state.values())
        held = ", ".join(
            f"`{row['name']}` {row['snapshots']:.0f} held, {row['snapshot_bytes'] / row['snapshots'] / 2**20:.1f} MiB "
            f"each, {row['snapshot_bytes'] / 2**20:.1f} MiB in all"
            for row in snapshots
        )
        lines.append(
            f"\nSnapshots (`guard.metrics()`): {held}. The model's parameters {state['params'] / 2**20:.1f} MiB, "
            f"buffers {state['buffers'] / 2**20:.1f} MiB, AdamW state {state['optimizer'] / 2**20:.1f} MiB: "
            f"{total / 2**20:.1f} MiB, so `keep: 2` holds {2 * total / 2**20:.1f} MiB once two are taken."
        )
    return "\n".join(lines)


def sweep_table(sweep: SweepResult) -> str:
    lines = [
        f"**sweep**: chains of Linear(16, 16), batch 8; {sweep.rounds} rounds. Extra time of the update "
        "phase (treatment + AdamW step) over no treatment, median of paired differences:",
        "",
        "| tensors | none ms/step | global: +us/step (us/tensor) | gradguard (a): +us/step (us/tensor) |",
        "|---:|---:|---:|---:|",
    ]
    for i, size in enumerate(sweep.sizes):
        g, a = sweep.cost_us["global"][i], sweep.cost_us["gg-a"][i]
        lines.append(f"| {size} | {sweep.none_ms[i]:.2f} | {g:.0f} ({g / size:.2f}) | {a:.0f} ({a / size:.2f}) |")
    lines.append(
        f"\nPer-tensor cost, least-squares slope: global {sweep.slope_us['global']:.2f} us/tensor "
        f"(R^2 {sweep.r_squared['global']:.3f}); gradguard (a) {sweep.slope_us['gg-a']:.2f} us/tensor "
        f"(R^2 {sweep.r_squared['gg-a']:.3f}). From whole-step times: global "
        f"{sweep.step_slope_us['global']:.2f}, gradguard (a) {sweep.step_slope_us['gg-a']:.2f} us/tensor."
    )
    return "\n".join(lines)


def _row(result: ModelResult, name: str) -> dict[str, Any]:
    return next(row for row in result.rows if row["name"] == name)


def targets(results: dict[str, ModelResult], sweep: SweepResult | None, device: torch.device) -> str:
    lines = [
        "| target | measured: update-phase estimate; whole step, median [p25-p75] | verdict (on the estimate) |",
        "|---|---|---|",
    ]

    def add(target: str, value: str, ok: bool) -> None:
        lines.append(f"| {target} | {value} | {'met' if ok else 'NOT met'} |")

    def ratio(row: dict[str, Any], key: str, limit: float) -> tuple[str, bool]:
        estimate = row[f"est_{key}"]
        return f"{estimate:.3f}; {row[key]}", estimate <= limit

    gpt, deep = results.get("gpt"), results.get("deep")
    cuda = device.type == "cuda"
    if gpt is not None:
        limit = 1.05 if cuda else 1.005
        add(f"(a) vs global, gpt <= {limit}", *ratio(_row(gpt, "gg-a"), "vs_global", limit))
        if not cuda:
            add("(a) vs none, gpt <= 1.02", *ratio(_row(gpt, "gg-a"), "vs_none", 1.02))
    if deep is not None:
        limit = 1.05 if cuda else 1.01
        add(f"(a) vs global, deep <= {limit}", *ratio(_row(deep, "gg-a"), "vs_global", limit))
    for result in (r for r in (gpt, deep) if r is not None):
        present = {row["name"] for row in result.rows}
        names = ("gg-a", "gg-a0", "gg-a0-lc", "gg-b", "gg-c0", "gg-c", "gg-zclip", "gg-autoclip", "gg-spike")
        rows = [_row(result, name) for name in names if name in present]
        syncs = ", ".join(f"{row['name']} {row['extra_syncs']} ({row['backward_syncs']})" for row in rows)
        ok = all(row["extra_syncs"] <= 1 and row["backward_syncs"] == 0 for row in rows)
        add(f"extra host syncs/step <= 1 (in backward: 0), {result.workload}", syncs, ok)
        memory = ", ".join(f"{row['name']} {row['extra_peak_pct']:+.2f}%" for row in rows)
        ok = all(abs(row["extra_peak_pct"]) <= 1.0 for row in rows)
        add(f"peak memory within 1% of none, {result.workload}", memory, ok)
    for result in (r for r in (gpt, deep) if r is not None):
        if "gg-a0-lc / gg-a0-lc-off" in result.comparisons:
            cost = result.comparisons["gg-a0-lc / gg-a0-lc-off"]
            add(
                f"acting before the loop's clip: (a0)+clip, before it vs at step(), {result.workload} <= 1.005",
                f"{cost['update']:.4f}; {cost['wall']}",
                cost["update"] <= 1.005,
            )
    if gpt is not None and "gg-c0 / gg-a0" in gpt.comparisons:
        cost = gpt.comparisons["gg-c0 / gg-a0"]
        add(
            "audit log on, nothing clipped: (c) vs (a), gpt <= 1.005",
            f"{cost['update']:.4f}; {cost['wall']} (process CPU {cost['cpu'].median:.3f})",
            cost["update"] <= 1.005,
        )
    if gpt is not None and "gg-ml / gg-m" in gpt.comparisons:
        cost = gpt.comparisons["gg-ml / gg-m"]
        add(
            "audit log with per-step stats: (a)+monitor+log vs (a)+monitor, gpt <= 1.005",
            f"{cost['update']:.4f}; {cost['wall']} (process CPU {cost['cpu'].median:.3f})",
            cost["update"] <= 1.005,
        )
    for name, limit in (("gg-m", 1.01), ("gg-m10", 1.003)):
        for result in (r for r in (gpt, deep) if r is not None and f"{name} / gg-a0" in r.comparisons):
            cost = result.comparisons[f"{name} / gg-a0"]
            add(
                f"monitor ({name}) vs the same guard without it, {result.workload} <= {limit}",
                f"{cost['update']:.4f}; {cost['wall']}",
                cost["update"] <= limit,
            )
    if deep is not None:
        for name in ("gg-agc", "gg-zclip", "gg-autoclip", "gg-spike"):
            if f"{name} / gg-a" in deep.comparisons:
                cost = deep.comparisons[f"{name} / gg-a"]
                add(
                    f"adaptive ({name}) vs fixed clip_norm (gg-a), deep <= 1.01",
                    f"{cost['update']:.4f}; {cost['wall']}",
                    cost["update"] <= 1.01,
                )
    for result in (r for r in (gpt, deep) if r is not None and "gg-r / gg-a" in r.comparisons):
        cost = result.comparisons["gg-r / gg-a"]
        control = result.comparisons.get("gg-a-2 / gg-a")
        aa = f"; A/A ((a) again) {control['update']:.4f}, mean {control['update_mean']:.4f}" if control else ""
        amortized = cost.get("amortized", cost["update"])
        add(
            f"recovery (snapshot_every {RECOVERY_EVERY}) vs the same policy without it, {result.workload} <= 1.01",
            f"{amortized:.4f} amortized (steps without a snapshot {cost['update']:.4f}, a snapshot step "
            f"+{cost.get('snapshot_ms', math.nan):.1f} ms); mean of every step {cost['update_mean']:.4f}; "
            f"{cost['wall']}{aa}",
            amortized <= 1.01,
        )
    if sweep is not None and not cuda:
        add(
            "per-tensor cost (sweep slope) < 5 us, linear",
            f"{sweep.slope_us['gg-a']:.2f} us/tensor, R^2 {sweep.r_squared['gg-a']:.3f} "
            f"(global clip: {sweep.slope_us['global']:.2f})",
            sweep.slope_us["gg-a"] < 5.0,
        )
    return "\n".join(lines)


def machine(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    text = (
        f"{os.cpu_count()} CPU cores ({cpu}), torch {torch.__version__} on {device.type}, "
        f"{torch.get_num_threads()} intra-op thread(s), Python {platform.python_version()}"
    )
    if device.type == "cuda":
        text += f", {torch.cuda.get_device_name(device)}"
    return text


# --- main --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="tiny models, one round: a smoke run of seconds")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--only", default="gpt,deep,sweep", help="comma-separated subset of gpt,deep,sweep")
    parser.add_argument(
        "--rounds", type=int, default=None, help="rounds (default: 25 gpt, 45 deep, 30 sweep; 1 with --quick)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write every measurement here")
    parser.add_argument(
        "--rows", default=None, help="comma-separated treatments to run (default: all), e.g. none,none-2,global,gg-a"
    )
    args = parser.parse_args(argv)
    wanted = None if args.rows is None else set(args.rows.split(","))

    def treatments(with_caller_render: bool) -> list[Treatment]:
        every = decoder_treatments(with_caller_render)
        chosen = [t for t in every if wanted is None or t.name in wanted or t.name in ("none", "global")]
        unknown = (wanted or set()) - {t.name for t in every}
        if unknown:
            parser.error(f"--rows: no treatment named {', '.join(sorted(unknown))}")
        return chosen

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    only = set(args.only.split(","))
    started = time.perf_counter()
    quick, cuda = args.quick, device.type == "cuda"

    def rounds(default: int) -> int:
        return args.rounds if args.rounds is not None else (1 if quick else default)

    results: dict[str, ModelResult] = {}
    sweep: SweepResult | None = None
    with tempfile.TemporaryDirectory(prefix="gradguard-bench-") as scratch_dir:
        scratch = Path(scratch_dir)
        if "gpt" in only:
            batch, length = (32, 256) if cuda else (4, 64)
            shape = (
                dict(vocab=64, width=32, depth=1, heads=2) if quick else dict(vocab=8192, width=384, depth=6, heads=6)
            )
            results["gpt"] = run_model(
                lambda: decoder_workload(
                    "gpt", device, **shape, batch=2 if quick else batch, length=8 if quick else length
                ),
                treatments(False),
                rounds(25),
                scratch,
                args.seed,
                warmup=1 if quick else 2,
            )
        if "deep" in only:
            batch, length = (32, 128) if cuda else (4, 32)
            shape = (
                dict(vocab=32, width=16, depth=2, heads=2) if quick else dict(vocab=2048, width=128, depth=24, heads=4)
            )
            results["deep"] = run_model(
                lambda: decoder_workload(
                    "deep", device, **shape, batch=2 if quick else batch, length=8 if quick else length
                ),
                treatments(True),
                rounds(45),
                scratch,
                args.seed,
                warmup=1 if quick else 2,
            )
        if "sweep" in only:
            links = [5, 25] if quick else [5, 25, 100, 250, 500, 1000]
            sweep = run_sweep(links, device, rounds(30), scratch, args.seed)

    print(f"## gradguard step overhead ({machine(device)})\n")
    for result in results.values():
        print(model_table(result) + "\n")
    if sweep is not None:
        print(sweep_table(sweep) + "\n")
    print("**targets**\n")
    print(targets(results, sweep, device))
    elapsed = time.perf_counter() - started
    print(f"\n(ran in {elapsed:.0f} s{'; --quick: tiny models, the figures mean nothing' if quick else ''})")
    if args.json is not None:
        payload = {
            "machine": machine(device),
            "models": {name: _jsonable(result) for name, result in results.items()},
            "sweep": _jsonable(sweep) if sweep is not None else None,
        }
        args.json.write_text(json.dumps(payload, indent=1, default=str))
    return 0


def _jsonable(value: Any) -> Any:
    if isinstance(value, Ratio):
        return {"median": value.median, "p25": value.low, "p75": value.high}
    if hasattr(value, "__dataclass_fields__"):
        return {key: _jsonable(getattr(value, key)) for key in value.__dataclass_fields__}
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
