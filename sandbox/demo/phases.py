"""One phase of traffic through the router, and the switch from Shadow to Auto between phases."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cacheroute.operator.control.conditions import GUARD_REJECTED
from cacheroute.sandbox.demo.cluster import DemoError, await_true, condition, get_object, set_plan_mode
from cacheroute.sandbox.demo.observe import Counters, PoolMetrics, await_routers_on
from cacheroute.sandbox.demo.settings import DemoSettings
from cacheroute.sandbox.loadgen.client import LoadSettings, RequestResult, run_load
from cacheroute.sandbox.loadgen.report import Summary, summarize
from cacheroute.sandbox.loadgen.schedule import Schedule

ROUTER_HTTP_PORT = 8080
KEY_HEADER = "x-affinity-key"  # the pool's spec.router.keyHeader (examples/demo/pool.yaml)

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class PhaseResult:
    name: str
    started_at: float  # wall clock, when the first request was due
    results: list[RequestResult]
    summary: Summary
    counters: Counters  # what the phase added to the pool's counters


def run_phase(
    name: str, schedule: Schedule, *, router: str, model: str, metrics: PoolMetrics, destinations: int,
    progress: Progress | None = None,
) -> PhaseResult:
    """Send the phase's requests open loop through the router's Envoy; read the counters it moved."""
    before = metrics.settled_counters(destinations)
    # Chat requests: the router estimates a key's reusable prefix from the messages before the
    # newest one (docs/router.md), which the planner and the guard value; a completions prompt
    # gives it nothing to go on.
    settings = LoadSettings(url=f"http://{router}:{ROUTER_HTTP_PORT}", api="chat", model=model,
                            key_header=KEY_HEADER, key_field=None, timeout_s=120.0)
    started = time.time()
    results = asyncio.run(run_load(schedule, settings, progress=progress))
    after = metrics.settled_counters(destinations)
    return PhaseResult(name, started, results, summarize(results), after.minus(before))


def switch_to_auto(api: Any, settings: DemoSettings, routers: list[str], window_s: float) -> dict[str, Any]:
    """Set the AffinityPlan to Auto with a metrics window of the last `window_s` seconds (the
    first phase); return it once its plan is published and every router runs it, or once the
    operator has decided not to publish one (`guard_rejected`).

    A new spec generation is planned at once (docs/affinity-plan.md): the operator reads the
    last metrics window (the first phase), plans, replays the candidate in its guard and
    publishes it. A candidate the guard rejects is reported as it is, not worked around: the
    plan in effect (none) stays, and the demo goes on under it. Any other reason not to apply
    one (no metrics, a failed period) ends the demo.
    """
    set_plan_mode(api, settings, "Auto", metrics_window=f"{math.ceil(window_s)}s")
    generation = get_object(api, settings.namespace, "affinityplans", settings.plan)["metadata"]["generation"]

    def acted() -> bool:
        obj = get_object(api, settings.namespace, "affinityplans", settings.plan)
        status = obj.get("status") or {}
        if status.get("observedGeneration") != generation:
            return False
        applied = condition(obj, "Applied")
        if applied.get("status") == "True" and status.get("planVersion"):
            return True
        if applied.get("reason") == GUARD_REJECTED:
            return True
        if applied.get("reason") not in (None, "ShadowMode"):
            raise DemoError(f"the operator did not apply a plan: Applied={applied.get('status')} "
                           f"{applied.get('reason')}: {applied.get('message')}")
        return False

    await_true(acted, f"AffinityPlan {settings.plan} to publish its first plan in Auto", settings.step_timeout_s)
    plan = get_object(api, settings.namespace, "affinityplans", settings.plan)
    if not guard_rejected(plan):
        await_routers_on(routers, plan["status"]["planVersion"], settings.step_timeout_s)
    return plan


def guard_rejected(plan: dict[str, Any]) -> bool:
    """Whether the operator's guard kept the AffinityPlan's candidate from being applied."""
    return condition(plan, "Applied").get("reason") == GUARD_REJECTED

