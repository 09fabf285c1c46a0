"""torch's clips bound by name in the loop's own modules, reached with the module attributes' swap.

``from torch.nn.utils import clip_grad_value_`` at the top of a script binds torch's own function in the script's
namespace before any guard attaches, and the swap of ``torch.nn.utils``' attribute (``torch_hooks``) never reaches
that name. A value clip so bound clamps an Inf gradient to a finite value before the guard's step at the optimizer
sees it, and the guard then passes a step that was not finite: silently, where the module's spelling halts. So when the
clips are wrapped, every name a loaded module binds to one of the wrapped functions is bound to its wrapper too, and
put back with the module attributes when the last guard goes (unless something rebound it since).

Left alone: torch's own modules (their names are the swapped attributes themselves, or torch's internals, which are
no loop's clip) and gradguard's. Not reached: a clip held anywhere but a module's namespace (an object's attribute, a
``functools.partial``, a default argument), and a name bound to torch's function while no guard is attached and
called before the next guard attaches.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

__all__ = ["Swap", "rebind"]

Swap = tuple[Any, str, Callable[..., Any], Callable[..., Any]]
"""(owner, attribute, original, wrapper): one name swapped, as ``torch_hooks`` keeps them."""

_LEFT_ALONE = ("torch.", "gradguard.")


def rebind(wrappers: dict[int, tuple[Callable[..., Any], Callable[..., Any]]]) -> list[Swap]:
    """Bind every loaded module's name for a wrapped function (``id(original) -> (original, wrapper)``) to its wrapper;
    the swaps made, to be undone as the module attributes' are."""
    wanted = wrappers.keys()
    swaps: list[Swap] = []
    for name, module in list(sys.modules.items()):  # a copy: another thread may import meanwhile
        if name in ("torch", "gradguard") or name.startswith(_LEFT_ALONE) or not isinstance(module, types.ModuleType):
            continue
        namespace = vars(module)
        try:
            if wanted.isdisjoint(map(id, namespace.values())):  # in C: almost every module holds none
                continue
            items = list(namespace.items())
        except RuntimeError:  # its namespace changed meanwhile (a finalizer, an import): it is being made, not used
            continue
        for attribute, value in items:
            found = wrappers.get(id(value))
            if found is not None and found[0] is value:
                namespace[attribute] = found[1]
                swaps.append((module, attribute, value, found[1]))
    return swaps
