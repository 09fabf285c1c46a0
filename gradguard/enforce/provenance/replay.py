"""What the default (``first_fault``) holds of each forward instead of tracing it, and the replay of a faulting step.

A clean step, the step that happens a million times, needs no trace: only the step that faults does. So at every
forward of the model (gradients on) two hooks on the model itself do the whole of the default's per-forward work, in
a few C calls and no torch op: they hold the forward's arguments by reference (no copy), the versions of the tensors
among them, the random generators' states (the CPU's, and each CUDA device's once CUDA is up) and the model's output
(its tensors of at most ``SMALL_OUTPUT`` bytes by reference, larger ones weakly: a vocabulary head's logits are not
kept alive past backward). When a step's gradients come out non-finite, ``Replay.run`` calls the model again on each
held forward's arguments, in order, with the generators put back as they were at its start and the model's buffers
saved before and put back after (a batch norm's running statistics); the caller arms the trace around it. The
generators are then set where they were, so a skipped step's run goes on as it would have.

What a replay cannot see, said instead of naming a module (``Replay.refusal``, ``agreement``): arguments changed in
place since their forward (``_version``), a forward that raised or was never held (compiled around the hooks, more
than ``MAX_FORWARDS`` since the last step), a replay that raises, and a replay whose output is not non-finite where the
step's was: a fault that does not recur (a transient), or one the replay makes and the step did not (a forward with
side effects, or state the replay does not put back).
"""

from __future__ import annotations

import weakref
from typing import Any, Final

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradguard.enforce.distributed.collective import is_sharded

__all__ = ["MAX_FORWARDS", "SMALL_INPUT", "SMALL_OUTPUT", "Replay", "agreement", "outputs", "unreplayable"]

MAX_FORWARDS: Final = 64
"""Forwards held between two steps at most (micro-batches): past it the step is not replayed (memory stays bounded
in a loop that runs forwards with gradients and never steps)."""
SMALL_OUTPUT: Final = 0
"""An output tensor of at most this many bytes would be held by reference until the step (to tell a transient); every
one is held weakly: holding one would keep it past its backward, above the unguarded step's peak (the footprint
tests: +1 MiB of a small GPT's logits). A loop that keeps its output (nanoGPT keeps its logits) lets the replay tell
a transient; one that drops it gets ``unknown`` there, and the replay's trace names the module as the light trace
would."""
SMALL_INPUT: Final = 1 << 20
"""A forward whose tensor arguments take at most this many bytes in all (a batch of token ids) is held until the step;
a larger one (a batch of images) only until the next forward begins, weakly after: a loop that accumulates over
micro-batches it makes one after the other lets each go when it moves on, and holding each until the step would keep
all of them alive at once, above the unguarded loop's peak. A faulting step whose earlier input the loop let go is
not replayed (``Replay.refusal`` says so) and the full trace is armed for a recurrence, as for any refusal."""
_TENSOR = torch.Tensor
_CPU = torch.default_generator
_grad_enabled = torch.is_grad_enabled
_graph_task = torch._C._current_graph_task_id
_weak = weakref.ref

Forward = list[Any]
"""One held forward: [args, kwargs, versions of the plain tensors among them, CPU generator state, CUDA generator
states, output references (a list of tensors or weak references) or None until the forward returns, the bytes of its
plain tensor arguments]; ``_let_go`` puts weak references (``_Input``) in place of a large forward's tensors."""


class _Input(weakref.ref):  # type: ignore[type-arg]
    """A held forward's tensor argument the loop may let go of (``SMALL_INPUT``); not a weak reference of the user's."""

    __slots__ = ()


def unreplayable(model: nn.Module) -> str | None:
    """Why ``model``'s forward cannot be replayed by the ranks that faulted alone (None: it can): a forward that talks
    to the other ranks (sharded parameters gathered, a synchronized batch norm), or one compiled in place around the
    hooks, or a Lightning module (Lightning calls its ``training_step``, and its DDP wrapper's forward is that step,
    with the user's logging and, in manual optimization, the optimizer's step)."""
    if getattr(model, "_compiled_call_impl", None) is not None:
        return "the model was compiled in place (model.compile()), around the hooks that hold its forwards"
    lightning = ("LightningModule", "_LightningModuleWrapperBase")
    if any(klass.__name__ in lightning for klass in type(_called(model)).__mro__):
        return "Lightning calls its training_step, not the model's forward"
    for module in model.modules():
        if isinstance(module, nn.SyncBatchNorm):
            return "its forward reduces across ranks (SyncBatchNorm)"
    for param in model.parameters():
        if is_sharded(param) or hasattr(param, "ds_status"):
            return "its parameters are sharded (FSDP2, tensor parallel, ZeRO 3): its forward gathers them across ranks"
    return None


def _unarmed() -> Replay:
    """A replay whose hooks return at once and hold nothing (``Replay.__reduce__``)."""
    replay = Replay.__new__(Replay)
    replay._model = _no_model  # type: ignore[assignment]  # called as the weak reference is: None
    replay.forwards, replay.overflow, replay.active, replay._open = [], False, True, False
    replay.handles, replay.whole_step = [], False
    return replay


def _no_model() -> None:
    return None


def _called(model: nn.Module) -> nn.Module:
    """The module a replay calls: the model inside a DDP or DataParallel wrapper (its forward syncs nothing then), the
    eager module inside ``torch.compile``'s wrapper (no recompilation for the trace's hooks)."""
    if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
        inner: nn.Module = model.module
        return inner
    original = getattr(model, "_orig_mod", None)
    return original if isinstance(original, nn.Module) else model


class Replay:
    """The two hooks on the model that hold its forwards, and the replay of those forwards."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self.forwards: list[Forward] = []
        self.overflow = False
        """More than ``MAX_FORWARDS`` forwards since the last step: none is held until the next."""
        self.active = False
        """A replay runs now: the hooks hold nothing."""
        self._open = False
        """A forward was held and has not returned yet (its output goes to it)."""
        self.handles: list[RemovableHandle] = []
        self.whole_step = False
        """The hooks were armed through a whole step (from the end of the one before): its forwards are all held."""

    def __reduce__(self) -> tuple[Any, ...]:
        """A copy of the model (``copy.deepcopy``, ``torch.save`` of the module, a pickle) takes its hooks along, bound
        to this object: the copy gets an unarmed one instead, which holds nothing and whose hooks return at once (no
        guard watches the copy; a weak reference and the held forwards could not be pickled anyway)."""
        return (_unarmed, ())

    def arm(self) -> None:
        model = self._model()
        if model is not None and not self.handles:
            self.whole_step = False
            self.handles = [
                model.register_forward_pre_hook(self._before, with_kwargs=True),
                model.register_forward_hook(self._after),
            ]

    def disarm(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.clear()

    def clear(self) -> None:
        self.forwards, self.overflow, self._open = [], False, False

    # --- the hooks: C calls only (they run at every forward, where a small model's step is host-bound) ---------------

    def _before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # Not under no_grad (evaluation), nor a checkpoint's recomputation in backward, nor while replaying.
        if self.active or not _grad_enabled() or _graph_task() != -1:
            return
        forwards = self.forwards
        if len(forwards) >= MAX_FORWARDS:
            self.overflow, self.forwards = True, []
            return
        if forwards and forwards[-1][6] > SMALL_INPUT:
            _let_go(forwards[-1])
        versions = []
        size = 0
        for arg in args:
            if type(arg) is _TENSOR:
                versions.append(arg._version)
                size += arg.nbytes
        for value in kwargs.values():
            if type(value) is _TENSOR:
                versions.append(value._version)
                size += value.nbytes
        cuda: tuple[torch.Tensor, ...] = ()
        if torch.cuda._initialized:
            cuda = tuple(generator.get_state() for generator in torch.cuda.default_generators)
        forwards.append([args, kwargs, versions, _CPU.get_state(), cuda, None, size])
        self._open = True

    def _after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self._open:
            return
        self._open = False
        held: list[Any] = []
        # ``outputs``' walk, inlined: this runs at every forward, and a function is a call.
        items = (
            output.values() if isinstance(output, dict) else output if isinstance(output, tuple | list) else (output,)
        )
        for item in items:
            if isinstance(item, _TENSOR) and item.is_floating_point():
                held.append(item if item.numel() * item.element_size() <= SMALL_OUTPUT else _weak(item))
        self.forwards[-1][5] = held

    # --- at a faulting step --------------------------------------------------------------------------------------

    def refusal(self, forwards: list[Forward], overflow: bool) -> str | None:
        """Why the held forwards cannot be replayed (None: they can)."""
        if overflow:
            return f"more than {MAX_FORWARDS} forwards ran since the last step, and none was held"
        if not forwards:
            return "no forward of the model with gradients was held since the last step"
        for number, (args, kwargs, versions, *_) in enumerate(forwards, 1):
            values = (*args, *kwargs.values())
            if any(type(value) is _Input and value() is None for value in values):
                return (
                    f"the loop let go of forward {number} of {len(forwards)}'s input before the step (a micro-batch's "
                    f"input of more than {SMALL_INPUT:,} bytes is held only until the next forward begins)"
                )
            now = [value._version for value in map(_taken, values) if type(value) is _TENSOR]
            if now != versions:
                return "its inputs were changed in place after their forward"
        return None

    def run(self, forwards: list[Forward]) -> tuple[str, str | None]:
        """Call the model again on each held forward's arguments (the caller arms the trace around it): whether the
        replayed outputs agree with the step's (``agreement``: each compared and let go before the next forward, so a
        replay holds one forward's graph at a time), or why the replay failed."""
        model = self._model()
        if model is None:
            return "unknown", "the model is gone"
        called = _called(model)
        cuda = torch.cuda._initialized
        cpu_now = _CPU.get_state()
        cuda_now = tuple(generator.get_state() for generator in torch.cuda.default_generators) if cuda else ()
        with torch.no_grad():
            buffers = [(buffer, buffer.clone()) for buffer in model.buffers()]
        found: set[str] = set()
        self.active = True
        try:
            with torch.no_grad():  # no graph kept: a replay's memory is one module's activations, not the forward's
                for args, kwargs, _, cpu, cuda_states, held, _ in forwards:
                    _set_states(cpu, cuda_states)
                    args, kwargs = tuple(map(_taken, args)), {key: _taken(value) for key, value in kwargs.items()}
                    found.add(agreement(held, outputs(called(*args, **kwargs))))
        except Exception as error:  # the replay's own failure is reported in the origin, never raised over the halt
            return "unknown", f"its replay raised {type(error).__name__}: {error}"
        finally:
            self.active = False
            _set_states(cpu_now, cuda_now)
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
        return next((verdict for verdict in _VERDICTS if verdict in found), "unknown"), None


def _let_go(forward: Forward) -> None:
    """The next forward begins: a large forward's tensor arguments are held weakly from now on (``SMALL_INPUT``)."""
    args, kwargs = forward[0], forward[1]
    forward[0] = tuple(_Input(arg) if type(arg) is _TENSOR else arg for arg in args)
    forward[1] = {key: _Input(value) if type(value) is _TENSOR else value for key, value in kwargs.items()}


def _taken(value: Any) -> Any:
    """A held argument as the forward took it (a weakly held tensor the loop still holds)."""
    return value() if type(value) is _Input else value


def outputs(output: Any) -> list[torch.Tensor]:
    """The floating-point tensors a model's output holds at its top level (a tensor, a tuple or list, a dict such as
    transformers' ``ModelOutput``): what the hook holds of each forward, to compare a replay's with."""
    items = output.values() if isinstance(output, dict) else output if isinstance(output, tuple | list) else (output,)
    return [item for item in items if isinstance(item, _TENSOR) and item.is_floating_point()]


def _set_states(cpu: torch.Tensor, cuda: tuple[torch.Tensor, ...]) -> None:
    _CPU.set_state(cpu)
    for generator, state in zip(torch.cuda.default_generators, cuda, strict=False):
        generator.set_state(state)


def _nonfinite(tensor: torch.Tensor) -> torch.Tensor:
    return (
        ~torch.isfinite(tensor.detach()) if tensor.is_floating_point() or tensor.is_complex() else tensor.new_zeros(0)
    )


_VERDICTS: Final = ("differs", "transient", "same")
"""A replay's verdict, from its forwards' (``agreement``): the first of these that any forward gave, else unknown."""


def agreement(held: list[Any] | None, replayed: list[torch.Tensor]) -> str:
    """Whether a replayed forward's outputs are non-finite where the step's were, element by element: ``"same"``,
    ``"transient"`` (the step's were non-finite somewhere, the replay's nowhere), ``"differs"`` (otherwise), or
    ``"unknown"`` (the step's outputs are gone: larger than ``SMALL_OUTPUT`` and not kept by the loop)."""
    originals = [item() if isinstance(item, weakref.ref) else item for item in held or ()]
    alive = [item for item in originals if isinstance(item, torch.Tensor)]
    if held is None or len(alive) != len(replayed) or len(alive) != len(originals):
        return "unknown"
    before = [_nonfinite(original) for original in alive]
    after = [_nonfinite(output) for output in replayed]
    if all(b.shape == a.shape and torch.equal(b, a) for b, a in zip(before, after, strict=True)):
        return "same"
    if any(bool(b.any()) for b in before) and not any(bool(a.any()) for a in after):
        return "transient"
    return "differs"
