"""The one error lowering raises."""

from __future__ import annotations


class LoweringError(ValueError):
    """The plan cannot be lowered as it stands (inconsistent sizes, a divisibility an engine requires).

    The message shows the arithmetic and says which plan field is wrong; lowering never repairs a plan.
    """
