"""The one error type of the memory planner."""

from __future__ import annotations


class MemoryPlanError(ValueError):
    """A model, GPU or flag combination that cannot be planned; the message says what and by how much."""
