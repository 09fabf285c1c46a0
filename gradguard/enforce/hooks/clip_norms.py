"""The total norm a clip took of gradients the guard's step then dropped, made the norm of those it left.

torch's ``clip_grad_norm_`` lists its parameters' gradients, takes their total norm (``_get_total_norm``) and clips
them with it (``_clip_grads_with_norm_``, which reads ``p.grad`` again). Bound by name before the guard attached, it
is not intercepted itself: the guard's step runs inside ``_get_total_norm``, on that list. A ``drop`` or a skip sets
``p.grad`` to None there, yet the list still holds those gradients, so the norm (and the clip's coefficient) would
count gradients the optimizer will never apply, and a skip would return NaN. So the norm such a step took is noted
(``noted``), and ``_clip_grads_with_norm_`` given that very tensor makes it, in place, the norm of the gradients its
parameters still hold (``refresh``) before it clips: torch's ``clip_grad_norm_`` returns that tensor, as the
intercepted clip returns the norm after the policy. The two-call spelling (``get_total_norm`` then
``clip_grads_with_norm_``) is the same calls, and is treated the same way.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["INNER_SITES", "inside", "noted", "refresh"]

INNER_SITES = (  # what torch's clip_grad_norm_ calls, at call time: the same functions as get_total_norm and
    ("torch.nn.utils.clip_grad", "_get_total_norm", True, "tensors"),  # clip_grads_with_norm_, wrapped as those
    ("torch.nn.utils.clip_grad", "_clip_grads_with_norm_", False, "parameters"),
)
"""(module, attribute, takes gradients?, its first argument's name), as ``torch_hooks``' clip sites."""
inside = threading.local()
"""``inside.clip``: this thread is inside an intercepted clip, whose own inner calls are not clips of their own."""

_taken = threading.local()
"""``_taken.norm``: ``(the total norm returned, the ids of the gradients it was taken of, norm_type, foreach, torch's
_get_total_norm)`` of the last norm taken by a guard's step on this thread, until a clip with it consumes it. Ids, not
the gradients: a norm no clip consumes must not keep a step's gradients alive. The clip that consumes it runs while
torch's own list still holds them, so no id is taken by another tensor meanwhile."""


def noted(
    total: Any, grads: list[torch.Tensor], norm_of: Callable[..., Any], args: tuple[Any, ...], kwargs: Any
) -> None:
    """``norm_of(*args, **kwargs)`` (torch's ``_get_total_norm``) returned ``total`` of ``grads`` after a guard's
    step ran in it."""
    if not isinstance(total, torch.Tensor):
        return
    try:
        bound = inspect.signature(norm_of).bind(*args, **kwargs).arguments
    except TypeError:
        return
    _taken.norm = (total, list(map(id, grads)), bound.get("norm_type", 2.0), bound.get("foreach"), norm_of)


def refresh(parameters: list[torch.Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Before ``_clip_grads_with_norm_(parameters, max_norm, total_norm, ...)``: where ``total_norm`` is a norm
    ``noted`` and some of its gradients are gone since, make it the norm of the gradients left."""
    taken = getattr(_taken, "norm", None)
    if taken is None:
        return
    total = args[2] if len(args) > 2 else kwargs.get("total_norm")
    if total is not taken[0]:
        return
    _taken.norm = None
    grads = [p.grad for p in parameters if p.grad is not None]
    if list(map(id, grads)) == taken[1]:
        return  # every gradient it was taken of is still there (changed in place, if at all: the norm saw that)
    _, _, norm_type, foreach, norm_of = taken
    with torch.no_grad():
        total.copy_(norm_of(grads, norm_type, False, foreach))
