"""The replay's routing settings refuse what the router's options refuse."""

from __future__ import annotations

import re

import pytest

from cacheroute.planner.replay.planned import CACHEROUTE_ROUTING, RoutingSettings
from cacheroute.planner.tokenload import DEFAULT_IN_FLIGHT_WEIGHT


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"in_flight_weight": 1.5}, "in-flight weight must be within [0, 1]"),
        ({"in_flight_weight": float("nan")}, "in-flight weight must be within [0, 1]"),
        ({"tokens_per_unit": -1.0}, "tokens per load unit must not be negative"),
        ({"prefix_memory_blocks": 0}, "prefix memory must hold at least 1 block"),
    ],
)
def test_out_of_range_routing_settings_are_refused(settings: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        RoutingSettings(**settings)  # type: ignore[arg-type]


def test_cacheroute_routes_with_the_routers_default_load() -> None:
    """The replay measures the router as shipped: requests in flight weigh what the router's
    `--in-flight-weight` gives them by default; the plain defaults keep the load before."""
    assert CACHEROUTE_ROUTING.in_flight_weight == DEFAULT_IN_FLIGHT_WEIGHT < 1
    assert RoutingSettings().in_flight_weight == 1.0
