"""The light trace's hooks (``provenance="first_fault"``, ``provenance.LIGHT``): a forward hook on each of the model's
outer modules that records one figure of its output, held and reduced with the others at the end of the forward where
it can be (``figures.HeldOutputs``), on the device and with no host sync.

Its hot path runs for every hooked module at every forward, where a small model's step is host-bound: a module seen
to hand out a new small output that the forward keeps alive is held in a few C calls. ``Provenance`` owns the state,
arms these hooks and reads their figures; ``Tracing`` says how they record (``LIGHT``: the default). This module may
import ``figures``, ``origins`` and ``tensors`` only.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import nn

from gradguard.enforce.provenance.figures import (
    HELD_BYTES,
    MARK,
    STRIDED,
    HeldOutputs,
    linear_figure,
    mark,
    passed_on,
    tensors,
    total,
)
from gradguard.enforce.provenance.origins import DATA, OUTPUT, BackwardMeta, ForwardMeta
from gradguard.enforce.work.tensors import device_constant

__all__ = ["LIGHT", "LINEAR_FORWARD", "MAX_ENTRIES", "LightTrace", "Tracing", "recording"]

MAX_ENTRIES = 4096
"""Figures kept per kind and step (the first ones are the ones that matter; a loop that never steps
cannot grow them without bound)."""
_STRIDED = STRIDED
_TENSOR = torch.Tensor
_HALF = (torch.float16, torch.bfloat16)
LINEAR_FORWARD = nn.Linear.forward
_grad_enabled, _set_grad_enabled = torch.is_grad_enabled, torch._C._set_grad_enabled
_graph_task = torch._C._current_graph_task_id
_dynamo_compiling, _compiler = torch.compiler.is_dynamo_compiling, torch.compiler
"""``_dynamo_compiling() or _compiler._is_compiling_flag`` is ``torch.compiler.is_compiling()`` in one Python call,
not two (it asks TorchScript first): dynamo folds ``is_dynamo_compiling`` to True where it traces, and elsewhere the
flag is ``is_compiling``'s own answer (an export, a compile session). The hooks ask it for every hooked module at every
forward."""


@dataclass(frozen=True)
class Tracing:
    """How the light trace (``first_fault``) records: the benchmark's arms vary these."""

    reduce: Callable[[torch.Tensor], torch.Tensor] = total
    backward: bool = True
    """Tensor hooks on the recorded outputs (their gradients in backward)."""
    depth: int | None = None
    """Hook only the modules at most this many dots deep (None: every module)."""
    leaves: bool = False
    """Hook only the modules without children."""
    budget: int | None = None
    """Hook at most this many modules: the model's shallowest levels, as many whole levels as fit (None: all)."""
    hold: bool = True
    """Small outputs held and reduced together at the end of the forward (``figures.HeldOutputs``), not one by one."""
    linear: bool = True
    """A plain Linear's output (a vocabulary head's logits) watched through its input and parameters when they are
    less than half its size (``_linear_figure``): on a 50k-vocabulary head the trace then never reads the logits."""
    replay: bool = False
    """Trace no forward of a clean step: hold each forward and replay a faulting step's with this trace
    (``first_fault.FirstFault``); False: trace every forward (and where the model cannot be replayed)."""


LIGHT: Final = Tracing(backward=False, budget=32, replay=True)
"""``first_fault``'s trace: sums of the outputs of the model's outermost 32 modules at most, forward only
(benchmarks/provenance.py: within 1% of the step on the GPT and the deep model; tensor hooks or every
module's outputs are not), run on a faulting step's replay only."""


class LightTrace:
    """The light trace's hooks; ``Provenance`` makes the state they record into."""

    _fwd: list[torch.Tensor]
    _fwd_meta: ForwardMeta
    _bwd: list[torch.Tensor]
    _bwd_meta: BackwardMeta
    _held: HeldOutputs
    _last: tuple[weakref.ReferenceType[torch.Tensor] | None, int, object]
    _tracing: Any
    """``Tracing``: how it records (the benchmark's arms vary it)."""
    _quick: bool
    _replaying: bool
    """A faulting step's forwards are replayed now (under no_grad: the replay keeps no graph): the hooks record."""
    """The hook may reduce a ``HeldOutputs.reduced`` module's output itself: ``_tracing`` sums outputs, holds the small
    ones and puts no tensor hooks (``LIGHT``)."""

    def _light_data(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if not kwargs:
            for arg in args:
                if type(arg) is not _TENSOR or arg.is_floating_point():
                    break
            else:
                return  # token ids, or nothing: no floating-point batch to record (without a call)
        if self._replaying or recording(self._fwd) is not None:
            for tensor in tensors((args, kwargs)):  # a batch given by keyword too (``model(input_ids=...)``)
                self._fwd.append(self._tracing.reduce(tensor))
                self._fwd_meta.append((0, DATA))

    def _light_forward(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        # ``recording``, inlined (this runs for every hooked module at every forward, where a small model's step is
        # host-bound): not under no_grad, nor in a checkpoint's recomputation in backward, nor past the cap.
        if (not _grad_enabled() and not self._replaying) or len(self._fwd) >= MAX_ENTRIES:
            return
        compiling = _dynamo_compiling() or _compiler._is_compiling_flag
        if not compiling and _graph_task() != -1 and not self._replaying:
            return
        held = self._held
        if index and not compiling and type(output) is _TENSOR and output.is_floating_point():
            # The common cases, in as few calls as they take: a plain floating-point tensor that is not the last
            # recorded one handed on unchanged (nor, below, a cast of it); not the model's (it ends the forward).
            last, version, _ = self._last
            if last is not None and last() is output and version == output._version:
                return
            if index in held.fast and output.numel() * output.element_size() <= HELD_BYTES:
                # A module whose outputs were held before, handing out a new small tensor: held (no marker: a cast
                # of it is read as its own).
                self._last = (weakref.ref(output), output._version, None)
                held.outputs.append((len(self._fwd), index, weakref.ref(output), output._version))
                self._fwd.append(device_constant(0.0, torch.float32, output.device))
                self._fwd_meta.append((index, OUTPUT))
                return
            node = output.grad_fn
            if (
                index in held.reduced
                and self._quick
                and output.layout is _STRIDED
                and output.numel()
                and (node is None or type(node).__name__ != "ToCopyBackward0")
            ):
                # A module whose output the forward frees (``HeldOutputs.in_hook``): reduced here, as
                # ``_light_record`` would, with ``mark``'s marker put on its node.
                marker = None
                if node is not None:
                    marker = object()
                    node.metadata[MARK] = (marker, output.dtype.itemsize)  # type: ignore[index]
                self._last = (weakref.ref(output), output._version, marker)
                _set_grad_enabled(False)  # ``total``, without its wrapper's call
                try:
                    reduced = output.sum(dtype=torch.float32) if output.dtype in _HALF else output.sum()
                finally:
                    _set_grad_enabled(True)
                self._fwd.append(reduced)
                self._fwd_meta.append((index, OUTPUT))
                return
        if isinstance(output, torch.Tensor):
            if (output.is_floating_point() or output.is_complex()) and output.layout is _STRIDED and output.numel():
                # Only a Linear asks whether its input was passed on: ``linear_figure`` alone uses the answer.
                linear = type(module).forward is LINEAR_FORWARD and self._tracing.linear
                figure = linear_figure(module, args, output, self._passed_on(args)) if linear else None
                self._light_record(output, index, figure, compiling)
        else:
            for tensor in tensors(output):
                self._light_record(tensor, index, None, compiling)
        if index == 0:
            held.reduce(self._fwd)  # the model's forward is done: the outputs held are reduced together

    def _passed_on(self, args: Any) -> bool:
        """Whether a module's first argument is the last recorded tensor, or a widening cast of it."""
        last, version, marker = self._last
        tensor = args[0] if args else None
        if last is None or not isinstance(tensor, torch.Tensor) or _dynamo_compiling() or _compiler._is_compiling_flag:
            return False  # dynamo cannot compare ids
        return passed_on(tensor, last(), version, marker)

    def _light_record(self, tensor: torch.Tensor, index: int, figure: torch.Tensor | None, compiling: bool) -> None:
        if not compiling:  # dynamo cannot compare ids: there a container's output is read twice
            last, version, marker = self._last
            if last is not None and passed_on(tensor, last(), version, marker):
                return  # a container passing its last child's output on (or a widening cast of it)
            self._last = (weakref.ref(tensor), tensor._version, mark(tensor))
        position = len(self._fwd)
        if figure is not None or compiling or not self._tracing.hold or not self._held.hold(self._fwd, tensor, index):
            self._fwd.append(self._tracing.reduce(tensor) if figure is None else figure)
        self._fwd_meta.append((index, OUTPUT))
        if tensor.requires_grad and self._tracing.backward:
            tensor.register_hook(functools.partial(self._light_backward, index, position))  # type: ignore[no-untyped-call]

    def _light_backward(self, producer: int, position: int, grad: torch.Tensor) -> None:
        if len(self._bwd) < MAX_ENTRIES and grad.layout is _STRIDED:
            self._bwd.append(self._tracing.reduce(grad))
            self._bwd_meta.append((producer, [], position))


def recording(entries: list[torch.Tensor]) -> bool | None:
    """Whether the hooks record now: None if not, else whether dynamo is compiling (a function of its own, not a
    method: it runs in every hook, for every hooked module at every forward)."""
    # Not under no_grad (evaluation), and not the recomputation that activation checkpointing runs
    # inside backward (it repeats the forward the first figures already describe).
    # Under torch.compile (dynamo inlines the hooks) the graph task id is not traceable: every hooked module
    # would break the graph; a compiled region is not a checkpoint's recomputation.
    if not _grad_enabled() or len(entries) >= MAX_ENTRIES:
        return None
    compiling = _dynamo_compiling() or _compiler._is_compiling_flag
    return compiling if compiling or _graph_task() == -1 else None
