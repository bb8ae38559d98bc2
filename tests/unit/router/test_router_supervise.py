"""No background task dies silently: failures are restarted with backoff and shown in readiness and metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cacheroute.planner.plan import Destination, affinity_key_hash, plan_from_routes
from cacheroute.planner.plan_format import encode_plan
from cacheroute.router import plans as plans_module
from cacheroute.router.endpoints import EndpointPool
from cacheroute.router.metrics import RouterMetrics
from cacheroute.router.picker import Picker
from cacheroute.router.plans import DirectoryPlanSource, PlanStore
from cacheroute.router.server import Router
from cacheroute.router.settings import RouterSettings
from cacheroute.router.supervise import Supervisor
from tests.support.plan_payloads import bad_payloads

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def until(check: Callable[[], bool], within: float = 10.0) -> None:
    """Await `check()` becoming true, polling; fail after `within` seconds."""
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            pytest.fail("condition not met in time")
        await asyncio.sleep(0.01)


async def test_a_failing_task_is_restarted_with_backoff_and_reported_down() -> None:
    states: list[tuple[str, bool]] = []
    changes = []
    supervisor = Supervisor(on_state=lambda n, up: states.append((n, up)), on_change=lambda: changes.append(1),
                            initial_backoff=0.05, max_backoff=0.2)
    runs = 0
    steady = asyncio.Event()

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs <= 3:
            raise RuntimeError(f"failure {runs}")
        steady.set()
        await asyncio.Event().wait()

    loop = asyncio.get_running_loop()
    started = loop.time()
    supervisor.spawn("flaky", flaky)
    await asyncio.wait_for(steady.wait(), 10)
    # Backoff doubles: 0.05 + 0.1 + 0.2 before the fourth run.
    assert loop.time() - started >= 0.3
    assert supervisor.restarts["flaky"] == 3
    assert supervisor.down == frozenset()
    assert states == [("flaky", True)] + [("flaky", False), ("flaky", True)] * 3
    assert len(changes) == 6
    await supervisor.stop()


async def test_a_task_that_returns_counts_as_failed() -> None:
    supervisor = Supervisor(initial_backoff=5.0)
    supervisor.spawn("quitter", lambda: asyncio.sleep(0))
    await until(lambda: "quitter" in supervisor.down)
    await supervisor.stop()
    assert supervisor.restarts["quitter"] == 0


async def test_readiness_is_not_serving_while_a_task_is_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = RouterSettings(grpc_host="127.0.0.1", grpc_port=0, metrics_host="127.0.0.1", metrics_port=0,
                              endpoints=("10.0.0.1:8000",), scrape_interval=0)
    router = Router(settings)
    router.supervisor.initial_backoff = 0.5
    real_run = router.store.run
    crashes = 0

    async def crash_once() -> None:
        nonlocal crashes
        if crashes == 0:
            crashes += 1
            await asyncio.sleep(0.2)
            raise RuntimeError("plan store bug")
        await real_run()

    monkeypatch.setattr(router.store, "run", crash_once)
    await router.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def readiness() -> int:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=2)
                return int(reply.status)

            assert await readiness() == SERVING
            # Every task's restarts are exported from its start, at 0 (dashboards see a zero, not no data).
            restarts = router.metrics.registry.get_sample_value
            assert restarts("cacheroute_router_task_restarts_total", {"task": "plan-store"}) == 0
            await until(lambda: "plan-store" in router.supervisor.down)
            await until(lambda: router._health_state is False)
            assert await readiness() == NOT_SERVING
            up = router.metrics.registry.get_sample_value("cacheroute_router_task_up", {"task": "plan-store"})
            assert up == 0
            await until(lambda: not router.supervisor.down)
            await until(lambda: router._health_state is True)
            assert await readiness() == SERVING
            samples = router.metrics.registry
            assert samples.get_sample_value("cacheroute_router_task_up", {"task": "plan-store"}) == 1
            assert samples.get_sample_value("cacheroute_router_task_restarts_total", {"task": "plan-store"}) == 1
    finally:
        await router.stop(grace=0)


def store() -> tuple[PlanStore, RouterMetrics]:
    pool = EndpointPool(scraping=False)
    metrics = RouterMetrics(pool, sketch_size=8, export_key_names=False)
    return PlanStore(pool, Picker(pool, seed=1), metrics), metrics


def rejected(metrics: RouterMetrics) -> float:
    return metrics.registry.get_sample_value("cacheroute_router_plan_loads_total", {"result": "rejected"}) or 0.0


PLAN = plan_from_routes("pool", [Destination("pool-0", "10.0.0.1:8000")], {affinity_key_hash("alice"): ["pool-0"]})


async def test_any_exception_while_loading_is_a_rejected_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    plan_store, metrics = store()
    good = encode_plan(PLAN)
    for files in bad_payloads(PLAN).values():
        assert not await plan_store.process(files, origin="test")
    assert rejected(metrics) == len(bad_payloads(PLAN))

    def boom(*_args: object) -> object:
        raise MemoryError("no room for the table")

    monkeypatch.setattr(plans_module, "build_table", boom)
    assert not await plan_store.process(good.files, origin="test")
    assert plan_store.last_error == "MemoryError: no room for the table"
    monkeypatch.undo()
    assert await plan_store.process(good.files, origin="test")
    assert plan_store.version == good.version


async def test_the_same_bad_payload_is_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    plan_store, metrics = store()
    files = bad_payloads(PLAN)["address not an address"]
    for _ in range(3):
        await plan_store.process(files, origin="test")
    assert rejected(metrics) == 1
    assert sum("rejected" in r.message for r in caplog.records) == 1
    await plan_store.process(bad_payloads(PLAN)["spill threshold huge"], origin="test")
    assert rejected(metrics) == 2


async def test_plan_files_too_large_or_not_regular_are_rejected_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan_store, metrics = store()
    source = DirectoryPlanSource(tmp_path, plan_store, interval=0.05)
    (tmp_path / "plan.json.gz").mkdir()
    assert not await source.poll_async()
    assert rejected(metrics) == 1 and "not a regular file" in str(plan_store.last_error)
    (tmp_path / "plan.json.gz").rmdir()
    monkeypatch.setattr(plans_module, "MAX_PAYLOAD_BYTES", 1000)
    (tmp_path / "plan.json.gz").write_bytes(b"\0" * 2000)
    assert not await source.poll_async()
    assert rejected(metrics) == 2 and "at most 1,000" in str(plan_store.last_error)
