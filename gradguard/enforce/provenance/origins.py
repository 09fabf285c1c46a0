"""Naming where a NaN or Inf started, from the figures the provenance traces recorded.

Pure reading: the traces (``gradguard.enforce.provenance.provenance``) record one figure per tensor in the order the
hooks fired, with who recorded it; these functions take the figures after the step's one host read and
return the ``origin`` dict the halt and the skip carry (phase, module, kind, seen_in, and where the trace
cannot be exact, the neighbours it narrows the fault to: ``before``, ``consumers``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

from torch import nn

from gradguard.policy.matching import canonical_name

__all__ = [
    "DATA",
    "INPUT",
    "OUTPUT",
    "ROOT",
    "ModuleTree",
    "backward_origin",
    "boundary_origin",
    "finite_note",
    "first_params",
    "forward_origin",
    "kind_of",
    "owner_of",
    "unrooted",
]

ROOT: Final = "(model)"
_INDEX_MODULES: Final = (nn.Embedding, nn.EmbeddingBag)
DATA, INPUT, OUTPUT = 0, 1, 2
"""A forward figure's role: the batch given to the model, a module's input, a module's output."""

ForwardMeta = list[tuple[int, int]]
"""(module index, role), per forward figure."""
BackwardMeta = list[tuple[int, list[int], int]]
"""(producing module or -1, the modules that took the tensor as input, and for the light trace, which does
not follow inputs, the position of the tensor's own forward figure, else -1), per gradient figure."""


class ModuleTree:
    """The model's modules by index (``named_modules`` order, parents first; tied modules once), with their
    canonical names, parents and depths."""

    def __init__(self, model: nn.Module) -> None:
        strip = isinstance(model, nn.DataParallel | nn.parallel.DistributedDataParallel)
        named = list(model.named_modules())
        self.names = [canonical_name(name, strip_module_prefix=strip) or ROOT for name, _ in named]
        self.names[0] = ROOT
        self.position = {name: i for i, name in enumerate(self.names)}
        self.parent = [self.position.get(name.rpartition(".")[0], 0) for name in self.names]
        self.level = [0] * len(self.names)
        for index in range(1, len(self.names)):
            self.level[index] = self.level[self.parent[index]] + 1
        self.fed_from_input = [isinstance(module, _INDEX_MODULES) for _, module in named]
        """Modules whose input is indices (an embedding lookup): no gradient flows back through them, so their
        backward passes nothing to any module; they sit beside the modules before them, not after."""

    def within(self, inner: int, outer: int) -> bool:
        """Whether module ``inner`` is ``outer`` or lies inside it (by name)."""
        while inner != outer and inner != 0:
            inner = self.parent[inner]
        return inner == outer

    def deepest_level(self, budget: int | None) -> int | None:
        """The deepest level (the model is level 0) such that the levels down to it hold at most ``budget``
        modules together (None: no budget)."""
        if budget is None:
            return None
        deepest, total = 0, 0
        for level in range(max(self.level) + 1):
            total += self.level.count(level)
            if total > budget:
                break
            deepest = level
        return deepest

    def has_unhooked_children(self, module: str | None, deepest_hooked: int) -> bool:
        """Whether ``module`` sits at the deepest hooked level and has submodules (which were not hooked)."""
        if module is None or module not in self.position:
            return False
        index = self.position[module]
        return self.level[index] == deepest_hooked and index in self.parent[1:]

    def next_module(self, producer: int, later: ForwardMeta) -> list[int]:
        """The light trace's guess at who consumed ``producer``'s output: the next module to record an output
        that is not around ``producer`` (the trace does not follow inputs)."""
        return next(([index] for index, role in later if role == OUTPUT and not self.within(producer, index)), [])


def owner_of(param_name: str) -> str:
    """The name of the module that holds a parameter (``blocks.1.fc.weight`` -> ``blocks.1.fc``)."""
    return param_name.rpartition(".")[0] or ROOT


def kind_of(value: float) -> str:
    return "nan" if math.isnan(value) else "inf"


def finite_note(flags: bool, gradients: bool, distributed: bool) -> str:
    """Why nothing the hooks recorded was non-finite: with the gradient flags, every gradient as backward
    accumulated it was finite; without, only the forward (and the outputs' gradients) were looked at."""
    if flags and distributed:
        return (
            "not on this rank: its forward, backward and gradients were finite (another rank's arrived through "
            "the all-reduce)"
        )
    if flags:
        return "every gradient was finite as backward accumulated it: it went non-finite after backward"
    if gradients:
        return (
            "its forward and the gradients of the modules' outputs were finite: it went non-finite in a "
            "parameter's own gradient, or after backward"
        )
    return "its forward was finite and every gradient is non-finite: the loss, or code after backward, made it"


def first_params(param_names: Mapping[int, str], values: list[float], meta: list[int]) -> list[str]:
    """The guarded tensors whose gradients were non-finite first, as backward accumulated them."""
    names: dict[str, None] = {}
    for value, index in zip(values, meta, strict=True):
        if not math.isfinite(value) and (name := param_names.get(index)):
            names[name] = None
    return list(names)


def forward_origin(tree: ModuleTree, values: list[float], meta: ForwardMeta) -> dict[str, Any] | None:
    names = tree.names
    for position, value in enumerate(values):
        if math.isfinite(value):
            continue
        index, role = meta[position]
        origin = {"phase": "forward", "kind": kind_of(value), "input_nonfinite": role == DATA}
        if role == DATA:
            # The batch itself: name the first module whose output it made non-finite.
            later = range(position, len(values))
            bad = (meta[k][0] for k in later if meta[k][1] == OUTPUT and not math.isfinite(values[k]))
            seen_in = next((names[i] for i in bad if i > 0), None)
            return origin | {"module": seen_in, "seen_in": seen_in}
        if role == INPUT and tree.parent[index] > 0:
            # Non-finite on entry, yet no module before produced it: the code around this module made it.
            return origin | {"module": names[tree.parent[index]], "seen_in": names[index]}
        if role == INPUT or index == 0:
            # The model's own code, outside its modules (never named as a module: it has no name).
            seen_in = names[index] if index > 0 else None
            return origin | {"module": None, "seen_in": seen_in, "note": _own_code_note(seen_in, kind_of(value))}
        return origin | {"module": names[index], "seen_in": names[index]}
    return None


def _own_code_note(seen_in: str | None, kind: str) -> str:
    if seen_in is not None:
        return f"the model's own code, outside its modules, made it in forward: {seen_in} received a {kind} input"
    return (
        f"its modules' outputs were finite and the model's output went {kind}: the model's own code, outside its "
        "modules, made it (a loss computed in the model's forward, say)"
    )


def backward_origin(
    tree: ModuleTree, values: list[float], meta: BackwardMeta, forward: ForwardMeta
) -> dict[str, Any] | None:
    names = tree.names
    for position, value in enumerate(values):
        if math.isfinite(value):
            continue
        producer, consumers, recorded = meta[position]
        if recorded >= 0:
            consumers = tree.next_module(producer, forward[recorded + 1 :])
        # The tensor's gradient comes from the modules that took it as input: the innermost of them. The model
        # itself (0) among them: the model handed the tensor out, so its gradient came from the loss.
        inner = [c for c in consumers if not any(d != c and tree.within(d, c) for d in consumers)]
        outside = producer >= 0 and (inner == [0] or (not inner and producer == 0))
        if inner and inner != [0]:
            module: str | None = names[inner[0]]
        elif producer > 0 and tree.parent[producer] > 0 and not inner:
            module = names[tree.parent[producer]]  # the code around the module that consumed its output
        else:
            module = None  # the loss (the model's output), or the model's own code outside its modules
        kind = kind_of(value)
        seen_in = names[producer] if producer > 0 else (module if producer < 0 else None)
        own_code = f"{seen_in}'s output" if seen_in else "the input batch"
        origin: dict[str, Any] = {"phase": "backward", "module": module, "kind": kind}
        origin |= {"input_nonfinite": False, "seen_in": seen_in}
        if len(inner) > 1:
            origin["consumers"] = [names[c] for c in inner]
        if outside:
            origin["note"] = (
                f"its forward was finite and the gradient of the model's output was already {kind} as backward "
                "began: the loss made it"
            )
        elif module is None:
            origin["note"] = (
                f"the model's own code, outside its modules, made it in the backward pass: the gradient of "
                f"{own_code}, which no module took as input, went {kind} first"
            )
        return origin
    return None


def unrooted(origin: dict[str, Any]) -> dict[str, Any]:
    """Never a module named ``(model)``: a fault placed in the model's own code or parameters (outside its
    modules, which have names) is said in words, with ``module`` None."""
    if origin.get("module") != ROOT:
        return origin
    first = ", ".join(origin.get("first_params") or ())
    origin["module"] = None
    origin["seen_in"] = None if origin.get("seen_in") == ROOT else origin.get("seen_in")
    origin["note"] = f"it started in the {origin['phase']} pass, in the model's own code or parameters, outside its "
    origin["note"] += f"modules ({first})" if first else "modules"
    return origin


def _passer(tree: ModuleTree, modules: list[int], last: int, good: set[int]) -> dict[str, Any]:
    """Who handed the gradient of module ``modules[last]``'s output back to it: the next module in forward order
    that took something computed from it. A module fed from the input (an embedding beside it, its output summed with
    this one's: GPT-2's ``wpe`` beside ``wte``) took nothing from it and passed nothing back, so it is skipped and
    named ``beside``; ``passer_kept``: the passer's own parameters kept finite gradients."""
    faulty = modules[last]
    beside: list[str] = []
    for position in range(last + 1, len(modules)):
        index = modules[position]
        if index == 0 or tree.within(index, faulty) or tree.within(faulty, index):
            continue  # the model itself, or a module around or inside the faulty one: not a consumer of its output
        if tree.fed_from_input[index]:
            beside.append(tree.names[index])
            continue
        found: dict[str, Any] = {"passer": tree.names[index], "passer_kept": position in good}
        return found | ({"beside": beside[:4]} if beside else {})
    return {"beside": beside[:4]} if beside else {}


def boundary_origin(
    tree: ModuleTree,
    param_names: Mapping[int, str],
    forward: ForwardMeta,
    grads: tuple[int, ...],
    nonfinite: Mapping[int, tuple[str, int]],
) -> dict[str, Any] | None:
    """The light trace without tensor hooks, its forward finite: the fault started in backward, after (in
    forward order) the last traced module with a non-finite parameter gradient, and before the first one
    after it whose parameter gradients are all finite (backward runs from the loss: everything it reaches
    after a fault goes non-finite, nothing it reached before does). When the non-finite gradients are one
    module's parameters and modules before it stayed finite, the fault did not travel through backward at
    all: it is named in those parameters' own gradients (phase ``gradient``, ``own``). When they are the
    first module's (no module before it kept gradients), both readings remain, its own gradients or the
    gradient passed back to it by the module after it: phase ``backward`` with ``first`` set, and
    ``finite_own``, the parameters of that module whose gradients stayed finite."""
    order: dict[int, int] = {}
    for module, role in forward:
        if role == OUTPUT:
            order.setdefault(module, len(order))
    bad: set[int] = set()
    good: set[int] = set()
    for index in grads:
        name = param_names.get(index)
        module = tree.position.get(owner_of(name), 0) if name else 0
        while module not in order and module != 0:
            module = tree.parent[module]
        (bad if index in nonfinite else good).add(order.get(module, -1))
    if not bad or not good:
        return None  # every gradient non-finite: the loss, or code after backward (a global clip spreads one)
    last = max(bad)
    kinds = {kind for kind, _ in nonfinite.values()}
    origin: dict[str, Any] = {"phase": "backward", "kind": kinds.pop() if len(kinds) == 1 else None}
    origin["input_nonfinite"] = False
    owners = {owner_of(param_names.get(index, "")) for index in nonfinite}
    if len(owners) == 1 and any(p < min(bad) for p in good):
        # One module's parameters, while the modules that ran before it kept finite gradients: backward did
        # not carry it on through the activations, so it was made in these gradients themselves.
        owner = owners.pop()
        return origin | {"phase": "gradient", "module": owner, "seen_in": owner, "own": True}
    after = [p for p in good if p > last]
    if not after:
        note = "the gradient of the model's output was already non-finite: the loss made it"
        return origin | {"module": None, "seen_in": None, "note": note}
    modules = list(order)
    between = [tree.names[m] for m in modules[last + 1 : min(after)]]
    where = tree.names[modules[last]] if last >= 0 else ROOT
    origin |= {"module": where, "seen_in": where, "before": tree.names[modules[min(after)]]}
    if between:
        origin["consumers"] = between[:4]
    if len(owners) == 1 and last >= 0:
        # One module's parameters, and no module before it kept gradients (it is the first with any: a stem,
        # an input layer): backward may have made it in these gradients, or carried it in from the module
        # after it, and nothing before can tell. Said so (``first``), with the parameters of the same module
        # that stayed finite: a non-finite gradient carried in would most likely have spoiled them too.
        owner = next(iter(owners))
        origin |= _passer(tree, modules, last, good)
        origin["first"] = True
        origin["finite_own"] = [
            name
            for index in grads
            if index not in nonfinite and (name := param_names.get(index)) and owner_of(name) == owner
        ][:4]
    return origin
