"""One AffinityPlan's control loop: every control period, from Prometheus to the plan ConfigMaps.

A period (`PlanLoop.run_period`):

1. reads the pool and the plan in effect (read back from its ConfigMaps, so a restarted or
   failed-over operator re-plans from what routers follow, neither losing it nor churning it);
2. reads the metrics window from Prometheus (`prometheus.PrometheusReader`);
3. computes a candidate with the planner, the plan in effect as the previous plan (Manual: the
   pinned routes, nothing computed);
4. judges it in shadow replay against the plan in effect and p2c (`guard`);
5. publishes it (Auto, Manual; shards first, header last), and
6. writes status, conditions, an Event and metrics.

Failures keep the plan in effect: Prometheus unreachable, slow or empty, a pool without a ready
destination, a rejected or empty candidate. The next period tries again. Blocking work (API
calls, queries, planning, replay, encoding) runs in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, Protocol, TypeVar

from pydantic import ValidationError

from cacheroute.operator.api.common import parse_duration
from cacheroute.operator.api.plan import AffinityPlanSpec
from cacheroute.operator.api.pool import InferencePool
from cacheroute.operator.control import conditions as cond
from cacheroute.operator.control import inputs
from cacheroute.operator.control.conditions import Finding
from cacheroute.operator.control.guard import run_guard
from cacheroute.operator.control.kube import ApiError, ControlApi
from cacheroute.operator.control.metrics import PlanMetrics
from cacheroute.operator.control.plans import check_payload, manual_plan, same_routing
from cacheroute.operator.control.prometheus import (
    REASON_NOT_CONFIGURED,
    MetricsReadError,
    PrometheusReader,
    WindowMetrics,
)
from cacheroute.operator.control.promql import PoolSeries
from cacheroute.operator.control.publish import CurrentPlan, publish, read_current
from cacheroute.operator.control.settings import ControlSettings
from cacheroute.planner.errors import PlanInputError
from cacheroute.planner.keystats import KeyStats
from cacheroute.planner.plan import Plan, PlanError
from cacheroute.planner.plan_format import PlanPayload, encode_plan
from cacheroute.planner.planning import PlanResult, compute_plan
from cacheroute.planner.replay.guard import GuardVerdict

log = logging.getLogger(__name__)

T = TypeVar("T")
Outcome = Literal["applied", "unchanged", "shadow", "rejected", "kept", "failed"]
# A period never starts sooner than this after the previous one, whatever the spec says.
MIN_PERIOD_S = 1.0
SHADOW_PLANNED = "ShadowPlanned"


class EventSink(Protocol):
    def __call__(self, kind: Literal["Normal", "Warning"], reason: str, message: str) -> None: ...


class WindowReader(Protocol):
    async def read_window(self, series: PoolSeries, window_s: float, *, at: int) -> WindowMetrics: ...

    def close(self) -> None: ...


ReaderFactory = Callable[[str, float], WindowReader]


@dataclass
class PeriodResult:
    """What one period found and did (also what tests and benchmarks inspect)."""

    outcome: Outcome
    evaluated_at: int
    findings: list[Finding] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[Literal["Normal", "Warning"], str, str]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    stats: KeyStats | None = None
    result: PlanResult | None = None
    candidate: Plan | None = None
    payload: PlanPayload | None = None
    verdict: GuardVerdict | None = None
    window: WindowMetrics | None = None

    def finding(self, type_: str) -> Finding | None:
        return next((f for f in self.findings if f.type == type_), None)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: object) -> float | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


class PlanLoop:
    """The control loop of one AffinityPlan (its period, run by a kopf daemon)."""

    def __init__(
        self,
        api: ControlApi,
        settings: ControlSettings,
        *,
        namespace: str,
        name: str,
        events: EventSink,
        reader_factory: ReaderFactory | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.api = api
        self.settings = settings
        self.namespace = namespace
        self.name = name
        self.events = events
        self.reader_factory: ReaderFactory = reader_factory or (lambda url, t: PrometheusReader(url, timeout_s=t))
        self.clock = clock
        self.metrics = PlanMetrics(namespace, name)
        self._last_at: float | None = None
        self._last_generation: int | None = None

    # --- scheduling --------------------------------------------------------------------------------

    def seconds_until_due(self, body: Mapping[str, Any]) -> float:
        """Seconds until the next period: one control period after the last (as status records it,
        so a restarted operator keeps the rhythm), at once for a new generation of the spec."""
        spec = body.get("spec") or {}
        status = body.get("status") or {}
        generation = (body.get("metadata") or {}).get("generation")
        try:
            period = max(parse_duration(str(spec.get("controlPeriod", "5m"))), MIN_PERIOD_S)
        except ValueError:
            period = 300.0
        last = max(filter(None, (_parse_time(status.get("lastPeriodTime")), self._last_at)), default=None)
        seen = self._last_generation if self._last_generation is not None else status.get("observedGeneration")
        now = self.clock()
        if last is None:
            return 0.0
        if generation is not None and seen != generation:
            return max(0.0, last + MIN_PERIOD_S - now)
        return max(0.0, last + period - now)

    # --- one period ----------------------------------------------------------------------------------

    async def run_period(self, body: Mapping[str, Any], *, publish_allowed: Callable[[], bool] = lambda: True) -> (
        PeriodResult
    ):
        """Run one period for the AffinityPlan `body`, then report it (status, Event, metrics)."""
        started = time.perf_counter()
        at = math.floor(self.clock())
        self._last_at = float(at)
        generation = (body.get("metadata") or {}).get("generation")
        self._last_generation = generation
        try:
            result = await self._period(body, at, publish_allowed)
        except (ApiError, OSError) as exc:
            result = PeriodResult("failed", at, findings=[Finding(cond.DEGRADED, True, "ApiError", str(exc))])
        except Exception as exc:  # a bug must not end the loop: report it and try again next period
            log.exception("control period of AffinityPlan %s/%s failed", self.namespace, self.name)
            result = PeriodResult(
                "failed", at, findings=[Finding(cond.DEGRADED, True, "InternalError", f"{type(exc).__name__}: {exc}")]
            )
        t0 = time.perf_counter()
        try:
            await self._report(body, result, generation)
        except ApiError as exc:
            log.warning("AffinityPlan %s/%s: %s", self.namespace, self.name, exc)
        result.seconds["status"] = time.perf_counter() - t0
        self.metrics.step("status", result.seconds["status"])
        self.metrics.period(time.perf_counter() - started, result.outcome)
        if result.outcome != "failed" and not (result.finding(cond.DEGRADED) or Finding("", False, "")).status:
            self.metrics.succeeded(self.clock())
        return result

    async def _timed(self, result: PeriodResult, step: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        t0 = time.perf_counter()
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        finally:
            result.seconds[step] = result.seconds.get(step, 0.0) + time.perf_counter() - t0
            self.metrics.step(step, time.perf_counter() - t0)

    async def _timed_async(self, result: PeriodResult, step: str, awaitable: Awaitable[T]) -> T:
        t0 = time.perf_counter()
        try:
            return await awaitable
        finally:
            result.seconds[step] = time.perf_counter() - t0
            self.metrics.step(step, result.seconds[step])

    async def _period(self, body: Mapping[str, Any], at: int, publish_allowed: Callable[[], bool]) -> PeriodResult:
        result = PeriodResult("kept", at)
        try:
            spec = AffinityPlanSpec.model_validate(body.get("spec") or {})
        except ValidationError as exc:
            return self._not_planned(result, cond.INVALID_INPUT, f"spec is invalid: {exc.errors()[0]['msg']}")
        pool_name = spec.pool_ref.name
        pool_obj = await asyncio.to_thread(self.api.get_pool, self.namespace, pool_name)
        if pool_obj is None:
            return self._not_planned(result, cond.POOL_NOT_FOUND, f"InferencePool {pool_name} does not exist")
        try:
            pool = InferencePool.model_validate(pool_obj)
        except ValidationError as exc:
            return self._not_planned(result, cond.INVALID_INPUT, f"InferencePool {pool_name}: {exc.errors()[0]['msg']}")
        current = await asyncio.to_thread(read_current, self.api, self.namespace, pool_name)
        result.status["planVersion"] = current.version if current.plan is not None else None
        if current.plan is not None:
            self.metrics.in_effect(pool_name, current.version, len(current.plan))
        if spec.mode == "Manual":
            return await self._manual(result, spec, pool, pool_obj, current, publish_allowed)
        return await self._computed(result, spec, pool, pool_obj, current, publish_allowed)

    def _not_planned(self, result: PeriodResult, reason: str, message: str) -> PeriodResult:
        result.findings += [Finding(cond.PLANNED, False, reason, message), Finding(cond.DEGRADED, True, reason, message)]
        result.events.append(("Warning", reason, message))
        return result

    # --- Manual ----------------------------------------------------------------------------------

    async def _manual(
        self,
        result: PeriodResult,
        spec: AffinityPlanSpec,
        pool: InferencePool,
        pool_obj: Mapping[str, Any],
        current: CurrentPlan,
        publish_allowed: Callable[[], bool],
    ) -> PeriodResult:
        everyone = inputs.pool_destinations(pool, ready_only=False)
        if not everyone:
            return self._not_planned(result, cond.POOL_NOT_READY, f"InferencePool {pool.metadata.name} lists no destination")
        unknown = inputs.unknown_pinned_destination(spec, {d.id: d for d in everyone})
        if unknown is not None:
            return self._not_planned(
                result, cond.INVALID_PINNED, f"a pinned route names {unknown}, which is not a destination of the pool"
            )
        await self._observe(result, spec, pool.metadata.name, keys=False)
        t0 = time.perf_counter()
        plan = manual_plan(
            spec,
            everyone,
            pool=pool.metadata.name,
            generated_at=_iso(result.evaluated_at),
            key_extraction=inputs.key_extraction(pool),
            spill_threshold=pool.spec.router.spill_threshold,
        )
        result.seconds["plan"] = time.perf_counter() - t0
        result.candidate = plan
        result.findings.append(Finding(cond.PLANNED, True, cond.PINNED_ROUTES, plan.summary.reason))
        figures = {"admittedKeys": len(plan), "coveredRequestShare": None, "churn": None, "forcedChurn": None,
                   "predictedKvHit": None, "predictedP99TtftSeconds": None}
        self.metrics.verdict("skipped")
        return await self._apply(result, spec, pool_obj, current, plan, figures, publish_allowed)

    # --- Auto and Shadow ---------------------------------------------------------------------------

    async def _observe(self, result: PeriodResult, spec: AffinityPlanSpec, pool: str, *, keys: bool) -> bool:
        """Read the window into `result`; False (with findings) when it could not be read."""
        url = spec.prometheus.url or self.settings.prometheus_url
        if not url:
            result.findings.append(
                Finding(cond.METRICS_AVAILABLE, False, REASON_NOT_CONFIGURED,
                        "no Prometheus: set spec.prometheus.url or the operator's --prometheus-url")
            )
            return False
        window_s = parse_duration(spec.metrics_window)
        reader = self.reader_factory(url, parse_duration(spec.prometheus.timeout))
        try:
            series = PoolSeries(self.namespace, pool)
            window = await self._timed_async(result, "query", reader.read_window(series, window_s, at=result.evaluated_at))
        except MetricsReadError as exc:
            result.findings.append(Finding(cond.METRICS_AVAILABLE, False, exc.reason, exc.message))
            return False
        finally:
            reader.close()
        result.window = window
        result.status["observedKvHit"] = window.observed_kv_hit
        if keys and not window.total_requests > 0:
            result.findings.append(
                Finding(cond.METRICS_AVAILABLE, False, cond.NO_TRAFFIC,
                        f"no router requests of pool {pool} in the last {spec.metrics_window}")
            )
            return False
        routers = f"{window.total_requests:,.0f} requests, {len(window.keys):,} tracked keys"
        engines = f"{len(window.engines)} vLLM pods reporting"
        result.findings.append(Finding(cond.METRICS_AVAILABLE, True, cond.METRICS_READ, f"{routers}; {engines}"))
        return True

    async def _computed(
        self,
        result: PeriodResult,
        spec: AffinityPlanSpec,
        pool: InferencePool,
        pool_obj: Mapping[str, Any],
        current: CurrentPlan,
        publish_allowed: Callable[[], bool],
    ) -> PeriodResult:
        pool_name = pool.metadata.name
        ready = inputs.pool_destinations(pool, ready_only=True)
        if not ready:
            return self._not_planned(result, cond.POOL_NOT_READY, f"InferencePool {pool_name} has no ready destination")
        if not await self._observe(result, spec, pool_name, keys=True):
            metrics = result.finding(cond.METRICS_AVAILABLE)
            message = metrics.message if metrics else "metrics unavailable"
            result.findings += [
                Finding(cond.PLANNED, False, cond.METRICS_UNAVAILABLE, message),
                Finding(cond.DEGRADED, True, metrics.reason if metrics else cond.METRICS_UNAVAILABLE, message),
            ]
            return result
        assert result.window is not None
        pins, pin_notes = inputs.pinned_routes(spec, ready)
        prepared = inputs.key_stats(result.window, list(pins))
        stats = result.stats = prepared.stats
        previous = current.plan
        try:
            plan_result = await self._timed(
                result, "plan", self._plan, stats, ready, spec, pool, previous, pins, _iso(result.evaluated_at)
            )
        except (PlanInputError, PlanError) as exc:
            return self._not_planned(result, cond.INVALID_INPUT, str(exc))
        result.result = plan_result
        candidate = result.candidate = plan_result.plan
        try:
            payload = result.payload = await self._timed(result, "plan", _encode_checked, candidate)
        except PlanError as exc:
            return self._not_planned(result, cond.INVALID_PLAN, str(exc))
        notes = [*pin_notes] + ([] if prepared.output_tokens_known else ["vLLM reported no generated tokens"])
        summary = candidate.summary
        planned_msg = (
            f"candidate {payload.version}: {len(candidate):,} routes for {len(stats):,} keys, "
            f"{_pct(summary.admitted_request_share)} of requests, churn {_pct(plan_result.churn)} "
            f"(forced {_pct(plan_result.churn_forced)}) on {len(ready)} ready destinations"
        )
        result.findings.append(Finding(cond.PLANNED, True, cond.PLAN_COMPUTED, "; ".join([planned_msg, *notes])))
        result.status["candidateVersion"] = payload.version
        figures: dict[str, Any] = {
            "admittedKeys": len(candidate),
            "coveredRequestShare": min(max(summary.admitted_request_share, 0.0), 1.0),
            "churn": min(max(plan_result.churn, 0.0), 1.0),
            "forcedChurn": min(max(plan_result.churn_forced, 0.0), 1.0),
        }
        unchanged = same_routing(candidate, previous)
        if spec.mode == "Auto" and unchanged:
            self.metrics.verdict("skipped")
            result.outcome = "unchanged"
            result.status.update(figures, churn=0.0, forcedChurn=0.0)
            result.findings += [
                Finding(cond.APPLIED, True, cond.UNCHANGED, f"plan {current.version} already routes this way"),
                Finding(cond.DEGRADED, False, cond.AS_EXPECTED),
            ]
            return result
        if spec.mode == "Auto" and not len(candidate) and previous is not None and len(previous):
            self.metrics.verdict("skipped")
            message = f"the candidate routes no key; plan {current.version} with {len(previous):,} routes stays"
            result.findings += [
                Finding(cond.APPLIED, False, cond.EMPTY_PLAN, message),
                Finding(cond.DEGRADED, False, cond.AS_EXPECTED),
            ]
            return result
        verdict = None
        if spec.guard.enabled:
            try:
                verdict = result.verdict = await self._timed(
                    result, "guard", run_guard, stats, candidate, previous,
                    settings=inputs.guard_settings(spec),
                    duration_s=parse_duration(spec.guard.replay_duration),
                    kv_capacity_tokens=ready[0].kv_capacity_tokens,
                )
            except ValueError as exc:  # e.g. too little traffic to synthesise a replay window
                self.metrics.verdict("rejected")
                result.outcome = "rejected"
                message = f"candidate {payload.version} could not be replayed ({exc}); the plan in effect stays"
                result.findings += [Finding(cond.APPLIED, False, cond.GUARD_REJECTED, message),
                                    Finding(cond.DEGRADED, False, cond.AS_EXPECTED)]
                return result
            self.metrics.verdict("passed" if verdict.passed else "rejected")
            figures["predictedKvHit"] = min(max(verdict.candidate.kv_hit, 0.0), 1.0)
            p99 = verdict.candidate.ttft_p99_s
            figures["predictedP99TtftSeconds"] = p99 if math.isfinite(p99) else None
        else:
            self.metrics.verdict("skipped")
            figures["predictedKvHit"] = summary.predicted_kv_hit
            figures["predictedP99TtftSeconds"] = None
        judged = _verdict_text(verdict)
        if spec.mode == "Shadow":
            result.outcome = "shadow"
            result.status.update(figures)
            would = "would apply" if verdict is None or verdict.passed else "would not apply"
            message = f"mode Shadow: {would} candidate {payload.version} ({judged})"
            result.findings += [Finding(cond.APPLIED, False, cond.SHADOW_MODE, message),
                                Finding(cond.DEGRADED, False, cond.AS_EXPECTED)]
            result.events.append(("Normal", SHADOW_PLANNED, f"{planned_msg}; {judged}"))
            return result
        if verdict is not None and not verdict.passed:
            result.outcome = "rejected"
            stays = f"plan {current.version} stays" if current.plan is not None else "no plan in effect"
            message = f"candidate {payload.version} lost in the guard: {verdict.reason}; {stays}"
            result.findings += [Finding(cond.APPLIED, False, cond.GUARD_REJECTED, message),
                                Finding(cond.DEGRADED, False, cond.AS_EXPECTED)]
            result.events.append(("Warning", cond.GUARD_REJECTED, message))
            return result
        return await self._apply(result, spec, pool_obj, current, candidate, figures, publish_allowed, payload)

    @staticmethod
    def _plan(
        stats: KeyStats,
        ready: list[Any],
        spec: AffinityPlanSpec,
        pool: InferencePool,
        previous: Plan | None,
        pins: Mapping[str, list[str]],
        generated_at: str,
    ) -> PlanResult:
        return compute_plan(
            stats,
            ready,
            pool=pool.metadata.name,
            budget=inputs.budget(spec),
            stability=inputs.stability(spec),
            previous=previous,
            pinned=pins,
            generated_at=generated_at,
            key_extraction=inputs.key_extraction(pool),
            spill_threshold=pool.spec.router.spill_threshold,
        )

    # --- applying ----------------------------------------------------------------------------------

    async def _apply(
        self,
        result: PeriodResult,
        spec: AffinityPlanSpec,
        pool_obj: Mapping[str, Any],
        current: CurrentPlan,
        plan: Plan,
        figures: Mapping[str, Any],
        publish_allowed: Callable[[], bool],
        payload: PlanPayload | None = None,
    ) -> PeriodResult:
        pool_name = plan.pool
        if same_routing(plan, current.plan):
            result.outcome = "unchanged"
            result.status.update(figures)
            result.findings += [Finding(cond.APPLIED, True, cond.UNCHANGED, f"plan {current.version} already routes this way"),
                                Finding(cond.DEGRADED, False, cond.AS_EXPECTED)]
            return result
        if payload is None:
            try:
                payload = result.payload = await self._timed(result, "plan", _encode_checked, plan)
            except PlanError as exc:
                return self._not_planned(result, cond.INVALID_PLAN, str(exc))
        result.status["candidateVersion"] = payload.version
        if not publish_allowed():
            result.findings.append(Finding(cond.APPLIED, False, "Stopped", "the AffinityPlan is being deleted"))
            return result
        try:
            await self._timed(result, "publish", publish, self.api, pool_obj, payload, writer=self.name)
        except (ApiError, PlanError) as exc:
            result.outcome = "failed"
            message = f"plan {payload.version} could not be published: {exc}"
            result.findings += [Finding(cond.APPLIED, False, cond.PUBLISH_FAILED, message),
                                Finding(cond.DEGRADED, True, cond.PUBLISH_FAILED, message)]
            result.events.append(("Warning", cond.PUBLISH_FAILED, message))
            return result
        result.outcome = "applied"
        result.status.update(figures, planVersion=payload.version, appliedAt=_iso(self.clock()))
        self.metrics.in_effect(pool_name, payload.version, len(plan))
        judged = _verdict_text(result.verdict)
        message = (
            f"plan {payload.version} applied ({spec.mode}): {len(plan):,} routes"
            + (f", {_pct(figures.get('coveredRequestShare'))} of requests" if figures.get("coveredRequestShare") is not None else "")
            + (f", churn {_pct(figures.get('churn'))} (forced {_pct(figures.get('forcedChurn'))})" if figures.get("churn") is not None else "")
            + f"; {judged}; " + _seconds_text(result.seconds)
        )
        result.findings += [Finding(cond.APPLIED, True, cond.PLAN_APPLIED, message),
                            Finding(cond.DEGRADED, False, cond.AS_EXPECTED)]
        result.events.append(("Normal", cond.PLAN_APPLIED, message))
        return result

    # --- reporting ---------------------------------------------------------------------------------

    async def _report(self, body: Mapping[str, Any], result: PeriodResult, generation: int | None) -> None:
        old_status = body.get("status") or {}
        old_conditions = list(old_status.get("conditions") or [])
        spec = body.get("spec") or {}
        mode = spec.get("mode", "Auto")
        findings = list(result.findings)
        version = result.status.get("planVersion", old_status.get("planVersion"))
        if mode == "Shadow":
            planned = result.finding(cond.PLANNED)
            ok = planned is not None and planned.status
            findings.append(Finding(cond.READY, ok, cond.REPORTING if ok else (planned.reason if planned else cond.NO_PLAN),
                                    "" if ok else (planned.message if planned else "")))
        else:
            findings.append(
                Finding(cond.READY, True, cond.PLAN_IN_EFFECT, f"plan {version} is in effect")
                if version else Finding(cond.READY, False, cond.NO_PLAN, "no plan has been published yet")
            )
        now = datetime.fromtimestamp(self.clock(), UTC)
        status = dict(result.status)
        status["conditions"] = cond.merge(old_conditions, findings, generation=generation, now=now)
        status["lastPeriodTime"] = _iso(result.evaluated_at)
        if generation is not None:
            status["observedGeneration"] = generation
        for kind, reason, message in self._transition_events(old_conditions, result):
            result.events.append((kind, reason, message))
        result.events = self._worth_telling(old_status, result)
        result.status = status
        await asyncio.to_thread(self.api.patch_plan_status, self.namespace, self.name, status)
        for kind, reason, message in result.events:
            self.events(kind, reason, message)

    @staticmethod
    def _worth_telling(
        old_status: Mapping[str, Any], result: PeriodResult
    ) -> list[tuple[Literal["Normal", "Warning"], str, str]]:
        """The period's Events less repeats: the same candidate judged again, the same failure again."""
        old_conditions = list(old_status.get("conditions") or [])
        same_candidate = result.status.get("candidateVersion") == old_status.get("candidateVersion")
        degraded = cond.current(old_conditions, cond.DEGRADED)
        still_failing = degraded is not None and degraded.get("status") == "True"
        kept = []
        for kind, reason, message in result.events:
            if reason in (SHADOW_PLANNED, cond.GUARD_REJECTED) and same_candidate:
                continue
            if kind == "Warning" and still_failing and degraded is not None and degraded.get("reason") == reason:
                continue
            kept.append((kind, reason, message))
        return kept

    @staticmethod
    def _transition_events(old: list[Mapping[str, Any]], result: PeriodResult) -> list[tuple[Literal["Normal", "Warning"], str, str]]:
        out: list[tuple[Literal["Normal", "Warning"], str, str]] = []
        metrics = result.finding(cond.METRICS_AVAILABLE)
        if metrics is not None and cond.is_true(old, cond.METRICS_AVAILABLE) is not metrics.status:
            out.append(("Normal" if metrics.status else "Warning", metrics.reason, metrics.message))
        return out

    def forget(self) -> None:
        """Drop this AffinityPlan's metric series (it was deleted)."""
        self.metrics.forget()


def _encode_checked(plan: Plan) -> PlanPayload:
    payload = encode_plan(plan)
    check_payload(plan, payload)
    return payload


def _verdict_text(verdict: GuardVerdict | None) -> str:
    if verdict is None:
        return "guard off"
    c, p = verdict.candidate, verdict.p2c
    return (
        f"guard {'passed' if verdict.passed else 'rejected'}: predicted KV hit {_pct(c.kv_hit)} (p2c {_pct(p.kv_hit)}), "
        f"p99 TTFT {c.ttft_p99_s:.2f}s (p2c {p.ttft_p99_s:.2f}s)"
    )


def _seconds_text(seconds: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}s" for k, v in seconds.items())
