"""One AffinityPlan's control loop: every control period, from Prometheus to the plan ConfigMaps.

A period (`PlanLoop.run_period`):

1. reads the pool and the plan in effect, read back from its ConfigMaps (so a restarted or
   failed-over operator re-plans from what the routers follow: it neither loses nor churns it);
2. reads the metrics window from Prometheus (`prometheus.PrometheusReader`);
3. computes a candidate with the planner, the plan in effect as the previous plan (Manual: the
   pinned routes, nothing computed);
4. judges it in shadow replay against the plan in effect and p2c (`guard`);
5. publishes it (Auto, Manual: shards first, header last; Shadow never does), and
6. writes status and conditions, posts Events, updates the metrics (`report`, `metrics`).

Anything that goes wrong keeps the plan in effect: Prometheus unreachable, slow or empty, a pool
without a ready destination, a rejected candidate, an empty candidate where a plan routes keys.
The next period tries again. Blocking work (API calls, queries, planning, replay, encoding)
runs in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Protocol, TypeVar

from pydantic import ValidationError

from cacheroute.operator.api.common import parse_duration
from cacheroute.operator.api.plan import MIN_CONTROL_PERIOD, AffinityPlanSpec
from cacheroute.operator.api.pool import InferencePool
from cacheroute.operator.control import conditions as cond
from cacheroute.operator.control import inputs
from cacheroute.operator.control.conditions import Finding
from cacheroute.operator.control.guard import plan_cost, routing_of, run_guard
from cacheroute.operator.control.kube import ApiError, ControlApi
from cacheroute.operator.control.metrics import PlanMetrics
from cacheroute.operator.control.period import EventKind, PeriodResult, pct, seconds_text, verdict_text
from cacheroute.operator.control.plans import (
    check_payload,
    manual_plan,
    pinned_only,
    pinned_plan,
    pins_alone,
    same_routing,
)
from cacheroute.operator.control.prometheus import (
    REASON_ERROR,
    REASON_NOT_CONFIGURED,
    REASON_TIMEOUT,
    REASON_UNREACHABLE,
    MetricsReadError,
    PrometheusReader,
    WindowMetrics,
)
from cacheroute.operator.control.promql import PoolSeries
from cacheroute.operator.control.publish import (
    VERSION_ANNOTATION,
    WRITER_ANNOTATION,
    CurrentPlan,
    claim_writer,
    publish,
    read_current,
    read_writer,
    release_writer,
)
from cacheroute.operator.control.report import SHADOW_PLANNED, events_to_post, iso, new_status
from cacheroute.operator.control.settings import ControlSettings
from cacheroute.operator.fleet.names import MAX_PLAN_SHARDS
from cacheroute.planner.errors import PlanInputError
from cacheroute.planner.keystats import KeyStats
from cacheroute.planner.plan import Destination, Plan, PlanError, validate_plan
from cacheroute.planner.plan_format import PlanPayload, configmap_name, encode_plan
from cacheroute.planner.planning import PlanResult, compute_plan
from cacheroute.planner.refused import over_all_traffic, without_refused
from cacheroute.planner.replay.guard import GuardVerdict

log = logging.getLogger(__name__)

T = TypeVar("T")
# A period never starts sooner than this after the previous one, whatever the spec says.
MIN_PERIOD_S = parse_duration(MIN_CONTROL_PERIOD)
# A period that found nothing to plan from yet (its pool still starting, no traffic counted yet) is
# retried this soon instead of a whole control period later: a plan applied with its pool, as
# `kubectl apply -f examples/` does, would otherwise sit idle for the default five minutes. A plan
# refused because another one publishes its pool is retried as soon, to take the pool when freed.
WAITING_RETRY_S = 15.0
WAITING_REASONS = cond.WAITING | {cond.POOL_NOT_FOUND, cond.POOL_CLAIMED}
# A period that could not read Prometheus is retried this soon (at most): a plan with an hour's
# period would otherwise plan again an hour after Prometheus is back. One query round a minute
# is no load on a Prometheus that is coming back.
PROMETHEUS_RETRY_S = 60.0
PROMETHEUS_FAILURES = frozenset({REASON_UNREACHABLE, REASON_TIMEOUT, REASON_ERROR})
# How often, between periods, a plan compares its pool's destinations with the last period's.
POOL_CHECK_S = 10.0
# Router history missing from a window that is not counted as missing (see `_incomplete_window`).
MISSING_HISTORY_SLACK_S = 10.0


class EventSink(Protocol):
    """Posts one Event and returns once it is posted (called in a worker thread)."""

    def __call__(self, kind: EventKind, reason: str, message: str) -> None: ...


class WindowReader(Protocol):
    async def read_window(
        self, series: PoolSeries, window_s: float, *, at: int, keys: bool = True
    ) -> WindowMetrics: ...

    def close(self) -> None: ...


ReaderFactory = Callable[[str, float], WindowReader]


def _default_reader(url: str, timeout_s: float) -> WindowReader:
    return PrometheusReader(url, timeout_s=timeout_s)


def _parse_time(text: object) -> float | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def encode_checked(plan: Plan) -> PlanPayload:
    """The ConfigMap payload of `plan`: the plan passes `validate_plan` (the check every router
    applies), the payload decodes back to the same routes, and it fits the ConfigMaps the pool's
    routers mount."""
    validate_plan(plan)
    payload = encode_plan(plan)
    check_payload(plan, payload)
    if len(payload.configmaps) > MAX_PLAN_SHARDS:
        raise PlanError(
            f"plan {payload.version} needs {len(payload.configmaps)} ConfigMaps; the pool's routers mount at most "
            f"{MAX_PLAN_SHARDS} (lower the warm budget or the routers' sketch size)"
        )
    return payload


@dataclass
class _Work:
    """What one period works on."""

    result: PeriodResult
    spec: AffinityPlanSpec
    pool: InferencePool
    pool_obj: Mapping[str, Any]
    current: CurrentPlan
    publish_allowed: Callable[[], bool]

    @property
    def pool_name(self) -> str:
        return self.pool.metadata.name


class PlanLoop:
    """The control loop of one AffinityPlan (run by a kopf daemon, one period at a time)."""

    def __init__(
        self,
        api: ControlApi,
        settings: ControlSettings,
        *,
        namespace: str,
        name: str,
        events: EventSink,
        reader_factory: ReaderFactory = _default_reader,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.api = api
        self.settings = settings
        self.namespace = namespace
        self.name = name
        self.events = events
        self.reader_factory = reader_factory
        self.clock = clock
        self.metrics = PlanMetrics(namespace, name)
        self._last_at: float | None = None
        self._last_generation: int | None = None
        # The pool spec generation its status described at the last period, and when the pool was
        # last looked at (None: no period has read it yet).
        self._pool_generation: int | None = None
        self._pool_checked_at: float | None = None

    # --- scheduling --------------------------------------------------------------------------------

    def seconds_until_due(self, body: Mapping[str, Any]) -> float:
        """Seconds until the next period: one control period after the last one (as the status
        records it, so a restarted operator keeps the rhythm); soon for a new spec generation."""
        spec = body.get("spec") or {}
        status = body.get("status") or {}
        generation = (body.get("metadata") or {}).get("generation")
        try:
            period = max(parse_duration(str(spec.get("controlPeriod", "5m"))), MIN_PERIOD_S)
        except ValueError:
            period = 300.0
        last = max(filter(None, (_parse_time(status.get("lastPeriodTime")), self._last_at)), default=None)
        if last is None:
            return 0.0
        seen = self._last_generation if self._last_generation is not None else status.get("observedGeneration")
        if generation is not None and seen != generation:
            period = MIN_PERIOD_S
        elif _waiting(status):
            period = min(period, WAITING_RETRY_S)
        elif _prometheus_failed(status):
            period = min(period, PROMETHEUS_RETRY_S)
        return max(0.0, last + period - self.clock())

    async def pool_changed(self, body: Mapping[str, Any]) -> bool:
        """Whether the pool or the plan it has changed under this AffinityPlan since the last
        period, so that the next period runs now rather than a control period later:
        - the pool's status describes a newer spec (scaled, say; a pod that restarts is not a
          change), once its status lists the new destinations;
        - the pool was deleted (the status must stop describing a plan in effect);
        - the plan ConfigMap no longer holds the plan this one published (deleted by hand and
          recreated empty by the pool's reconciler, say): it is published again.
        Looked at no more often than every `POOL_CHECK_S`; an unreadable pool or ConfigMap counts
        as unchanged (the period will say why)."""
        now = self.clock()
        if self._pool_checked_at is None or now - self._pool_checked_at < POOL_CHECK_S:
            return False
        self._pool_checked_at = now
        pool_name = _pool_name(body)
        if not pool_name:
            return False
        try:
            obj = await asyncio.to_thread(self.api.get_pool, self.namespace, pool_name)
            pool = InferencePool.model_validate(obj) if obj is not None else None
            if pool is None:
                return self._pool_generation is not None
            if _described_generation(pool) != self._pool_generation:
                return True
            return await self._published_elsewhere(body, pool_name)
        except (ApiError, ValidationError):
            return False

    async def _published_elsewhere(self, body: Mapping[str, Any], pool_name: str) -> bool:
        """Whether the plan ConfigMap holds another version than the one this AffinityPlan
        published, with no other AffinityPlan named as its publisher."""
        status = body.get("status") or {}
        mode = (body.get("spec") or {}).get("mode", "Auto")
        version = status.get("planVersion")
        if mode == "Shadow" or not version or _waiting(status):
            return False
        annotations = await asyncio.to_thread(self.api.configmap_annotations, self.namespace,
                                              configmap_name(pool_name, 0))
        if annotations is None:
            return True
        writer = annotations.get(WRITER_ANNOTATION)
        return writer in (None, self.name) and annotations.get(VERSION_ANNOTATION) != version

    # --- one period ----------------------------------------------------------------------------------

    async def run_period(
        self, body: Mapping[str, Any], *, publish_allowed: Callable[[], bool] = lambda: True
    ) -> PeriodResult:
        """Run one period for the AffinityPlan `body`, then report it (status, Events, metrics)."""
        started = time.perf_counter()
        at = math.floor(self.clock())
        generation = (body.get("metadata") or {}).get("generation")
        self._last_at, self._last_generation = float(at), generation
        try:
            result = await self._period(body, at, publish_allowed)
        except ApiError as exc:
            result = PeriodResult("failed", at, [Finding(cond.DEGRADED, True, "ApiError", str(exc))])
        except Exception as exc:  # a bug must not end the loop: report it, try again next period
            log.exception("control period of AffinityPlan %s/%s failed", self.namespace, self.name)
            message = f"{type(exc).__name__}: {exc}"
            result = PeriodResult("failed", at, [Finding(cond.DEGRADED, True, "InternalError", message)])
        if result.outcome == "kept" and result.degraded:
            # Nothing applied because something is wrong (Prometheus away, a spec refused): a
            # failure for dashboards, not "nothing new to apply".
            result.outcome = "failed"
        t0 = time.perf_counter()
        try:
            await self._report(body, result, generation)
        except ApiError as exc:
            log.warning("AffinityPlan %s/%s: %s", self.namespace, self.name, exc)
        result.seconds["status"] = time.perf_counter() - t0
        self.metrics.step("status", result.seconds["status"])
        took = time.perf_counter() - started
        self.metrics.period(took, result.outcome)
        self._log_period(result, took)
        if not result.degraded:
            self.metrics.succeeded(self.clock())
        return result

    def _log_period(self, result: PeriodResult, took: float) -> None:
        """One line per period: what an SRE tailing the log would otherwise find only in status."""
        # A failed period is told by what degraded it (Prometheus away, the API refusing), else by Applied.
        told = result.finding(cond.DEGRADED) if result.outcome == "failed" else None
        told = told or result.finding(cond.APPLIED)
        said = f"; {told.reason}: {told.message}" if told is not None else ""
        log.info("AffinityPlan %s/%s: period %s in %.2fs%s", self.namespace, self.name, result.outcome, took, said)

    async def _timed(self, result: PeriodResult, step: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn` in a worker thread, its duration added to `step`."""
        t0 = time.perf_counter()
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        finally:
            elapsed = time.perf_counter() - t0
            result.seconds[step] = result.seconds.get(step, 0.0) + elapsed
            self.metrics.step(step, elapsed)

    async def _timed_await(self, result: PeriodResult, step: str, work: Coroutine[Any, Any, T]) -> T:
        t0 = time.perf_counter()
        try:
            return await work
        finally:
            elapsed = time.perf_counter() - t0
            result.seconds[step] = result.seconds.get(step, 0.0) + elapsed
            self.metrics.step(step, elapsed)

    async def _period(self, body: Mapping[str, Any], at: int, publish_allowed: Callable[[], bool]) -> PeriodResult:
        result = PeriodResult("kept", at)
        try:
            spec = AffinityPlanSpec.model_validate(body.get("spec") or {})
        except ValidationError as exc:
            return _not_planned(result, cond.INVALID_INPUT, f"spec: {exc.errors()[0]['msg']}")
        pool_name = spec.pool_ref.name
        pool_obj = await self._timed(result, "read", self.api.get_pool, self.namespace, pool_name)
        if pool_obj is None:
            self._pool_generation = None  # told once: the waiting retry looks again
            return _pool_gone(result, pool_name)
        try:
            pool = InferencePool.model_validate(pool_obj)
        except ValidationError as exc:
            return _not_planned(result, cond.INVALID_INPUT, f"InferencePool {pool_name}: {exc.errors()[0]['msg']}")
        self._pool_generation, self._pool_checked_at = _described_generation(pool), self.clock()
        current = await self._timed(result, "read", read_current, self.api, self.namespace, pool_name)
        if current.error:
            log.warning("AffinityPlan %s/%s: the plan ConfigMaps hold no valid plan (%s)",
                        self.namespace, self.name, current.error)
            if spec.mode != "Shadow":
                # The routers keep the last plan they loaded; this period publishes over it, planned
                # without it (no churn limit holds against a plan that cannot be read).
                result.tell("Warning", cond.PLAN_UNREADABLE, (
                    f"the plan ConfigMaps of pool {pool_name} hold no valid plan ({current.error}); the routers "
                    "keep the last plan they loaded, and this period publishes its own in its place, planned "
                    "as if no plan were in effect"
                ))
        result.status["planVersion"] = current.version if current.plan is not None else None
        if current.plan is not None and not len(current.plan) and spec.mode != "Shadow":
            result.empty_in_effect = current.version
            result.status["admittedKeys"] = 0  # the plan in effect's, until a candidate's replace it
        if current.plan is not None:
            self.metrics.in_effect(pool_name, current.version, len(current.plan))
        work = _Work(result, spec, pool, pool_obj, current, publish_allowed)
        if spec.mode != "Shadow" and await self._claimed(work):
            return result
        if spec.mode == "Manual":
            return await self._manual(work)
        await self._computed(work)
        if spec.mode == "Shadow" and result.finding(cond.APPLIED) is None:
            # A period that ended early still says Shadow applies nothing, rather than leave the
            # Applied of an earlier mode standing.
            result.add(Finding(cond.APPLIED, False, cond.SHADOW_MODE, "mode Shadow: nothing is applied"))
        return result

    # --- Manual ----------------------------------------------------------------------------------

    async def _manual(self, w: _Work) -> PeriodResult:
        """Exactly the pinned routes, on the pool's destinations whether ready or not."""
        result = w.result
        everyone = inputs.pool_destinations(w.pool, ready_only=False)
        if not everyone:
            return _no_destination(result, w, ready_only=False)
        if w.spec.prometheus.url or self.settings.prometheus_url:
            # For the observed KV hit only; read before the pins are checked, so that a period
            # refusing them still reports this window's MetricsAvailable, not an older one's.
            await self._observe(w, keys=False)
        if _refused_pins(w, everyone):
            return result
        t0 = time.perf_counter()
        plan = manual_plan(
            w.spec,
            everyone,
            pool=w.pool_name,
            generated_at=iso(result.evaluated_at),
            key_extraction=inputs.key_extraction(w.pool),
            spill_threshold=w.pool.spec.router.spill_threshold,
        )
        result.seconds["plan"] = time.perf_counter() - t0
        result.candidate = plan
        result.add(Finding(cond.PLANNED, True, cond.PINNED_ROUTES, plan.summary.reason))
        self.metrics.verdict("skipped")
        figures = _pinned_figures(plan)
        return await self._apply(w, plan, figures)

    # --- Auto and Shadow ---------------------------------------------------------------------------

    async def _observe(self, w: _Work, *, keys: bool) -> bool:
        """Read the window into the result; False (with the MetricsAvailable finding) if unusable."""
        result = w.result
        url = w.spec.prometheus.url or self.settings.prometheus_url
        if not url:
            message = "no Prometheus: set spec.prometheus.url or the operator's --prometheus-url"
            result.add(Finding(cond.METRICS_AVAILABLE, False, REASON_NOT_CONFIGURED, message))
            return False
        window_s = parse_duration(w.spec.metrics_window)
        reader = self.reader_factory(url, parse_duration(w.spec.prometheus.timeout))
        try:
            series = PoolSeries(self.namespace, w.pool_name)
            read = reader.read_window(series, window_s, at=result.evaluated_at, keys=keys)
            window = result.window = await self._timed_await(result, "query", read)
        except MetricsReadError as exc:
            result.add(Finding(cond.METRICS_AVAILABLE, False, exc.reason, exc.message))
            # Unknown while Prometheus does not answer: `kubectl get` shows no figure rather than
            # the last window's as if it were current.
            result.status["observedKvHit"] = None
            return False
        finally:
            reader.close()
        observed = window.observed_kv_hit
        # `kubectl get` prints the figure as stored: four decimals say all a counter ratio can.
        result.status["observedKvHit"] = None if observed is None else round(observed, 4)
        if keys and not window.total_requests > 0:
            message = f"no router requests of pool {w.pool_name} in the last {w.spec.metrics_window}"
            if w.pool.spec.router.replicas == 0:
                message += " (it runs no router of its own, spec.router.replicas being 0: Prometheus must scrape yours)"
            result.add(Finding(cond.METRICS_AVAILABLE, False, cond.NO_TRAFFIC, message))
            return False
        incomplete = _incomplete_window(window, w.spec.metrics_window)
        if incomplete is not None:
            result.add(Finding(cond.METRICS_AVAILABLE, False, cond.INCOMPLETE_WINDOW, incomplete))
            # A hit ratio of the last seconds is no figure of the window.
            result.status["observedKvHit"] = None
            return False
        # Counted over the window: a pod deleted within it still counts.
        reporting = f"{len(window.engines)} vLLM pods reporting in the last {w.spec.metrics_window}"
        if keys:
            message = f"{window.total_requests:,.0f} requests, {len(window.keys):,} tracked keys; {reporting}"
        else:  # Manual reads the engines' KV hit only, not the routers' per-key counts
            message = f"observed KV hit {pct(observed)}; {reporting}"
        result.add(Finding(cond.METRICS_AVAILABLE, True, cond.METRICS_READ, message))
        return True

    async def _computed(self, w: _Work) -> PeriodResult:
        result = w.result
        ready = inputs.pool_destinations(w.pool, ready_only=True)
        if not ready:
            return _no_destination(result, w, ready_only=True)
        # A pin to a replica the pool has but that is not ready is left out for the period; one to
        # a replica it does not have at all is a mistake in the spec, refused as in Manual.
        if _refused_pins(w, inputs.pool_destinations(w.pool, ready_only=False)):
            return result
        if not await self._observe(w, keys=True):
            why = result.finding(cond.METRICS_AVAILABLE)
            assert why is not None
            if w.spec.mode == "Auto" and w.spec.pinned and pins_alone(w.current.plan):
                # Pins do not wait for traffic: a new plan from Git routes them from its first period.
                await self._publish_pins(w, ready, why.message)
            # Added after the pins' findings, so that these say why the period planned nothing more.
            result.add(Finding(cond.PLANNED, False, cond.METRICS_UNAVAILABLE, why.message),
                       Finding(cond.DEGRADED, why.reason not in cond.WAITING, why.reason, why.message))
            return result
        planned = await self._plan(w, ready)
        if planned is None:
            return result
        plan_result, payload = planned
        candidate = plan_result.plan
        previous = w.current.plan
        figures: dict[str, Any] = {
            "admittedKeys": len(candidate),
            "coveredRequestShare": _share(candidate.summary.admitted_request_share),
            "churn": _share(plan_result.churn),
            "forcedChurn": _share(plan_result.churn_forced),
        }
        if w.spec.mode == "Auto" and same_routing(candidate, previous):
            self.metrics.verdict("skipped")
            return await self._keep(w, {**figures, "churn": 0.0, "forcedChurn": 0.0})
        if w.spec.mode == "Auto" and not len(candidate) and previous is not None and len(previous):
            self.metrics.verdict("skipped")
            message = f"the candidate routes no key; plan {w.current.version} with {len(previous):,} routes stays"
            result.add(Finding(cond.APPLIED, False, cond.EMPTY_PLAN, message),
                       Finding(cond.DEGRADED, False, cond.AS_EXPECTED))
            return result
        if w.spec.mode == "Auto" and same_routing(candidate, previous, addresses=False):
            # Pods that came back on new addresses: the same routes, nothing to judge.
            self.metrics.verdict("skipped")
            figures.update(churn=0.0, forcedChurn=0.0)
            return await self._apply(w, candidate, figures, payload,
                                     judged="the same routes on the pods' new addresses, not replayed")
        if not await self._judge(w, candidate, ready, figures):
            verdict = result.verdict
            if verdict is not None and _withdraws(w, verdict):
                return await self._withdraw(w, verdict, figures)
            if verdict is not None:
                result.status.update(_in_effect_figures(w, verdict))
                _rejected(w, f"lost in the guard: {verdict.reason}")
            return result
        if w.spec.mode == "Shadow":
            result.outcome = "shadow"
            result.status.update(figures)
            passed = result.verdict is None or result.verdict.passed
            judged = verdict_text(result.verdict)
            if same_routing(candidate, previous):
                would = f"would keep plan {w.current.version} in effect, which candidate {payload.version} routes as"
            else:
                would = f"{'would apply' if passed else 'would not apply'} candidate {payload.version}"
            message = f"mode Shadow: {would} ({judged})"
            result.add(Finding(cond.APPLIED, False, cond.SHADOW_MODE, message),
                       Finding(cond.DEGRADED, False, cond.AS_EXPECTED))
            result.tell("Normal", SHADOW_PLANNED, message)
            return result
        return await self._apply(w, candidate, figures, payload)

    async def _plan(self, w: _Work, ready: list[Destination]) -> tuple[PlanResult, PlanPayload] | None:
        """The candidate and its payload; None (with findings) when there is none."""
        result = w.result
        assert result.window is not None
        pins, pin_notes = inputs.pinned_routes(w.spec, ready)
        prepared = inputs.key_stats(result.window, list(pins))
        stats, refused_note = _served_only(prepared.stats, inputs.max_prompt_tokens(w.pool))
        result.stats = stats
        try:
            plan_result = result.result = await self._timed(
                result, "plan", compute_plan, stats, ready,
                pool=w.pool_name,
                budget=inputs.budget(w.spec),
                stability=inputs.stability(w.spec),
                cost=plan_cost(ready[0].kv_capacity_tokens, ready[0].host_kv_capacity_tokens),
                previous=w.current.plan,
                pinned=pins,
                generated_at=iso(result.evaluated_at),
                key_extraction=inputs.key_extraction(w.pool),
                spill_threshold=w.pool.spec.router.spill_threshold,
            )
        except (PlanInputError, PlanError) as exc:
            _not_planned(result, cond.INVALID_INPUT, str(exc))
            return None
        if stats is not prepared.stats:
            # Its shares of the whole window: the refused requests were requests too.
            plan_result = result.result = replace(
                plan_result, plan=over_all_traffic(plan_result.plan, stats, prepared.stats))
        result.candidate = plan_result.plan
        try:
            payload = result.payload = await self._timed(result, "plan", encode_checked, plan_result.plan)
        except PlanError as exc:
            _not_planned(result, cond.INVALID_PLAN, str(exc))
            return None
        candidate = plan_result.plan
        notes = [*pin_notes] + ([] if prepared.output_tokens_known else ["vLLM reported no generated tokens"])
        notes += [note for note in (refused_note, plan_result.nothing_admitted) if note]
        message = (
            f"candidate {payload.version}: {len(candidate):,} routes ({len(candidate.pinned_keys):,} pinned), "
            f"keys in the window: {len(prepared.stats):,}, "
            f"{pct(candidate.summary.admitted_request_share)} of requests, churn {pct(plan_result.churn)} "
            f"(forced {pct(plan_result.churn_forced)}) on {len(ready)} ready destinations"
        )
        result.add(Finding(cond.PLANNED, True, cond.PLAN_COMPUTED, "; ".join([message, *notes])))
        result.status["candidateVersion"] = payload.version
        return plan_result, payload

    async def _judge(self, w: _Work, candidate: Plan, ready: list[Destination], figures: dict[str, Any]) -> bool:
        """Run the guard (when enabled) and record its figures; False when the candidate lost (the
        caller records why, or withdraws the plan in effect)."""
        result = w.result
        assert result.stats is not None and result.payload is not None
        if not w.spec.guard.enabled:
            self.metrics.verdict("skipped")
            figures.update(predictedKvHit=candidate.summary.predicted_kv_hit, predictedP99TtftSeconds=None)
            return True
        try:
            verdict = result.verdict = await self._timed(
                result, "guard", run_guard, result.stats, candidate, w.current.plan,
                settings=inputs.guard_settings(w.spec),
                duration_s=parse_duration(w.spec.guard.replay_duration),
                kv_capacity_tokens=ready[0].kv_capacity_tokens,
                host_kv_capacity_tokens=ready[0].host_kv_capacity_tokens,
                routing=routing_of(w.pool.spec.router),
            )
        except ValueError as exc:  # too little traffic to synthesise a replay
            self.metrics.verdict("skipped")
            return _not_judged(w, str(exc))
        self.metrics.verdict("passed" if verdict.passed else "rejected")
        figures["predictedKvHit"] = _share(verdict.candidate.kv_hit)
        p99 = verdict.candidate.ttft_p99_s
        figures["predictedP99TtftSeconds"] = p99 if math.isfinite(p99) else None
        return verdict.passed or w.spec.mode == "Shadow"

    async def _publish_pins(self, w: _Work, ready: list[Destination], unavailable: str) -> None:
        """Publish `spec.pinned` alone (on ready destinations) while no window can be planned from."""
        pins, notes = inputs.pinned_routes(w.spec, ready)
        if not pins:
            return
        reason = f"{len(pins)} pinned routes from spec.pinned alone: nothing to plan the rest from ({unavailable})"
        try:
            plan = pinned_plan(
                pins, ready, pool=w.pool_name, generated_at=iso(w.result.evaluated_at),
                key_extraction=inputs.key_extraction(w.pool), spill_threshold=w.pool.spec.router.spill_threshold,
                reason=reason,
            )
        except PlanError as exc:
            _not_planned(w.result, cond.INVALID_PLAN, str(exc))
            return
        figures = _pinned_figures(plan)
        judged = "; ".join(["pinned routes alone, not replayed (no window to plan from yet)", *notes])
        await self._apply(w, plan, figures, judged=judged)

    async def _withdraw(self, w: _Work, verdict: GuardVerdict, figures: dict[str, Any]) -> PeriodResult:
        """Publish the candidate's pinned routes alone: the plan in effect and the candidate both
        lose to the routers without a plan (docs/affinity-plan.md, step 5)."""
        result = w.result
        assert result.candidate is not None and result.payload is not None
        why = (f"plan {w.current.version} withdrawn, worse than no plan on recent traffic "
               f"({verdict.current_reason}); candidate {result.payload.version} lost in the guard ({verdict.reason})")
        plan = pinned_only(result.candidate, why)
        figures.update(admittedKeys=len(plan), coveredRequestShare=None, churn=None, forcedChurn=None,
                       predictedKvHit=_share(verdict.baseline.kv_hit))
        p99 = verdict.baseline.ttft_p99_s
        figures["predictedP99TtftSeconds"] = p99 if math.isfinite(p99) else None
        rejected = result.payload.version
        applied = await self._apply(w, plan, figures, reason=cond.PLAN_WITHDRAWN, why=why)
        applied.status["candidateVersion"] = rejected
        return applied

    # --- applying ----------------------------------------------------------------------------------

    async def _apply(
        self, w: _Work, plan: Plan, figures: Mapping[str, Any], payload: PlanPayload | None = None, *,
        reason: str = cond.PLAN_APPLIED, why: str = "", judged: str = "",
    ) -> PeriodResult:
        result = w.result
        if same_routing(plan, w.current.plan):
            return await self._keep(w, figures)
        try:
            if payload is None:
                payload = result.payload = await self._timed(result, "plan", encode_checked, plan)
        except PlanError as exc:
            return _not_planned(result, cond.INVALID_PLAN, str(exc))
        result.status["candidateVersion"] = payload.version
        # Plans of one pool publish one at a time, each after reading the writer afresh: another
        # plan may have published since this period began, and the first to publish keeps the pool.
        async with _publish_lock(self.namespace, w.pool_name):
            if await self._claimed(w, fresh=True):
                return result
            if not w.publish_allowed():
                result.add(Finding(cond.APPLIED, False, "Stopping", "the AffinityPlan is being deleted"))
                return result
            try:
                await self._timed(result, "publish", publish, self.api, w.pool_obj, payload, writer=self.name)
            except (ApiError, PlanError) as exc:
                result.outcome = "failed"
                message = f"plan {payload.version} could not be published: {exc}"
                result.add(Finding(cond.APPLIED, False, cond.PUBLISH_FAILED, message),
                           Finding(cond.DEGRADED, True, cond.PUBLISH_FAILED, message))
                result.tell("Warning", cond.PUBLISH_FAILED, message)
                return result
        result.outcome = "applied"
        result.status.update(figures, planVersion=payload.version, appliedAt=iso(self.clock()))
        self.metrics.in_effect(w.pool_name, payload.version, len(plan))
        parts = [why] if why else []
        parts.append(f"plan {payload.version} applied ({w.spec.mode}): {len(plan):,} routes")
        if figures.get("coveredRequestShare") is not None:
            parts.append(f"{pct(figures['coveredRequestShare'])} of requests")
        if figures.get("churn") is not None:
            parts.append(f"churn {pct(figures['churn'])} (forced {pct(figures.get('forcedChurn'))})")
        # Manual publishes its pins as given: the guard judges computed candidates only.
        if not judged:
            judged = "pinned routes, not replayed" if w.spec.mode == "Manual" else verdict_text(result.verdict)
        message = ", ".join(parts) + f"; {judged}; {seconds_text(result.seconds)}"
        result.add(Finding(cond.APPLIED, True, reason, message), Finding(cond.DEGRADED, False, cond.AS_EXPECTED))
        result.tell("Normal" if reason == cond.PLAN_APPLIED else "Warning", reason, message)
        return result

    async def _keep(self, w: _Work, figures: Mapping[str, Any]) -> PeriodResult:
        """The plan in effect already routes as this plan would: nothing to publish, but the pool
        becomes this plan's if no other plan publishes it now (taken over from a plan moved to
        Shadow, say), so that its next change is published rather than refused."""
        result = w.result
        if w.current.writer != self.name:
            async with _publish_lock(self.namespace, w.pool_name):
                if await self._claimed(w, fresh=True):
                    return result
                try:
                    await self._timed(result, "publish", claim_writer, self.api, self.namespace, w.pool_name, self.name)
                except ApiError as exc:
                    log.warning("AffinityPlan %s/%s: naming it the publisher failed: %s",
                                self.namespace, self.name, exc)
        result.outcome = "unchanged"
        result.status.update(figures)
        result.add(_unchanged(w), Finding(cond.DEGRADED, False, cond.AS_EXPECTED))
        return result

    async def _claimed(self, w: _Work, *, fresh: bool = False) -> bool:
        """True (with the findings) when another AffinityPlan publishes this pool's plan: this one
        then neither plans nor applies, whatever its candidate would be. `fresh`: read the
        publisher from the ConfigMap now, not as the period began."""
        owner = await asyncio.to_thread(self._other_writer, w, fresh)
        if owner is None:
            return False
        message = f"the plan of pool {w.pool_name} is published by AffinityPlan {owner}; this one is not applied"
        w.result.add(Finding(cond.APPLIED, False, cond.POOL_CLAIMED, message),
                     Finding(cond.DEGRADED, True, cond.POOL_CLAIMED, message))
        w.result.tell("Warning", cond.POOL_CLAIMED, message)
        return True

    def _other_writer(self, w: _Work, fresh: bool) -> str | None:
        """Another AffinityPlan that publishes this pool's plan (Auto or Manual), if any: the first
        to publish keeps the pool until it is deleted, moved to Shadow or to another pool."""
        writer = read_writer(self.api, self.namespace, w.pool_name) if fresh else w.current.writer
        if not writer or writer == self.name:
            return None
        other = self.api.get_plan(self.namespace, writer)
        spec = (other or {}).get("spec") or {}
        claims = spec.get("mode", "Auto") != "Shadow" and (spec.get("poolRef") or {}).get("name") == w.pool_name
        return writer if other is not None and claims else None

    # --- reporting ---------------------------------------------------------------------------------

    async def _report(self, body: Mapping[str, Any], result: PeriodResult, generation: int | None) -> None:
        old_status = body.get("status") or {}
        mode = str((body.get("spec") or {}).get("mode", "Auto"))
        to_post = events_to_post(old_status, result, generation)
        result.status = new_status(old_status, result, mode=mode, generation=generation, now=self.clock())
        # Told before the status that records them is written: an operator that dies in between
        # (or a status write that fails) has the next period tell them again, rather than never.
        for event in to_post:
            await asyncio.to_thread(self.events, event.kind, event.reason, event.message)
        await asyncio.to_thread(self.api.patch_plan_status, self.namespace, self.name, result.status)

    async def release(self, body: Mapping[str, Any]) -> None:
        """This AffinityPlan is deleted: its pool's plan ConfigMaps stop naming it as their
        publisher, so that none is named until another plan publishes (the routes stay)."""
        pool = _pool_name(body)
        if not pool:
            return
        async with _publish_lock(self.namespace, pool):
            try:
                released = await asyncio.to_thread(release_writer, self.api, self.namespace, pool, self.name)
            except ApiError as exc:
                log.warning("AffinityPlan %s/%s: the plan ConfigMaps of pool %s still name it (%s)",
                            self.namespace, self.name, pool, exc)
                return
        if released:
            log.info("AffinityPlan %s/%s deleted: the plan ConfigMaps of pool %s name no publisher now",
                     self.namespace, self.name, pool)

    def forget(self) -> None:
        """Drop this AffinityPlan's metric series (it is gone, or this operator stops)."""
        self.metrics.forget()


def _pool_name(body: Mapping[str, Any]) -> str:
    """The pool an AffinityPlan's body names ("" when none), before its spec is validated."""
    name = ((body.get("spec") or {}).get("poolRef") or {}).get("name")
    return name if isinstance(name, str) else ""


def _described_generation(pool: InferencePool) -> int | None:
    return pool.status.observed_generation if pool.status is not None else None


_PUBLISH_LOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str], asyncio.Lock]] = (
    weakref.WeakKeyDictionary()
)


def _publish_lock(namespace: str, pool: str) -> asyncio.Lock:
    """One lock per pool for every plan loop of this operator: they all run on its event loop,
    and one operator replica acts at a time. (A lock belongs to one event loop.)"""
    locks = _PUBLISH_LOCKS.setdefault(asyncio.get_running_loop(), {})
    return locks.setdefault((namespace, pool), asyncio.Lock())


def _share(x: float) -> float:
    return min(max(float(x), 0.0), 1.0)


def _unchanged(w: _Work) -> Finding:
    # The candidate's version differs from the plan in effect whenever its summary does (its
    # figures, its time): name both, so that `Planned` and `Applied` read as one story.
    payload = w.result.payload
    if payload is not None and payload.version != w.current.version:
        message = f"candidate {payload.version} routes as plan {w.current.version}, which stays in effect"
    else:
        message = f"plan {w.current.version} already routes this way"
    return Finding(cond.APPLIED, True, cond.UNCHANGED, message)


def _withdraws(w: _Work, verdict: GuardVerdict) -> bool:
    """Auto, the candidate lost, and so does the plan in effect against no plan: it routes keys
    that this spec does not pin (withdrawing publishes the spec's pins alone). The pins of the
    plan in effect do not count: a Manual plan switched to Auto has every route pinned."""
    current, candidate = w.current.plan, w.result.candidate
    if w.spec.mode != "Auto" or verdict.passed or verdict.current_holds or current is None:
        return False
    pinned = set(candidate.pinned_keys.tolist()) if candidate is not None else set()
    return any(key not in pinned for key in current.route_keys.tolist())


def _in_effect_figures(w: _Work, verdict: GuardVerdict) -> dict[str, Any]:
    """The status figures of the plan that stays after a rejection (docs/affinity-plan.md: the
    figures describe the plan in effect), so none are left from a period of another mode: its
    routes, and the guard's replay of it on this window."""
    current = w.current.plan
    if current is None:
        return {}
    # A plan without routes (the pool's empty plan) routes as no plan: the baseline's replay.
    replayed = verdict.current if len(current) and verdict.current is not None else verdict.baseline
    p99 = replayed.ttft_p99_s
    return {
        "admittedKeys": len(current),
        "coveredRequestShare": _share(current.summary.admitted_request_share) if len(current) else 0.0,
        "predictedKvHit": _share(replayed.kv_hit),
        "predictedP99TtftSeconds": p99 if math.isfinite(p99) else None,
    }


def _stays(w: _Work) -> str:
    current = w.current.plan
    if current is None:
        return "no plan is in effect"
    routes = "" if len(current) else " (no routes: every key by the routers' own choice)"
    return f"plan {w.current.version}{routes} stays"


def _rejected(w: _Work, reason: str) -> bool:
    """Record a candidate the guard turned down (the plan in effect stays); returns False."""
    result = w.result
    assert result.payload is not None
    result.outcome = "rejected"
    message = f"candidate {result.payload.version} {reason}; {_stays(w)}"
    result.add(
        Finding(cond.APPLIED, False, cond.GUARD_REJECTED, message), Finding(cond.DEGRADED, False, cond.AS_EXPECTED)
    )
    result.tell("Warning", cond.GUARD_REJECTED, message)
    return False


def _served_only(stats: KeyStats, max_prompt_tokens: int | None) -> tuple[KeyStats, str]:
    """`stats` less the traffic the engines refuse for its length (`planner/refused.py`), neither
    planned nor replayed; and a note saying what was left out (empty when nothing was)."""
    if max_prompt_tokens is None:
        return stats, ""
    served, refused = without_refused(stats, max_prompt_tokens)
    return served, refused.describe(max_prompt_tokens) if refused else ""


def _not_judged(w: _Work, why: str) -> bool:
    """Record a candidate the guard could not replay for lack of traffic (the plan in effect
    stays): a wait for traffic, not a verdict on the plan, so no Warning; returns False."""
    result = w.result
    assert result.payload is not None
    result.outcome = "rejected"
    message = f"candidate {result.payload.version} not judged, too little traffic to replay ({why}); {_stays(w)}"
    result.add(
        Finding(cond.APPLIED, False, cond.NO_TRAFFIC, message), Finding(cond.DEGRADED, False, cond.NO_TRAFFIC, message)
    )
    result.tell("Normal", cond.NO_TRAFFIC, message)
    return False


def _prometheus_failed(status: Mapping[str, Any]) -> bool:
    """The last period could not read Prometheus (down, hung, refusing)."""
    metrics = cond.current(list(status.get("conditions") or []), cond.METRICS_AVAILABLE) or {}
    return metrics.get("status") == "False" and metrics.get("reason") in PROMETHEUS_FAILURES


def _waiting(status: Mapping[str, Any]) -> bool:
    """The last period found its pool not ready yet or no traffic to plan from."""
    conditions = status.get("conditions") or []
    return any(
        isinstance(c, Mapping) and c.get("status") == "False" and c.get("reason") in WAITING_REASONS
        for c in conditions
    )


def _refused_pins(w: _Work, everyone: Sequence[Destination]) -> bool:
    """True (with the findings) when a pinned route names a destination the pool does not have."""
    unknown = inputs.unknown_pinned_destinations(w.spec, {d.id for d in everyone})
    if not unknown:
        return False
    key, destination = unknown[0]
    message = f"pinned key {key!r} names {destination}, which is not a destination of InferencePool {w.pool_name}"
    if len(unknown) > 1:
        message += f" (and {len(unknown) - 1} more pinned route(s) name destinations it does not have)"
    _not_planned(w.result, cond.INVALID_PINNED, message)
    if w.spec.mode != "Shadow":
        # Said of this generation: the plan in effect stays, not this spec's.
        if w.current.version:
            kept = f"plan {w.current.version} stays in effect; this spec's pins are refused: {message}"
            w.result.add(Finding(cond.APPLIED, True, cond.UNCHANGED, kept))
        else:
            w.result.add(Finding(cond.APPLIED, False, cond.INVALID_PINNED, message))
    return True


# Figures of a plan in effect: none while the pool does not exist.
_FIGURES = (
    "planVersion", "appliedAt", "candidateVersion", "admittedKeys", "coveredRequestShare", "churn",
    "forcedChurn", "predictedKvHit", "observedKvHit", "predictedP99TtftSeconds",
)


def _incomplete_window(window: WindowMetrics, window_text: str) -> str | None:
    """Why the window cannot be planned from, if Prometheus holds less than half of a router's
    history in it (from the window's start, or the router's if later): planned from the rest, every
    key not seen since would lose its route at once. None when it holds enough."""
    gap = window.missing
    if gap is None:
        return None
    span = window.evaluated_at - gap.expected_from
    # A few scrape intervals pass before a new router's first sample: no history is missing then.
    if gap.seconds <= max(span / 2, MISSING_HISTORY_SLACK_S):
        return None
    # Enough once the window's start passes the middle of the gap, or (a router younger than the
    # window) once the router has run twice as long as the gap.
    ready_at = min(gap.first_sample + window.window_s / 2, 2 * gap.first_sample - gap.expected_from)
    return (
        f"Prometheus holds only the last {_span_text(window.evaluated_at - gap.first_sample)} of the "
        f"{window_text} window for router pod {gap.pod}: its samples from {iso(gap.expected_from)} to "
        f"{iso(gap.first_sample)} are missing (Prometheus was down, or lost its data); the plan in effect "
        f"stays until Prometheus holds half of the window, in about {_span_text(ready_at - window.evaluated_at)}"
    )


def _span_text(seconds: float) -> str:
    seconds = max(0, round(seconds))
    minutes, rest = divmod(seconds, 60)
    if not minutes:
        return f"{rest} s"
    return f"{minutes} min {rest} s" if rest else f"{minutes} min"


def _pool_gone(result: PeriodResult, pool_name: str) -> PeriodResult:
    """No pool, no plan in effect: its ConfigMaps went with it, so nothing the status said of a
    plan or its traffic holds any more."""
    message = f"InferencePool {pool_name} does not exist"
    result.status.update(dict.fromkeys(_FIGURES))
    result.add(Finding(cond.APPLIED, False, cond.POOL_NOT_FOUND, message),
               Finding(cond.METRICS_AVAILABLE, False, cond.POOL_NOT_FOUND, message))
    return _not_planned(result, cond.POOL_NOT_FOUND, message)


def _pinned_figures(plan: Plan) -> dict[str, Any]:
    """Status figures of a plan of pinned routes: its keys; nothing computed, nothing predicted."""
    figures: dict[str, Any] = dict.fromkeys(
        ("coveredRequestShare", "churn", "forcedChurn", "predictedKvHit", "predictedP99TtftSeconds")
    )
    figures["admittedKeys"] = len(plan)
    return figures


def _no_destination(result: PeriodResult, w: _Work, *, ready_only: bool) -> PeriodResult:
    # No engine serves: the last window's KV hit is no figure of the pool as it is.
    result.status["observedKvHit"] = None
    return _not_planned(result, cond.POOL_NOT_READY, inputs.no_destination_message(w.pool, w.pool_name,
                                                                                   ready_only=ready_only))


def _not_planned(result: PeriodResult, reason: str, message: str) -> PeriodResult:
    waiting = reason in cond.WAITING
    result.add(Finding(cond.PLANNED, False, reason, message), Finding(cond.DEGRADED, not waiting, reason, message))
    result.tell("Normal" if waiting else "Warning", reason, message)
    return result
