"""What every policy model shares: strict models, and the finite floats their fields take."""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo

__all__ = ["Finite", "FiniteAboveOne", "PositiveFinite", "Strict", "check_skip_window"]


class Strict(BaseModel):
    """A policy model: unknown keys refused, frozen."""

    # Attribute docstrings become field descriptions in the JSON Schema (`gradguard schema`).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False, use_attribute_docstrings=True)


def _finite(value: float, info: ValidationInfo) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{info.field_name} must be a finite number, got {value!r}")
    return value


Finite = Annotated[float, AfterValidator(_finite)]
"""A float field that must be finite (``.inf`` and ``.nan`` parse as floats): the error names the field."""
PositiveFinite = Annotated[float, Field(gt=0, strict=True), AfterValidator(_finite)]
"""A finite float above 0, for optional fields (the bound belongs to the number, not to ``None``)."""
FiniteAboveOne = Annotated[float, Field(gt=1, strict=True), AfterValidator(_finite)]
"""A finite float above 1 (a multiple that raises), for optional fields."""


def check_skip_window(max_skips: int | None, window_steps: int | None) -> None:
    """``max_skips`` and ``window_steps`` (a skip rule's, the loss spike's): both or neither, and a limit that can
    be reached."""
    if (max_skips is None) != (window_steps is None):
        raise ValueError(
            "max_skips and window_steps go together (at most max_skips skips within the last "
            f"window_steps steps); got max_skips={max_skips}, window_steps={window_steps}"
        )
    if max_skips is not None and window_steps is not None and max_skips > window_steps:
        raise ValueError(
            f"max_skips ({max_skips}) cannot exceed window_steps ({window_steps}); the limit could never be reached"
        )
