"""Recovery (issue 25): a bad stretch of data drives a small language model into a loss spike and NaN.

    python benchmarks/recovery.py                  # CPU, 2 to 4 minutes: 3 seeds x 400 steps x 4 runs
    python benchmarks/recovery.py --quick          # a tiny model, 60 steps, 1 seed: seconds (the smoke test)
    python benchmarks/recovery.py --plot docs/recovery.png   # also draw the held-out loss of seed 0's runs
    python benchmarks/recovery.py --json out.json  # also keep every figure and curve

The model, its data and its optimizer are those of ``benchmarks/spikes.py``: the ``Decoder`` of
``benchmarks/step_overhead.py`` (4 layers, width 64, 4 heads, vocab 64), AdamW (betas 0.9/0.95, weight
decay 0.1) at 1e-2, here with a schedule (``LambdaLR``: 20 steps of linear warm-up, then a cosine down
to 10% at the last step), on segments of a fixed random Markov chain repeated to fill the context.

The bad stretch (``--bad-start``, default half-way; ``--bad-steps``, default 40): every batch of it is
corrupted (uniform random tokens, a shard of garbage) and its loss is multiplied by a weight that starts
at ``--factor`` (100) and grows ``--growth`` (100) times a step, as a broken loss scale or sample weight
would. The first steps of it drive the model into a loss spike (AdamW's normalised steps follow the
garbage); then the gradients grow past float32's range, their norms first, the gradients themselves
after: an unguarded run ends in NaN.

Four runs per seed, from the same initial weights, on the same batches in the same order:

- ``halt``: gradguard, ``halt_on_nonfinite`` on every parameter; the run ends at the first step whose
  gradients (or their norms) are not finite: :class:`~gradguard.GradientHalt`. Its held-out loss is
  that of the model as the halt left it (no update at the faulty step).
- ``recovery``: the same policy with ``recovery: {snapshot_every: 50}`` (every other key its default:
  keep 2, min_age 10, skip_steps 10, max_rewinds 3, lr_factor 1.0); the guard is given the scheduler,
  and the loop asks ``guard.pass_step()`` so that a skipped step costs no compute.
- ``reference``: the same guarded run on the same batches, except that it never sees the bad stretch
  (its steps are left out: no forward, no update, no scheduler step).
- ``twin`` (the exactness check): the same, leaving out instead exactly the steps the recovery run
  never learned from (for each ``rewind`` event of its audit log: ``to_step`` up to ``skip_until``);
  its parameters, AdamW state and scheduler must be bitwise those of the recovery run.

Reported per seed: the held-out loss after the last step (cross-entropy on 64 sequences of the chain),
recovery / reference, the rewinds, the steps whose update was not taken (the faulty steps and the skip
windows), the batches the recovery run never learned from, the steps whose forward and backward ran,
and the wall time of each run's training (the held-out evaluations excluded; the runs follow one
another, so on a shared machine their times are no measure of the guard's cost: that is
``benchmarks/step_overhead.py``'s ``gg-r`` row).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import spikes
from step_overhead import Decoder

from gradguard import GradGuard, GradientHalt, Policy

RUNS = ("halt", "recovery", "reference", "twin")
LABELS = {
    "halt": "gradguard `halt_on_nonfinite`, no recovery",
    "recovery": "the same + `recovery: {snapshot_every: N}`",
    "reference": "the same run, never seeing the bad stretch",
    "twin": "never learning from what recovery undid (exactness check)",
}


@dataclass
class Config(spikes.Config):
    warmup: int = 20
    final_lr: float = 0.1
    """The cosine ends at this fraction of the peak LR, at the last step."""
    bad_start: int = 200
    bad_steps: int = 40
    growth: float = 100.0
    snapshot_every: int = 50
    eval_every: int = 10

    @property
    def close_up(self) -> range:
        """Steps around the bad stretch after which the held-out loss is taken every step (for the plot)."""
        return range(self.bad_start - 2, self.bad_start + self.bad_steps + 12)

    @property
    def bad(self) -> range:
        return range(self.bad_start, self.bad_start + self.bad_steps)

    def weight(self, step: int) -> float:
        """The loss weight of a step of the bad stretch (float32 overflows it in time: inf)."""
        return self.factor * self.growth ** (step - self.bad_start)


def policy(cfg: Config, recovery: bool) -> Policy:
    data: dict[str, Any] = {
        "version": 1,
        "rules": [{"name": "nonfinite", "match": "*", "actions": [{"action": "halt_on_nonfinite"}]}],
    }
    if recovery:
        data["recovery"] = {"snapshot_every": cfg.snapshot_every}
    return Policy.from_dict(data, source=f"recovery benchmark{' with recovery' if recovery else ''}")


def schedule(cfg: Config) -> Any:
    def factor(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - 1 - cfg.warmup))
        return cfg.final_lr + (1.0 - cfg.final_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


@dataclass
class Run:
    name: str
    curve: list[tuple[int, float]] = field(default_factory=list)
    """(steps done, held-out loss) every ``eval_every`` steps, every step around the bad stretch, and at a halt."""
    train_losses: list[float] = field(default_factory=list)
    """Each step's training loss (a bad step's unweighted garbage loss; NaN where no step was taken)."""
    final: float = math.nan
    halted_at: int | None = None
    halt_kind: str | None = None
    rewinds: list[dict[str, Any]] = field(default_factory=list)
    not_updated: int = 0
    passed: int = 0
    never_learned: list[int] = field(default_factory=list)
    seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)
    """Each step's wall time (0 where the loop left it out)."""
    snapshot_bytes: float = 0.0
    state: dict[str, Any] = field(default_factory=dict)


def train(
    cfg: Config,
    name: str,
    model0: nn.Module,
    train_batches: torch.Tensor,
    held_out: torch.Tensor,
    corrupted: dict[int, torch.Tensor],
    scratch: Path,
    leave_out: Sequence[int] = (),
    evaluate: bool = True,
) -> Run:
    run = Run(name)
    model = copy.deepcopy(model0)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(cfg))
    recovery = name == "recovery"
    log = scratch / f"{name}.jsonl"
    guard = GradGuard(model, policy(cfg, recovery), audit_log=log, logger=None, lr_scheduler=sched)
    skipped = set(leave_out)

    def held_out_loss(done: int) -> None:
        if evaluate:
            with torch.no_grad():
                run.curve.append((done, spikes.cross_entropy(model, held_out, cfg.vocab).item()))

    try:
        held_out_loss(0)
        for step in range(cfg.steps):
            start = time.perf_counter()
            if step in skipped or (recovery and guard.pass_step()):
                run.passed += 1
                run.train_losses.append(math.nan)
                run.step_seconds.append(0.0)  # left out, or passed: no forward, no backward
            else:
                opt.zero_grad(set_to_none=True)
                bad = corrupted.get(step)
                if bad is None:
                    loss = spikes.cross_entropy(model, train_batches[step], cfg.vocab)
                    total = loss
                else:
                    loss = spikes.cross_entropy(model, bad, cfg.vocab)
                    total = loss * cfg.weight(step)
                total.backward()  # type: ignore[no-untyped-call]
                rewinds = guard.counters.total("rewind")
                try:
                    opt.step()
                except GradientHalt as halt:
                    run.halted_at, run.halt_kind = step, halt.kind
                    run.train_losses.append(loss.item())
                    run.step_seconds.append(time.perf_counter() - start)
                    break
                run.not_updated += guard.counters.total("rewind") > rewinds
                sched.step()
                run.train_losses.append(loss.item())
                run.step_seconds.append(time.perf_counter() - start)
            if (step + 1) % cfg.eval_every == 0 or (step + 1) in cfg.close_up:
                held_out_loss(step + 1)
        run.seconds = sum(run.step_seconds)
        run.snapshot_bytes = guard.metrics().get("gradguard/recovery/snapshot_bytes", 0.0)
    finally:
        guard.remove()
    with torch.no_grad():
        run.final = spikes.cross_entropy(model, held_out, cfg.vocab).item()
    if run.halted_at is not None and evaluate:
        run.curve.append((run.halted_at, run.final))
    run.not_updated += run.passed
    events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    run.rewinds = [
        {k: e.get(k) for k in ("step", "to_step", "skip_until", "kind", "params")}
        for e in events
        if e["event"] == "rewind"
    ]
    undone = {s for r in run.rewinds for s in range(r["to_step"], r["skip_until"])}
    run.never_learned = sorted(undone)
    run.state = {
        "params": [p.detach().clone() for p in model.parameters()],
        "opt": copy.deepcopy(opt.state_dict()),
        "sched": sched.state_dict(),
    }
    return run


def bitwise_equal(a: Run, b: Run) -> bool:
    def same(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, list | tuple):
            return isinstance(y, list | tuple) and len(x) == len(y) and all(map(same, x, y))
        return bool(x == y)

    return same(a.state, b.state)


@dataclass
class SeedResult:
    seed: int
    runs: dict[str, Run]
    exact: bool


def run_seed(cfg: Config, seed: int, scratch: Path) -> SeedResult:
    task = copy.copy(cfg)
    task.inject = tuple(cfg.bad)  # make_task draws a corrupted batch for each of these steps
    train_batches, held_out, corrupted = spikes.make_task(task, seed)
    torch.manual_seed(seed)
    model0 = Decoder(cfg.vocab, cfg.width, cfg.depth, cfg.heads, cfg.length)
    runs: dict[str, Run] = {}
    for name, leave_out in (("halt", ()), ("recovery", ()), ("reference", tuple(cfg.bad))):
        folder = scratch / f"seed{seed}"
        folder.mkdir(exist_ok=True)
        runs[name] = train(cfg, name, model0, train_batches, held_out, corrupted, folder, leave_out)
        print(f"  seed {seed}: {name} done in {runs[name].seconds:.0f} s", file=sys.stderr, flush=True)
    never = runs["recovery"].never_learned
    runs["twin"] = train(cfg, "twin", model0, train_batches, held_out, corrupted, scratch / f"seed{seed}", never)
    return SeedResult(seed, runs, bitwise_equal(runs["recovery"], runs["twin"]))


# --- report --------------------------------------------------------------------------------------------


def _stretches(steps: Sequence[int]) -> str:
    """``[200, 201, 202, 207]`` -> ``200-202, 207``."""
    parts: list[str] = []
    for s in steps:
        if parts and int(parts[-1].split("-")[-1]) == s - 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{s}"
        else:
            parts.append(str(s))
    return ", ".join(parts) or "none"


def unseen(cfg: Config, result: SeedResult, name: str) -> list[int]:
    """The steps whose batches a run never learned from (for the halted run: those from the halt on)."""
    run = result.runs[name]
    if name == "recovery":
        return run.never_learned
    if name == "halt":
        return [] if run.halted_at is None else list(range(run.halted_at, cfg.steps))
    return [step for step, loss in enumerate(run.train_losses) if math.isnan(loss)]


def table(cfg: Config, results: Sequence[SeedResult]) -> str:
    seeds = ", ".join(str(r.seed) for r in results)
    first_bad, last_bad = cfg.bad_start, cfg.bad_start + cfg.bad_steps - 1
    lines = [
        f"Decoder {cfg.depth} layers, width {cfg.width}, vocab {cfg.vocab}, batch {cfg.batch}x{cfg.length} tokens; "
        f"AdamW lr {cfg.lr:g} (warm-up {cfg.warmup}, cosine to {cfg.final_lr:g}x), betas {cfg.betas}, weight decay "
        f"{cfg.weight_decay:g}; {cfg.steps} steps; seeds {seeds}. Bad stretch: steps {first_bad}-{last_bad}, "
        f"garbage batches with a loss weight of {cfg.factor:g} x {cfg.growth:g}^k at its k-th step. Recovery: "
        f"snapshot_every {cfg.snapshot_every}, every other key its default.",
        "",
        "Mean over seeds, per-seed values in brackets. Held-out loss: cross-entropy on 64 held-out sequences after "
        "the last step (for the halted run: where the halt left the model); not updated: steps whose update was not "
        "taken (faulty steps, skip windows, steps left out); never learned from: batches whose update is not in the "
        "final model (a rewind undoes those from its snapshot on; the halted run: from the halt to its end); "
        "steps computed: steps whose forward and backward ran (a skipped step's pass_step() saves them); "
        "train s: wall time of the training steps (evaluations excluded; the runs are sequential, so on a shared "
        "machine this is no measure of the guard's cost: see benchmarks/step_overhead.py).",
        "",
        "| run | held-out loss | vs reference | halted at | rewinds | not updated | never learned from "
        "| steps computed | train s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in RUNS:
        per_seed = [r.runs[name] for r in results]
        label = LABELS[name].replace("N}", f"{cfg.snapshot_every}}}")
        ratio = spikes.spread([r.runs[name].final / r.runs["reference"].final for r in results], 4)
        halted = ", ".join("-" if run.halted_at is None else str(run.halted_at) for run in per_seed)
        rewinds = spikes.spread([len(run.rewinds) for run in per_seed], 1)
        not_updated = spikes.spread([run.not_updated for run in per_seed], 1)
        never = spikes.spread([len(unseen(cfg, r, name)) for r in results], 1)
        seconds = spikes.spread([run.seconds for run in per_seed], 1)
        computed = spikes.spread([sum(1 for t in run.step_seconds if t > 0) for run in per_seed], 1)
        final = spikes.spread([run.final for run in per_seed], 3)
        lines.append(
            f"| {label} | {final} | {ratio} | {halted} | {rewinds} | {not_updated} | {never} | {computed} | {seconds} |"
        )
    lines.append("")
    for r in results:
        rec, halt = r.runs["recovery"], r.runs["halt"]
        rewinds = "; ".join(
            f"step {e['step']} ({e['kind']}) -> {e['to_step']}, skip until {e['skip_until']}" for e in rec.rewinds
        )
        lines.append(
            f"- seed {r.seed}: halt at step {halt.halted_at} ({halt.halt_kind}); rewinds: {rewinds or 'none'}; "
            f"never learned from: steps {_stretches(rec.never_learned)} ({len(rec.never_learned)} batches); "
            f"snapshots hold {rec.snapshot_bytes / 2**20:.2f} MiB; recovery bitwise equal to its twin: "
            f"{'yes' if r.exact else 'NO'}"
        )
    return "\n".join(lines)


def plot(cfg: Config, result: SeedResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=120)
    ax.axvspan(cfg.bad_start, cfg.bad_start + cfg.bad_steps, color="tab:red", alpha=0.12, label="bad stretch")
    styles = {
        "reference": ("tab:gray", "-", 2.4, "reference: never sees the bad stretch"),
        "recovery": ("tab:blue", "-", 1.3, "recovery: rewinds, skips, goes on"),
        "halt": ("tab:red", "--", 1.3, "no recovery: halts (X)"),
    }
    for name, (color, style, width, label) in styles.items():
        run = result.runs[name]
        xs, ys = zip(*run.curve, strict=True)
        ax.plot(xs, ys, style, color=color, label=label, linewidth=width)
        if run.halted_at is not None:
            ax.plot([xs[-1]], [ys[-1]], "X", color=color, markersize=9)
    for k, event in enumerate(result.runs["recovery"].rewinds):
        ax.axvline(event["step"], color="tab:blue", linestyle=":", linewidth=0.9, label="rewind" if k == 0 else None)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_yticks([0.4, 0.6, 1.0, 2.0, 3.0, 4.0])
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (cross-entropy)")
    ax.set_title(f"A bad stretch of data, with and without recovery (seed {result.seed})")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="tiny model, 60 steps, one seed: a smoke run of seconds")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds, from 0 (default 3; 1 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 400; 60 with --quick)")
    parser.add_argument("--bad-start", type=int, default=None, help="first step of the bad stretch (default: half-way)")
    parser.add_argument("--bad-steps", type=int, default=None, help="its length (default 40; 12 with --quick)")
    parser.add_argument("--factor", type=float, default=100.0, help="loss weight of its first step (default 100)")
    parser.add_argument(
        "--growth", type=float, default=None, help="growth of the weight per step (default 100; 1e4 with --quick)"
    )
    parser.add_argument("--snapshot-every", type=int, default=None, help="default 50; 10 with --quick")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--plot", type=Path, default=None, help="draw the first seed's held-out loss curves here")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure and curve here")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    cfg = Config(factor=args.factor)
    if args.quick:
        cfg.depth, cfg.width, cfg.length, cfg.batch = 1, 16, 16, 4
        cfg.steps, cfg.bad_steps, cfg.snapshot_every, cfg.warmup, cfg.eval_every = 60, 12, 10, 5, 5
        cfg.growth = 1e4
    if args.growth is not None:
        cfg.growth = args.growth
    if args.steps is not None:
        cfg.steps = args.steps
    if args.bad_steps is not None:
        cfg.bad_steps = args.bad_steps
    if args.snapshot_every is not None:
        cfg.snapshot_every = args.snapshot_every
    cfg.bad_start = args.bad_start if args.bad_start is not None else cfg.steps // 2
    if cfg.bad_start + cfg.bad_steps > cfg.steps:
        parser.error("the bad stretch must end before the last step")
    seeds = args.seeds if args.seeds is not None else (1 if args.quick else 3)

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gradguard-recovery-") as scratch:
        results = [run_seed(cfg, seed, Path(scratch)) for seed in range(seeds)]
    print(
        f"## Recovery from a bad stretch of data (torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
        f"Python {platform.python_version()})\n"
    )
    print(table(cfg, results))
    elapsed = time.perf_counter() - started
    print(f"\n(ran in {elapsed:.0f} s{'; --quick: a tiny model, the figures mean nothing' if args.quick else ''})")
    if args.plot is not None:
        plot(cfg, results[0], args.plot)
        print(f"plot: {args.plot}")
    if args.json is not None:
        payload = {
            "config": {**cfg.__dict__, "bad": list(cfg.bad)},
            "seeds": [
                {
                    "seed": r.seed,
                    "exact": r.exact,
                    "runs": {
                        name: {k: v for k, v in run.__dict__.items() if k != "state"} for name, run in r.runs.items()
                    },
                }
                for r in results
            ],
        }
        args.json.write_text(json.dumps(payload, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
