"""A small decoder and the layouts a torchtitan user gives it: tensor, sequence, 2-D and pipeline parallel.

Every layout is built from the same seed as the single-process reference (``Decoder``), so a rank's parameters are
pieces of the reference's: the tests compare the whole model's figures and weights with the reference trained on
the full batch and treated with torch's own functions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "VOCAB",
    "WIDTH",
    "Decoder",
    "apply_plain_tp",
    "apply_torchtitan_tp",
    "batch",
    "loss_of",
    "make_decoder",
    "stage_modules",
    "titan_clip",
]

VOCAB = 32
WIDTH = 16
HEADS = 2
TOKENS = 6


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(WIDTH, WIDTH)
        self.k = nn.Linear(WIDTH, WIDTH)
        self.v = nn.Linear(WIDTH, WIDTH)
        self.o = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch_size, tokens, _ = x.shape
        # -1 heads: a column-wise q, k, v hold this rank's heads only (HEADS / tp of them).
        q, k, v = (
            proj(x).view(batch_size, tokens, -1, WIDTH // HEADS).transpose(1, 2) for proj in (self.q, self.k, self.v)
        )
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(batch_size, tokens, -1)
        result: torch.Tensor = self.o(out)
        return result


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.down(torch.tanh(self.up(x)))
        return result


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(WIDTH)
        self.attention = Attention()
        self.ffn_norm = nn.LayerNorm(WIDTH)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        result: torch.Tensor = x + self.feed_forward(self.ffn_norm(x))
        return result


class Decoder(nn.Module):
    """torchtitan's Llama in miniature: its module names, so its TP plan applies as written; a stage keeps the whole
    model's names and has the other stages' parts set to None, as torchtitan's pipeline split does."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(WIDTH)
        self.output: nn.Linear | None = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            x = layer(x)
        x = self.norm(x) if self.norm is not None else x
        return self.output(x) if self.output is not None else x


def make_decoder(seed: int = 0, layers: int = 2) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(layers)


def batch(step: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The full batch of ``step``: token ids and next-token targets (the same on every rank that asks)."""
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (size, TOKENS + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def apply_plain_tp(model: Decoder, mesh: Any) -> None:
    """The blocks' Linears column-/row-wise over ``mesh``; the embedding, norms and head left as plain tensors."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.layers.values():
        plan = {
            "attention.q": ColwiseParallel(),
            "attention.k": ColwiseParallel(),
            "attention.v": ColwiseParallel(),
            "attention.o": RowwiseParallel(),
            "feed_forward.up": ColwiseParallel(),
            "feed_forward.down": RowwiseParallel(),
        }
        parallelize_module(block, mesh, plan)


def apply_torchtitan_tp(model: Decoder, mesh: Any) -> None:
    """torchtitan's Llama plan: a row-wise embedding, SequenceParallel norms, a column-wise head."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    top: dict[str, Any] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    parallelize_module(model, mesh, top)
    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.q": ColwiseParallel(),
            "attention.k": ColwiseParallel(),
            "attention.v": ColwiseParallel(),
            "attention.o": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.up": ColwiseParallel(),
            "feed_forward.down": RowwiseParallel(output_layouts=Shard(1)),
        }
        parallelize_module(block, mesh, plan)


def stage_modules(model: Decoder, stage: int, stages: int) -> Decoder:
    """Stage ``stage`` of ``stages``, as torchtitan's pipeline split makes it: the whole model's names, the other
    stages' layers removed, the embedding on the first stage only, the norm and head on the last only."""
    names = list(model.layers)
    per = len(names) // stages
    keep = set(names[stage * per : (stage + 1) * per])
    for name in names:
        if name not in keep:
            del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
    if stage != stages - 1:
        model.norm = None
        model.output = None
    return model


@torch.no_grad()
def titan_clip(parameters: Any, max_norm: float, pp_mesh: Any = None) -> torch.Tensor:
    """torchtitan's ``dist_utils.clip_grad_norm_`` (torchtitan/distributed/utils.py), as it calls torch: the total norm
    of the gradients through ``get_total_norm`` (a DTensor's placement-aware), ``full_tensor()``, the p-th powers
    summed over the pipeline's stages, then ``clip_grads_with_norm_`` with that one norm."""
    import torch.distributed as dist

    parameters = list(parameters)
    total = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None], 2.0)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    if pp_mesh is not None:
        total **= 2.0
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
        total **= 0.5
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total
