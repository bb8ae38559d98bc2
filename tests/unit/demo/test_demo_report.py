"""What the demo reports when the operator applied its plan, and when its guard kept none."""

from __future__ import annotations

import io

from rich.console import Console

from cacheroute.sandbox.demo import report
from cacheroute.sandbox.demo.observe import Counters
from cacheroute.sandbox.demo.phases import PhaseResult
from cacheroute.sandbox.demo.run import DemoRun
from cacheroute.sandbox.demo.settings import SHORT
from cacheroute.sandbox.demo.workload import demo_workload
from cacheroute.sandbox.loadgen.report import Summary

REJECTION = ("candidate 17a8ce215cdd9ba0 lost in the guard: p99 TTFT 7.23s misses the SLO 3.50s; "
             "plan 2d282296ab90ab39 stays")


def _phase(name: str, hit: float, p99_s: float) -> PhaseResult:
    summary = Summary(requests=100, succeeded=100, failed=0, duration_s=10.0, throughput_rps=10.0,
                      ttft_p50_s=0.4, ttft_p90_s=1.0, ttft_p99_s=p99_s, e2e_p50_s=2.0, e2e_p99_s=5.0,
                      prompt_tokens=1000, cached_tokens=int(1000 * hit), served_kv_hit=hit, max_send_lag_s=0.0,
                      errors={})
    counters = Counters(at=0.0, hit_tokens=1000 * hit, query_tokens=1000.0, requests_by_pod={"demo-0": 100.0},
                        decisions={"p2c": 100.0})
    return PhaseResult(name, 0.0, [], summary, counters)


def _run(applied: dict[str, str]) -> DemoRun:
    run = DemoRun(SHORT, demo_workload(SHORT))
    run.phases = [_phase("p2c", 0.60, 5.0), _phase("planned", 0.62, 4.0)]
    run.plan_object = {"status": {"planVersion": "2d282296ab90ab39", "conditions": [{"type": "Applied", **applied}]}}
    run.destination_ids = ("demo-0",)
    return run


def _text(run: DemoRun) -> str:
    buffer = io.StringIO()
    Console(width=200, file=buffer).print(report.render(run))
    return buffer.getvalue()


def test_a_plan_the_guard_rejected_is_reported_as_no_plan_not_as_a_planned_phase() -> None:
    run = _run({"status": "False", "reason": "GuardRejected", "message": REJECTION})
    assert run.guard_rejected
    text = _text(run)
    assert "the guard kept no plan" in text and "planned (Auto)" not in text
    assert "guard rejected the candidate" in text and "misses the SLO 3.50s" in text
    assert "planned wins" not in text
    verdict = report.document(run)["verdict"]
    assert verdict["guard_rejected"] is True and verdict["planned_wins"] is False


def test_an_applied_plan_is_judged_against_the_phase_without_one() -> None:
    run = _run({"status": "True", "reason": "PlanApplied", "message": "applied"})
    assert not run.guard_rejected
    text = _text(run)
    assert "planned (Auto)" in text and "planned wins on both" in text
    verdict = report.document(run)["verdict"]
    assert verdict["guard_rejected"] is False and verdict["planned_wins"] is True
