"""What the guard costs where a step is host-bound: nanoGPT's smallest shape on the CPU, paired and interleaved.

    python benchmarks/host_time.py            # about 2 minutes: ratios, and the counts per step
    python benchmarks/host_time.py --quick    # a few rounds (the smoke test)
    python benchmarks/host_time.py --check    # exit 1 if over 1.03x (the MLP: 1.10x) or over the budget
    python benchmarks/host_time.py --phases   # where the time goes: forward, backward, the loop's clip, the update
    python benchmarks/host_time.py --phases mlp --clock cpu   # the same for the MLP loop, in thread CPU time
    python benchmarks/host_time.py --toggle   # the default provenance's own share, its hooks on and off by turns
    python benchmarks/host_time.py --ratios-only --clock cpu   # each step's thread CPU time, not the wall's
    py-spy record -r 400 -f raw -o mlp.txt -- python benchmarks/host_time.py --only "MLP: default" --steps 12000

The model is nanoGPT's ``GPT`` (Karpathy's ``model.py``: token and position embeddings, pre-norm blocks of
causal self-attention and a GELU MLP, dropout modules, a head tied to the token embedding) at the smallest shape
its ``train.py`` is run at: 2 layers, width 64, 2 heads, vocabulary 65 (shakespeare_char), 64 tokens, batch 8.
The loop is ``train.py``'s: ``zero_grad(set_to_none=True)``, forward with the loss, backward, the loop's own
``clip_grad_norm_(params, 1.0)``, ``AdamW.step()``; torch on one thread.

A second loop, host-bound too: an MLP of two ``Linear(64, 64)`` layers (a ReLU between), batch 32, ``AdamW``, four
micro-batches accumulated per update (each loss divided by 4), then the same clip and step.

Treatments, each on its own copy of the model from the same seed (so all see the same weights and batches):
``none`` (the loop alone), ``default`` (``GradGuard(model, "default")``: the shipped default policy with the
default provenance, ``first_fault``), and ``default, provenance=None`` (the share of the provenance trace); for the
MLP, ``MLP: none`` and ``MLP: default``. Rounds: every treatment runs ``steps`` steps per round, in a shuffled order;
a treatment's figure is the median over rounds of its step-time median over its loop's ``none`` in the same round
(paired: noise that hits a round hits both). Besides time, two deterministic counts per step (issue 51's budget:
at most +10 ops and +200 calls, and no more at 4x the layers): Python function calls (``sys.setprofile``) and torch
operations dispatched (a ``TorchDispatchMode``), each above the unguarded loop's, averaged over ``COUNT_STEPS``
steps (the default policy's monitor samples every 10th), for each of three module trees at 2 layers and at 8
(``TREES``, ``budget_table``; issue 56): nanoGPT's ``GPT``, ``FlatGPT`` (the same shape, its blocks holding their
Linears directly, no ``transformer`` dict) and the MLP loop's ``LinearStack``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional
from torch.utils._python_dispatch import TorchDispatchMode

from gradguard import GradGuard

TARGET = 1.03
"""Issue 41: the shipped default guard at this shape costs at most this much of the unguarded loop."""
MLP_TARGET = 1.10
"""Issue 56: on the MLP loop (4 micro-batches a step), at most this much."""
COUNT_STEPS = 10
"""Steps the counts are averaged over: the default policy's monitor samples every 10th."""
BUDGET_OPS, BUDGET_CALLS = 10, 200
"""Issue 51: the shipped default's torch ops and Python calls per step above the unguarded loop's, at most."""


# --- nanoGPT's model.py, as its train.py builds it ---------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.heads, self.width, self.dropout = heads, width, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.size()
        q, k, v = self.c_attn(x).split(self.width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = functional.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, length, width)
        out: torch.Tensor = self.resid_dropout(self.c_proj(y))
        return out


class MLP(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.dropout(self.c_proj(self.gelu(self.c_fc(x))))
        return out


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, layers: int, heads: int, width: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, width),
                "wpe": nn.Embedding(context, width),
                "drop": nn.Dropout(dropout),
                "h": nn.ModuleList(Block(width, heads, dropout) for _ in range(layers)),
                "ln_f": nn.LayerNorm(width),
            }
        )
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # nanoGPT ties them
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


class FlatBlock(nn.Module):
    """nanoGPT's block with its attention's and MLP's Linears held directly (no ``attn``/``mlp`` modules)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.c_attn, self.attn_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.c_fc, self.mlp_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.heads, self.width = heads, width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(self.width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(batch, length, width))
        out: torch.Tensor = x + self.mlp_proj(functional.gelu(self.c_fc(self.ln_2(x))))
        return out


class FlatGPT(nn.Module):
    """A GPT of nanoGPT's shape with a flatter module tree (issue 56): no ``transformer`` dict, blocks holding their
    Linears directly; its head tied to the token embedding, the same (logits, loss) out."""

    def __init__(self, vocab: int, context: int, layers: int, heads: int, width: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(FlatBlock(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        self.apply(GPT._init_weights)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.wte(idx) + self.wpe(torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


# --- the loop -----------------------------------------------------------------------------------------


class LinearStack(nn.Module):
    """``layers`` Linear(64, 64) layers with a ReLU between each two (the MLP loop's model: 2 layers)."""

    def __init__(self, layers: int = 2, width: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            x = layer(functional.relu(x) if index else x)
        return x


ACCUMULATION = 4
"""The MLP loop's micro-batches per update."""


@dataclass
class Run:
    """One treatment: its model, optimizer, batches and guard (if any); ``loop``: ``"gpt"`` (nanoGPT at ``layers``
    layers), ``"flat"`` (``FlatGPT``, the same loop) or ``"mlp"``."""

    name: str
    attach: Callable[[nn.Module], GradGuard | None]
    loop: str = "gpt"
    layers: int = 2
    model: nn.Module = field(init=False)
    opt: torch.optim.Optimizer = field(init=False)
    guard: GradGuard | None = field(init=False, default=None)
    data: torch.Generator = field(init=False)

    def start(self) -> None:
        torch.manual_seed(1337)
        if self.loop == "mlp":
            self.model = LinearStack(self.layers)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        else:
            shape = {"vocab": 65, "context": 64, "layers": self.layers, "heads": 2, "width": 64}
            self.model = FlatGPT(**shape) if self.loop == "flat" else GPT(**shape)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
        self.data = torch.Generator().manual_seed(0)
        self.guard = self.attach(self.model)

    def step(self) -> None:
        if self.loop == "mlp":
            self.opt.zero_grad(set_to_none=True)
            for _ in range(ACCUMULATION):
                x = torch.randn(32, 64, generator=self.data)
                loss = functional.mse_loss(self.model(x), x.flip(1)) / ACCUMULATION
                loss.backward()  # type: ignore[no-untyped-call]
        else:
            tokens = torch.randint(0, 65, (8, 65), generator=self.data)
            _, loss = self.model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()

    def stop(self) -> None:
        if self.guard is not None:
            self.guard.remove()


def _unguarded(model: nn.Module) -> GradGuard | None:
    return None


def _default(model: nn.Module) -> GradGuard | None:
    return GradGuard(model, "default", logger=None)


def _untraced(model: nn.Module) -> GradGuard | None:
    return GradGuard(model, "default", logger=None, provenance=None)


def _per_tensor_clip(model: nn.Module) -> GradGuard | None:
    """0.2.0's shipped default policy (every tensor clipped at norm 1.0), on which issues 51 and 56 set the budget."""
    return GradGuard(model, "per-tensor-clip", logger=None)


TREES: dict[str, str] = {"nanoGPT's GPT": "gpt", "the flat GPT": "flat", "the MLP, 4 micro-batches": "mlp"}
"""Issue 56: the budget holds on each of these module trees, at 2 layers and at 8."""

TREATMENTS: dict[str, tuple[str, Callable[[nn.Module], GradGuard | None]]] = {
    "none": ("gpt", _unguarded),
    "default": ("gpt", _default),
    "default, provenance=None": ("gpt", _untraced),
    "MLP: none": ("mlp", _unguarded),
    "per-tensor-clip (0.2.0's default)": ("gpt", _per_tensor_clip),
    "MLP: default": ("mlp", _default),
    "MLP: default, provenance=None": ("mlp", _untraced),
    "MLP: per-tensor-clip": ("mlp", _per_tensor_clip),
}
BASELINE = {"gpt": "none", "mlp": "MLP: none"}
"""Each loop's unguarded treatment: the one its ratios and counts are taken over."""


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def counts(run: Run, steps: int = COUNT_STEPS) -> tuple[float, float]:
    """Python calls and torch operations per step, averaged over ``steps`` steps (after a warm-up step)."""
    run.step()
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(profile)
    try:
        for _ in range(steps):
            run.step()
    finally:
        sys.setprofile(None)
    counted = OpCount()
    with counted:
        for _ in range(steps):
            run.step()
    return calls / steps, counted.ops / steps


def budget_counts(
    layers: int = 2, loop: str = "gpt", attach: Callable[[nn.Module], GradGuard | None] = _default
) -> tuple[float, float]:
    """A treatment's (Python calls, torch ops) per step above the unguarded loop's (the shipped default's unless
    ``attach`` says), each run from the seed and warmed up 5 steps as ``measure`` does: deterministic. Counted one
    after the other, with no other guard attached: a guard's hooks on torch's global entry points (the optimizers'
    step, the clip functions) run for every loop of the process."""
    found = []
    for each in (_unguarded, attach):
        run = Run(loop, each, loop, layers)
        run.start()
        try:
            for _ in range(5):
                run.step()
            found.append(counts(run))
        finally:
            run.stop()
    (calls_none, ops_none), (calls, ops) = found
    return round(calls - calls_none, 1), round(ops - ops_none, 1)  # means of COUNT_STEPS whole counts: one decimal


@dataclass
class Result:
    ratios: dict[str, list[float]]

    def median(self, name: str) -> float:
        return statistics.median(self.ratios[name])

    def spread(self, name: str) -> tuple[float, float]:
        values = sorted(self.ratios[name])
        quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
        return quartiles[0], quartiles[2]


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}
"""``--clock``: wall time (what a user waits), or this thread's CPU time (steadier on a shared or virtual machine: a
step descheduled meanwhile is not counted; what the cache loses to a neighbour still is)."""


def measure(rounds: int, steps: int, seed: int = 0, clock: Callable[[], float] = time.perf_counter) -> Result:
    runs = {name: Run(name, attach, loop) for name, (loop, attach) in TREATMENTS.items()}
    for run in runs.values():
        run.start()
        for _ in range(5):  # warm-up: the guard's first steps learn what to hold, the allocator settles
            run.step()
    shuffle = random.Random(seed)
    ratios: dict[str, list[float]] = {name: [] for name in runs if name not in BASELINE.values()}
    try:
        for _ in range(rounds):
            order = list(runs)
            shuffle.shuffle(order)
            medians = {}
            for name in order:
                run, times = runs[name], []
                for _ in range(steps):
                    start = clock()
                    run.step()
                    times.append(clock() - start)
                medians[name] = statistics.median(times)
            for name in ratios:
                ratios[name].append(medians[name] / medians[BASELINE[runs[name].loop]])
    finally:
        for run in runs.values():
            run.stop()
    return Result(ratios)


def toggled(loop: str, rounds: int = 80, steps: int = 10, seed: int = 0) -> dict[str, float]:
    """The default provenance's own share on one guard (the shipped default): its replay hooks on, off, and off again
    (the A/A control) by turns, in shuffled rounds of ``steps`` steps; each arm's median over rounds of its round's
    median thread CPU time per step, over ``off``'s in the same round (the same model, memory and guard in every
    arm: only the hooks differ)."""
    run = Run(loop, _default, loop)
    run.start()
    try:
        for _ in range(30):
            run.step()
        provenance = run.guard._enforcer.provenance if run.guard is not None else None
        replay = provenance._replay if provenance is not None else None
        assert replay is not None, "the default does not replay this model"
        times: dict[str, list[float]] = {"on": [], "off": [], "off-2": []}
        shuffle = random.Random(seed)
        for _ in range(rounds):
            order = list(times)
            shuffle.shuffle(order)
            for arm in order:
                replay.arm() if arm == "on" else replay.disarm()
                run.step()  # the arm's first step: the step the hooks were switched in
                spent = []
                for _ in range(steps):
                    start = time.thread_time()
                    run.step()
                    spent.append(time.thread_time() - start)
                times[arm].append(statistics.median(spent))
    finally:
        run.stop()
    return {arm: statistics.median(a / b for a, b in zip(times[arm], times["off"], strict=True)) for arm in times}


PHASES = ("forward", "backward", "clip", "update")
"""A loop's parts, timed apart by ``phase_times``: the forward with the loss, ``zero_grad`` and backward (the MLP's
``zero_grad`` untimed, its micro-batches' forwards and backwards summed), the loop's ``clip_grad_norm_`` (where the
guard's step runs), ``AdamW.step()``."""


def _noop_hooks(model: nn.Module) -> GradGuard | None:
    """A forward hook that does nothing on each module the default's light trace hooks: what torch's slower module
    call costs by itself (the trace hooks the model's shallowest levels, as many whole levels as 32 modules hold)."""
    modules = dict(model.named_modules())
    depth = 0
    while depth < 8 and len([name for name in modules if name.count(".") < depth + 1]) <= 32:
        depth += 1
    for name, module in modules.items():
        if (name.count(".") < depth or not name) and type(module) not in (nn.ModuleList, nn.ModuleDict):
            module.register_forward_hook(lambda module, args, output: None)
    return None


PHASE_TREATMENTS: dict[str, Callable[[nn.Module], GradGuard | None]] = {
    "none": _unguarded,
    "default": _default,
    "default, provenance=None": TREATMENTS["default, provenance=None"][1],
    "no-op forward hooks": _noop_hooks,
}


def _noop_root_hooks(model: nn.Module) -> GradGuard | None:
    """The replay's two hooks on the model itself (a pre-hook with kwargs, a forward hook), doing nothing: what torch's
    slower module call costs the default's replay before its hooks do anything."""
    model.register_forward_pre_hook(lambda module, args, kwargs: None, with_kwargs=True)
    model.register_forward_hook(lambda module, args, output: None)
    return None


MLP_PHASE_TREATMENTS: dict[str, Callable[[nn.Module], GradGuard | None]] = {
    "none": _unguarded,
    "default": _default,
    "default, provenance=None": _untraced,
    "per-tensor-clip (0.2.0's default)": _per_tensor_clip,
    "the replay's two hooks, doing nothing": _noop_root_hooks,
}


def _timed_step(run: Run, clock: Callable[[], float]) -> list[float]:
    """One step of ``run``'s loop, its ``PHASES`` timed apart (us): the MLP's forwards and backwards summed over its
    micro-batches."""
    if run.loop == "mlp":
        forward = backward = 0.0
        run.opt.zero_grad(set_to_none=True)
        for _ in range(ACCUMULATION):
            x = torch.randn(32, 64, generator=run.data)
            start = clock()
            loss = functional.mse_loss(run.model(x), x.flip(1)) / ACCUMULATION
            middle = clock()
            loss.backward()  # type: ignore[no-untyped-call]
            forward, backward = forward + middle - start, backward + clock() - middle
        marks = [0.0, forward, forward + backward]
        offset = clock() - marks[-1]
    else:
        tokens = torch.randint(0, 65, (8, 65), generator=run.data)
        offset = clock()
        marks = [0.0]
        _, loss = run.model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        marks.append(clock() - offset)
        run.opt.zero_grad(set_to_none=True)
        loss.backward()
        marks.append(clock() - offset)
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), 1.0)
    marks.append(clock() - offset)
    run.opt.step()
    marks.append(clock() - offset)
    return [(end - start) * 1e6 for start, end in itertools.pairwise(marks)]


def phase_times(
    rounds: int, steps: int, seed: int = 0, loop: str = "gpt", clock: Callable[[], float] = time.perf_counter
) -> dict[str, dict[str, float]]:
    """Each treatment's median time (us) of each of ``PHASES`` on nanoGPT's loop (``PHASE_TREATMENTS``) or the MLP's
    (``loop="mlp"``, ``MLP_PHASE_TREATMENTS``), interleaved in shuffled rounds (after 5 rounds of warm-up, not
    counted)."""
    treatments = MLP_PHASE_TREATMENTS if loop == "mlp" else PHASE_TREATMENTS
    runs = {name: Run(name, attach, loop) for name, attach in treatments.items()}
    times: dict[str, dict[str, list[float]]] = {name: {phase: [] for phase in PHASES} for name in runs}
    shuffle = random.Random(seed)
    for run in runs.values():
        run.start()
    try:
        for round_index in range(rounds + 5):
            order = list(runs)
            shuffle.shuffle(order)
            for name in order:
                for _ in range(steps):
                    spent = _timed_step(runs[name], clock)
                    if round_index >= 5:
                        for phase, value in zip(PHASES, spent, strict=True):
                            times[name][phase].append(value)
    finally:
        for run in runs.values():
            run.stop()
    return {
        name: {phase: statistics.median(values) for phase, values in parts.items()} for name, parts in times.items()
    }


def phase_report(medians: dict[str, dict[str, float]]) -> str:
    lines = [
        "| treatment | " + " | ".join(f"{phase} (us)" for phase in PHASES) + " | step (us) | / none |",
        "|---" * 7 + "|",
    ]
    base = sum(medians["none"].values())
    for name, parts in medians.items():
        total = sum(parts.values())
        cells = " | ".join(f"{parts[phase]:,.0f}" for phase in PHASES)
        lines.append(f"| {name} | {cells} | {total:,.0f} | {total / base:.3f} |")
    return "\n".join(lines)


def report(result: Result, counted: dict[str, tuple[float, float]]) -> str:
    """The table; ``counted``: each row's (Python calls, torch ops) per step above its loop's unguarded one
    (``budget_counts``: counted with no other guard attached, whose hooks on torch's global entry points would also
    run for the unguarded loop)."""
    lines = [
        "| treatment | step time / unguarded loop, median [p25-p75] | Python calls per step | torch ops per step |",
        "|---|---|---|---|",
    ]
    for loop, baseline in BASELINE.items():
        lines.append(f"| {baseline} | 1 | | |")
        for name in result.ratios:
            if TREATMENTS[name][0] == loop:
                low, high = result.spread(name)
                calls, ops = counted.get(name, (math.nan, math.nan))
                ratio = f"{result.median(name):.3f} [{low:.3f}-{high:.3f}]"
                lines.append(f"| {name} | {ratio} | +{calls:,.0f} | +{ops:,.1f} |")
    return "\n".join(lines)


BUDGET_ROWS: dict[str, Callable[[nn.Module], GradGuard | None]] = {
    "default": _default,
    "default, provenance=None": _untraced,
    "per-tensor-clip (0.2.0's default)": _per_tensor_clip,
}
"""The guards ``budget_table`` counts on each tree: the shipped default, its share without provenance, and the policy
the budget was set on with the default provenance."""


def within_budget(counted: dict[int, tuple[float, float]]) -> bool:
    """Whether (calls, ops) at 2 layers and at 8 are within the budget, and none grows at 4x the layers."""
    (calls, ops), (calls_8, ops_8) = counted[2], counted[8]
    small = all(c <= BUDGET_CALLS and o <= BUDGET_OPS for c, o in counted.values())
    return small and calls_8 <= calls and ops_8 <= ops


def budget_table() -> tuple[str, bool]:
    """Each ``BUDGET_ROWS`` guard's counts above each tree's unguarded loop, at 2 layers and at 8 (``TREES``), and
    whether the shipped default is within the budget on every tree."""
    lines = ["| guard | tree | layers | torch ops per step | Python calls per step | within the budget |"]
    lines.append("|---|---|---|---|---|---|")
    ok = True
    for row, attach in BUDGET_ROWS.items():
        for tree, loop in TREES.items():
            counted = {layers: budget_counts(layers, loop, attach) for layers in (2, 8)}
            within = within_budget(counted)
            ok = ok and (within or row != "default")
            for layers, (calls, ops) in counted.items():
                lines.append(f"| {row} | {tree} | {layers} | {ops:+.1f} | {calls:+.1f} | {'yes' if within else 'NO'} |")
    return "\n".join(lines), ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 5 steps")
    parser.add_argument("--check", action="store_true", help=f"exit 1 if the default guard is over {TARGET}x")
    parser.add_argument(
        "--phases",
        nargs="?",
        const="gpt",
        choices=("gpt", "mlp"),
        help="a loop's phases timed apart, per treatment: nanoGPT's (gpt, the default) or the MLP's",
    )
    parser.add_argument("--ratios-only", action="store_true", help="the times only (the counts are deterministic)")
    parser.add_argument("--toggle", action="store_true", help="the default provenance's share, toggled (``toggled``)")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall", help="what a step's time is (``CLOCKS``)")
    parser.add_argument(
        "--only",
        metavar="TREATMENT",
        choices=list(TREATMENTS),
        help="run --steps steps of one treatment and nothing else, for a profiler outside (py-spy record -- ...)",
    )
    args = parser.parse_args(argv)
    rounds, steps = (3, 5) if args.quick else (args.rounds, args.steps)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    if args.only:
        loop, attach = TREATMENTS[args.only]
        run = Run(args.only, attach, loop)
        run.start()
        for _ in range(args.steps):
            run.step()
        run.stop()
        return 0
    if args.toggle:
        try:
            shares = {tree: toggled(loop, 2 if args.quick else 80) for tree, loop in TREES.items()}
        finally:
            torch.set_num_threads(threads)
        print("the default provenance's replay hooks on/off on one guard, thread CPU time per step over off:")
        for tree, share in shares.items():
            print(f"{tree}: on {share['on']:.3f}, off again (A/A) {share['off-2']:.3f}")
        return 0
    if args.phases:
        try:
            medians = phase_times(rounds, steps, loop=args.phases, clock=CLOCKS[args.clock])
        finally:
            torch.set_num_threads(threads)
        shape = "nanoGPT, 2 layers, width 64" if args.phases == "gpt" else f"the MLP, {ACCUMULATION} micro-batches"
        print(f"{shape}, CPU, one thread, {rounds} rounds x {steps} steps, {args.clock} clock; medians per phase")
        print(phase_report(medians))
        return 0
    try:
        counted, budget, within = {}, "", True
        if not args.ratios_only:
            counted = {name: budget_counts(2, loop, attach) for name, (loop, attach) in TREATMENTS.items()}
            budget, within = budget_table()
        result = measure(rounds, steps, clock=CLOCKS[args.clock])
    finally:
        torch.set_num_threads(threads)
    print(
        f"nanoGPT, 2 layers, width 64, vocabulary 65, batch 8 x 64 tokens, CPU, {rounds} rounds x {steps} steps, "
        f"{args.clock} clock;"
    )
    print(
        f"MLP 2 x Linear(64, 64), batch 32, {ACCUMULATION} micro-batches a step; counts: a mean of {COUNT_STEPS} steps"
    )
    print(report(result, counted))
    for loop, name in (("nanoGPT", "per-tensor-clip (0.2.0's default)"), ("the MLP", "MLP: per-tensor-clip")):
        print(f"{loop} under 0.2.0's default policy (the budget's): {result.median(name):.3f}x")
    ok = result.median("default") <= TARGET
    print(f"target: the shipped default <= {TARGET}x: {'PASS' if ok else 'FAIL'} ({result.median('default'):.3f}x)")
    mlp = result.median("MLP: default")
    mlp_ok = mlp <= MLP_TARGET
    print(f"target: the MLP loop's shipped default <= {MLP_TARGET}x: {'PASS' if mlp_ok else 'FAIL'} ({mlp:.3f}x)")
    if budget:
        print(f"counts per step over each unguarded loop (budget +{BUDGET_OPS} ops, +{BUDGET_CALLS} calls):")
        print(budget)
        print(f"budget on every tree, and no more at 4x the layers: {'PASS' if within else 'FAIL'}")
    return 1 if args.check and not (ok and mlp_ok and within) else 0


if __name__ == "__main__":
    sys.exit(main())
