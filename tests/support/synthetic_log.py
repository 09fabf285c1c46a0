"""Synthetic audit logs, written exactly as the guard writes them, for tests and the throughput benchmark.

:class:`LogBuilder` writes one event per call and keeps the counters the guard would keep, so the
``counters``/``halt``/``detach`` snapshots it writes agree with its per-event lines (as a real log's
do) and :attr:`LogBuilder.counts` is what ``guard.counters.snapshot()`` would return.
:func:`write_synthetic_run` writes a long, realistic run (a large model, spikes, group clips, NaN
steps skipped, a halt) with it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import IO, Any

__all__ = ["LogBuilder", "decoder_names", "write_norm_run", "write_synthetic_run"]


class LogBuilder:
    """Appends gradguard events to ``path``, with the fields, order and counters of the real guard."""

    def __init__(self, path: Path, *, run: str = "run0", rank: int = 0, start: datetime | None = None) -> None:
        self.path = Path(path)
        self.run = run
        self.rank = rank
        self.counts: dict[str, dict[str, int]] = {}
        self._time = start or datetime(2026, 1, 1, tzinfo=timezone.utc)
        self._file: IO[str] = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def __enter__(self) -> LogBuilder:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def flush(self) -> None:
        """Hand what was written so far to the OS, so that a reader sees it."""
        self._file.flush()

    def count(self, rule: str, action: str, n: int = 1) -> None:
        by_action = self.counts.setdefault(rule, {})
        by_action[action] = by_action.get(action, 0) + n

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {rule: dict(by_action) for rule, by_action in self.counts.items()}

    def event(self, event: str, level: str = "info", *, seconds: float = 0.001, **fields: Any) -> None:
        """Write one event line; ``seconds`` advances the clock first."""
        self._time += timedelta(seconds=seconds)
        head: dict[str, Any] = {"ts": self._time.isoformat().replace("+00:00", "Z"), "level": level, "event": event}
        head.update(run=self.run, rank=self.rank)
        if "step" in fields:
            head["step"] = fields.pop("step")
        head.update(fields)
        self._file.write(json.dumps(head) + "\n")

    def raw(self, text: str) -> None:
        """Write ``text`` as it is (a line from another program, a corrupt line)."""
        self._file.write(text)

    # --- the guard's events -------------------------------------------------------------------------

    def attach(self, rules: dict[str, int], *, model: str = "Model", policy: str = "policy.yaml") -> None:
        params = max(rules.values(), default=0)
        self.event(
            "attach",
            schema=1,
            policy=policy,
            model=model,
            boundary="any torch.optim optimizer",
            params=params,
            rules=rules,
            pid=4242,
        )

    def clip(self, step: int, rule: str, param: str, before: float, max_norm: float = 1.0) -> None:
        self.count(rule, "clip_norm")
        coef = max_norm / (before + 1e-6)
        self.event(
            "intervention",
            "debug",
            step=step,
            rule=rule,
            action="clip_norm",
            param=param,
            scope="tensor",
            norm_type=2.0,
            max_norm=max_norm,
            before=before,
            after=before * coef,
            coef=coef,
        )

    def group_clip(self, step: int, rule: str, params: Sequence[str], before: float, max_norm: float = 1.0) -> None:
        self.count(rule, "clip_norm", len(params))
        coef = max_norm / (before + 1e-6)
        self.event(
            "intervention",
            "debug",
            step=step,
            rule=rule,
            action="clip_norm",
            param=None,
            params=list(params),
            n_params=len(params),
            scope="group",
            norm_type=2.0,
            max_norm=max_norm,
            before=before,
            after=before * coef,
            coef=coef,
        )

    def clip_value(self, step: int, rule: str, param: str, before: float, limit: float) -> None:
        self.count(rule, "clip_value")
        self.event(
            "intervention",
            "debug",
            step=step,
            rule=rule,
            action="clip_value",
            param=param,
            limit=limit,
            before=before,
            after=limit,
        )

    def nonfinite(
        self, step: int, rule: str, param: str, kind: str = "nan", *, halts: bool = False, skips: bool = False
    ) -> None:
        self.count(rule, kind)
        self.event("nonfinite", step=step, rule=rule, param=param, kind=kind, halts=halts, skips=skips)

    def unhalted(self, step: int, params: Sequence[str], kinds: Sequence[str]) -> None:
        self.event("nonfinite_unhalted", "warning", step=step, params=list(params), kinds=list(kinds))

    def halt(self, step: int, rule: str, params: Sequence[str], kind: str = "nan", reason: str | None = None) -> None:
        self.count(rule, "halt_on_nonfinite")
        self.event(
            "halt",
            "error",
            step=step,
            rule=rule,
            params=list(params),
            kinds=dict.fromkeys(params, kind),
            kind=kind,
            reason=reason,
            counters=self.snapshot(),
        )

    def skip(self, step: int, rule: str, params: Sequence[str], kind: str = "nan") -> None:
        self.count(rule, "skip_step_on_nonfinite")
        self.event(
            "skip", "warning", step=step, rule=rule, params=list(params), kinds=dict.fromkeys(params, kind), kind=kind
        )

    def scaler_skip(self, step: int) -> None:
        self.count("grad_scaler", "skip")
        self.event("scaler_skip", step=step, fused=False)

    def stats(self, step: int, rule: str, figures: dict[str, Any], scope: str = "tensor") -> None:
        """A monitor's figures of one step, as ``Health.report`` writes them."""
        self.event("stats", step=step, rule=rule, scope=scope, figures=figures)

    def counters(self, step: int) -> None:
        self.event("counters", step=step, steps=step + 1, counters=self.snapshot())

    def detach(self, steps: int, reason: str = "removed") -> None:
        self.event("detach", reason=reason, steps=steps, counters=self.snapshot())


def write_synthetic_run(
    path: Path,
    *,
    events: int,
    params: int = 200,
    seed: int = 0,
    run: str = "synthetic0",
    rank: int = 0,
    summary_every: int = 100,
) -> dict[str, dict[str, int]]:
    """Write a realistic run of about ``events`` events to ``path``; return its final counters.

    A decoder-like model of ``params`` tensors under the shipped LLM policy's rules: per-tensor clips
    of the embeddings and attention on most steps, a group clip during warm-up, router clip_value,
    scale every step (counted, not logged), periodic loss spikes that clip dozens of tensors, NaN
    steps skipped by a skip rule, a ``counters`` event every ``summary_every`` steps, a halt near
    the end, and ``detach``. Deterministic for a given seed.
    """
    rng = random.Random(seed)
    names = decoder_names(params)
    attention = [name for name in names if ".attn." in name]
    routers = [name for name in names if "router" in name]
    everything = names
    rules = {
        "nonfinite": len(names),
        "embeddings": 2,
        "attention": len(attention),
        "router": len(routers),
        "warmup-global": len(names),
        "skip-bad-batches": len(names),
    }
    written = 0
    step = 0
    with LogBuilder(path, run=run, rank=rank) as log:
        log.attach(rules, model="SyntheticDecoder", policy="policies/llm-pretraining.yaml")
        written += 1
        while written < events - 3:
            log.count("router", "scale", len(routers))
            if step % 997 == 500:  # a bad batch: NaN, the step is skipped
                bad = rng.sample(names, 3)
                for name in bad:
                    log.nonfinite(step, "skip-bad-batches", name, "nan", skips=True)
                log.skip(step, "skip-bad-batches", bad)
                written += 4
            else:
                spike = step % 250 == 40
                for name in ("embed.weight", "pos_embed"):
                    if spike or rng.random() < 0.8:
                        log.clip(step, "embeddings", name, rng.uniform(0.6, 50.0 if spike else 3.0), 0.5)
                        written += 1
                for name in attention:
                    if spike or rng.random() < 0.02:
                        log.clip(step, "attention", name, rng.uniform(1.1, 80.0 if spike else 4.0))
                        written += 1
                for name in routers:
                    if rng.random() < 0.01:
                        log.clip_value(step, "router", name, rng.uniform(0.11, 2.0), 0.1)
                        written += 1
                if step < 2000 and (spike or rng.random() < 0.05):
                    log.group_clip(step, "warmup-global", everything, rng.uniform(1.1, 30.0))
                    written += 1
            if summary_every and (step + 1) % summary_every == 0:
                log.counters(step)
                written += 1
            step += 1
        bad = names[:2]
        for name in bad:
            log.nonfinite(step, "nonfinite", name, "inf", halts=True)
        log.halt(step, "nonfinite", bad, "inf")
        log.counters(step)
        log.detach(step + 1)
    return log.snapshot()


_PARTS = ("attn.in_proj_weight", "attn.out_proj.weight", "mlp.0.weight", "mlp.2.weight", "router.weight")


def decoder_names(params: int) -> list[str]:
    """``params`` parameter names of a decoder-like model: embeddings, then five tensors per block."""
    names = ["embed.weight", "pos_embed"]
    layer = 0
    while len(names) < params:
        names.extend(f"blocks.{layer}.{part}" for part in _PARTS)
        layer += 1
    return names[:params]


def write_norm_run(path: Path, *, params: int, steps: int, seed: int = 0, rule: str = "norms") -> list[int]:
    """A run recorded by a ``monitor`` (``stats: [norm]``, tensor scope, every step): one ``stats`` line per step.

    Norms are log-normal around a median per kind of tensor (1e-4 to 1, spread 0.2 in ``ln``), float32
    values as the guard writes them; every 1,000 steps (from step 500) one kind's norms spike 100x, and
    at step 777 one tensor's norm is NaN. Returns the spike steps.
    """
    import numpy as np

    names = decoder_names(params)
    medians = {"embed.weight": 1.0, "pos_embed": 0.3, "attn.in_proj_weight": 0.05, "attn.out_proj.weight": 0.02}
    medians |= {"mlp.0.weight": 0.01, "mlp.2.weight": 0.004, "router.weight": 1e-4}
    kinds = sorted(medians)
    kind_names = [next(k for k in kinds if name.endswith(k)) for name in names]  # "embed.weight" is not pos_embed
    centre = np.log([medians[kind] for kind in kind_names])
    kind_of = np.array([kinds.index(kind) for kind in kind_names])
    rng = np.random.default_rng(seed)
    spikes = []
    with LogBuilder(path) as log:
        log.attach({rule: len(names)}, model="SyntheticDecoder")
        for step in range(steps):
            logs = centre + rng.normal(0.0, 0.2, len(names))
            if step % 1000 == 500:
                logs = logs + np.where(kind_of == (step // 1000) % len(kinds), np.log(100.0), 0.0)
                spikes.append(step)
            values = np.exp(logs).astype(np.float32).astype(np.float64).tolist()
            if step == 777:
                values[len(values) // 2] = "NaN"
            log.stats(step, rule, {"norm": dict(zip(names, values, strict=True))})
    return spikes
