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
from gradguard.enforce.provenance.figures import tensors

__all__ = ["MAX_FORWARDS", "SMALL_OUTPUT", "Replay", "agreement", "unreplayable"]

MAX_FORWARDS: Final = 64
"""Forwards held between two steps at most (micro-batches): past it the step is not replayed (memory stays bounded
in a loop that runs forwards with gradients and never steps)."""
SMALL_OUTPUT: Final = 4 * 2**20
"""An output tensor of at most this many bytes is held by reference until the step (to tell a transient); a larger one
weakly (the loop may keep it, as nanoGPT keeps its logits)."""
_TENSOR = torch.Tensor
_CPU = torch.default_generator
_grad_enabled = torch.is_grad_enabled
_graph_task = torch._C._current_graph_task_id
_weak = weakref.ref

Forward = list[Any]
"""One held forward: [args, kwargs, versions of the plain tensors among them, CPU generator state, CUDA generator
states, output references (a list of tensors or weak references) or None until the forward returns]."""


def unreplayable(model: nn.Module) -> str | None:
    """Why ``model``'s forward cannot be replayed by the ranks that faulted alone (None: it can): a forward that talks
    to the other ranks (sharded parameters gathered, a synchronized batch norm), or one compiled in place around the
    hooks."""
    if getattr(model, "_compiled_call_impl", None) is not None:
        return "the model was compiled in place (model.compile()), around the hooks that hold its forwards"
    for module in model.modules():
        if isinstance(module, nn.SyncBatchNorm):
            return "its forward reduces across ranks (SyncBatchNorm)"
    for param in model.parameters():
        if is_sharded(param) or hasattr(param, "ds_status"):
            return "its parameters are sharded (FSDP2, tensor parallel, ZeRO 3): its forward gathers them across ranks"
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

    def arm(self) -> None:
        model = self._model()
        if model is not None and not self.handles:
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
        versions = []
        for arg in args:
            if type(arg) is _TENSOR:
                versions.append(arg._version)
        for value in kwargs.values():
            if type(value) is _TENSOR:
                versions.append(value._version)
        cuda: tuple[torch.Tensor, ...] = ()
        if torch.cuda._initialized:
            cuda = tuple(generator.get_state() for generator in torch.cuda.default_generators)
        forwards.append([args, kwargs, versions, _CPU.get_state(), cuda, None])
        self._open = True

    def _after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self._open:
            return
        self._open = False
        held: list[Any] = []
        items = (
            output.values() if isinstance(output, dict) else output if isinstance(output, tuple | list) else (output,)
        )
        for item in items:
            if isinstance(item, _TENSOR):
                held.append(item if item.numel() * item.element_size() <= SMALL_OUTPUT else _weak(item))
        self.forwards[-1][5] = held

    # --- at a faulting step --------------------------------------------------------------------------------------

    def refusal(self, forwards: list[Forward], overflow: bool) -> str | None:
        """Why the held forwards cannot be replayed (None: they can)."""
        if overflow:
            return f"more than {MAX_FORWARDS} forwards ran since the last step, and none was held"
        if not forwards:
            return "no forward of the model with gradients was held since the last step (compiled around its hooks?)"
        for args, kwargs, versions, *_ in forwards:
            now = [value._version for value in (*args, *kwargs.values()) if type(value) is _TENSOR]
            if now != versions:
                return "its inputs were changed in place after their forward"
        return None

    def run(self, forwards: list[Forward]) -> tuple[list[list[torch.Tensor]], str | None]:
        """Call the model again on each held forward's arguments (the caller arms the trace around it): the replayed
        outputs' tensors, or why the replay failed."""
        model = self._model()
        if model is None:
            return [], "the model is gone"
        called = _called(model)
        cuda = torch.cuda._initialized
        cpu_now = _CPU.get_state()
        cuda_now = tuple(generator.get_state() for generator in torch.cuda.default_generators) if cuda else ()
        with torch.no_grad():
            buffers = [(buffer, buffer.clone()) for buffer in model.buffers()]
        outputs: list[list[torch.Tensor]] = []
        self.active = True
        try:
            with torch.enable_grad():  # the trace records where gradients are on, as the step's own forward ran
                for args, kwargs, _, cpu, cuda_states, _ in forwards:
                    _set_states(cpu, cuda_states)
                    outputs.append([tensor.detach() for tensor in tensors(called(*args, **kwargs))])
        except Exception as error:  # the replay's own failure is reported in the origin, never raised over the halt
            return [], f"its replay raised {type(error).__name__}: {error}"
        finally:
            self.active = False
            _set_states(cpu_now, cuda_now)
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
        return outputs, None


def _set_states(cpu: torch.Tensor, cuda: tuple[torch.Tensor, ...]) -> None:
    _CPU.set_state(cpu)
    for generator, state in zip(torch.cuda.default_generators, cuda, strict=False):
        generator.set_state(state)


def _nonfinite(tensor: torch.Tensor) -> torch.Tensor:
    return (
        ~torch.isfinite(tensor.detach()) if tensor.is_floating_point() or tensor.is_complex() else tensor.new_zeros(0)
    )


def agreement(forwards: list[Forward], replayed: list[list[torch.Tensor]]) -> str:
    """Whether the replay's outputs are non-finite where the step's were: ``"same"`` (element by element, where both
    are still known), ``"transient"`` (the step's were non-finite, the replay's are not), ``"differs"`` (otherwise), or
    ``"unknown"`` (the step's outputs are gone: larger than ``SMALL_OUTPUT`` and not kept by the loop)."""
    known = False
    step_bad = replay_bad = False
    for held, outputs in zip(forwards, replayed, strict=True):
        originals = [item() if isinstance(item, weakref.ref) else item for item in held[5] or ()]
        if len(originals) != len(outputs) or any(item is None for item in originals):
            continue
        for original, output in zip(originals, outputs, strict=True):
            assert isinstance(original, torch.Tensor)
            before, after = _nonfinite(original), _nonfinite(output)
            step_bad, replay_bad = step_bad or bool(before.any()), replay_bad or bool(after.any())
            if before.shape != after.shape or not torch.equal(before, after):
                return "transient" if bool(before.any()) and not bool(after.any()) else "differs"
            known = True
    if step_bad and not replay_bad:
        return "transient"
    return "same" if known else "unknown"
