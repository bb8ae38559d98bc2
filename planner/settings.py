"""Planner settings: the warm-prefix budget and the stability rules (AffinityPlan spec.budget/stability)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from cacheroute.planner.errors import PlanInputError

# The plan format stores a destination count per key in one byte.
MAX_DESTINATIONS_PER_KEY_FORMAT = 255


@dataclass(frozen=True)
class Budget:
    """How much KV each destination keeps warm for planned keys, and how hot keys are spread.

    `warm_tokens_per_destination` is a number of KV tokens reserved on every destination, or
    `auto` for `auto_fraction` of each destination's KV capacity. A key whose expected load would
    take more than `max_key_share_of_destination` of a destination is replicated onto several
    destinations, at most `max_destinations_per_key`.
    """

    warm_tokens_per_destination: int | Literal["auto"] = "auto"
    auto_fraction: float = 0.6
    max_destinations_per_key: int = 4
    max_key_share_of_destination: float = 0.5

    def __post_init__(self) -> None:
        w = self.warm_tokens_per_destination
        if w != "auto" and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
            raise PlanInputError(f"budget.warm_tokens_per_destination must be an integer >= 0 or 'auto', got {w!r}")
        if not (math.isfinite(self.auto_fraction) and 0 < self.auto_fraction <= 1):
            raise PlanInputError(f"budget.auto_fraction must be in (0, 1], got {self.auto_fraction!r}")
        m = self.max_destinations_per_key
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= MAX_DESTINATIONS_PER_KEY_FORMAT:
            raise PlanInputError(
                f"budget.max_destinations_per_key must be an integer in [1, {MAX_DESTINATIONS_PER_KEY_FORMAT}], "
                f"got {m!r}"
            )
        s = self.max_key_share_of_destination
        if not (math.isfinite(s) and 0 < s <= 1):
            raise PlanInputError(f"budget.max_key_share_of_destination must be in (0, 1], got {s!r}")


@dataclass(frozen=True)
class Stability:
    """Re-planning rules that keep routes (and so warm caches) in place.

    `max_churn` caps the share of planned load a re-plan may move voluntarily; `min_gain` is the
    relative improvement of the objective (the largest normalised destination load) a re-plan
    must predict before it moves anything. Incumbent keys also get a `1 + min_gain` head start in
    admission, so keys near the budget cut do not flip in and out on noise.
    """

    max_churn: float = 0.1
    min_gain: float = 0.02

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_churn) and 0 <= self.max_churn <= 1):
            raise PlanInputError(f"stability.max_churn must be in [0, 1], got {self.max_churn!r}")
        if not (math.isfinite(self.min_gain) and 0 <= self.min_gain <= 1):
            raise PlanInputError(f"stability.min_gain must be in [0, 1], got {self.min_gain!r}")
