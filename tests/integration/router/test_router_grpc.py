"""The endpoint-picker protocol and gRPC health, spoken directly to a running router."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from cacheroute.planner.plan import Destination, affinity_key_hash, plan_from_routes
from cacheroute.planner.plan_format import encode_plan
from tests.support.router import (
    Engine,
    PlanVolume,
    RouterStarter,
    await_condition,
    destination,
    exchange,
    headers_request,
    make_plan,
)

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def volume(tmp_path: Path) -> Iterator[PlanVolume]:
    yield PlanVolume(tmp_path / "plan")


def test_header_and_metadata_carry_the_planned_endpoint_then_fallbacks(
    engines: list[Engine], volume: PlanVolume, start_router: RouterStarter
) -> None:
    volume.publish(make_plan(engines, {"alice": [2, 0]}))
    router = start_router("--plan-dir", str(volume.path), "--fallbacks", "2")
    header, metadata = destination(exchange(router, headers_request("alice")))
    assert header == metadata
    listed = header.split(",")
    planned = [engines[2].address, engines[0].address]
    # Equal load on both planned destinations: the key's hash breaks the tie.
    first = affinity_key_hash("alice") % 2
    assert listed[:2] == [planned[first], planned[1 - first]]
    assert listed[2] == engines[1].address
    # Every replica answers the same for a planned key (no randomness for planned keys).
    other = start_router("--plan-dir", str(volume.path), "--fallbacks", "2")
    assert destination(exchange(other, headers_request("alice")))[0] == header


def test_subset_hint_restricts_the_choice(
    engines: list[Engine], volume: PlanVolume, start_router: RouterStarter
) -> None:
    volume.publish(make_plan(engines, {"alice": [1]}))
    router = start_router("--plan-dir", str(volume.path))
    for _ in range(5):
        header, _ = destination(exchange(router, headers_request("alice", subset=[engines[0].address])))
        assert header == engines[0].address
    response = exchange(router, headers_request("alice", subset=["10.9.9.9:8000"]))
    assert response.immediate_response.status.code == 503


def test_health_services_follow_readiness(
    engines: list[Engine], volume: PlanVolume, start_router: RouterStarter
) -> None:
    router = start_router("--plan-dir", str(volume.path), wait_ready=False)
    assert router.health("liveness") == SERVING
    assert router.health("readiness") == NOT_SERVING
    assert router.health("envoy.service.ext_proc.v3.ExternalProcessor") == NOT_SERVING
    volume.publish(make_plan(engines, {"alice": [1]}))
    await_condition(router.ready, "readiness once a plan is loaded")
    assert router.health("envoy.service.ext_proc.v3.ExternalProcessor") == SERVING


def test_static_endpoints_alone_make_the_router_ready(engines: list[Engine], start_router: RouterStarter) -> None:
    router = start_router("--endpoints", ",".join(e.address for e in engines[:2]))
    header, _ = destination(exchange(router, headers_request("anyone")))
    assert header in {engines[0].address, engines[1].address}
    assert router.sample("cacheroute_router_decisions_total", outcome="p2c") == 1


def test_bad_plan_keeps_the_last_good_one(
    engines: list[Engine], volume: PlanVolume, start_router: RouterStarter
) -> None:
    good = volume.publish(make_plan(engines, {"alice": [1]}))
    router = start_router("--plan-dir", str(volume.path))
    files = dict(encode_plan(make_plan(engines, {"alice": [2]})).files)
    files["routes-0000.bin.gz"] = b"\x1f\x8b not gzip"
    volume.publish_files(files)
    await_condition(lambda: router.sample("cacheroute_router_plan_loads_total", result="rejected") == 1,
                    "the broken plan to be rejected")
    assert f'version="{good}"' in router.metrics()
    assert destination(exchange(router, headers_request("alice")))[0] == engines[1].address


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_both_event_loops_route_planned_keys(
    loop: str, engines: list[Engine], volume: PlanVolume, start_router: RouterStarter
) -> None:
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    volume.publish(make_plan(engines, {"alice": [1]}))
    router = start_router("--plan-dir", str(volume.path), "--event-loop", loop)
    for _ in range(3):
        assert destination(exchange(router, headers_request("alice"))) == (engines[1].address,) * 2
    assert f"event loop {loop}." in router.process.log.read_text()


def test_a_plan_without_addresses_readies_the_router_with_a_warning_that_nothing_can_be_routed(
    volume: PlanVolume, start_router: RouterStarter, tmp_path: Path
) -> None:
    # What `cacheroute plan` writes offline: destinations by id only.
    destinations = [Destination("pool-0"), Destination("pool-1")]
    volume.publish(plan_from_routes("pool", destinations, {affinity_key_hash("alice"): ["pool-0"]}))
    router = start_router("--plan-dir", str(volume.path))
    log = tmp_path / "router-0.log"
    await_condition(lambda: "router ready with no endpoint to route to" in log.read_text(), "the warning")
    assert exchange(router, headers_request("alice")).immediate_response.status.code == 503
