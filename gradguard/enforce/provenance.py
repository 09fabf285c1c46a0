"""Provenance: where a NaN or Inf started, named in the halt and the skip.

Three kinds of hooks record, on the device and with no host sync, the 2-norm (NaN if any element is NaN,
Inf if any is Inf) of what they see, in the order they fire:

- module forward hooks (and a pre-hook on the model itself, for the input batch): every module's
  floating-point inputs and outputs, each tensor once (a tensor already recorded as an earlier module's
  output, unchanged since, is not read again: the module is noted as one of its consumers);
- tensor hooks on those tensors: their gradients in backward, in the order backward produces them (tensor
  hooks, not ``register_full_backward_hook``: those wrap module outputs in a view that in-place ops after
  the module, such as ``ReLU(inplace=True)``, refuse);
- post-accumulate-grad hooks on the guarded parameters: their gradients as backward accumulates them,
  before any code after backward (a ``clip_grad_norm_`` over every parameter) spreads one NaN to all.

The figures ride the step's one host read; the first non-finite one names the origin. ``"always"`` arms
every hook at attach; ``"after_fault"`` arms them (module hooks and gradient flags) after the first
non-finite step (or skip) and disarms them after :data:`ARMED_STEPS` clean steps, so it costs nothing
until a fault and traces its recurrence.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradguard.enforce.distributed import local_tensor
from gradguard.enforce.step import StepOutcome, StepWork
from gradguard.enforce.tensors import stack_on
from gradguard.policy.matching import Binding, canonical_name

__all__ = ["ARMED_STEPS", "GRADIENT_FLAGS_BY_DEFAULT", "MODES", "Provenance", "attach_provenance", "check_mode"]

MODES: Final = ("always", "after_fault")
ARMED_STEPS: Final = 100
"""``after_fault``: the module hooks stay armed this many steps after the last non-finite step."""
GRADIENT_FLAGS_BY_DEFAULT: Final = False
"""Whether the post-accumulate-grad flags are on from the start in ``after_fault`` mode too. No: on the deep
benchmark model (293 tensors) they cost 5% of the whole step (a norm and a Python call per parameter
during backward; benchmarks/step_overhead.py, gg-a against gg-a-np), so ``after_fault`` arms them with
the module hooks, after a fault."""
MAX_ENTRIES: Final = 4096
"""Figures kept per kind and step (the first ones are the ones that matter; a loop that never steps
cannot grow them without bound)."""
FIRST_PARAMS_SHOWN: Final = 16
ROOT: Final = "(model)"

_DATA, _INPUT, _OUTPUT = 0, 1, 2
_HALF = (torch.float16, torch.bfloat16)
_STRIDED = torch.strided  # sparse tensors (Embedding(sparse=True) gradients) are left out: no norm kernel


class _Seen:
    """A tensor recorded this step: which modules took it as input since."""

    __slots__ = ("consumers", "ref", "version")

    def __init__(self, tensor: torch.Tensor, consumers: list[int]) -> None:
        self.ref = weakref.ref(tensor)
        self.version = tensor._version
        self.consumers = consumers


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The floating-point tensors with elements in a module's arguments or outputs (tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        if (value.is_floating_point() or value.is_complex()) and value.layout is _STRIDED and value.numel():
            yield value
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)


def _peak(tensor: torch.Tensor) -> torch.Tensor:
    """The 2-norm (in float32 at least): NaN if any element is NaN, else Inf if any is infinite (or if it
    overflows: elements beyond ~1e19). One kernel, no sync; the max-abs norm would be exact about overflow,
    but on CPU it runs 20x slower than the 2-norm."""
    local = local_tensor(tensor).detach()
    norm: torch.Tensor = torch.linalg.vector_norm(local, dtype=torch.float32 if local.dtype in _HALF else None)
    return norm


def _kind(value: float) -> str:
    return "nan" if math.isnan(value) else "inf"


class Provenance:
    """Arms and disarms the hooks, queues their figures into the step's one read, and names the origin."""

    def __init__(self, model: nn.Module, binding: Binding, mode: str | None, *, gradients: bool | None = None) -> None:
        check_mode(mode)
        self.mode = mode
        self.gradients = mode is not None and (mode == "always" or GRADIENT_FLAGS_BY_DEFAULT)
        """Whether the gradient flags are on from the start (else they are armed with the module hooks)."""
        if gradients is not None:
            self.gradients = gradients
        self._model = weakref.ref(model)
        strip = isinstance(model, nn.DataParallel | nn.parallel.DistributedDataParallel)
        modules = list(model.named_modules())  # tied (shared) modules once, under their first name
        self._modules = [weakref.ref(module) for _, module in modules]
        self.names = [canonical_name(name, strip_module_prefix=strip) or ROOT for name, _ in modules]
        self.names[0] = ROOT
        position = {name: i for i, name in enumerate(self.names)}
        self._parent = [position.get(name.rpartition(".")[0], 0) for name in self.names]
        self._param_names: dict[int, str] = {}
        self._param_refs: list[tuple[int, Callable[[], torch.Tensor | None]]] = []
        self._module_handles: list[RemovableHandle] = []
        self._grad_handles: list[RemovableHandle] = []
        self._armed_until: int | None = None
        self._reset()
        if mode == "always":
            self._arm_modules()
        self.rebind(binding)

    # --- arming ------------------------------------------------------------------------------------

    @property
    def armed(self) -> bool:
        """Whether the module hooks are registered now."""
        return bool(self._module_handles)

    def _arm_modules(self) -> None:
        if self._module_handles:
            return
        if not self.gradients and self.mode is not None:
            self._register_flags()
        for index, ref in enumerate(self._modules):
            module = ref()
            if module is not None:
                hook = functools.partial(self._forward, index)
                self._module_handles.append(module.register_forward_hook(hook))
        root = self._modules[0]()
        if root is not None:
            self._module_handles.append(root.register_forward_pre_hook(self._data))

    def _disarm_modules(self) -> None:
        for handle in self._module_handles:
            handle.remove()
        self._module_handles = []
        if not self.gradients:
            self._remove_flags()

    def _remove_flags(self) -> None:
        for handle in self._grad_handles:
            handle.remove()
        self._grad_handles = []

    def _register_flags(self) -> None:
        self._remove_flags()
        for index, ref in self._param_refs:
            param = ref()
            if param is not None and param.requires_grad:
                hook = functools.partial(self._accumulated, index)
                self._grad_handles.append(param.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]

    def rebind(self, binding: Binding) -> None:
        """(Re)register the post-accumulate-grad flags on the binding's tensors (new after a rebind)."""
        self._param_names = {entry.index: entry.name for entry in binding.params}
        self._param_refs = [(entry.index, entry.ref) for entry in binding.params]
        if self.gradients or self.armed:
            self._register_flags()
        else:
            self._remove_flags()

    def remove(self) -> None:
        self._disarm_modules()
        self._remove_flags()
        self._reset()

    def _reset(self) -> None:
        self._fwd: list[torch.Tensor] = []
        self._fwd_meta: list[tuple[int, int]] = []
        """(module index, role: data, input or output), per forward figure."""
        self._bwd: list[torch.Tensor] = []
        self._bwd_meta: list[tuple[int, list[int]]] = []
        """(producing module or -1, the modules that took the tensor as input), per gradient figure."""
        self._acc: list[torch.Tensor] = []
        self._acc_meta: list[int] = []
        """Guarded tensor index, per accumulated-gradient figure."""
        self._seen: dict[int, _Seen] = {}

    # --- hooks (no host sync in any of them) -------------------------------------------------------

    def _recording(self) -> bool:
        # Not under no_grad (evaluation), and not the recomputation that activation checkpointing runs
        # inside backward (it repeats the forward the first figures already describe).
        return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1 and len(self._fwd) < MAX_ENTRIES

    def _data(self, module: nn.Module, args: Any) -> None:
        if self._recording():
            for tensor in _tensors(args):
                self._record(tensor, 0, _DATA)

    def _forward(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        if not self._recording():
            return
        seen = self._seen
        for tensor in _tensors(args):
            known = seen.get(id(tensor))
            if known is not None and known.ref() is tensor and known.version == tensor._version:
                known.consumers.append(index)
            else:
                self._record(tensor, index, _INPUT)
        for tensor in _tensors(output):
            known = seen.get(id(tensor))
            if known is None or known.ref() is not tensor or known.version != tensor._version:
                self._record(tensor, index, _OUTPUT)  # not a container passing its last child's output on

    def _record(self, tensor: torch.Tensor, index: int, role: int) -> None:
        self._fwd.append(_peak(tensor))
        self._fwd_meta.append((index, role))
        consumers = [] if role == _OUTPUT else [index]
        self._seen[id(tensor)] = _Seen(tensor, consumers)
        if tensor.requires_grad:
            producer = index if role == _OUTPUT else -1
            tensor.register_hook(functools.partial(self._backward, producer, consumers))  # type: ignore[no-untyped-call]

    def _backward(self, producer: int, consumers: list[int], grad: torch.Tensor) -> None:
        if len(self._bwd) < MAX_ENTRIES and grad.layout is _STRIDED:
            self._bwd.append(_peak(grad))
            self._bwd_meta.append((producer, consumers))

    def _accumulated(self, index: int, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is not None and len(self._acc) < MAX_ENTRIES and grad.layout is _STRIDED:
            self._acc.append(_peak(grad))
            self._acc_meta.append(index)

    # --- the step ----------------------------------------------------------------------------------

    def report(self, work: StepWork) -> None:
        """Queue this step's figures into the step's one read; the reader names the origin and arms."""
        fwd, bwd, acc = self._fwd, self._bwd, self._acc
        metas = (self._fwd_meta, self._bwd_meta, self._acc_meta)
        armed = self.armed
        self._reset()
        if self._armed_until is not None and work.step >= self._armed_until:
            self._armed_until = None
            self._disarm_modules()
        figures = fwd + bwd + acc
        pending = work.pending
        if not figures and not pending.parts:
            return  # nothing recorded and nothing else read: no read just for us
        device = pending.parts[0].device if pending.parts else figures[0].device
        values = stack_on(figures, device) if figures else torch.zeros(0, device=device)
        sizes = (len(fwd), len(bwd))
        distributed = work.collective is not None
        # Not ``work`` itself: a reader that holds it is a cycle (work -> pending -> reader) keeping the
        # step's gradients alive until the garbage collector runs.
        step = (work.outcome, work.step, len(work.grads))
        pending.add(values, functools.partial(self._read, step, sizes, metas, armed, distributed))

    def _read(
        self,
        step: tuple[StepOutcome, int, int],
        sizes: tuple[int, int],
        metas: tuple[list[tuple[int, int]], list[tuple[int, list[int]]], list[int]],
        armed: bool,
        distributed: bool,
        values: list[float],
    ) -> None:
        outcome, index, treated = step
        if not outcome.nonfinite or outcome.scaler_found_inf:
            return  # nothing to explain (a GradScaler's inf is its loss-scale search, not a fault)
        self._fault(index)
        fwd, bwd, acc = values[: sizes[0]], values[sizes[0] : sum(sizes)], values[sum(sizes) :]
        first = self._first_params(acc, metas[2])
        origin = self._forward_origin(fwd, metas[0]) or self._backward_origin(bwd, metas[1])
        singled_out = len(first) < len(outcome.nonfinite)  # some went non-finite before the others
        if origin is None and first:
            kind = _kind(next(v for v in acc if not math.isfinite(v)))
            module = (first[0].rpartition(".")[0] or ROOT) if singled_out else None
            origin = {"phase": "gradient", "module": module, "kind": kind, "input_nonfinite": False}
            if not singled_out:
                origin["note"] = "every non-finite gradient was so as backward accumulated it: it started in the "
                origin["note"] += "forward or backward pass" + ("" if armed else self._retrace)
        if origin is None and acc:
            note = "every gradient was finite as backward accumulated it: it went non-finite after backward"
            if distributed:
                note = "not on this rank: its forward, backward and gradients were finite (another rank's arrived"
                note += " through the all-reduce)"
            origin = {"phase": "after_backward", "module": None, "kind": None, "input_nonfinite": False, "note": note}
        everyone = len(outcome.nonfinite) == treated > 1
        if origin is None:
            # Nothing was recorded: after_fault's first fault (its hooks are armed from now on).
            note = "not traced: no hook was armed" + (self._retrace if self.mode == "after_fault" else "")
            origin = {"phase": "untraced", "module": None, "kind": None, "input_nonfinite": False, "note": note}
        # Said only when the guard saw a clip run over these gradients before its step: a NaN that reached
        # every gradient by itself (bad data, a NaN activation) never blames a clip.
        origin["spread"] = everyone and outcome.clipped_before is not None
        if origin["spread"]:
            origin["clip"] = outcome.clipped_before
        origin["first_params"] = first[:FIRST_PARAMS_SHOWN] if singled_out else []
        outcome.origin = origin

    @property
    def _retrace(self) -> str:
        return " (provenance='after_fault' has armed its module hooks: a recurrence is traced)" if self.mode else ""

    def _fault(self, step: int) -> None:
        if self.mode == "after_fault":
            self._arm_modules()
            self._armed_until = step + ARMED_STEPS

    def _first_params(self, values: list[float], meta: list[int]) -> list[str]:
        """The guarded tensors whose gradients were non-finite first, as backward accumulated them."""
        names: dict[str, None] = {}
        for value, index in zip(values, meta, strict=True):
            if not math.isfinite(value) and (name := self._param_names.get(index)):
                names[name] = None
        return list(names)

    def _forward_origin(self, values: list[float], meta: list[tuple[int, int]]) -> dict[str, Any] | None:
        names = self.names
        for position, value in enumerate(values):
            if math.isfinite(value):
                continue
            index, role = meta[position]
            origin = {"phase": "forward", "kind": _kind(value), "input_nonfinite": role == _DATA}
            if role == _DATA:
                # The batch itself: name the first module whose output it made non-finite.
                later = range(position, len(values))
                bad = (meta[k][0] for k in later if meta[k][1] == _OUTPUT and not math.isfinite(values[k]))
                seen_in = next((names[i] for i in bad), None)
                return origin | {"module": seen_in, "seen_in": seen_in}
            if role == _INPUT:
                # Non-finite on entry, yet no module before produced it: the code around this module made it.
                return origin | {"module": names[self._parent[index]], "seen_in": names[index]}
            return origin | {"module": names[index], "seen_in": names[index]}
        return None

    def _backward_origin(self, values: list[float], meta: list[tuple[int, list[int]]]) -> dict[str, Any] | None:
        names = self.names
        for position, value in enumerate(values):
            if math.isfinite(value):
                continue
            producer, consumers = meta[position]
            # The tensor's gradient comes from the modules that took it as input: the innermost of them.
            inner = [c for c in consumers if not any(d != c and self._within(d, c) for d in consumers)]
            if inner:
                module: str | None = names[inner[0]]
            elif producer > 0:
                module = names[self._parent[producer]]  # the code around the module that consumed its output
            else:
                module = None  # the gradient of the model's output: the loss, or code after the model
            seen_in = names[producer] if producer >= 0 else module
            origin: dict[str, Any] = {"phase": "backward", "module": module, "kind": _kind(value)}
            origin |= {"input_nonfinite": False, "seen_in": seen_in}
            if len(inner) > 1:
                origin["consumers"] = [names[c] for c in inner]
            if module is None:
                origin["note"] = "the gradient of the model's output was already non-finite: the loss made it"
            return origin
        return None

    def _within(self, inner: int, outer: int) -> bool:
        """Whether module ``inner`` is ``outer`` or lies inside it (by name)."""
        while inner != outer and inner != 0:
            inner = self._parent[inner]
        return inner == outer


def attach_provenance(
    model: nn.Module, binding: Binding, mode: str | None, add_handle: Callable[[Provenance], None]
) -> Provenance | None:
    """A :class:`Provenance` for ``mode`` (None: none), its removal handed to ``add_handle``."""
    if mode is None:
        return None
    provenance = Provenance(model, binding, mode)
    add_handle(provenance)
    return provenance


def check_mode(mode: object) -> None:
    if mode is not None and mode not in MODES:
        raise ValueError(f"provenance must be 'always', 'after_fault' or None, got {mode!r}")
