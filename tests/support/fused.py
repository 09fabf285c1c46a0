"""The guard as it was before its read waited for a fused optimizer's update (``enforce/step/fused_update.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from gradguard.enforce.step.fused_update import FusedUpdate


@contextmanager
def reading_first(yes: bool = True) -> Iterator[None]:
    """With ``yes``, every guard reads before the update, fused or not: the reference the read-after order must
    equal bitwise (tests), and the other arm of its A/B (``benchmarks/gpu_check.py``)."""
    if not yes:
        yield
        return
    takes = FusedUpdate.takes
    FusedUpdate.takes = lambda *args, **kwargs: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        FusedUpdate.takes = takes  # type: ignore[method-assign]
