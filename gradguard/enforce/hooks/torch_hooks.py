"""Process-wide hooks into torch, shared by every live guard of the process.

torch keeps its optimizer step hooks in two global ``OrderedDict`` tables that every ``Optimizer.step`` iterates:
registering or removing a hook while another thread steps raises ``RuntimeError: OrderedDict mutated during
iteration`` there. So gradguard registers one pre-hook and one post-hook, once, when the first guard attaches, and
never removes them; they dispatch to the guards attached at that moment (an immutable tuple, replaced under a lock
when a guard comes or goes: a step in flight keeps iterating the tuple it read).

The same registry wraps torch's gradient clips while any guard is attached, so a loop's own ``clip_grad_norm_``
(nanoGPT, timm, Lightning, accelerate, HF Trainer) runs the guard's step first, on the raw gradients, before the clip
spreads one NaN to every gradient: ``torch.nn.utils``' ``clip_grad_norm_``, ``clip_grad_norm``, ``clip_grad_value_``,
``clip_grads_with_norm_`` and ``get_total_norm`` (which takes gradients, not parameters), and
``torch.nn.utils.clip_grad``'s ``clip_grad_norm_``, ``clip_grad_norm`` and ``clip_grad_value_``. A wrapper is a module
attribute swapped in one assignment (atomic for every thread); the originals are put back when the last guard goes,
unless someone else wrapped them on top of ours since. A name a loaded module bound before the swap (``from
torch.nn.utils import clip_grad_value_`` before gradguard attached) is swapped with them (``bound_names``). One held
elsewhere (an object's attribute) keeps torch's function; ``clip_grad_norm_`` so held looks up
``torch.nn.utils.clip_grad``'s ``_get_total_norm`` and ``_clip_grads_with_norm_`` at call time: those are wrapped too
(as ``get_total_norm`` and ``clip_grads_with_norm_``, ``clip_norms``), so the guard's step runs before such a clip
takes its norm; inside a call already intercepted they pass straight through.

It wraps ``torch.autograd.backward`` (which ``Tensor.backward`` calls) to hand each backward's root to the guards whose
policy watches the loss (the ``loss`` section), unscaled where ``GradScaler.scale`` made it; and
``torch.amp.GradScaler.scale`` and ``unscale_`` (class attributes, the same way), so a guard acting at a clip knows
whether the gradients are still scaled (the guard then waits for the optimizer's step) or were unscaled, with which
inf/NaN flags (the scaler's skip stays the scaler's).
"""

from __future__ import annotations

import functools
import threading
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from gradguard.enforce.hooks import bound_names, clip_norms
from gradguard.enforce.hooks.guard_hooks import CLIP_SITES, CLIPS, ClipCall, GuardHooks
from gradguard.enforce.hooks.scaler_agreement import agree_found_inf
from gradguard.enforce.triggers.loss import LossWatch, root_of
from gradguard.errors import GradientHalt

__all__ = [
    "CLIPS",
    "ClipCall",
    "Enlisted",
    "GuardHooks",
    "enlist",
    "note_scaled_root",
    "optimizer_steps",
]


_lock = threading.Lock()
_guards: tuple[weakref.ReferenceType[GuardHooks], ...] = ()
_optimizer_hooks_registered = False
_wrapped: list[tuple[Any, str, Callable[..., Any], Callable[..., Any]]] = []
"""(owner, attribute, original, wrapper) of every swap in force."""
_steps: weakref.WeakKeyDictionary[Optimizer, int] = weakref.WeakKeyDictionary()
_steps_lock = threading.Lock()
_scaled: weakref.WeakKeyDictionary[torch.amp.GradScaler, tuple[Any, int]] = weakref.WeakKeyDictionary()
"""Scalers that scaled a loss, with their per-optimizer state table then (``update()`` replaces it: another table
means that step is finished; held, not its ``id``, which a new table could take) and the thread that scaled it."""
_unscaled: weakref.WeakKeyDictionary[torch.amp.GradScaler, dict[int, weakref.ReferenceType[Optimizer]]] = (
    weakref.WeakKeyDictionary()
)
_scaler_lock = threading.Lock()
_dynamo_compiling, _compiler = torch.compiler.is_dynamo_compiling, torch.compiler
"""``torch.compiler.is_compiling()`` in one call, as ``provenance.light_trace`` asks it (at every backward here)."""


class Enlisted:
    """A guard's place in the registry; ``remove`` takes it out (the last one unwraps the clips)."""

    def __init__(self, ref: weakref.ReferenceType[GuardHooks]) -> None:
        self.ref = ref

    def remove(self) -> None:
        global _guards
        with _lock:
            _guards = tuple(ref for ref in _guards if ref is not self.ref and ref() is not None)
            if not _guards:
                _unwrap_all()


def enlist(guard: GuardHooks) -> Enlisted:
    """Dispatch torch's optimizer steps and clips to ``guard`` from now on (held weakly)."""
    global _guards, _optimizer_hooks_registered
    ref: weakref.ReferenceType[GuardHooks] = weakref.ref(guard)
    with _lock:
        if not _optimizer_hooks_registered:
            # Never removed: removing mutates torch's table while another thread may iterate it.
            register_optimizer_step_pre_hook(_before_step)
            register_optimizer_step_post_hook(_after_step)
            _optimizer_hooks_registered = True
        _guards = (*(r for r in _guards if r() is not None), ref)
        if not _wrapped:
            _wrap_all()
    with _scaler_lock:
        # A scaler this thread left scaled (a run that halted between scale() and update()) is a finished
        # training's: a guard attached now starts a new one, whose clip must not wait for that scaler.
        here = threading.get_ident()
        for scaler in [scaler for scaler, (_, thread) in list(_scaled.items()) if thread == here]:
            del _scaled[scaler]
    return Enlisted(ref)


def _live() -> list[GuardHooks]:
    """The guards enlisted now, alive (the hooks on the step's path loop over ``_guards`` themselves: no call)."""
    live = []
    for ref in _guards:  # the tuple as it is now: a guard enlisted or removed meanwhile does not disturb it
        guard = ref()
        if guard is not None:
            live.append(guard)
    return live


@torch.compiler.disable  # type: ignore[untyped-decorator]
def _before_step(
    optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    with _steps_lock:
        _steps[optimizer] = _steps.get(optimizer, 0) + 1
    changed = None
    for ref in _guards:  # the tuple as it is now; a loop without a call (it runs at every step)
        if (guard := ref()) is None:
            continue
        try:
            result = guard._on_optimizer_step(optimizer, args, kwargs)
        except GradientHalt as halt:
            raise _raised_here(halt) from None
        if result is not None:
            args, kwargs = changed = result
    return changed


def _raised_here(halt: GradientHalt) -> GradientHalt:
    """``halt`` without the frames of the guard's step below the hook torch called (about a dozen: the guard, the
    engine, the pipeline's stages, the verdicts), so its traceback ends at the loop's own ``step()`` or clip and the
    hook that raised it. A halt is the guard's verdict, not a fault in its code: those frames tell a user nothing the
    message and the halt's fields do not, and they would keep the halted step's gradients and work alive for as long
    as the halt is held."""
    return halt.with_traceback(None)


@torch.compiler.disable  # type: ignore[untyped-decorator]
def _after_step(optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    for ref in _guards:  # the tuple as it is now; a loop without a call (it runs at every step)
        if (guard := ref()) is None:
            continue
        guard._after_optimizer_step(optimizer)


def optimizer_steps(optimizer: Optimizer) -> int:
    """How many times ``optimizer.step()`` has begun since the first guard attached (per optimizer, so a
    GradScaler's skip is seen as an unchanged count whatever other threads step meanwhile)."""
    with _steps_lock:
        return _steps.get(optimizer, 0)


# --- the clips ------------------------------------------------------------------------------------


def _wrap_all() -> None:
    import importlib

    made: dict[int, tuple[Callable[..., Any], Callable[..., Any]]] = {}
    for module_name, attribute, of_grads, first in (*CLIP_SITES, *clip_norms.INNER_SITES):
        owner = importlib.import_module(module_name)
        original = getattr(owner, attribute, None)
        if original is None:
            continue  # an older torch without this spelling
        wrapper = made.get(id(original), (None, None))[1]
        if wrapper is None:
            wrapper = _clip_wrapper(original, f"{module_name}.{attribute}", of_grads, first)
            made[id(original)] = (original, wrapper)
        setattr(owner, attribute, wrapper)
        _wrapped.append((owner, attribute, original, wrapper))
    _wrapped.extend(bound_names.rebind(made))  # the same functions bound by name in the loop's modules
    autograd = importlib.import_module("torch.autograd")
    original_backward = autograd.backward
    backward = _backward_wrapper(original_backward)
    setattr(autograd, "backward", backward)  # noqa: B010 (a module attribute, swapped like the clips)
    _wrapped.append((autograd, "backward", original_backward, backward))
    for attribute, make in (("scale", _scale_wrapper), ("unscale_", _unscale_wrapper)):
        original = getattr(torch.amp.GradScaler, attribute)
        wrapper = make(original)
        setattr(torch.amp.GradScaler, attribute, wrapper)
        _wrapped.append((torch.amp.GradScaler, attribute, original, wrapper))


def _unwrap_all() -> None:
    for owner, attribute, original, wrapper in reversed(_wrapped):
        if owner.__dict__.get(attribute) is wrapper:  # not if another library wrapped ours since
            setattr(owner, attribute, original)
    _wrapped.clear()


def _clip_wrapper(original: Callable[..., Any], name: str, of_grads: bool, first: str) -> Callable[..., Any]:
    with_norm = name.endswith("clip_grads_with_norm_")

    @functools.wraps(original)
    def intercepted(*args: Any, **kwargs: Any) -> Any:
        if not _guards or getattr(clip_norms.inside, "clip", False):
            return original(*args, **kwargs)
        if args:
            tensors = _as_list(args[0])
            args = (tensors, *args[1:])
        elif first in kwargs:
            tensors = kwargs[first] = _as_list(kwargs[first])
        else:
            return original(*args, **kwargs)  # let torch say what is missing
        clip_norms.inside.clip = True
        try:
            if with_norm:
                clip_norms.refresh(tensors, args, kwargs)  # a norm taken before the guard's step dropped gradients
            acted, result = _clip_instead(ClipCall(name, tensors, of_grads), original, args, kwargs)
            if result is None:
                result = original(*args, **kwargs)
                if acted:
                    _after_clip(acted)
            if acted and of_grads:
                clip_norms.noted(result, tensors, original, args, kwargs)
        finally:
            clip_norms.inside.clip = False
        return result

    intercepted.__gradguard_original__ = original  # type: ignore[attr-defined]
    return intercepted


# The guards run eagerly, also inside a torch.compile'd function (their step reads the host once and keeps
# Python state that dynamo must not trace): dynamo breaks the graph around these calls.
@torch.compiler.disable  # type: ignore[untyped-decorator]
def _clip_instead(
    call: ClipCall, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[GuardHooks], Any]:
    """The guards that act at this clip, and what the clip returns from the norms a guard's step has just taken
    (None: torch's own clip runs, and ``_after_clip`` follows it). One crossing of ``torch.compiler.disable`` where
    a guard answers the clip (each costs 3 Python calls a step): the guards' ``_after_clip`` is called here then, as
    it was right after the answer."""
    acted = []
    for ref in _guards:  # the tuple as it is now; a loop without a call (it runs at every step)
        if (guard := ref()) is None:
            continue
        try:
            if guard._before_clip(call):
                acted.append(guard)
        except GradientHalt as halt:
            raise _raised_here(halt) from None
    for guard in acted:
        result = guard._clip_instead(call.name, original, args, kwargs)
        if result is not None:
            for each in acted:
                each._after_clip()
            return acted, result
    return acted, None


@torch.compiler.disable  # type: ignore[untyped-decorator]
def _after_clip(acted: list[GuardHooks]) -> None:
    for guard in acted:
        guard._after_clip()


def _as_list(value: Any) -> Any:
    """The tensors of a clip's first argument, as a list it can still be given (a generator only runs once)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, types.GeneratorType | Iterable):
        return list(value)
    return value


# --- GradScaler -------------------------------------------------------------------------------------


def _scale_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def scale(self: torch.amp.GradScaler, outputs: Any) -> Any:
        if self.is_enabled():
            with _scaler_lock:
                _scaled[self] = (self._per_optimizer_states, threading.get_ident())
        result = original(self, outputs)
        if self.is_enabled() and isinstance(outputs, torch.Tensor) and isinstance(result, torch.Tensor):
            note_scaled_root(result, outputs)  # the loss this root scaled, for the guards' loss section
        return result

    return scale


_unscaled_roots: dict[int, tuple[weakref.ReferenceType[torch.Tensor], torch.Tensor]] = {}
"""``id(scaled loss) -> (the scaled loss, the loss)``: what ``GradScaler.scale`` returned, until its backward."""


def note_scaled_root(scaled: torch.Tensor, loss: torch.Tensor) -> None:
    """``scaled`` is ``loss`` times a loss scale another library applied (DeepSpeed's fp16): a backward of ``scaled``
    hands the guards' loss section ``loss``, as after ``GradScaler.scale``."""
    with _scaler_lock:
        _let_go_of_gone_roots()  # a backward no guard watched the loss of took nothing out
        _unscaled_roots[id(scaled)] = (weakref.ref(scaled), loss.detach())


def _let_go_of_gone_roots() -> None:
    """Forget the scaled losses that are gone (under ``_scaler_lock``)."""
    for key in [key for key, (held, _) in _unscaled_roots.items() if held() is None]:
        del _unscaled_roots[key]


def _backward_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def backward(*args: Any, **kwargs: Any) -> Any:
        # Eager, a backward whose step no guard watches the loss of (9 steps in 10 under the default's monitor) goes
        # straight to torch's: no crossing of torch.compiler.disable (3 calls), no probe. Dynamo folds
        # ``_dynamo_compiling()`` to True where it traces: the guards' part then breaks the graph, as it always did.
        if not _guards or not (_dynamo_compiling() or _compiler._is_compiling_flag or _loss_watched()):
            return original(*args, **kwargs)
        return _guarded_backward(original, args, kwargs)

    return backward


def _loss_watched() -> bool:
    """Whether a guard watches the loss of the step whose backward runs now (``GradGuard._loss_watch``)."""
    for ref in _guards:  # noqa: SIM110 (any() over a generator is a call per guard, at every backward)
        if (guard := ref()) is not None and guard._loss_watch() is not None:
            return True
    return False


# One crossing of torch.compiler.disable for a backward (each costs 3 Python calls): dynamo breaks the graph at a
# backward inside a compiled function anyway, and the guards' probes before it and roots after it run eagerly.
@torch.compiler.disable  # type: ignore[untyped-decorator]
def _guarded_backward(original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    seen = _before_backward(args, kwargs)
    result = original(*args, **kwargs)
    if seen:
        _after_backward(seen)  # only a backward that ran, and only to the guards whose model it reached
    return result


_Seen = list[tuple["LossWatch", Any, torch.Tensor | None, str | None]]


def _before_backward(args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Seen:
    """A backward's root (the loss, unscaled where a GradScaler scaled it), and each watching guard's probe of its
    model's gradients as they are before it."""
    watches = []
    for ref in _guards:  # the tuple as it is now; a loop without a call (it runs at every step)
        if (guard := ref()) is None:
            continue
        watch = guard._loss_watch()
        if watch is not None:
            watches.append(watch)
    if not watches:
        return []
    root, why = root_of(args, kwargs)
    if root is None and why is None:
        return []
    if root is not None:
        with _scaler_lock:
            scaled = _unscaled_roots.pop(id(root), None)
            _let_go_of_gone_roots()
        if scaled is not None and scaled[0]() is root:
            root = scaled[1]
    return [(watch, watch.probe(), root, why) for watch in watches]


def _after_backward(seen: _Seen) -> None:
    """Each root goes to the guards whose model's gradients the backward changed (another model's loss is not
    theirs: two guarded models in one loop, or an unguarded one beside)."""
    for watch, probe, root, why in seen:
        if watch.reached(probe):
            watch.saw(root, why)


def _unscale_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def unscale_(self: torch.amp.GradScaler, optimizer: Optimizer) -> Any:
        result = original(self, optimizer)
        agree_found_inf(self, optimizer)  # every rank of a tensor-parallel mesh skips alike
        with _scaler_lock:
            _unscaled.setdefault(self, {})[id(optimizer)] = weakref.ref(optimizer)
        return result

    return unscale_
