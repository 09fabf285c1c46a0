"""A NaN in a token embedding's own gradient, beside a position embedding (#50 item 6): the position embedding
is fed from the input and its output summed with the token embedding's, so it passed nothing back to it; the
origin names the module that took the sum (the next one in forward order that was not fed from the input) as the
one that could have passed the NaN back, and the position embedding as a sibling."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gradguard import GradGuard, GradientHalt, Policy

HALT = {"version": 1, "rules": [{"name": "nonfinite", "match": ["*"], "actions": [{"action": "halt_on_nonfinite"}]}]}


class TinyGPT(nn.Module):
    """GPT-2's shape in small: token and position embeddings summed, dropout, one block, a final norm, a head tied
    to the token embedding."""

    def __init__(self, vocab: int = 32, positions: int = 16, width: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(positions, width)
        self.drop = nn.Dropout(0.0)
        self.block = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1])
        hidden = self.drop(self.wte(tokens) + self.wpe(positions))
        logits: torch.Tensor = self.head(self.ln_f(hidden + self.block(hidden)))
        return logits


def poison_first_element(grad: torch.Tensor) -> torch.Tensor:
    """A tensor hook that writes one NaN into the gradient it is given."""
    grad = grad.clone()
    grad.view(-1)[0] = math.nan
    return grad


def halt_of(model: nn.Module, loss_of: object) -> GradientHalt:
    """One step under a halting guard (the default trace): the halt it raises."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with GradGuard(model, Policy.from_dict(HALT), logger=None):
        loss_of()  # type: ignore[operator]
        with pytest.raises(GradientHalt) as caught:
            opt.step()
    return caught.value


def test_a_nan_in_the_token_embedding_is_not_said_to_be_passed_back_by_the_position_embedding_beside_it() -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    model.wte.weight.register_hook(poison_first_element)  # type: ignore[no-untyped-call]
    tokens = torch.randint(0, 32, (2, 8))

    def loss() -> None:
        nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()  # type: ignore[no-untyped-call]

    halt = halt_of(model, loss)
    origin = halt.origin
    assert origin is not None
    assert (origin["module"], origin["before"], origin["first"]) == ("wte", "wpe", True)
    assert (origin["passer"], origin["beside"]) == ("drop", ["wpe"])
    message = str(halt)
    assert "that wpe passed back" not in message
    assert "in the gradient of its output that drop passed back" in message
    assert "wpe, fed from the input beside it, passed nothing back to it" in message
    assert "Likelier its own gradients" in message


def test_the_same_holds_for_transformers_gpt2_with_tiny_sizes() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=32, n_positions=16, n_embd=8, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    model.transformer.wte.weight.register_hook(poison_first_element)
    tokens = torch.randint(0, 32, (2, 8))
    halt = halt_of(model, lambda: model(tokens, labels=tokens).loss.backward())
    origin = halt.origin
    assert origin is not None
    assert (origin["module"], origin["passer"], origin["beside"]) == (
        "transformer.wte",
        "transformer.drop",
        ["transformer.wpe"],
    )
    assert "that transformer.wpe passed back" not in str(halt)
    assert "that transformer.drop passed back" in str(halt)
