"""The router behind a real Envoy (ext_proc + ORIGINAL_DST on the destination header)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from cacheroute.planner.plan import KeyExtraction
from tests.support.router import (
    Engine,
    GatewayStarter,
    PlanVolume,
    RouterStarter,
    await_condition,
    make_plan,
    metric_value,
)

pytestmark = pytest.mark.integration

BODY_MODES = ["BUFFERED", "FULL_DUPLEX_STREAMED"]


def chat(user: str | None = None, text: str = "hello") -> bytes:
    doc: dict[str, object] = {"model": "m", "messages": [{"role": "user", "content": text}]}
    if user is not None:
        doc["user"] = user
    return json.dumps(doc).encode()


def post(client: httpx.Client, url: str, body: bytes, key: str | None = None) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["x-affinity-key"] = key
    return client.post(f"{url}/v1/chat/completions", content=body, headers=headers)


@pytest.fixture
def volume(tmp_path: Path) -> PlanVolume:
    return PlanVolume(tmp_path / "plan")


@pytest.mark.parametrize("body_mode", BODY_MODES)
def test_planned_key_lands_on_its_destination(
    engines: list[Engine], volume: PlanVolume, start_router: RouterStarter, gateway: GatewayStarter, body_mode: str
) -> None:
    volume.publish(make_plan(engines, {"alice": [1], "bob": [2]}))
    router = start_router("--plan-dir", str(volume.path))
    gw = gateway(router, engines, request_body_mode=body_mode)
    with httpx.Client(timeout=10) as client:
        for _ in range(5):
            assert post(client, gw.url, chat(), key="alice").status_code == 200
            # The key in the OpenAI `user` field when no header carries one.
            assert post(client, gw.url, chat(user="bob")).status_code == 200
    assert engines[1].count() == 5
    assert engines[2].count() == 5
    assert engines[0].count() == 0
    assert all(json.loads(r.body)["user"] == "bob" for r in engines[2].received)
    assert router.sample("cacheroute_router_decisions_total", outcome="planned") == 10


def test_in_flight_lasts_until_the_response_ends(
    engines: list[Engine], volume: PlanVolume, start_router: RouterStarter, gateway: GatewayStarter
) -> None:
    volume.publish(make_plan(engines, {"alice": [1]}))
    router = start_router("--plan-dir", str(volume.path))
    gw = gateway(router, engines)
    engines[1].gate = threading.Event()
    results: list[int] = []

    def send() -> None:
        with httpx.Client(timeout=30) as client:
            results.append(post(client, gw.url, chat(), key="alice").status_code)

    threads = [threading.Thread(target=send) for _ in range(3)]
    for t in threads:
        t.start()
    address = engines[1].address
    await_condition(lambda: router.sample("cacheroute_router_endpoint_in_flight", endpoint=address) == 3,
                    "three requests in flight on the planned engine")
    engines[1].gate.set()
    for t in threads:
        t.join(30)
    assert results == [200, 200, 200]
    await_condition(lambda: router.sample("cacheroute_router_endpoint_in_flight", endpoint=address) == 0,
                    "in-flight back to zero once the responses ended")
    # A client that gives up resets the stream: the request stops counting as in flight.
    engines[1].gate = threading.Event()
    with httpx.Client(timeout=0.5) as client, pytest.raises(httpx.TimeoutException):
        post(client, gw.url, chat(), key="alice")
    await_condition(lambda: router.sample("cacheroute_router_endpoint_in_flight", endpoint=address) == 0,
                    "in-flight back to zero after the client reset")
    engines[1].gate.set()


def test_a_prompt_weighs_on_the_load_until_the_queue_says_it_is_prefilled(
    engines: list[Engine], volume: PlanVolume, start_router: RouterStarter, gateway: GatewayStarter
) -> None:
    volume.publish(make_plan(engines, {"alice": [1]}))
    router = start_router("--plan-dir", str(volume.path), "--scrape-interval", "0.1")
    gw = gateway(router, engines)
    address = engines[1].address
    engines[1].gate = threading.Event()
    engines[1].waiting = 2

    def pending() -> float:
        return router.sample("cacheroute_router_endpoint_pending_prompt_tokens", endpoint=address)

    # Three prompts with nothing in common, sent one after the other and held by the engine.
    bodies = [chat(text=f"{i} " + "lorem ipsum dolor " * (400 * (i + 1))) for i in range(3)]
    charges = [int(len(body) / 4 + 0.5) for body in bodies]  # the estimate before any response
    results: list[int] = []

    def send(body: bytes) -> None:
        with httpx.Client(timeout=30) as client:
            results.append(post(client, gw.url, body, key="alice").status_code)

    def in_flight() -> float:
        return router.sample("cacheroute_router_endpoint_in_flight", endpoint=address)

    threads = []
    for n, body in enumerate(bodies, 1):
        threads.append(threading.Thread(target=send, args=(body,)))
        threads[-1].start()
        # Awaited before `n` moves on.
        await_condition(lambda: in_flight() == n, f"{n} requests in flight on the planned engine")  # noqa: B023
    # Two queued and one prefilling: all three still to prefill.
    await_condition(lambda: pending() == sum(charges), "the three prompts counted")
    # The queue empties: only the newest can still be prefilling.
    engines[1].waiting = 0
    await_condition(lambda: pending() == charges[2], "only the newest prompt counted once the queue is empty")
    engines[1].gate.set()
    for t in threads:
        t.join(30)
    assert results == [200, 200, 200]
    await_condition(lambda: pending() == 0, "nothing left to prefill once the responses ended")
    assert in_flight() == 0


def test_overloaded_destination_spills(
    engines: list[Engine], volume: PlanVolume, start_router: RouterStarter, gateway: GatewayStarter
) -> None:
    volume.publish(make_plan(engines, {"alice": [1]}, spill_threshold=1.5))
    router = start_router("--plan-dir", str(volume.path))
    gw = gateway(router, engines)
    engines[1].waiting = 50
    await_condition(
        lambda: router.sample("cacheroute_router_endpoint_waiting", endpoint=engines[1].address) == 50,
        "the router to scrape the queue of the planned engine",
    )
    with httpx.Client(timeout=10) as client:
        for _ in range(10):
            assert post(client, gw.url, chat(), key="alice").status_code == 200
    assert engines[1].count() == 0
    assert engines[0].count() + engines[2].count() == 10
    assert router.sample("cacheroute_router_decisions_total", outcome="spilled") == 10
    # Once the queue drains, the key goes home.
    engines[1].waiting = 0
    await_condition(
        lambda: router.sample("cacheroute_router_endpoint_waiting", endpoint=engines[1].address) == 0,
        "the router to see the queue drained",
    )
    with httpx.Client(timeout=10) as client:
        assert post(client, gw.url, chat(), key="alice").status_code == 200
    assert engines[1].count() == 1


def test_unready_destination_is_avoided(
    engines: list[Engine], volume: PlanVolume, start_router: RouterStarter, gateway: GatewayStarter
) -> None:
    volume.publish(make_plan(engines, {"alice": [1]}))
    router = start_router("--plan-dir", str(volume.path))
    gw = gateway(router, engines)

    def ready() -> float:
        return router.sample("cacheroute_router_endpoint_ready", endpoint=engines[1].address)

    await_condition(lambda: ready() == 1, "the planned engine to be ready")
    engines[1].metrics_ok = False
    await_condition(lambda: ready() == 0, "the router to take the unscrapable engine out")
    with httpx.Client(timeout=10) as client:
        for _ in range(10):
            assert post(client, gw.url, chat(), key="alice").status_code == 200
    assert engines[1].count() == 0
    assert router.sample("cacheroute_router_decisions_total", outcome="spilled") == 10
    engines[1].metrics_ok = True
    await_condition(lambda: ready() == 1, "the engine to be ready again")
    with httpx.Client(timeout=10) as client:
        assert post(client, gw.url, chat(), key="alice").status_code == 200
    assert engines[1].count() == 1


def test_no_ready_endpoint_gives_503(
    engines: list[Engine], volume: PlanVolume, start_router: RouterStarter, gateway: GatewayStarter
) -> None:
    volume.publish(make_plan(engines, {"alice": [1]}))
    router = start_router("--plan-dir", str(volume.path))
    gw = gateway(router, engines)
    for engine in engines:
        engine.metrics_ok = False
    await_condition(lambda: router.sample("cacheroute_router_endpoint_ready") == 0, "every engine to be unready")
    with httpx.Client(timeout=10) as client:
        response = post(client, gw.url, chat(), key="alice")
    assert response.status_code == 503
    assert response.text == "no ready endpoint\n"
    assert sum(e.count() for e in engines) == 0
    assert router.sample("cacheroute_router_decisions_total", outcome="none") == 1


def test_plan_swapped_mid_traffic_fails_no_request(
    engines: list[Engine], volume: PlanVolume, start_router: RouterStarter, gateway: GatewayStarter
) -> None:
    volume.publish(make_plan(engines, {"alice": [1], "bob": [2]}))
    router = start_router("--plan-dir", str(volume.path))
    gw = gateway(router, engines)
    statuses: list[int] = []
    stop = threading.Event()

    def traffic() -> None:
        keys = ["alice", "bob", "carol", None]
        with httpx.Client(timeout=10) as client:
            i = 0
            while not stop.is_set():
                try:
                    statuses.append(post(client, gw.url, chat(), key=keys[i % len(keys)]).status_code)
                except httpx.HTTPError:
                    statuses.append(-1)
                i += 1

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        await_condition(lambda: len(statuses) >= 20, "traffic to flow")
        before = engines[2].keys().count("alice")
        published = time.monotonic()
        version = volume.publish(make_plan(engines, {"alice": [2], "bob": [0]}))
        await_condition(lambda: f'version="{version}"' in router.metrics(), "the new plan version", timeout=10)
        took = time.monotonic() - published
        await_condition(lambda: engines[2].keys().count("alice") > before, "alice to reach her new destination")
        seen = len(statuses)
        await_condition(lambda: len(statuses) >= seen + 20, "traffic to keep flowing on the new plan")
    finally:
        stop.set()
        worker.join(30)
    assert statuses and all(s == 200 for s in statuses), sorted(set(statuses))
    assert took <= 1.0, f"the new plan took {took:.2f}s to take effect"
    # After the swap, alice no longer reaches engine 1 and bob only engine 0.
    tail_alice = engines[1].keys().count("alice")
    with httpx.Client(timeout=10) as client:
        for _ in range(5):
            post(client, gw.url, chat(), key="alice")
            post(client, gw.url, chat(), key="bob")
    assert engines[1].keys().count("alice") == tail_alice
    assert engines[0].keys().count("bob") >= 5


def test_traffic_flows_with_the_router_stopped(
    engines: list[Engine], volume: PlanVolume, start_router: RouterStarter, gateway: GatewayStarter
) -> None:
    volume.publish(make_plan(engines, {"alice": [1]}))
    router = start_router("--plan-dir", str(volume.path))
    gw = gateway(router, engines)
    with httpx.Client(timeout=10) as client:
        assert post(client, gw.url, chat(), key="alice").status_code == 200
        assert engines[1].count() == 1
        router.stop()
        statuses = [post(client, gw.url, chat(), key="alice").status_code for _ in range(12)]
    assert statuses == [200] * 12
    # failure_mode_allow: no destination header, so the default cluster spreads the requests.
    assert sum(e.count() for e in engines) == 13
    assert sum(1 for e in engines if e.count() > 0) >= 2


def test_malformed_body_or_missing_key_falls_back_to_unplanned_routing(
    engines: list[Engine], volume: PlanVolume, start_router: RouterStarter, gateway: GatewayStarter
) -> None:
    """A body that does not parse goes by p2c; a parsed one without a key is scored by what each
    engine holds of its prompt and by load (both spread over the engines)."""
    volume.publish(make_plan(engines, {"alice": [1]}))
    router = start_router("--plan-dir", str(volume.path))
    gw = gateway(router, engines)
    with httpx.Client(timeout=10) as client:
        for _ in range(15):
            assert post(client, gw.url, b'{"model": "m", "messages": [').status_code == 200
            assert post(client, gw.url, chat()).status_code == 200
    assert router.sample("cacheroute_router_decisions_total", outcome="p2c") == 15
    assert router.sample("cacheroute_router_decisions_total", outcome="scored") == 15
    assert router.sample("cacheroute_router_body_key_fallbacks_total", reason="malformed") == 15
    assert sum(1 for e in engines if e.count() > 0) >= 2


def test_oversized_body_is_not_buffered_for_a_key(
    engines: list[Engine], volume: PlanVolume, start_router: RouterStarter, gateway: GatewayStarter
) -> None:
    volume.publish(make_plan(engines, {"alice": [1]}))
    router = start_router("--plan-dir", str(volume.path), "--max-body-bytes", "4096")
    gw = gateway(router, engines, request_body_mode="FULL_DUPLEX_STREAMED")
    big = chat(user="alice", text="x" * 200_000)
    with httpx.Client(timeout=10) as client:
        for _ in range(6):
            assert post(client, gw.url, big).status_code == 200
        assert post(client, gw.url, chat(user="alice")).status_code == 200
    assert router.sample("cacheroute_router_body_key_fallbacks_total", reason="too_large") == 6
    assert router.sample("cacheroute_router_decisions_total", outcome="p2c") == 6
    # The body still reaches the engine whole.
    assert all(len(r.body) == len(big) for e in engines for r in e.received if len(r.body) > 4096)
    assert engines[1].received[-1].body == chat(user="alice")


@pytest.mark.parametrize("body_mode", BODY_MODES)
def test_a_long_prompt_past_the_routers_body_limit_is_served_by_p2c(
    engines: list[Engine], volume: PlanVolume, start_router: RouterStarter, gateway: GatewayStarter, body_mode: str
) -> None:
    """A 6 MiB body (long prompts, images inline) passes Envoy's buffer (16 MiB by default, not
    Envoy's own 1 MiB), is not parsed past the router's 1 MiB, goes where p2c sends it, whole."""
    volume.publish(make_plan(engines, {"alice": [1]}))
    router = start_router("--plan-dir", str(volume.path))
    gw = gateway(router, engines, request_body_mode=body_mode)
    big = chat(user="alice", text="x" * (6 << 20))
    with httpx.Client(timeout=30) as client:
        assert [post(client, gw.url, big).status_code for _ in range(3)] == [200] * 3
        assert post(client, gw.url, chat(user="alice")).status_code == 200
    assert router.sample("cacheroute_router_body_key_fallbacks_total", reason="too_large") == 3
    assert router.sample("cacheroute_router_decisions_total", outcome="p2c") == 3
    assert sorted(len(r.body) for e in engines for r in e.received)[-3:] == [len(big)] * 3
    assert engines[1].received[-1].body == chat(user="alice")


def test_a_body_past_envoys_buffer_is_refused_by_envoy(
    engines: list[Engine], volume: PlanVolume, start_router: RouterStarter, gateway: GatewayStarter
) -> None:
    volume.publish(make_plan(engines, {"alice": [1]}))
    router = start_router("--plan-dir", str(volume.path))
    gw = gateway(router, engines, max_request_bytes=2 << 20)
    with httpx.Client(timeout=30) as client:
        assert post(client, gw.url, chat(user="alice", text="x" * (3 << 20))).status_code == 413
        assert post(client, gw.url, chat(user="alice", text="x" * (1 << 20))).status_code == 200
    assert sum(e.count() for e in engines) == 1


def test_per_key_metrics_name_heavy_keys_by_hash(
    engines: list[Engine], volume: PlanVolume, start_router: RouterStarter, gateway: GatewayStarter
) -> None:
    volume.publish(make_plan(engines, {"alice": [1]}, key_extraction=KeyExtraction(prompt_prefix_chars=0)))
    router = start_router("--plan-dir", str(volume.path), "--sketch-size", "2")
    gw = gateway(router, engines)
    body = chat(text="y" * 400)
    with httpx.Client(timeout=10) as client:
        for key in ["alice"] * 6 + ["bob"] * 3 + ["carol"]:
            assert post(client, gw.url, body, key=key).status_code == 200
    from cacheroute.planner.plan import affinity_key_hash

    alice = f"{affinity_key_hash('alice'):016x}"
    await_condition(lambda: router.sample("cacheroute_router_key_requests_total") == 10, "all requests counted")
    text = router.metrics()
    assert "alice" not in text
    assert metric_value(text, "cacheroute_router_key_requests_total", key=alice) == 6
    assert metric_value(text, "cacheroute_router_key_prompt_tokens_total", key=alice) == 6 * ((len(body) + 3) // 4)
    assert metric_value(text, "cacheroute_router_sketch_keys") == 2
