"""torch.distributed.pipelining's zero-bubble weight pass, as the per-micro-batch hooks see it.

The zero-bubble schedules (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, any schedule whose weight pass
runs ``stage_backward_weight``) split a stage's backward of each micro-batch in two: an input pass, then a weight pass
that takes the weights' gradients with ``torch.autograd.grad`` and adds them into ``weight.grad`` itself. A weight's
tensor hook runs there on exactly the gradient that is then added (what the hook returns is what ``autograd.grad``
returns), but the engine does not accumulate it, so the hooks would leave it alone as they leave any
``autograd.grad``'s (a gradient penalty's), and the step, which leaves those actions to the hooks, would not act
either: the weights of every stage but the first (which runs a full backward) went unclipped, silently.

So while per-micro-batch hooks are registered, ``stage_backward_weight`` is wrapped where pipelining's stages call it
(``torch.distributed.pipelining.stage``) and where it is defined (``._backward``): during the call, the gradient
accumulators of the weights it is given are marked, and a hook on a marked accumulator acts as in a backward. Marked
for the whole process, not a thread: on a GPU the engine runs the hooks on its device thread. The originals are put
back when the last hooks go, unless something wrapped ours since. The module is wrapped where it is loaded, or where
a process group is initialized (a pipeline's stages need one), at the first registration.
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["by_hand", "enlist", "release"]

_SITES = ("torch.distributed.pipelining.stage", "torch.distributed.pipelining._backward")
_NAME = "stage_backward_weight"

_lock = threading.Lock()
_users = 0
_swapped: list[tuple[Any, Callable[..., Any], Callable[..., Any]]] = []
"""(module, original, wrapper) of every swap in force."""
_marked: dict[torch.autograd.graph.Node, int] = {}
"""Grad accumulator -> weight passes in flight over it."""


def by_hand(node: torch.autograd.graph.Node | None) -> bool:
    """Whether ``node`` (a weight's grad accumulator) is inside pipelining's weight pass, whose ``autograd.grad``
    result is added into the weight's ``.grad`` by hand: an accumulation, though the engine does not make it."""
    return node is not None and node in _marked


def enlist() -> None:
    """One more holder of per-micro-batch hooks: the first wraps the weight pass (``release`` undoes it)."""
    global _users
    with _lock:
        _users += 1
        if not _swapped:
            _wrap()


def release() -> None:
    """One holder fewer: the last puts the originals back."""
    global _users
    with _lock:
        _users = max(_users - 1, 0)
        if _users or not _swapped:
            return
        for module, original, wrapper in reversed(_swapped):
            if module.__dict__.get(_NAME) is wrapper:  # not if another library wrapped ours since
                setattr(module, _NAME, original)
        _swapped.clear()


def _wrap() -> None:
    loaded = _SITES[0] in sys.modules
    if not loaded and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return  # no pipeline here: importing pipelining costs a second
    made: dict[int, Callable[..., Any]] = {}
    for name in _SITES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a torch without pipelining
            return
        original = getattr(module, _NAME, None)
        if original is None:
            continue  # a torch whose schedules split the backward otherwise
        wrapper = made.setdefault(id(original), _wrapper(original))
        setattr(module, _NAME, wrapper)
        _swapped.append((module, original, wrapper))


def _accumulator(weight: Any) -> torch.autograd.graph.Node | None:
    if not isinstance(weight, torch.Tensor) or not weight.requires_grad or weight.grad_fn is not None:
        return None
    view = weight.view_as(weight).grad_fn
    return view.next_functions[0][0] if view is not None else None


def _wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def stage_backward_weight(weights: Any, *args: Any, **kwargs: Any) -> Any:
        weights = list(weights)  # pipelining passes a generator (``submod.parameters()``)
        nodes = [node for node in map(_accumulator, weights) if node is not None]
        with _lock:
            for node in nodes:
                _marked[node] = _marked.get(node, 0) + 1
        try:
            return original(iter(weights), *args, **kwargs)
        finally:
            with _lock:
                for node in nodes:
                    if _marked[node] == 1:
                        del _marked[node]
                    else:
                        _marked[node] -= 1

    stage_backward_weight.__gradguard_original__ = original  # type: ignore[attr-defined]
    return stage_backward_weight
