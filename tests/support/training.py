"""What the guarded-versus-reference training tests share: a small MLP, a policy from rule dicts, torch's
own clip applied by hand, and bitwise comparisons of gradients, parameters and optimizer state.

``conftest.py`` hands several of these to tests as fixtures too (``make_policy``, ``same``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradguard import Policy

# --- models ---------------------------------------------------------------------------------------


class SmallMLP(nn.Module):
    """Linear layers ``inp`` (8 -> 16), ``hidden`` (16 -> 16) and ``out`` (16 -> 4) with tanh between them,
    big enough that a clip at max_norm 1.0 bites every step.

    ``hidden=False`` leaves the hidden layer out (8 -> 16 -> 4); ``with_spare=True`` adds ``spare``,
    never used in forward, so its gradient stays None. Layers are made in that order, so a seed gives
    the same ``inp`` and ``out`` weights whichever is asked for.
    """

    def __init__(self, *, hidden: bool = True, with_spare: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.hidden = nn.Linear(16, 16) if hidden else None
        self.out = nn.Linear(16, 4)
        self.spare = nn.Linear(4, 4) if with_spare else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.hidden is not None:
            h = torch.tanh(self.hidden(h))
        return self.out(h)  # type: ignore[no-any-return]


class BatchNormNet(nn.Module):
    """Parameters, BatchNorm's running statistics (floats an EMA lerps) and its batch count (an integer it copies);
    made under seed 0."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.norm, self.out = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(torch.relu(self.norm(self.inp(x))))
        return out


class TinyRegressor(nn.Module):
    """Two linear layers, no dropout, made under seed 0; returns {"loss": mse} (a Hugging Face Trainer's model)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 8)
        self.second = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.second(torch.tanh(self.first(x))), y)}


def mlp_pair(seed: int = 0) -> tuple[SmallMLP, SmallMLP]:
    """A :class:`SmallMLP` made under ``torch.manual_seed(seed)``, and an independent copy of it."""
    torch.manual_seed(seed)
    model = SmallMLP()
    return model, copy.deepcopy(model)


# --- policies and logs ----------------------------------------------------------------------------


def make_policy(*rules: Mapping[str, Any]) -> Policy:
    """A version-1 policy from rule dicts (name defaults to r0, r1, ...)."""
    listed = [{"name": f"r{i}", **rule} for i, rule in enumerate(rules)]
    return Policy.from_dict({"version": 1, "rules": listed})


def events_of(path: Path, kind: str) -> list[dict[str, Any]]:
    """The events named ``kind`` in a JSON-lines audit log, in order."""
    return [event for line in path.read_text().splitlines() if (event := json.loads(line))["event"] == kind]


# --- references -----------------------------------------------------------------------------------


def clip_each(model: nn.Module, max_norm: float) -> int:
    """The reference for a tensor-scope clip_norm: torch's clip_grad_norm_ on each parameter alone.

    Returns how many tensors it changed (clip coefficient below 1), which is what the guard counts.
    """
    changed = 0
    for p in model.parameters():
        if p.grad is not None:
            norm = torch.nn.utils.clip_grad_norm_([p], max_norm)
            changed += bool(max_norm / (norm + 1e-6) < 1.0)
    return changed


# --- comparing bit for bit ------------------------------------------------------------------------


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers, detached and cloned."""
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient (cloned), or None, by name in model order."""
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Deep equality of nested dicts/lists of tensors and plain values; tensors compared with torch.equal
    (dtype and shape too)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype, f"{where}: {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{where}: {a.shape} != {b.shape}"
        assert torch.equal(a, b), f"{where}: max abs diff {(a.double() - b.double()).abs().max().item()}"
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping), where
        assert set(a) == set(b), f"{where}: keys {sorted(a, key=repr)} != {sorted(b, key=repr)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple), where
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_params(guarded: nn.Module, reference: nn.Module, where: str) -> None:
    """The same parameter names in the same order, and bitwise equal values."""
    params_g, params_r = dict(guarded.named_parameters()), dict(reference.named_parameters())
    assert list(params_g) == list(params_r), f"{where}: parameter names"
    assert_same(params_g, params_r, f"{where}: parameters")


def assert_same_training_state(
    guarded: nn.Module,
    reference: nn.Module,
    opt_g: torch.optim.Optimizer,
    opt_r: torch.optim.Optimizer,
    where: str,
    *,
    param_groups: bool = False,
) -> None:
    """Parameters and optimizer state bitwise equal.

    With ``param_groups``, the optimizer must also have state to compare, and its param groups
    (learning rates and the like) must be equal too.
    """
    assert_same_params(guarded, reference, where)
    state_g, state_r = opt_g.state_dict(), opt_r.state_dict()
    if param_groups:
        assert state_g["state"], f"{where}: the optimizer has no state to compare"
    assert list(state_g["state"]) == list(state_r["state"]), f"{where}: optimizer state keys"
    assert_same(state_g["state"], state_r["state"], f"{where}: optimizer state")
    if param_groups:
        assert_same(state_g["param_groups"], state_r["param_groups"], f"{where}: param groups")


def hf_training_args(tmp_path: Path, **overrides: Any) -> Any:
    """``transformers.TrainingArguments`` for a tiny CPU fit that writes nothing but ``tmp_path/out``."""
    import transformers

    options: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "seed": 0,
    }
    options.update(overrides)
    return transformers.TrainingArguments(**options)


def hf_poison_at(step: int, param: str = "second.weight") -> Any:
    """A Hugging Face ``TrainerCallback``: a NaN in one element of ``param``'s gradient during the backward of global
    step ``step`` (shared by the Trainer recovery tests)."""
    import transformers

    class PoisonAt(transformers.TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            def hook(grad: torch.Tensor) -> torch.Tensor:
                if state.global_step != step:
                    return grad
                grad = grad.clone()
                grad.view(-1)[0] = float("nan")
                return grad

            dict(model.named_parameters())[param].register_hook(hook)

    return PoisonAt()
