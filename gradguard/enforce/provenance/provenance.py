"""Provenance: where a NaN or Inf started, named in the halt and the skip.

Two traces record, on the device and with no host sync, one figure per tensor (non-finite if any element
is), in the order the hooks fire; the figures ride the step's one host read and the first non-finite one
names the origin.

The light trace (``"first_fault"``, the default, run on a faulting step's replay: ``first_fault``, ``replay``;
at every forward where the model cannot be replayed): a forward hook on each of the model's outer modules (the
shallowest whole levels of at most ``Tracing.budget`` modules: every module of a small model, the blocks of a deep
one) that sums its output (a sum is half the cost of a 2-norm, and NaN/Inf all the same), and a pre-hook on the model
for the input batch; outputs only (a module's input is the previous one's output), with no per-tensor bookkeeping
but the last output's identity (a container passing its last child's output on).

The full trace (``"always"`` from the start; ``"first_fault"`` and ``"after_fault"`` arm it after a non-finite step
or skip, for ``ARMED_STEPS`` steps): module forward hooks (and a pre-hook on the model, for the batch) on every
module's floating-point inputs and outputs, each tensor once (an earlier output unchanged since is not read again: the
module is noted as one of its consumers), as 2-norms; tensor hooks on those tensors for their gradients in backward
(not ``register_full_backward_hook``, whose view of an output in-place ops after the module refuse); and
post-accumulate-grad hooks on the guarded parameters, before code after backward (a global clip) spreads one NaN.

``"after_fault"`` costs nothing until a fault and cannot name the first one.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from typing import Any, Final

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradguard.enforce.provenance.figures import STRIDED, HeldOutputs, tensors, total
from gradguard.enforce.provenance.figures import peak as _peak
from gradguard.enforce.provenance.first_fault import FirstFault
from gradguard.enforce.provenance.light_trace import LIGHT, LINEAR_FORWARD, MAX_ENTRIES, LightTrace, Tracing
from gradguard.enforce.provenance.light_trace import recording as _recording
from gradguard.enforce.provenance.origins import (
    DATA,
    INPUT,
    OUTPUT,
    BackwardMeta,
    ForwardMeta,
    ModuleTree,
    backward_origin,
    boundary_origin,
    finite_note,
    first_params,
    forward_origin,
    kind_of,
    owner_of,
    unrooted,
)
from gradguard.enforce.provenance.replay import Replay, unreplayable
from gradguard.enforce.work.participant import Participant
from gradguard.enforce.work.step_work import StepOutcome, StepWork
from gradguard.enforce.work.tensors import stack_on
from gradguard.policy.matching import Binding

__all__ = [
    "ARMED_STEPS",
    "GRADIENT_FLAGS_BY_DEFAULT",
    "LIGHT",
    "MODES",
    "UNTRACED_HINT",
    "Provenance",
    "Tracing",
    "attach_provenance",
    "check_mode",
]

MODES: Final = ("first_fault", "always", "after_fault")
ARMED_STEPS: Final = 100
"""``after_fault``: the module hooks stay armed this many steps after the last non-finite step."""
GRADIENT_FLAGS_BY_DEFAULT: Final = False
"""Whether the post-accumulate-grad flags are on from the start in ``first_fault`` and ``after_fault`` modes
too. No: on the deep benchmark model (293 tensors) they cost 5% of the whole step (a norm and a Python call
per parameter during backward), so these modes arm them with the module hooks, after a fault."""
FIRST_PARAMS_SHOWN: Final = 16
UNTRACED_HINT: Final = "To trace a first fault: GradGuard(..., provenance='first_fault')."


class _Seen:
    """A tensor recorded this step: which modules took it as input since."""

    __slots__ = ("consumers", "ref", "version")

    def __init__(self, tensor: torch.Tensor, consumers: list[int]) -> None:
        self.ref = weakref.ref(tensor)
        self.version = tensor._version
        self.consumers = consumers


class Provenance(LightTrace, FirstFault, Participant):
    """Arms and disarms the hooks, queues their figures into the step's one read, and names the origin."""

    def __init__(
        self,
        model: nn.Module,
        binding: Binding,
        mode: str | None,
        *,
        gradients: bool | None = None,
        tracing: Tracing = LIGHT,
    ) -> None:
        check_mode(mode)
        self.mode = mode
        self._tracing = tracing
        self._quick = tracing.reduce is total and tracing.hold and not tracing.backward
        self._held = HeldOutputs()
        self.gradients = mode is not None and (mode == "always" or GRADIENT_FLAGS_BY_DEFAULT)
        """Whether the gradient flags are on from the start (else they are armed with the module hooks)."""
        if gradients is not None:
            self.gradients = gradients
        self._model = weakref.ref(model)
        self._modules = [weakref.ref(module) for module in model.modules()]  # the tree's order: tied ones once
        self.tree = ModuleTree(model)
        self._param_names: dict[int, str] = {}
        self._param_refs: list[tuple[int, Callable[[], torch.Tensor | None]]] = []
        self._module_handles: list[RemovableHandle] = []
        self._grad_handles: list[RemovableHandle] = []
        self._light_handles: list[RemovableHandle] = []
        self._light_levels: tuple[int, int] | None = None
        self._armed_until: int | None = None
        self._replaying = False
        self.unreplayable = unreplayable(model) if mode == "first_fault" and tracing.replay else None
        replays = mode == "first_fault" and tracing.replay and self.unreplayable is None
        self._replay: Replay | None = Replay(model) if replays else None
        self._reset()
        if mode == "always":
            self._arm_modules()
        elif mode == "first_fault":
            self._arm_first_fault()
        self.rebind(binding)

    # --- arming ------------------------------------------------------------------------------------

    @property
    def armed(self) -> bool:
        """Whether the module hooks are registered now."""
        return bool(self._module_handles)

    def _arm_light(self) -> None:
        """``first_fault``'s light trace: a forward hook per module that reduces its output (and a tensor hook
        on that output for its gradient), and the pre-hook on the model for the batch."""
        tracing = self._tracing
        deepest = self.tree.deepest_level(tracing.budget)
        hooked = sum(1 for level in self.tree.level if level <= deepest) if deepest is not None else 0
        self._light_levels = (deepest, hooked) if deepest is not None and deepest < max(self.tree.level) else None
        """When the budget stopped the trace short of the leaves: (the deepest level hooked, modules hooked)."""
        for index, ref in enumerate(self._modules):
            module = ref()
            if module is None or (index == 0 and (tracing.depth is not None or tracing.leaves)):
                continue
            if deepest is not None and self.tree.level[index] > deepest:
                continue
            if tracing.depth is not None and self.tree.names[index].count(".") > tracing.depth:
                continue
            if tracing.leaves and next(module.children(), None) is not None:
                continue
            hook = functools.partial(self._light_forward, index)
            self._light_handles.append(module.register_forward_hook(hook))
            if index == 0 or (tracing.linear and type(module).forward is LINEAR_FORWARD) or tracing.backward:
                self._held.never_fast({index})  # the model's hook ends the forward; a Linear's figure, a tensor hook
        root = self._modules[0]()
        if root is not None:
            self._light_handles.append(root.register_forward_pre_hook(self._light_data, with_kwargs=True))

    def _disarm_light(self) -> None:
        """The default's hooks off: the light trace's, and the replay's (the forwards it held dropped)."""
        if self._replay is not None:
            self._replay.disarm()
        for handle in self._light_handles:
            handle.remove()
        self._light_handles = []

    def _arm_modules(self) -> None:
        if self._module_handles:
            return
        self._disarm_light()
        if not self.gradients and self.mode is not None:
            self._register_flags()
        for index, ref in enumerate(self._modules):
            module = ref()
            if module is not None:
                hook = functools.partial(self._forward, index)
                self._module_handles.append(module.register_forward_hook(hook))
        root = self._modules[0]()
        if root is not None:
            self._module_handles.append(root.register_forward_pre_hook(self._data, with_kwargs=True))

    def _disarm_modules(self) -> None:
        for handle in self._module_handles:
            handle.remove()
        self._module_handles = []
        if not self.gradients:
            self._remove_flags()
        if self.mode == "first_fault" and not self._light_handles:
            self._arm_first_fault()

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
        self.mode = None  # nothing re-arms
        self._disarm_modules()
        self._disarm_light()
        self._remove_flags()
        self._reset()

    def _reset(self) -> None:
        self._held.drop()
        self._fwd: list[torch.Tensor] = []
        self._fwd_meta: ForwardMeta = []
        self._bwd: list[torch.Tensor] = []
        self._bwd_meta: BackwardMeta = []
        self._acc: list[torch.Tensor] = []
        self._acc_meta: list[int] = []
        """Guarded tensor index, per accumulated-gradient figure."""
        self._seen: dict[int, _Seen] = {}
        self._last: tuple[weakref.ReferenceType[torch.Tensor] | None, int, object] = (None, -1, None)
        """The light trace's last recorded tensor, its version and marker (``figures.mark``): a container passing it on
        (or a cast of it) is not read again. Held weakly, compared by identity: a freed tensor's id is reused."""

    # --- hooks (no host sync in any of them) -------------------------------------------------------

    def _recording(self) -> bool:
        return _recording(self._fwd) is not None

    def _data(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if self._recording():
            for tensor in tensors((args, kwargs)):  # a batch given by keyword too (``model(input_ids=...)``)
                self._record(tensor, 0, DATA)

    def _forward(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        if not self._recording():
            return
        seen = self._seen
        for tensor in tensors(args):
            known = seen.get(id(tensor))
            if known is not None and known.ref() is tensor and known.version == tensor._version:
                known.consumers.append(index)
            else:
                self._record(tensor, index, INPUT)
        for tensor in tensors(output):
            known = seen.get(id(tensor))
            if known is None or known.ref() is not tensor or known.version != tensor._version:
                self._record(tensor, index, OUTPUT)  # not a container passing its last child's output on
            elif index == 0:
                known.consumers.append(0)  # the model hands it out: its gradient comes from the loss

    def _record(self, tensor: torch.Tensor, index: int, role: int) -> None:
        self._fwd.append(_peak(tensor))
        self._fwd_meta.append((index, role))
        consumers = [] if role == OUTPUT else [index]
        self._seen[id(tensor)] = _Seen(tensor, consumers)
        if tensor.requires_grad:
            producer = index if role == OUTPUT else -1
            tensor.register_hook(functools.partial(self._backward, producer, consumers))  # type: ignore[no-untyped-call]

    def _backward(self, producer: int, consumers: list[int], grad: torch.Tensor) -> None:
        if len(self._bwd) < MAX_ENTRIES and grad.layout is STRIDED:
            self._bwd.append(_peak(grad))
            self._bwd_meta.append((producer, consumers, -1))

    def _accumulated(self, index: int, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is not None and len(self._acc) < MAX_ENTRIES and grad.layout is STRIDED:
            self._acc.append(_peak(grad))
            self._acc_meta.append(index)

    # --- the step ----------------------------------------------------------------------------------

    def after_actions(self, work: StepWork) -> None:
        self.report(work)  # last: its reader sees the step's non-finite verdict

    def report(self, work: StepWork) -> None:
        """Queue this step's figures into the step's one read; the reader names the origin and arms."""
        if not self._fwd and not self._bwd and not self._acc and self.replaying:
            return  # a clean step held its forwards only: ``after_read`` replays them if it faulted
        self._held.reduce(self._fwd)  # a forward the model's own hook did not end (another entry point, an error)
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
        step = (work.outcome, work.step, tuple(work.grads))
        pending.add(values, functools.partial(self._read, step, sizes, metas, armed, distributed))

    def _read(
        self,
        step: tuple[StepOutcome, int, tuple[int, ...]],
        sizes: tuple[int, int],
        metas: tuple[ForwardMeta, BackwardMeta, list[int]],
        armed: bool,
        distributed: bool,
        values: list[float],
    ) -> None:
        outcome, index, grads = step
        treated = len(grads)
        if not outcome.nonfinite or outcome.scaler_found_inf:
            return  # nothing to explain (a GradScaler's inf is its loss-scale search, not a fault)
        self._fault(index)
        fwd, bwd, acc = values[: sizes[0]], values[sizes[0] : sum(sizes)], values[sum(sizes) :]
        first = first_params(self._param_names, acc, metas[2])
        origin = forward_origin(self.tree, fwd, metas[0]) or backward_origin(self.tree, bwd, metas[1], metas[0])
        if origin is None and fwd and not bwd and not acc:
            origin = boundary_origin(self.tree, self._param_names, metas[0], grads, outcome.nonfinite)
        singled_out = 0 < len(first) < len(outcome.nonfinite)  # some went non-finite before the others
        if origin is None and first:
            kind = kind_of(next(v for v in acc if not math.isfinite(v)))
            module = owner_of(first[0]) if singled_out else None
            origin = {"phase": "gradient", "module": module, "kind": kind, "input_nonfinite": False}
            if not singled_out:
                origin["note"] = "every non-finite gradient was so as backward accumulated it: it started in the "
                origin["note"] += "forward or backward pass" + ("" if armed else self._retrace)
        everyone = len(outcome.nonfinite) == treated > 1
        if origin is None and (acc or fwd):
            note = finite_note(bool(acc), bool(bwd), distributed)
            origin = {"phase": "after_backward", "module": None, "kind": None, "input_nonfinite": False, "note": note}
        if origin is None:
            # Nothing was recorded: after_fault's first fault (its hooks are armed from now on).
            note = "not traced: no hook was armed" + (self._retrace if self.mode == "after_fault" else "")
            origin = {"phase": "untraced", "module": None, "kind": None, "input_nonfinite": False, "note": note}
            origin["hint"] = UNTRACED_HINT
        elif (
            not armed
            and (levels := self._light_levels)
            and self.tree.has_unhooked_children(origin["module"], levels[0])
        ):
            origin["hint"] = (
                f"The first fault's trace covers the model's {levels[1]} outermost modules: for the "
                f"module inside {origin['module']}, GradGuard(..., provenance='always') (a debugging run)."
            )
        # Said only when the guard saw a clip run over these gradients before its step: a NaN that reached
        # every gradient by itself (bad data, a NaN activation) never blames a clip.
        origin["spread"] = everyone and outcome.clipped_before is not None
        if origin["spread"]:
            origin["clip"] = outcome.clipped_before
        origin["first_params"] = first[:FIRST_PARAMS_SHOWN] if singled_out else []
        outcome.origin = unrooted(origin)

    @property
    def _retrace(self) -> str:
        return f" (provenance={self.mode!r} has armed its module hooks: a recurrence is traced)" if self.mode else ""

    def _fault(self, step: int) -> None:
        if self.mode in ("after_fault", "first_fault"):
            self._arm_modules()
            self._armed_until = step + ARMED_STEPS


def attach_provenance(
    model: nn.Module, binding: Binding, mode: str | None, add_handle: Callable[[Provenance], None]
) -> Provenance | None:
    """A ``Provenance`` for ``mode`` (None: none), its removal handed to ``add_handle``."""
    if mode is None:
        return None
    provenance = Provenance(model, binding, mode, tracing=LIGHT)  # the module's: a test may trace every forward
    add_handle(provenance)
    return provenance


def check_mode(mode: object) -> None:
    if mode is not None and mode not in MODES:
        raise ValueError(f"provenance must be 'first_fault', 'always', 'after_fault' or None, got {mode!r}")
