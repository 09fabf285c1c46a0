"""Shared fixtures: small real models, real optimizers, a guarded-versus-reference runner, log readers.

Helpers are handed to tests as fixtures (not imported from this module). Plain helpers that tests
import live in ``tests/support/`` (``support.training``, ``support.synthetic_log``); ``pythonpath``
in pyproject.toml puts ``tests/`` on ``sys.path`` in any import mode.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import support.training
import torch
from support.training import SmallMLP, assert_same, grads_of, model_state
from torch import nn

from gradguard import GradGuard, Policy
from gradguard.cli.demo import TinyDecoder

# --- models ---------------------------------------------------------------------------------------


class _Expert(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class _MoEBlock(nn.Module):
    def __init__(self, width: int, heads: int, experts: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.router = nn.Linear(width, experts)
        self.mlp = nn.ModuleList(_Expert(width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        h = self.norm2(x)
        gates = torch.softmax(self.router(h), dim=-1)
        mixed = sum(gates[..., i : i + 1] * expert(h) for i, expert in enumerate(self.mlp))
        return x + mixed


class MoEDecoder(nn.Module):
    """A decoder LLM in miniature: embed, blocks.N.{attn, router, mlp}, head (tied to the embedding)."""

    def __init__(self, vocab: int = 16, width: int = 16, depth: int = 2, heads: int = 2, experts: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(_MoEBlock(width, heads, experts) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # type: ignore[no-any-return]


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.downsample is None else self.downsample(x)
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + skip)


class TinyResNet(nn.Module):
    """ResNet naming in miniature: conv1, bn1, layerN.M.{conv,bn,downsample}, fc."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.layer1 = nn.Sequential(_BasicBlock(8, 8, 1))
        self.layer2 = nn.Sequential(_BasicBlock(8, 16, 2))
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(x.mean(dim=(2, 3)))  # type: ignore[no-any-return]


class FineTuneNet(nn.Module):
    """A pretrained-backbone-plus-new-head shape: embed, layers.0..3, head."""

    def __init__(self, vocab: int = 16, width: int = 16, depth: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).mean(dim=1)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)  # type: ignore[no-any-return]


# --- workloads: a model, its batches and its loss -------------------------------------------------


@dataclass
class Workload:
    """A model with deterministic batches (a function of the step) and a loss."""

    name: str
    model: nn.Module

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 + step)
        if self.name == "mlp":
            x = torch.randn(16, 8, generator=gen) * 3
            return x, torch.randn(16, 4, generator=gen)
        if self.name in {"decoder", "moe"}:
            tokens = torch.randint(0, 16, (4, 9), generator=gen)
            return tokens[:, :-1], tokens[:, 1:]
        if self.name == "resnet":
            return torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 5, (4,), generator=gen)
        if self.name == "finetune":
            return torch.randint(0, 16, (6, 5), generator=gen), torch.randint(0, 3, (6,), generator=gen)
        raise AssertionError(self.name)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        out = self.model(inputs)
        if self.name == "mlp":
            return nn.functional.mse_loss(out, targets) * 10
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))

    def clone(self) -> Workload:
        """An independent copy (deepcopy keeps ties, and carries no guard)."""
        return Workload(self.name, copy.deepcopy(self.model))

    def backward(self, step: int) -> torch.Tensor:
        loss = self.loss(self.batch(step))
        loss.backward()  # type: ignore[no-untyped-call]
        return loss.detach()


def _build(name: str, **kwargs: Any) -> nn.Module:
    if name == "mlp":
        return SmallMLP(**kwargs)
    if name == "decoder":
        return TinyDecoder(vocab=16, width=16, depth=2, heads=2, context=8)
    if name == "moe":
        return MoEDecoder()
    if name == "resnet":
        return TinyResNet()
    if name == "finetune":
        return FineTuneNet()
    raise AssertionError(name)


@pytest.fixture
def make_workload() -> Callable[..., Workload]:
    """``make_workload(name, seed=0, **model_kwargs)``: mlp, decoder (TinyDecoder), moe, resnet, finetune."""

    def make(name: str, seed: int = 0, **kwargs: Any) -> Workload:
        torch.manual_seed(seed)
        return Workload(name, _build(name, **kwargs))

    return make


# --- optimizers -----------------------------------------------------------------------------------

OPTIMIZERS = ("sgd", "adamw", "adamw_foreach", "adamw_fused")


def _fused_adamw_on_cpu() -> bool:
    param = nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    try:
        torch.optim.AdamW([param], fused=True).step()
    except RuntimeError:
        return False
    return True


@pytest.fixture
def make_optimizer() -> Callable[[str, Any], torch.optim.Optimizer]:
    """``make_optimizer(name, params)`` for each name in ``OPTIMIZERS``; skips fused AdamW where unsupported."""

    def make(name: str, params: Any) -> torch.optim.Optimizer:
        if name == "sgd":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
        if name == "sgd_plain":
            return torch.optim.SGD(params, lr=0.05)
        if name == "adamw":
            return torch.optim.AdamW(params, lr=1e-2, foreach=False)
        if name == "adamw_foreach":
            return torch.optim.AdamW(params, lr=1e-2, foreach=True)
        if name == "adamw_fused":
            if not _fused_adamw_on_cpu():
                pytest.skip("AdamW(fused=True) is not supported on the CPU by this torch build")
            return torch.optim.AdamW(params, lr=1e-2, fused=True)
        raise AssertionError(name)

    return make


# --- policies and files ---------------------------------------------------------------------------


@pytest.fixture
def make_policy() -> Callable[..., Policy]:
    """``make_policy(rule, ...)``: a version-1 policy from rule dicts (name defaults to r0, r1, ...)."""
    return support.training.make_policy


def _reject_constant(token: str) -> Any:
    raise AssertionError(f"bare {token} token in a JSON line: not valid JSON")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every line of a JSON-lines file, parsed strictly (no bare NaN/Infinity); fails on a torn line."""
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n"), "the last line of the log is incomplete"
    events = []
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            events.append(json.loads(line, parse_constant=_reject_constant))
        except json.JSONDecodeError as exc:  # pragma: no cover - the failure message is the point
            raise AssertionError(f"{path}:{number} is not a JSON line: {line!r}") from exc
    return events


@pytest.fixture
def read_audit() -> Callable[[Path], list[dict[str, Any]]]:
    """``read_audit(path)``: the audit log's events, each line strictly parsed."""
    return read_jsonl


# --- comparing tensors bit for bit ----------------------------------------------------------------


@pytest.fixture
def same() -> Callable[..., None]:
    """``same(a, b)``: deep, bitwise equality of tensors, state dicts, lists of tensors."""
    return assert_same


@dataclass
class PairRun:
    guard: GradGuard
    guarded: Workload
    reference: Workload
    counters: dict[str, dict[str, int]]


@pytest.fixture
def run_pair(
    make_workload: Callable[..., Workload], make_optimizer: Callable[[str, Any], torch.optim.Optimizer]
) -> Callable[..., PairRun]:
    """Train a guarded model and an unguarded copy side by side; after every step their gradients,
    parameters and optimizer states must be bitwise equal.

    ``reference(model, step)`` applies torch's own functions to the copy's gradients, by hand.
    ``tamper(model, step)`` runs on both models after backward (drop or poison a gradient).
    """

    def run(
        workload: str,
        optimizer: str,
        policy: Policy,
        reference: Callable[[nn.Module, int], None],
        *,
        steps: int = 4,
        tamper: Callable[[nn.Module, int], None] | None = None,
        seed: int = 0,
        model_kwargs: Mapping[str, Any] | None = None,
        **guard_kwargs: Any,
    ) -> PairRun:
        guarded = make_workload(workload, seed=seed, **(model_kwargs or {}))
        ref = guarded.clone()
        opt_g = make_optimizer(optimizer, guarded.model.parameters())
        opt_r = make_optimizer(optimizer, ref.model.parameters())
        guard_kwargs.setdefault("logger", None)
        with GradGuard(guarded.model, policy, **guard_kwargs) as guard:
            for step in range(steps):
                for side, opt in ((guarded, opt_g), (ref, opt_r)):
                    opt.zero_grad(set_to_none=True)
                    side.backward(step)
                    if tamper is not None:
                        tamper(side.model, step)
                assert_same(grads_of(guarded.model), grads_of(ref.model), f"raw gradients, step {step}")
                reference(ref.model, step)
                opt_r.step()
                opt_g.step()
                assert_same(grads_of(guarded.model), grads_of(ref.model), f"treated gradients, step {step}")
                assert_same(model_state(guarded.model), model_state(ref.model), f"parameters, step {step}")
                assert_same(opt_g.state_dict(), opt_r.state_dict(), f"optimizer state, step {step}")
            counters = guard.counters.snapshot()
        return PairRun(guard, guarded, ref, counters)

    return run


def params_where(model: nn.Module, keep: Callable[[str], bool]) -> list[nn.Parameter]:
    """Unique parameters in model order whose (first) name satisfies ``keep``."""
    return [p for name, p in model.named_parameters() if keep(name)]


@pytest.fixture
def select() -> Callable[[nn.Module, Callable[[str], bool]], list[nn.Parameter]]:
    """``select(model, predicate)``: unique parameters, in model order, whose name passes ``predicate``."""
    return params_where


@pytest.fixture
def dispatch_bench() -> Iterator[Any]:
    """``benchmarks/dispatch_count.py`` as a module."""
    folder = str(Path(__file__).resolve().parent.parent / "benchmarks")
    sys.path.insert(0, folder)
    try:
        import dispatch_count

        yield dispatch_count
    finally:
        sys.path.remove(folder)


# --- hygiene --------------------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread() -> Iterator[None]:
    """Tiny models run faster on one thread, and the test machine is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _no_guard_outlives_its_test() -> Iterator[None]:
    """A guard left attached would act on every later test's optimizers: remove it and fail."""
    from gradguard.lifecycle import live_guards

    yield
    leftovers = [guard for guard in live_guards() if guard.attached]
    for guard in leftovers:
        guard.remove()
    assert not leftovers, f"test left guards attached: {leftovers}"


@pytest.fixture
def nonfinite_names() -> Callable[[nn.Module], list[str]]:
    """``nonfinite_names(model)``: names (model order) of parameters whose gradient holds NaN or Inf."""

    def find(model: nn.Module) -> list[str]:
        return [
            name
            for name, p in model.named_parameters()
            if p.grad is not None and not bool(torch.isfinite(p.grad).all())
        ]

    return find
