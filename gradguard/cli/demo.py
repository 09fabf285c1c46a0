"""``gradguard demo``: a real small training on the CPU, with a spike and a NaN injected on purpose."""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ParamSpec, TypeVar, cast

import torch
from torch import nn

from gradguard.errors import GradientHalt
from gradguard.guard import GradGuard
from gradguard.policy.document import Policy

__all__ = ["DEMO_POLICY", "DemoResult", "TinyDecoder", "run_demo"]


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        attended: torch.Tensor = self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        x = x + attended
        mixed: torch.Tensor = self.mlp(self.norm2(x))
        return x + mixed


class TinyDecoder(nn.Module):
    """A GPT-style decoder small enough to train in seconds; the head is tied to the embedding.

    ``crushed_adapter=True`` adds a residual ``adapter`` layer whose output is scaled by 1e-9: its
    gradient vanishes (the demo's monitor flags it).
    """

    def __init__(
        self,
        vocab: int = 32,
        width: int = 64,
        depth: int = 2,
        heads: int = 4,
        context: int = 32,
        crushed_adapter: bool = False,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos_embed = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)
        self.adapter = nn.Linear(width, width) if crushed_adapter else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        mask = torch.triu(torch.full((length, length), float("-inf")), diagonal=1)
        x = self.embed(tokens) + self.pos_embed[:length]
        for block in self.blocks:
            x = block(x, mask)
        if self.adapter is not None:
            x = x + 1e-9 * self.adapter(x)  # a layer whose gradient is crushed: it vanishes
        return self.head(self.norm(x))  # type: ignore[no-any-return]


def _health_warnings(log_path: Path, shown: int = 6) -> list[str]:
    """The monitors' vanishing/exploding warnings in the demo's log, one line each (the first few)."""
    found = []
    with log_path.open(encoding="utf-8") as lines:
        for line in lines:
            if '"vanishing"' in line or '"exploding"' in line:
                event = json.loads(line)
                if event["event"] in ("vanishing", "exploding"):
                    found.append(event)
    out = [
        f"  {e['event']}: {e['name']} (rule {e['rule']}) at step {e['step']}: gradient norm {e['norm']:.3g}, "
        f"threshold {e['threshold']:g}"
        for e in found[:shown]
    ]
    if len(found) > shown:
        out.append(f"  ... and {len(found) - shown} more vanishing/exploding warnings in the log")
    return out


def _batch(generator: torch.Generator, vocab: int, batch: int, length: int) -> torch.Tensor:
    """Sequences that count upwards modulo ``vocab`` from a random start: easy to learn, so loss falls."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    return (start + torch.arange(length + 1)) % vocab


DEMO_POLICY = "llm-pretraining"
"""The shipped policy the demo runs under unless given another (``Policy.shipped(DEMO_POLICY)``)."""


@dataclass(frozen=True)
class DemoResult:
    losses: list[float]
    halt: GradientHalt | None
    params_untouched: bool
    counters: dict[str, dict[str, int]]
    log_path: Path


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _on_one_thread(run: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run on one torch thread, then give the process its threads back: a model this small trains several
    times faster on one (4.0 s against 16.8 s on 2 busy cores) than split across every core."""

    @functools.wraps(run)
    def one_thread(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return run(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    return one_thread


@_on_one_thread
def run_demo(
    *,
    log_path: Path,
    steps: int = 120,
    spike_step: int = 40,
    nan_step: int = 90,
    policy: Policy | None = None,
    say: Callable[[str], None] = print,
    seed: int = 0,
) -> DemoResult:
    """Train ``TinyDecoder`` with the guard on (on one torch thread); return what happened."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    vocab, length = 32, 24
    model = TinyDecoder(vocab=vocab, context=length, crushed_adapter=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    policy = policy if policy is not None else Policy.shipped(DEMO_POLICY)
    log_path.unlink(missing_ok=True)

    def poison(_: nn.Module, __: object, output: torch.Tensor) -> torch.Tensor:
        return output * float("nan")  # a broken kernel: NaN activations, so NaN gradients

    losses: list[float] = []
    halt: GradientHalt | None = None
    untouched = True
    say(f"gradguard demo: training a {sum(p.numel() for p in model.parameters()):,}-parameter decoder on the CPU")
    say(f"  policy {policy.source}; spike injected at step {spike_step}, NaN at step {nan_step}")
    started = time.perf_counter()
    with GradGuard(model, policy, audit_log=log_path, logger=None) as guard:
        for step in range(steps):
            tokens = _batch(generator, vocab, 16, length)
            mlp = cast(_Block, model.blocks[0]).mlp
            # prepend: the poison is the module's own output (a broken kernel inside it), before any other hook; it
            # stays broken through the step, whose forward the guard replays to name it (a fault gone by then is a
            # transient, and names no module)
            hook = mlp.register_forward_hook(poison, prepend=True) if step == nan_step else None
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            if step == spike_step:
                loss = loss * 1e4  # a bad batch: the gradient is ten thousand times too large
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            before = [p.detach().clone() for p in model.parameters()]
            clips_before = guard.counters.total("clip_norm") + guard.counters.total("clip_value")
            try:
                optimizer.step()
            except GradientHalt as exc:
                halt = exc
                untouched = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=False))
                say(f"step {step:4d}  HALT: {exc}")
                break
            finally:
                if hook is not None:
                    hook.remove()
            clips = guard.counters.total("clip_norm") + guard.counters.total("clip_value") - clips_before
            value = loss.item() / (1e4 if step == spike_step else 1.0)
            losses.append(value)
            if step % 10 == 0 or step == spike_step or (clips and step < 5):
                note = f"  <- spike: guard clipped {clips} gradient(s)" if step == spike_step else ""
                say(f"step {step:4d}  loss {value:7.4f}  clipped this step: {clips:3d}{note}")
        counters = guard.counters.snapshot()
    elapsed = time.perf_counter() - started
    say(f"  {len(losses)} steps in {elapsed:.1f}s; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    if halt is not None:
        verdict = "unchanged" if untouched else "CHANGED (this is a bug)"
        say(f"  halted at step {halt.step} on {halt.kind}; parameters after the halt: {verdict}")
    say(f"  counters: {counters}")
    for line in _health_warnings(log_path):
        say(line)
    say(f"  audit log: {log_path}")
    if not math.isfinite(losses[-1]):
        say("  warning: the last loss is not finite")
    return DemoResult(losses, halt, untouched, counters, log_path)
