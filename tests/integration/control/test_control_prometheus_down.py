"""Prometheus hung or stopped: the plan in effect stays and MetricsAvailable flips within one
period; Prometheus back: the next period plans again. A Prometheus of the test's own, so the
shared sandbox one keeps running."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from tests.support.control import (
    GUARD_THROUGH_TIES,
    ControlEnv,
    DedicatedPrometheus,
    condition,
    create_plan,
    events,
    get_plan,
    plan_manifest,
    published_plan,
    wait_for_window,
    zipf_traffic,
)
from tests.support.sandbox import wait_for

pytestmark = pytest.mark.integration

WINDOW = 10
PERIOD = 2


@pytest.fixture
def own_prometheus() -> Iterator[list[DedicatedPrometheus]]:
    started: list[DedicatedPrometheus] = []
    yield started
    for prom in started:
        prom.stop()


def _epoch(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC).timestamp()


def _a_plan_applied(
    env: ControlEnv, own_prometheus: list[DedicatedPrometheus], window: int
) -> tuple[DedicatedPrometheus, Any]:
    """A pool with traffic, a Prometheus of the test's own holding a whole window of it, and the
    AffinityPlan `llama` reading it every PERIOD, its first plan applied: that Prometheus and the
    operator (which has no default Prometheus: the plan names its own)."""
    kube_api, namespace = env.api, env.namespace
    traffic = zipf_traffic(30, 5.0, prompt=2000, prefix_share=0.9, exponent=1.0)
    fleet = env.fleet("llama")
    fleet.set_traffic(traffic)
    prom = DedicatedPrometheus(env.tmp_path / "prometheus", fleet.jobs())
    own_prometheus.append(prom)
    prom.start()
    operator = env.operator()
    env.pool("llama")
    wait_for_window(prom.url, namespace, len(traffic.keys) + 2, window)
    create_plan(kube_api, namespace, plan_manifest(
        "llama", "llama", controlPeriod=f"{PERIOD}s", metricsWindow=f"{window}s",
        prometheus={"url": prom.url, "timeout": "1s"}, guard=GUARD_THROUGH_TIES,
    ))
    wait_for(lambda: condition(get_plan(kube_api, namespace, "llama"), "Applied").get("status") == "True",
             timeout=90, what="a first plan applied")
    return prom, operator


def test_plan_stays_while_prometheus_is_away_and_planning_resumes(
    env: ControlEnv, own_prometheus: list[DedicatedPrometheus]
) -> None:
    kube_api, namespace = env.api, env.namespace
    prom, operator = _a_plan_applied(env, own_prometheus, WINDOW)
    wait_for(lambda: get_plan(kube_api, namespace, "llama")["status"].get("observedKvHit") is not None,
             timeout=30, what="an observed KV hit")
    version = get_plan(kube_api, namespace, "llama")["status"]["planVersion"]
    routes = published_plan(kube_api, namespace, "llama").routes()  # type: ignore[union-attr]

    def metrics_condition(status: str, reason: str, since: float) -> dict[str, Any]:
        found: dict[str, Any] = {}

        def flipped() -> bool:
            obj = get_plan(kube_api, namespace, "llama")
            c = condition(obj, "MetricsAvailable")
            last = _epoch(obj["status"]["lastPeriodTime"])
            if (c.get("status"), c.get("reason")) == (status, reason) and last >= since:
                found.update(obj)
                return True
            return False

        wait_for(flipped, timeout=60, what=f"MetricsAvailable={status} ({reason})", interval=0.2)
        return found

    def assert_plan_stayed(obj: dict[str, Any]) -> None:
        assert obj["status"]["planVersion"] == version
        assert published_plan(kube_api, namespace, "llama").routes() == routes  # type: ignore[union-attr]
        assert condition(obj, "Degraded")["status"] == "True"
        assert condition(obj, "Ready")["status"] == "True"
        assert condition(obj, "Planned")["reason"] == "MetricsUnavailable"
        # No KV hit was observed: the last window's figure is not shown as the current one.
        assert obj["status"].get("observedKvHit") is None

    # Hung: connections accepted, never answered; each period gives up after spec.prometheus.timeout.
    paused = time.time()
    prom.pause()
    obj = metrics_condition("False", "PrometheusTimeout", paused)
    # The first period that started after the pause noticed it.
    assert _epoch(obj["status"]["lastPeriodTime"]) <= paused + PERIOD + 2
    assert_plan_stayed(obj)

    # Stopped: connection refused.
    prom.stop()
    stopped = time.time()
    obj = metrics_condition("False", "PrometheusUnreachable", stopped)
    assert _epoch(obj["status"]["lastPeriodTime"]) <= stopped + PERIOD + 2
    assert_plan_stayed(obj)
    # Dashboards count these periods as failed, not as having had nothing new to apply.
    exported = httpx.get(f"http://127.0.0.1:{operator.health_port}/metrics", timeout=5).text
    failed = [line for line in exported.splitlines()
              if line.startswith("cacheroute_operator_plan_periods_total{") and 'outcome="failed"' in line]
    assert failed and float(failed[0].rsplit(" ", 1)[1]) >= 2, failed

    # Back: the next period reads the window and plans again.
    prom.start()
    back = time.time()
    obj = metrics_condition("True", "MetricsRead", back)
    assert condition(obj, "Planned")["status"] == "True"
    assert condition(obj, "Applied")["status"] == "True"
    assert condition(obj, "Degraded")["status"] == "False"
    assert obj["status"]["observedKvHit"] is not None


def test_a_prometheus_that_lost_its_data_leaves_the_plan_in_effect_until_it_holds_half_the_window(
    env: ControlEnv, own_prometheus: list[DedicatedPrometheus]
) -> None:
    window = 30
    kube_api, namespace = env.api, env.namespace
    prom, _ = _a_plan_applied(env, own_prometheus, window)
    version = get_plan(kube_api, namespace, "llama")["status"]["planVersion"]
    routes = published_plan(kube_api, namespace, "llama").routes()  # type: ignore[union-attr]

    prom.stop()
    prom.lose_data()
    prom.start()
    restarted = time.time()
    seen: list[dict[str, Any]] = []

    def period_since_restart() -> bool:
        obj = get_plan(kube_api, namespace, "llama")
        metrics = condition(obj, "MetricsAvailable")
        if _epoch(obj["status"]["lastPeriodTime"]) >= restarted and metrics.get("reason") != "PrometheusUnreachable":
            seen.append(obj)
            return metrics.get("reason") == "MetricsRead"
        return False

    wait_for(period_since_restart, timeout=90, what="planning again after Prometheus lost its data", interval=0.2)
    held = [obj for obj in seen if condition(obj, "MetricsAvailable").get("reason") == "IncompleteWindow"]
    assert held, [condition(obj, "MetricsAvailable") for obj in seen]
    for obj in held:
        # Waiting, not failing; the plan in effect and its routes stay.
        assert condition(obj, "MetricsAvailable")["status"] == "False"
        assert "Prometheus holds only the last" in condition(obj, "MetricsAvailable")["message"]
        assert condition(obj, "Degraded")["status"] == "False"
        assert condition(obj, "Ready")["status"] == "True"
        assert obj["status"]["planVersion"] == version
        assert obj["status"].get("observedKvHit") is None  # no figure from the last seconds alone
    assert published_plan(kube_api, namespace, "llama").routes() == routes  # type: ignore[union-attr]
    # The wait is told, once, after the outage's failure.
    assert [e.type for e in events(kube_api, namespace, "IncompleteWindow")] == ["Normal"]
    # Planned from again once Prometheus holds half the window, not before.
    planned_at = _epoch(seen[-1]["status"]["lastPeriodTime"])
    assert planned_at >= restarted + window / 2 - PERIOD - 2, planned_at - restarted
