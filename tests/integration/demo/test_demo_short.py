"""The short variant of `make demo` on the session's sandbox: the chart's operator, a pool of 4
emulated vLLM destinations behind its router, half a minute of traffic under p2c, the switch to
Auto, half a minute under the published plan."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from cacheroute.sandbox.cluster import Sandbox
from cacheroute.sandbox.demo import plots, report
from cacheroute.sandbox.demo.cluster import condition
from cacheroute.sandbox.demo.run import DemoRun, run_demo, teardown
from cacheroute.sandbox.demo.settings import SHORT

pytestmark = pytest.mark.integration


def test_the_planned_phase_serves_more_prompt_tokens_from_cache_than_p2c(
    sandbox: Sandbox, runtime_namespace: str, tmp_path: Path
) -> None:
    settings = replace(SHORT, namespace=runtime_namespace, release="cacheroute-demo")
    try:
        run = run_demo(sandbox, settings)
    finally:
        teardown(sandbox, settings)
    p2c, planned = run.phases
    for phase in run.phases:
        # Every request went through Envoy and the router to an emulator, and vLLM's counters in
        # Prometheus saw exactly those requests.
        assert phase.summary.failed == 0, phase.summary.errors
        assert sum(phase.counters.requests_by_pod.values()) == phase.summary.requests
        assert phase.counters.query_tokens == sum(r.prompt_tokens for r in phase.results)
    # Shadow published nothing: the router sent every key by its fallback. Auto did.
    assert p2c.counters.decisions.get("planned", 0) == 0
    assert planned.counters.decisions.get("planned", 0) > 0
    assert condition(run.plan_object, "Applied")["reason"] == "PlanApplied"
    assert run.plan is not None and len(run.plan) == run.plan_object["status"]["admittedKeys"]

    assert planned.counters.served_kv_hit > p2c.counters.served_kv_hit

    # The report and the figures come out of the same run.
    text = _rendered(run)
    assert "served KV hit" in text and "kubectl get affinityplans" in text
    assert [p.name for p in plots.write_plots(run, tmp_path)] == [
        "loop_ttft_cdf.png", "loop_kv_hit.png", "loop_requests_per_destination.png"]


def _rendered(run: DemoRun) -> str:
    buffer = io.StringIO()
    Console(width=160, file=buffer).print(report.render(run))
    return buffer.getvalue()
