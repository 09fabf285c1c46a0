"""The figures the provenance traces record: one per tensor, computed on the device with no host sync,
non-finite when the tensor has a non-finite element (a 2-norm, a sum, or for a plain Linear's output a
figure taken from its input and parameters), and which tensors a module's arguments and outputs hold."""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gradguard.enforce.distributed.collective import local_tensor
from gradguard.enforce.work.tensors import device_constant, without_grad

__all__ = [
    "HELD_BYTES",
    "MARK",
    "STRIDED",
    "HeldOutputs",
    "linear_figure",
    "mark",
    "passed_on",
    "peak",
    "tensors",
    "total",
]

_HALF = (torch.float16, torch.bfloat16)
STRIDED = torch.strided  # sparse tensors (Embedding(sparse=True) gradients) are left out: no norm kernel


def tensors(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors with elements in a module's arguments or outputs (tuples, lists, dicts), in order.

    A list, not a generator: the light trace asks at every forward for the model's output (nanoGPT's ``(logits,
    loss)``), and each step of a generator is a Python call; nested containers alone take another call."""
    found: list[torch.Tensor] = []
    _collect(value, found)
    return found


def _collect(value: Any, found: list[torch.Tensor]) -> None:
    # Tuples and lists before Mapping: an isinstance against an ABC is a Python call when it fails.
    items = value if isinstance(value, tuple | list) else value.values() if isinstance(value, Mapping) else (value,)
    for item in items:
        if isinstance(item, torch.Tensor):
            if (item.is_floating_point() or item.is_complex()) and item.layout is STRIDED and item.numel():
                found.append(item)
        elif item is not None and isinstance(item, tuple | list | Mapping):
            _collect(item, found)


def peak(tensor: torch.Tensor) -> torch.Tensor:
    """The 2-norm (in float32 at least): NaN if any element is NaN, else Inf if any is infinite (or if it
    overflows: elements beyond ~1e19). One kernel, no sync; the max-abs norm would be exact about overflow,
    but on CPU it runs 20x slower than the 2-norm."""
    local = local_tensor(tensor).detach()
    norm: torch.Tensor = torch.linalg.vector_norm(local, dtype=torch.float32 if local.dtype in _HALF else None)
    return norm


@without_grad  # not a detach: a dispatch of its own
def total(tensor: torch.Tensor) -> torch.Tensor:
    """The sum (in float32 at least): NaN if any element is NaN or if both infinities are present, else
    Inf if any is infinite or if the sum overflows (a finite tensor whose elements add up beyond ~3e38,
    far rarer than the 2-norm's overflow). Half the cost of the 2-norm on CPU; no sync."""
    # A plain tensor (every one but FSDP2's) skips the DTensor test: this runs for every hooked module at every step.
    local = tensor if type(tensor) is torch.Tensor else local_tensor(tensor)
    total: torch.Tensor = local.sum(dtype=torch.float32) if local.dtype in _HALF else local.sum()
    return total


_PROXY_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
"""Outputs a plain Linear's figure may be taken from its input and parameters for: not float16, whose
outputs overflow (beyond 65,504) from finite inputs and weights in real training."""


def linear_figure(module: nn.Module, args: Any, output: torch.Tensor, seen: bool) -> torch.Tensor | None:
    """A plain ``nn.Linear``'s output figure from what it was computed from, when that is less than half its
    output (a vocabulary head: its weight is 0.05-0.13x its logits): the sum of its weight, bias and (unless
    ``seen``: the trace's figure of the tensor it came from already covers it) input, non-finite when any of
    their elements is, as its output then is (and only then, but for an output beyond ~3e38 from finite ones,
    which float32 and bfloat16 do not reach in training). None when the module is not a plain Linear, another
    forward hook may have changed its output, or the output is the smaller read."""
    if (
        type(module).forward is not nn.Linear.forward
        or len(module._forward_hooks) != 1
        or output.dtype not in _PROXY_DTYPES
    ):
        return None
    x, weight, bias = args[0] if args else None, module.weight, module.bias
    if (
        not isinstance(x, torch.Tensor)
        or not isinstance(weight, torch.Tensor)
        or not isinstance(bias, torch.Tensor | None)
    ):
        return None
    if x.layout is not STRIDED or weight.layout is not STRIDED:
        return None
    weight = local_tensor(weight).detach()
    if 2 * (weight.numel() + (0 if seen else x.numel())) >= output.numel():
        return None
    dtype = torch.float64 if torch.float64 in (x.dtype, weight.dtype) else torch.float32
    figure = weight.sum(dtype=dtype)
    if bias is not None:
        figure = figure + local_tensor(bias).detach().sum(dtype=dtype)
    return figure if seen else figure + local_tensor(x).detach().sum(dtype=dtype)


MARK = "gradguard.last_recorded"
"""The key, in the autograd node's metadata of the light trace's last recorded tensor, of that record's marker:
a cast made after the tensor itself was freed (``head(x).float()`` in a model's forward) still points there."""


def passed_on(tensor: torch.Tensor, last: torch.Tensor | None, version: int, marker: object) -> bool:
    """Whether ``tensor`` is the light trace's last recorded tensor (``last``, alive, its ``version``; ``marker``
    in its node's metadata), unchanged, or a cast of it to a floating dtype at least as wide (a model's
    ``logits.float()``): finite exactly when it is, so not read again."""
    if last is tensor:
        return version == tensor._version
    node = tensor.grad_fn
    if node is None or type(node).__name__ != "ToCopyBackward0" or not tensor.dtype.is_floating_point:
        return False
    source = node.next_functions[0][0]
    token, itemsize = _metadata(source).get(MARK, (None, 0)) if source is not None else (None, 0)
    return token is not None and token is marker and tensor.dtype.itemsize >= itemsize


def _metadata(node: Any) -> dict[str, Any]:
    """An autograd node's metadata dict (a property at run time; torch's stubs call it a method)."""
    metadata: dict[str, Any] = node.metadata
    return metadata


def mark(tensor: torch.Tensor) -> object:
    """Mark ``tensor``'s autograd node as the last recorded (see ``passed_on``); the marker, or None."""
    node = tensor.grad_fn
    if node is None:
        return None
    marker = object()
    _metadata(node)[MARK] = (marker, tensor.dtype.itemsize)
    return marker


HELD_BYTES = 4 * 2**20
"""An output of at most this many bytes is not reduced in its hook but held, and reduced with the others at the end
of the model's forward (``HeldOutputs``): on a GPU a small tensor's reduction costs its launch, not its bytes."""


def _held_norm(device: torch.device) -> float:
    """The held outputs' norm: max-abs on a GPU (exact about overflow, and as fast as any there); the 2-norm
    elsewhere, where torch's multi-tensor max-abs runs 20x slower (1.2 ms against 60 us for a small GPT's outputs
    on one CPU thread). Either is NaN or Inf exactly when an element is, but for a 2-norm that overflows from
    elements beyond ~1e19, which only a step already diverging makes."""
    return math.inf if device.type == "cuda" else 2.0


class HeldOutputs:
    """The light trace's small outputs, reduced together (one ``_foreach_norm`` per device and dtype) instead
    of one sum launched per hooked module: 23 launches a forward become 2 or 3 on a small GPT, where each costs
    about 26 us of host time on an H200's host and the step is launch-bound.

    Outputs are held weakly: a held output costs no memory, because it is read only if the forward keeps it alive by
    itself (autograd saved it for backward, or the caller still holds it). Holding one strongly would keep every
    output nobody saves (an embedding's output fed to an add, a residual branch) alive to the end of the forward,
    at the step's peak. A module's outputs are held only after a forward in which they were reduced in the hook and
    watched, and came to its end alive and unchanged (same version); a module whose output was freed before the end
    of the forward, or changed in place after it (a ``ReLU(inplace=True)`` after it, ``x += ...`` on it), is reduced
    in its hook for good. If a held output is still freed or changed on a later forward (code that runs on some
    steps only), its figure is a finite 0 for that step: the trace names a later module, or none, rather than blame
    one for what came after it; and that module is reduced in its hook from then on.
    """

    def __init__(self) -> None:
        self.outputs: list[tuple[int, int, weakref.ReferenceType[torch.Tensor], int]] = []
        """The outputs held: (position among the figures, module index, output, its version when recorded); the light
        trace's hook appends to it itself in its common case (``hold_known``'s work without its call)."""
        self._watched: list[tuple[int, weakref.ReferenceType[torch.Tensor], int]] = []
        """(module index, output, its version) of outputs reduced in the hook, to see whether they stay alive and
        unchanged."""
        self._unchanged: set[int] = set()
        """Modules whose outputs came to the end of a watched forward alive and unchanged: held from then on."""
        self.in_hook: set[int] = set()
        """Modules whose outputs are reduced in the hook: one was freed before the end of the forward, or changed in
        place after its module returned."""
        self.fast: set[int] = set()
        """Held modules (``_unchanged``, not ``in_hook``) whose hook may hold a plain small output with no more checks
        (``hold_known``): the light trace's common case, where a step is host-bound."""
        self._never_fast: set[int] = set()
        self.reduced: set[int] = set()
        """``in_hook`` modules but ``never_fast`` ones: the light trace's hook reduces a plain output of theirs with no
        more checks."""

    def never_fast(self, indices: set[int]) -> None:
        """Modules whose outputs need the hook's checks at every forward (a Linear's figure may come from its input)."""
        self._never_fast |= indices
        self.fast -= indices
        self.reduced -= indices

    def _in_hook(self, index: int) -> None:
        self.in_hook.add(index)
        self.fast.discard(index)
        if index not in self._never_fast:
            self.reduced.add(index)

    def hold_known(self, figures: list[torch.Tensor], tensor: torch.Tensor, index: int) -> None:
        """``hold`` for a module of ``fast`` and a plain floating-point output of at most ``HELD_BYTES``."""
        self.outputs.append((len(figures), index, weakref.ref(tensor), tensor._version))
        figures.append(device_constant(0.0, torch.float32, tensor.device))

    def hold(self, figures: list[torch.Tensor], tensor: torch.Tensor, index: int) -> bool:
        """Hold ``tensor`` (its figure's place in ``figures`` kept by a 0 until ``reduce``), or False: reduce it now."""
        if index in self.in_hook or tensor.numel() * tensor.element_size() > HELD_BYTES or tensor.is_complex():
            return False
        if index in self._unchanged:
            self.hold_known(figures, tensor, index)
            return True
        self._watched.append((index, weakref.ref(tensor), tensor._version))
        return False

    def reduce(self, figures: list[torch.Tensor]) -> None:
        """Put each held output's figure (its max-abs: NaN or Inf exactly when an element is) into ``figures``."""
        held, watched = self.outputs, self._watched
        self.drop()
        for index, ref, version in watched:
            tensor = ref()
            if tensor is not None and tensor._version == version:
                self._unchanged.add(index)
                if index not in self.in_hook and index not in self._never_fast:
                    self.fast.add(index)
            else:
                self._in_hook(index)
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[int], list[torch.Tensor]]] = {}
        for position, index, ref, version in held:
            tensor = ref()
            if tensor is None or tensor._version != version:
                self._in_hook(index)  # freed, or changed in place since its module returned: its figure stays 0
                continue
            local = tensor if type(tensor) is torch.Tensor else local_tensor(tensor)
            positions, group = groups.setdefault((local.device, local.dtype), ([], []))
            positions.append(position)
            group.append(local)
        if groups:
            _reduce_held(groups, figures)

    def drop(self) -> None:
        self.outputs, self._watched = [], []


@without_grad  # one switch, not a detach of every output (a dispatch each)
def _reduce_held(
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[int], list[torch.Tensor]]], figures: list[torch.Tensor]
) -> None:
    for (device, _), (positions, group) in groups.items():
        for position, figure in zip(positions, torch._foreach_norm(group, _held_norm(device)), strict=True):
            figures[position] = figure
