"""Loss spikes under six ways of treating the gradient, side by side, over several seeds (issue 12).

    python benchmarks/spikes.py                  # CPU, a few minutes: 3 seeds x 400 steps x 7 arms
    python benchmarks/spikes.py --quick          # a tiny model, 40 steps, 1 seed: seconds (the smoke test)
    python benchmarks/spikes.py --json out.json  # also keep every loss and step time

The model is the ``Decoder`` of ``benchmarks/step_overhead.py`` (4 layers, width 64, 4 heads, vocab
64), trained with AdamW (betas 0.9/0.95, weight decay 0.1, no warm-up) at a high learning rate (1e-2) on a
synthetic language task with learnable structure: each sequence is a segment of 8 tokens drawn from a
fixed random Markov chain (a seed's own), repeated to fill the context, so the loss goes down first by
learning the chain and then by copying the earlier repeats (induction).

Gradient spikes are injected at fixed steps (``--inject``, by default 30%, 50%, 70% and 90% of the
run): the step's backward is that of the clean batch's loss plus ``--factor`` (100) times the loss of
a corrupted batch (uniform random tokens, the same for every arm), so the gradient is both huge and
points the wrong way. Every arm of a seed starts from the same weights, sees the same batches in the
same order and the same injections.

Arms:

- ``none``: no treatment;
- ``global``: ``torch.nn.utils.clip_grad_norm_(params, 1.0)``;
- ``clip``: gradguard, ``clip_norm`` 1.0 per tensor (fixed);
- ``zclip``: gradguard, ``zclip`` with its defaults (per tensor);
- ``zclip-group``: gradguard, ``zclip`` with ``scope: group`` (the joint norm of every parameter);
- ``autoclip``: gradguard, ``autoclip`` with its defaults (per tensor);
- ``spike``: gradguard, ``skip_step_on_spike`` with its defaults (window 128, min_samples 64, z 6,
  the joint norm).

Every gradguard arm also has ``skip_step_on_nonfinite`` on every parameter, so a NaN or Inf gradient
skips the step instead of ending the arm; the unguarded arms have nothing of the kind.

Metrics, per arm and seed:

- **loss spikes**: the number of steps ``t >= 10`` whose training loss (of the clean batch, taken
  in the forward pass before that step's update) is above 1.5 times the median of the finite training
  losses of steps ``max(0, t - 50) .. t - 1``; a non-finite loss counts as a spike. **Of which
  natural**: those not within 30 steps from an injected spike (``t - s`` in ``0 .. 29`` for no
  injected step ``s``);
- **final loss**: the cross-entropy on a held-out batch of 64 sequences from the same chain, after
  the last step (``eval``), and the mean training loss of the last 20 steps (in the JSON);
- **skipped**: steps the guard skipped (``skip_step_on_spike`` and ``skip_step_on_nonfinite``);
- **clipped steps**: steps on which any gradient was changed by the arm's clip (for ``global``:
  steps whose total norm was above 1.0; read after the run, not during it);
- **clips**: gradients changed, counted as gradguard counts them: (parameter, step) pairs;
- **step ms** and **vs none**: the whole step (zero_grad, forward, backward, treatment, AdamW step)
  of every arm is timed in the same process, the arms taking turns step by step in a new random
  order each step; ``vs none`` is the median over all steps of all seeds of (the arm's step time /
  ``none``'s step time at the same step).

The figures are of this model, this task and this machine; they say what each treatment does to
injected and natural spikes here, not in general.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_overhead import Decoder, Guarded, Workload

from gradguard import GradientHalt, Policy

SPIKE_RATIO = 1.5
SPIKE_WINDOW = 50
SPIKE_FIRST_STEP = 10
AFTERMATH = 30
"""A loss spike within this many steps from an injection (the injected step included) is counted as injected."""
LAST_STEPS = 20


@dataclass
class Config:
    vocab: int = 64
    width: int = 64
    depth: int = 4
    heads: int = 4
    length: int = 32
    batch: int = 16
    segment: int = 8
    sharpness: float = 5.0
    """Logit scale of the Markov chain's transitions: higher is more predictable."""
    steps: int = 400
    lr: float = 1e-2
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    inject: tuple[int, ...] = ()
    factor: float = 100.0
    eval_batch: int = 64


# --- the task ------------------------------------------------------------------------------------------


def make_task(cfg: Config, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """The seed's batches ``[steps, batch, length + 1]``, a held-out batch and the corrupted batches."""
    generator = torch.Generator().manual_seed(1000 + seed)
    chain = torch.softmax(torch.randn(cfg.vocab, cfg.vocab, generator=generator) * cfg.sharpness, -1)

    def sequences(n: int) -> torch.Tensor:
        segment = torch.empty(n, cfg.segment, dtype=torch.long)
        token = torch.randint(0, cfg.vocab, (n,), generator=generator)
        segment[:, 0] = token
        for t in range(1, cfg.segment):
            token = torch.multinomial(chain[token], 1, generator=generator).squeeze(1)
            segment[:, t] = token
        repeats = -(-(cfg.length + 1) // cfg.segment)
        return segment.repeat(1, repeats)[:, : cfg.length + 1]

    train = sequences(cfg.steps * cfg.batch).view(cfg.steps, cfg.batch, cfg.length + 1)
    held_out = sequences(cfg.eval_batch)
    corrupted = {
        step: torch.randint(0, cfg.vocab, (cfg.batch, cfg.length + 1), generator=generator) for step in cfg.inject
    }
    return train, held_out, corrupted


def cross_entropy(model: nn.Module, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))


# --- the arms ------------------------------------------------------------------------------------------


def guarded_policy(name: str, action: dict[str, Any]) -> Callable[[], Policy]:
    def build() -> Policy:
        return Policy.from_dict(
            {
                "version": 1,
                "rules": [
                    {"name": "nonfinite", "match": "*", "actions": [{"action": "skip_step_on_nonfinite"}]},
                    {"name": name, "match": "*", "actions": [action]},
                ],
            },
            source=f"spikes:{name}",
        )

    return build


ARMS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "none": ("no treatment", None),
    "global": ("`clip_grad_norm_(params, 1.0)`, global", None),
    "clip": ("gradguard `clip_norm` 1.0 per tensor", {"action": "clip_norm", "max_norm": 1.0}),
    "zclip": ("gradguard `zclip` (defaults, per tensor)", {"action": "zclip"}),
    "zclip-group": ("gradguard `zclip`, `scope: group`", {"action": "zclip", "scope": "group"}),
    "autoclip": ("gradguard `autoclip` (defaults, per tensor)", {"action": "autoclip"}),
    "spike": (
        "gradguard `skip_step_on_spike` (defaults: window 128, min_samples 64, z 6, group)",
        {"action": "skip_step_on_spike"},
    ),
}


@dataclass
class Arm:
    name: str
    label: str
    work: Workload
    guard: Guarded | None
    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    update_times: list[float] = field(default_factory=list)
    norms: list[torch.Tensor] = field(default_factory=list)
    clipped_steps: int = 0
    skipped: int = 0
    skipped_steps: list[int] = field(default_factory=list)
    halted_at: int | None = None
    _changed: int = 0

    def changed(self) -> int:
        """Gradients the arm's clip has changed so far ((parameter, step) pairs, gradguard's count)."""
        if self.guard is None or self.guard.guard is None:
            return 0
        counts = self.guard.guard.counters.snapshot().get(self.name, {})
        return sum(count for action, count in counts.items() if action in ("clip_norm", "zclip", "autoclip"))

    def skips(self) -> int:
        if self.guard is None or self.guard.guard is None:
            return 0
        return sum(
            count
            for by_action in self.guard.guard.counters.snapshot().values()
            for action, count in by_action.items()
            if action in ("skip_step_on_spike", "skip_step_on_nonfinite")
        )


def make_arms(cfg: Config, names: Sequence[str], model: nn.Module, scratch: Path) -> list[Arm]:
    arms = []
    for name in names:
        label, action = ARMS[name]
        copied = copy.deepcopy(model)
        work = Workload(name, copied, lambda: torch.zeros(()), torch.device("cpu"), label)
        work.opt = torch.optim.AdamW(copied.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        guard = None
        if action is not None:
            guard = Guarded(name, label, guarded_policy(name, action))
            guard.setup(work, scratch)
        arms.append(Arm(name, label, work, guard))
    return arms


def train_step(arm: Arm, cfg: Config, step: int, tokens: torch.Tensor, corrupted: torch.Tensor | None) -> None:
    """One step of one arm: its guard's hook is in torch's registry only during its own step."""
    if arm.halted_at is not None:
        arm.losses.append(math.nan)
        return
    model, opt = arm.work.model, arm.work.opt
    if arm.guard is not None:
        arm.guard.before_step()
    try:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = cross_entropy(model, tokens, cfg.vocab)
        total = loss if corrupted is None else loss + cfg.factor * cross_entropy(model, corrupted, cfg.vocab)
        total.backward()  # type: ignore[no-untyped-call]
        update = time.perf_counter()
        if arm.name == "global":
            arm.norms.append(torch.nn.utils.clip_grad_norm_(arm.work.params, 1.0))
        try:
            opt.step()
        except GradientHalt:
            arm.halted_at = step
        end = time.perf_counter()
    finally:
        if arm.guard is not None:
            arm.guard.after_step()
    arm.times.append(end - start)
    arm.update_times.append(end - update)
    arm.losses.append(loss.item())  # after the step: the timed step has only the guard's own sync
    if arm.guard is not None:
        changed = arm.changed()
        arm.clipped_steps += changed > arm._changed
        arm._changed = changed
        if arm.guard.guard is not None and arm.guard.guard.last_step_skipped:
            arm.skipped_steps.append(step)


def loss_spikes(losses: Sequence[float]) -> list[int]:
    """Steps t >= 10 whose loss is above 1.5x the median of the finite losses of the previous 50 steps."""
    steps = []
    for t in range(SPIKE_FIRST_STEP, len(losses)):
        if not math.isfinite(losses[t]):
            steps.append(t)
            continue
        window = [x for x in losses[max(0, t - SPIKE_WINDOW) : t] if math.isfinite(x)]
        if window and losses[t] > SPIKE_RATIO * statistics.median(window):
            steps.append(t)
    return steps


def natural(spikes: Sequence[int], inject: Sequence[int]) -> list[int]:
    """The spikes that are not within ``AFTERMATH`` steps from an injection."""
    return [t for t in spikes if not any(0 <= t - s < AFTERMATH for s in inject)]


@dataclass
class SeedResult:
    seed: int
    arms: dict[str, dict[str, Any]]
    ratios: dict[str, list[float]]


def run_seed(cfg: Config, names: Sequence[str], seed: int, scratch: Path) -> SeedResult:
    train, held_out, corrupted = make_task(cfg, seed)
    torch.manual_seed(seed)
    model = Decoder(cfg.vocab, cfg.width, cfg.depth, cfg.heads, cfg.length)
    arms = make_arms(cfg, names, model, scratch)
    order = list(range(len(arms)))
    shuffle = random.Random(seed)
    try:
        for step in range(cfg.steps):
            shuffle.shuffle(order)
            if step % 50 == 0:
                gc.collect()
            for k in order:
                train_step(arms[k], cfg, step, train[step], corrupted.get(step))
            if (step + 1) % 100 == 0:
                print(f"  seed {seed}: {step + 1}/{cfg.steps} steps", file=sys.stderr, flush=True)
    finally:
        for arm in arms:
            if arm.guard is not None:
                arm.skipped = arm.skips()
                arm.guard.teardown(arm.work)
    results: dict[str, dict[str, Any]] = {}
    for arm in arms:
        with torch.no_grad():
            final = cross_entropy(arm.work.model, held_out, cfg.vocab).item()
        if arm.name == "global":
            arm.clipped_steps = int((torch.stack(arm.norms) > 1.0).sum()) if arm.norms else 0
            clips = arm.clipped_steps * len(arm.work.params)
        else:
            clips = arm._changed
        results[arm.name] = {
            "label": arm.label,
            "spikes": len(loss_spikes(arm.losses)),
            "natural_spikes": len(natural(loss_spikes(arm.losses), cfg.inject)),
            "spike_steps": loss_spikes(arm.losses),
            "eval_loss": final,
            "last_train_loss": statistics.fmean(arm.losses[-LAST_STEPS:]),
            "skipped": arm.skipped,
            "skipped_steps": arm.skipped_steps,
            "clipped_steps": arm.clipped_steps,
            "clips": clips,
            "halted_at": arm.halted_at,
            "step_ms": statistics.median(arm.times) * 1e3,
            "update_ms": statistics.median(arm.update_times) * 1e3,
            "losses": arm.losses,
        }
    base = next((arm for arm in arms if arm.name == "none"), None)
    ratios = {
        arm.name: [a / b for a, b in zip(arm.times, base.times, strict=False)] if base is not None else []
        for arm in arms
    }
    return SeedResult(seed, results, ratios)


# --- report --------------------------------------------------------------------------------------------


def spread(values: Sequence[float], digits: int) -> str:
    """Mean, then the per-seed values: ``2.3 (1, 3, 3)``."""
    finite = all(math.isfinite(v) for v in values)
    mean = f"{statistics.fmean(values):.{digits}f}" if finite else "nan"
    if len(values) == 1:
        return mean
    return f"{mean} ({', '.join(f'{v:.{digits}f}' for v in values)})"


def table(cfg: Config, names: Sequence[str], results: Sequence[SeedResult]) -> str:
    seeds = ", ".join(str(r.seed) for r in results)
    lines = [
        f"Decoder {cfg.depth} layers, width {cfg.width}, vocab {cfg.vocab}, batch {cfg.batch}x{cfg.length} tokens; "
        f"AdamW lr {cfg.lr:g}, betas {cfg.betas}, weight decay {cfg.weight_decay:g}, no warm-up; {cfg.steps} steps; "
        f"seeds {seeds}; injected gradient spikes (clean loss + {cfg.factor:g} x a corrupted batch's loss) at steps "
        f"{', '.join(str(s) for s in cfg.inject) or 'none'}.",
        "",
        "Mean over seeds, per-seed values in brackets. Loss spike: a training loss above 1.5x the median of the "
        "previous 50; natural: not within 30 steps from an injection; final loss: held-out cross-entropy after the "
        "last step; vs none: median over all steps of the paired step-time ratio.",
        "",
        "| arm | loss spikes | of which natural | final loss (held-out) | skipped steps | clipped steps "
        "| clips (param x step) | step ms | vs none: step time |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        per_seed = [r.arms[name] for r in results]
        ratios = [x for r in results for x in r.ratios[name]]
        ratio = statistics.median(ratios) if ratios else math.nan
        halted = [f"seed {r.seed} at {r.arms[name]['halted_at']}" for r in results if r.arms[name]["halted_at"]]
        label = per_seed[0]["label"] + (f" (halted: {', '.join(halted)})" if halted else "")
        lines.append(
            f"| {label} | {spread([a['spikes'] for a in per_seed], 1)} "
            f"| {spread([a['natural_spikes'] for a in per_seed], 1)} "
            f"| {spread([a['eval_loss'] for a in per_seed], 3)} "
            f"| {spread([a['skipped'] for a in per_seed], 1)} "
            f"| {spread([a['clipped_steps'] for a in per_seed], 1)} "
            f"| {spread([a['clips'] for a in per_seed], 0)} "
            f"| {statistics.median(a['step_ms'] for a in per_seed):.2f} "
            f"| {ratio:.3f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="tiny model, 40 steps, one seed: a smoke run of seconds")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds, from 0 (default 3; 1 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="steps per seed (default 400; 40 with --quick)")
    parser.add_argument("--lr", type=float, default=Config.lr, help=f"AdamW learning rate (default {Config.lr:g})")
    parser.add_argument(
        "--sharpness", type=float, default=Config.sharpness, help="logit scale of the chain (higher: more predictable)"
    )
    parser.add_argument("--factor", type=float, default=Config.factor, help="weight of the corrupted batch's loss")
    parser.add_argument(
        "--inject", default=None, help="comma-separated steps of the spikes (default: 30/50/70/90%% of the run)"
    )
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--json", type=Path, default=None, help="also write every loss and figure here")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    names = [name for name in args.arms.split(",") if name]
    unknown = sorted(set(names) - set(ARMS))
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; expected some of {list(ARMS)}")
    steps = args.steps if args.steps is not None else (40 if args.quick else Config.steps)
    if args.inject is None:
        inject = tuple(int(steps * fraction) for fraction in (0.3, 0.5, 0.7, 0.9))
    else:
        inject = tuple(int(s) for s in args.inject.split(",") if s)
    cfg = Config(steps=steps, lr=args.lr, factor=args.factor, inject=inject, sharpness=args.sharpness)
    if args.quick:
        cfg.depth, cfg.width, cfg.length, cfg.batch = 1, 16, 16, 4
    seeds = args.seeds if args.seeds is not None else (1 if args.quick else 3)

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gradguard-spikes-") as scratch:
        results = [run_seed(cfg, names, seed, Path(scratch)) for seed in range(seeds)]
    print(
        f"## Loss spikes (torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
        f"Python {platform.python_version()})\n"
    )
    print(table(cfg, names, results))
    elapsed = time.perf_counter() - started
    print(f"\n(ran in {elapsed:.0f} s{'; --quick: a tiny model, the figures mean nothing' if args.quick else ''})")
    if args.json is not None:
        payload = {
            "config": cfg.__dict__,
            "seeds": [{"seed": r.seed, "arms": r.arms} for r in results],
        }
        args.json.write_text(json.dumps(payload, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
