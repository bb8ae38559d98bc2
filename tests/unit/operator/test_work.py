"""The reconcile thread pool takes the most urgent job first."""

from __future__ import annotations

import threading

from cacheroute.operator.work import ENGINE, ROUTER, STATUS, PriorityExecutor


def test_queued_engine_jobs_run_before_router_and_status_jobs() -> None:
    pool = PriorityExecutor(1)
    gate = threading.Event()
    order: list[str] = []
    blocker = pool.submit(ENGINE, gate.wait)  # occupies the only worker while the rest queue up
    futures = [
        pool.submit(STATUS, lambda: order.append("status")),
        pool.submit(ROUTER, lambda: order.append("router-a")),
        pool.submit(ENGINE, lambda: order.append("engine")),
        pool.submit(ROUTER, lambda: order.append("router-b")),
    ]
    gate.set()
    blocker.result(timeout=10)
    for future in futures:
        future.result(timeout=10)
    assert order == ["engine", "router-a", "router-b", "status"]


def test_a_failing_job_hands_its_exception_to_the_caller() -> None:
    pool = PriorityExecutor(2)

    def boom() -> None:
        raise ValueError("no")

    future = pool.submit(STATUS, boom)
    try:
        future.result(timeout=10)
    except ValueError as exc:
        assert str(exc) == "no"
    else:
        raise AssertionError("the exception was lost")
    assert pool.submit(STATUS, lambda: 42).result(timeout=10) == 42
