"""The one error type of bad planning input."""

from __future__ import annotations


class PlanInputError(ValueError):
    """Planning input that cannot be planned; the message names the field and the offending value."""
