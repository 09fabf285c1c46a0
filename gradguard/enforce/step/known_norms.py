"""The loop's own clip after the guard's step, without reading the gradients a second time.

A loop that clips globally (nanoGPT, timm, Lightning, accelerate, HF ``Trainer``) calls ``clip_grad_norm_``
right after the guard's step has taken every gradient's 2-norm. Torch would take them all again (a second
pass over the gradients) and multiply every gradient by its coefficient, 1 or not (a third and fourth).
Instead, the norms the guard took are used where the gradient is unchanged since (the same tensor at the same
version), torch's own ``_foreach_norm`` takes only the others, the total is stacked and reduced exactly as torch
does (so it is bitwise torch's), and the multiply is left out when the step's one read already showed that the
total is below ``max_norm`` by a margin (a multiply by 1 changes no bit). Where any of that does not hold (a
norm other than 2, ``error_if_nonfinite``, half precision, the per-tensor loop torch takes without foreach,
several devices, DTensors), torch's own function runs.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from functools import partial
from operator import attrgetter, is_, itemgetter, mul
from typing import Any, cast

import torch
from torch.utils._foreach_utils import _device_has_foreach_support, _group_tensors_by_device_and_dtype

from gradguard.enforce.work.participant import Participant
from gradguard.enforce.work.step_work import StepContext, StepPlan, StepWork
from gradguard.enforce.work.tensors import EPS, version_of, without_grad

__all__ = ["KnownNorms", "clip_with_known_norms"]

_EXACT = (torch.float32, torch.float64)
_EXACT_SET = frozenset(_EXACT)
_PLAIN, _STRIDED = {torch.Tensor}, {torch.strided}
_LAYOUT = attrgetter("layout")
_NORM, _VALUE = itemgetter(0), itemgetter(1)
_Hit = tuple[torch.Tensor | None, float | None, torch.Tensor]
_IS_NONE = partial(is_, None)
_GROUP = getattr(torch._C, "_group_tensors_by_device_and_dtype", None) or _group_tensors_by_device_and_dtype
"""torch's grouping itself: its Python wrapper only adds ``no_grad`` (eight Python calls a clip), and the clip runs
without grad already."""
_FOREACH_DEVICES: dict[str, bool] = {}
"""``_device_has_foreach_support`` by device type, asked once."""


MARGIN = 1e-3
"""Relative margin between the host's sum of the read norms and ``max_norm`` under which the multiply is left
out: the device's float32 reduction differs from the host's float64 sum by far less."""


class KnownNorms(Participant):
    """The 2-norms of the gradients as the guard's last step left them (device tensors, and host floats where read).

    Held as the step left them (``hold``), and looked at only when a clip asks (most steps none does): the step's
    gradients are held until the optimizer has stepped (``clear`` runs then, and at the next step), never longer;
    inside a DeepSpeed update (no guarded optimizer steps) until the next step, where they are views of DeepSpeed's
    own buffers.
    """

    def __init__(self) -> None:
        self._work: tuple[StepWork, dict[int, torch.Tensor]] | None = None
        self._entries: dict[tuple[int, int], tuple[torch.Tensor | None, float | None, torch.Tensor]] | None = None
        """``(id(gradient), its version) -> (its norm on the device or None, the norm's value, the gradient)``: the
        gradient is held, so no other live tensor has its id, and the key alone tells it is the same, unchanged."""
        self.stacked: tuple[list[torch.Tensor], torch.Tensor] | None = None
        """The step's raw norms and their stack (``Pending.raw_stack``): a clip over exactly those stacks none again."""

    def opens(self, step: int, plan: StepPlan, context: StepContext) -> bool:
        self.clear()  # a new step's gradients: the last one's norms describe nothing now
        return True

    def applied(self, work: StepWork) -> None:
        self.hold(work, work.wrapped)

    def release(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._work, self._entries, self.stacked = None, None, None

    def hold(self, work: StepWork, wrapped: dict[int, torch.Tensor]) -> None:
        """Keep an applied step's figures for the one clip that may follow it."""
        self._work, self._entries = (work, wrapped) if work.raw_host else None, None

    def take(self) -> bool:
        """Whether norms of the step just treated are held, for one clip: the first after the step uses them, later
        ones compute their own (code between may have changed a gradient through ``.data``, which no version
        shows)."""
        if self._work is None:
            return False
        self._entries = _entries(*self._work)
        self.stacked = self._work[0].pending.raw_stack
        self._work = None
        return True

    def lookup(self, grads: list[torch.Tensor]) -> list[tuple[torch.Tensor | None, float | None, torch.Tensor] | None]:
        """Each gradient's entry (None: not known, or changed since), found with map and zip: loops in C."""
        entries = self._entries
        if entries is None:
            return [None] * len(grads)
        return list(map(entries.get, zip(map(id, grads), map(version_of, grads), strict=True)))


def _entries(
    work: StepWork, wrapped: dict[int, torch.Tensor]
) -> dict[tuple[int, int], tuple[torch.Tensor | None, float | None, torch.Tensor]]:
    """``KnownNorms._entries``: the raw norm of each gradient still as it arrived, and the value (not the tensor) of
    each one the step multiplied once after its read."""
    grads, versions, host, factors = work.grads, work.raw_versions, work.raw_host, work.writes.factors
    out: dict[tuple[int, int], tuple[torch.Tensor | None, float | None, torch.Tensor]] = {}
    for index, norm in work.raw.items():
        grad = grads.get(index)
        if grad is None or index in wrapped:
            continue
        if grad._version == versions[index]:
            out[id(grad), grad._version] = (norm, host[index], grad)
        elif index in factors and grad._version == versions[index] + 1:  # one deferred multiply, nothing else
            out[id(grad), grad._version] = (None, host[index] * factors[index], grad)
    return out


def _torch_takes_foreach(device: torch.device, foreach: bool | None) -> bool:
    """Whether torch's clip takes ``_foreach_norm`` for plain strided gradients on ``device`` (``_known_total``
    checked they are): ``_has_foreach_support`` is then its device's answer alone (its per-tensor type check passes
    for every one: a generator step per gradient, at every clip)."""
    if foreach is not None and not foreach:
        return False
    supported = _FOREACH_DEVICES.get(device.type)
    if supported is None:
        supported = _FOREACH_DEVICES[device.type] = _device_has_foreach_support(device)
    return supported


def _known_total(
    known: KnownNorms, grads: list[torch.Tensor], foreach: bool | None
) -> tuple[torch.Tensor, float | None] | None:
    """Torch's total 2-norm of ``grads`` from the known norms (``_foreach_norm`` for the rest), and its host
    estimate where every norm's value was read; None where torch would compute it another way."""
    if not grads:
        return None
    # Checked with map and sets (loops in C): this runs after the step's read, while the device waits for the host.
    if set(map(type, grads)) != _PLAIN or set(map(_LAYOUT, grads)) != _STRIDED:
        return None
    groups = _GROUP([list(grads)], False)
    if len({device for device, _ in groups}) != 1 or not {dtype for _, dtype in groups} <= _EXACT_SET:
        return None
    norms: list[torch.Tensor] = []
    squares = 0.0
    complete = True
    for (group_device, _), ([listed], _) in groups.items():
        group = [g for g in listed if g is not None]
        if not _torch_takes_foreach(group_device, foreach):
            return None
        found = known.lookup(group)
        if None not in found:  # a tuple against None: no tensor is compared
            hits = cast(list[_Hit], found)
            found_norms = list(map(_NORM, hits))
            if not any(map(_IS_NONE, found_norms)):  # every norm known (the common case): no loop in Python
                norms += found_norms
                values = list(map(_VALUE, hits))
                if complete and None not in values and math.isfinite(total := sum(map(mul, values, values))):
                    squares += total
                else:
                    complete = False
                continue
        missing = [g for g, hit in zip(group, found, strict=True) if hit is None or hit[0] is None]
        fresh = iter(torch._foreach_norm(missing, 2.0)) if missing else iter(())
        for hit in found:
            norm = None if hit is None else hit[0]
            norms.append(next(fresh) if norm is None else norm)
            if hit is None or hit[1] is None or not math.isfinite(hit[1]):
                complete = False
            else:
                squares += hit[1] * hit[1]
    stacked = known.stacked
    if stacked is not None and len(stacked[0]) == len(norms) and all(map(is_, stacked[0], norms)):
        stack = stacked[1]  # the step's own stack of these very norms, in this order: the same tensor torch stacks
    else:
        stack = torch.stack(norms)
    total = torch.linalg.vector_norm(stack, 2.0)
    return total, (math.sqrt(squares) if complete else None)


def _clip_norm(
    known: KnownNorms,
    multiply: Callable[..., None],
    parameters: Any,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor | None:
    if float(norm_type) != 2.0 or error_if_nonfinite:
        return None
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    found = _known_total(known, grads, foreach)
    if found is None:
        return None
    total, estimate = found
    if estimate is None or estimate * (1.0 + MARGIN) + EPS >= float(max_norm):  # torch's coefficient: max / (n + EPS)
        multiply(params, max_norm, total, foreach)  # torch's own multiply, by torch's coefficient
    return total


def _total_norm(
    known: KnownNorms,
    tensors: Any,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor | None:
    if float(norm_type) != 2.0 or error_if_nonfinite:
        return None
    grads = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    found = _known_total(known, grads, foreach)
    return None if found is None else found[0]


_SIGNATURES: dict[str, tuple[inspect.Signature, tuple[str, ...], frozenset[str]]] = {}
"""A clip function's signature, its parameters' names when every one may be given by position or keyword (else
empty), and the names without a default."""


def _arguments(name: str, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``signature.bind(*args, **kwargs).arguments`` as a dict, or None where torch must say what is wrong.

    The common call (``clip_grad_norm_(params, 1.0)``) is matched by name in C-level dict and zip calls: ``bind``
    runs some thirty Python calls, at every step of a loop that clips."""
    cached = _SIGNATURES.get(name)
    if cached is None:
        signature = inspect.signature(original)
        plain = all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in signature.parameters.values())
        required = frozenset(n for n, p in signature.parameters.items() if p.default is inspect.Parameter.empty)
        cached = _SIGNATURES[name] = (signature, tuple(signature.parameters) if plain else (), required)
    signature, names, required = cached
    if names and len(args) <= len(names):
        values = dict(zip(names, args, strict=False))  # fewer arguments than names: the rest by keyword
        if values.keys().isdisjoint(kwargs) and set(kwargs) <= set(names) and required <= values.keys() | kwargs:
            values.update(kwargs)
            return values
    try:
        return dict(signature.bind(*args, **kwargs).arguments)
    except TypeError:
        return None  # let torch say what is wrong


@without_grad
def clip_with_known_norms(
    known: KnownNorms, name: str, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.Tensor | None:
    """What torch's ``name`` returns, computed from the known norms; None: run torch's own function."""
    short = name.rsplit(".", 1)[-1]
    if short not in ("clip_grad_norm_", "clip_grad_norm", "get_total_norm") or not known.take():
        return None
    values = _arguments(name, original, args, kwargs)
    if values is None:
        return None
    if short == "get_total_norm":
        return _total_norm(known, values.pop("tensors"), **values)
    from torch.nn.utils.clip_grad import _clip_grads_with_norm_

    return _clip_norm(known, _clip_grads_with_norm_, values.pop("parameters"), values.pop("max_norm"), **values)
