"""Small healthy training runs: what the shipped default must leave bitwise as their unguarded twins
(``tests/test_default_policy_on_healthy_runs.py``), and whose norms ``benchmarks/warm_up_ratios.py`` measures against
their warm-up scale. Each is a model builder (seeded) and a loop that trains it deterministically."""

from __future__ import annotations

import torch
from torch import nn

from gradguard.cli.demo import TinyDecoder

STEPS = 200


def tiny_gpt() -> nn.Module:
    torch.manual_seed(0)
    return TinyDecoder(vocab=32, width=32, depth=2, heads=2, context=16)


def gpt_loop(model: nn.Module, steps: int = STEPS, *, warm_up: int = 0) -> None:
    """nanoGPT's shape of loop: AdamW with weight decay, the loop's own global clip at 1.0, one batch a step; with
    ``warm_up``, a linear learning-rate warm-up over that many steps, then a linear decay to a tenth."""
    vocab, length = 32, 16
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warm_up) * max(0.1, 1 - step / steps) if warm_up else 1.0
    )
    for _ in range(steps):
        start = torch.randint(0, vocab, (8, 1), generator=generator)
        tokens = (start + torch.arange(length + 1) * torch.randint(1, 3, (8, 1), generator=generator)) % vocab
        logits = model(tokens[:, :-1])
        nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)


def teacher_student() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def teacher_loop(model: nn.Module, steps: int = STEPS) -> None:
    """A small MLP learning a fixed random teacher's classes: AdamW, the loop's clip at 1.0; its logits sharpen, and
    per-tensor norms pass 1.0 in many steps."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        inputs = torch.randn(64, 32, generator=generator)
        with torch.no_grad():
            labels = (3 * teacher(inputs)).argmax(1)
        nn.functional.cross_entropy(model(inputs), labels).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def regression() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def large_norms_loop(model: nn.Module, steps: int = STEPS, *, sum_reduced: bool) -> None:
    """A small regression whose per-tensor norms are far above 1 from the first step and stay there: targets around
    50 with a mean-reduced loss, or targets around 1 with a sum-reduced one (64 samples). Adam does not mind the scale:
    both train, unguarded, as they should."""
    generator = torch.Generator().manual_seed(1)
    weights = torch.randn(8, 1, generator=generator)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        inputs = torch.randn(64, 8, generator=generator)
        if sum_reduced:
            loss = nn.functional.mse_loss(model(inputs), inputs @ weights, reduction="sum")
        else:
            loss = nn.functional.mse_loss(model(inputs), 50 + 10 * (inputs @ weights))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip


def cnn_loop(model: nn.Module, steps: int = STEPS) -> None:
    """SGD with momentum under a one-cycle schedule, on noisy copies of ten class prototypes."""
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.4, total_steps=steps)
    prototypes = torch.randn(10, 3, 16, 16, generator=generator)
    for _ in range(steps):
        labels = torch.randint(0, 10, (32,), generator=generator)
        images = prototypes[labels] + 0.8 * torch.randn(32, 3, 16, 16, generator=generator)
        nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()


class LoRA(nn.Module):
    """A frozen layer with a low-rank adapter whose ``B`` starts at 0: ``A``'s gradient is 0 at the first step and
    grows as ``B`` learns."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(32, 32).requires_grad_(False)
        self.A = nn.Parameter(torch.randn(4, 32) * 0.1)
        self.B = nn.Parameter(torch.zeros(32, 4))
        self.head = nn.Linear(32, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.base(inputs) + inputs @ self.A.T @ self.B.T))


def lora_loop(model: nn.Module, steps: int = STEPS, *, lr: float = 1e-3, warm_up: int = 0) -> None:
    """AdamW on a smooth target; with ``warm_up``, a linear learning-rate warm-up over that many steps."""
    _regress_to_a_sine(model, steps, 32, lr, warm_up)


class Gated(nn.Module):
    """Residual blocks behind gates that start at 0 (ReZero, adaLN-Zero's shape): ``x + g * f(x)``. The blocks'
    gradients are 0 at the first step and grow with their gates."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)) for _ in range(4))
        self.gates = nn.Parameter(torch.zeros(4))
        self.out = nn.Linear(64, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.inp(inputs)
        for gate, block in zip(self.gates, self.blocks, strict=True):
            hidden = hidden + gate * block(hidden)
        return self.out(hidden)


def gated_loop(model: nn.Module, steps: int = STEPS, *, lr: float = 1e-3, warm_up: int = 200) -> None:
    """AdamW under a linear learning-rate warm-up: the gates open slowly, the blocks' norms grow thousands of times
    past their warm-up scale."""
    _regress_to_a_sine(model, steps, 16, lr, warm_up)


def _regress_to_a_sine(model: nn.Module, steps: int, width: int, lr: float, warm_up: int) -> None:
    generator = torch.Generator().manual_seed(1)
    weights = torch.randn(width, 1, generator=generator)
    optimizer = torch.optim.AdamW([param for param in model.parameters() if param.requires_grad], lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warm_up) if warm_up else 1.0
    )
    for _ in range(steps):
        inputs = torch.randn(64, width, generator=generator)
        nn.functional.mse_loss(model(inputs), torch.sin(inputs @ weights)).backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()


def two_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))


def late_layer_loop(model: nn.Module, steps: int = 60) -> None:
    """A layer left out of the forward for 30 steps (its gradient zeroed, not None: ``set_to_none=False``), then used:
    its first norms after zeros are not an explosion."""
    first, second = model[0], model[1]
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    for step in range(steps):
        inputs = torch.randn(8, 4, generator=generator)
        out = second(first(inputs)) if step >= 30 else second(inputs)
        (out - 3.0 - inputs.sum(1, keepdim=True)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
