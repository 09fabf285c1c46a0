"""The action families, one module each, behind one interface (``ActionKernel``).

- ``clipping``: ``clip_norm`` (tensor or group scope, a group's norm over a pipeline's stages) and ``clip_value``;
- ``overflow``: a 2-norm that overflowed while every element is finite (a float64 norm for its clips);
- ``shaping``: ``scale``, ``zero`` and ``drop``;
- ``nonfinite``: ``halt_on_nonfinite`` and ``skip_step_on_nonfinite`` (the watch, and skip limits);
- ``monitoring``: ``monitor`` (figures of the gradient as it arrives; an observing kernel);
- ``adaptive``: ``zclip``'s and ``autoclip``'s decisions and ``autoclip`` (thresholds from statistics of earlier norms);
- ``zclip``: ``zclip``'s kernel, per tensor decided on the host from the step's read where it can;
- ``adaptive_unitwise``: ``agc`` (adaptive gradient clipping against the weights' norms, per unit or group);
- ``spikes``: ``skip_step_on_spike`` (an observing kernel whose verdict is a skip).

``kernel_for`` maps a policy action to the kernel that executes it.

May import: work, distributed.
"""

from __future__ import annotations

from gradguard.enforce.actions.adaptive import AutoClipKernel
from gradguard.enforce.actions.adaptive_unitwise import AgcKernel
from gradguard.enforce.actions.base import ActionKernel
from gradguard.enforce.actions.clipping import ClipNormKernel, ClipValueKernel
from gradguard.enforce.actions.monitoring import MonitorKernel
from gradguard.enforce.actions.nonfinite import HaltKernel, SkipKernel
from gradguard.enforce.actions.shaping import DropKernel, ScaleKernel, ZeroKernel
from gradguard.enforce.actions.spikes import SpikeSkipKernel
from gradguard.enforce.actions.zclip import ZClipKernel
from gradguard.policy.schema import Action

__all__ = ["ActionKernel", "kernel_for"]

_KERNELS: dict[type, ActionKernel] = {
    schema: kernel
    for kernel in (
        ClipNormKernel(),
        ClipValueKernel(),
        ScaleKernel(),
        ZeroKernel(),
        DropKernel(),
        HaltKernel(),
        SkipKernel(),
        MonitorKernel(),
        ZClipKernel(),
        AutoClipKernel(),
        SpikeSkipKernel(),
        AgcKernel(),
    )
    for schema in kernel.schemas
}


def kernel_for(action: Action) -> ActionKernel:
    """The kernel that executes ``action`` (every schema action has one; a test checks it)."""
    return _KERNELS[type(action)]
