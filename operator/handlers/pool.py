"""InferencePool handlers: a pass of `fleet.reconcile` on every change, at resume, and from a daemon.

Each pool's daemon runs a status pass whenever one of its engine pods, its StatefulSet or its router
Deployment changes (so Ready follows the pods within moments), and at the latest every
`status_seconds`; a pass re-applies every owned object every `resync_seconds` (drift repair), and
at once after its StatefulSet, router Deployment or one of its Services was deleted. Watch caches
(kopf indexes) of those objects feed the status without extra API calls.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import kopf
from pydantic import ValidationError

from cacheroute.operator import metrics, work
from cacheroute.operator.api.common import GROUP, VERSION
from cacheroute.operator.api.manifests import field_errors
from cacheroute.operator.api.pool import InferencePoolSpec
from cacheroute.operator.context import current
from cacheroute.operator.control.kube import ControlApi
from cacheroute.operator.fleet import names
from cacheroute.operator.fleet.cluster import KubeError
from cacheroute.operator.fleet.reconcile import EventType, PoolMemory, Reconciler
from cacheroute.operator.fleet.status import FleetFacts, PodFacts, WorkloadFacts, pod_facts, workload_facts
from cacheroute.operator.handlers import events as handler_events

CTX = current()
RECONCILER = Reconciler(CTX.cluster, CTX.config)
EVENTS = ControlApi(CTX.cluster.api)
POOLS = "inferencepools"
ENGINE = {names.MANAGED_BY: names.MANAGER, names.COMPONENT: "engine"}
ROUTER = {names.MANAGED_BY: names.MANAGER, names.COMPONENT: "router"}


def plain(value: Any) -> Any:
    """kopf's body views as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


# --- watch caches ----------------------------------------------------------------------------------


@kopf.index("pods", labels=ENGINE)
def engine_pods(
    *, namespace: str | None, labels: Mapping[str, str], body: Any, **_: Any
) -> dict[Any, PodFacts] | None:
    facts = pod_facts(body)
    pool = labels.get(names.POOL)
    return {(namespace, pool): facts} if facts is not None and pool else None


@kopf.index("statefulsets", labels=ENGINE)
def engine_statefulsets(
    *, namespace: str | None, name: str, labels: Mapping[str, str], body: Any, **_: Any
) -> dict[Any, WorkloadFacts] | None:
    pool = labels.get(names.POOL)
    return {(namespace, pool): workload_facts(body)} if pool == name else None


@kopf.index("deployments", labels=ROUTER)
def router_deployments(
    *, namespace: str | None, name: str, labels: Mapping[str, str], body: Any, **_: Any
) -> dict[Any, WorkloadFacts] | None:
    pool = labels.get(names.POOL)
    return {(namespace, pool): workload_facts(body)} if pool and name == f"{pool}-router" else None


def _one(store: Iterable[WorkloadFacts] | None) -> WorkloadFacts | None:
    return next(iter(store), None) if store is not None else None


def _facts(key: tuple[str, str], indexes: Mapping[str, Any]) -> FleetFacts:
    """The pool's objects as the watch caches hold them (kopf passes each index by its function's name)."""
    pods, statefulsets, deployments = (indexes[n] for n in ("engine_pods", "engine_statefulsets", "router_deployments"))
    pod_list: Sequence[PodFacts] = list(pods[key]) if key in pods else []
    return FleetFacts(
        pods=pod_list,
        statefulset=_one(statefulsets[key]) if key in statefulsets else None,
        router=_one(deployments[key]) if key in deployments else None,
    )


# --- a pass ----------------------------------------------------------------------------------------


def _state(memo: Any, body: Any) -> tuple[asyncio.Lock, PoolMemory]:
    if "lock" not in memo:
        memo["lock"] = asyncio.Lock()
        memo["fleet"] = PoolMemory.resumed(plain(body.get("status") or {}))
        memo["last_full"] = 0.0
    return memo["lock"], memo["fleet"]


async def _pass(*, body: Any, memo: Any, logger: Any, indexes: Mapping[str, Any], full: bool) -> None:
    lock, mem = _state(memo, body)
    meta = body["metadata"]
    if meta.get("deletionTimestamp"):
        return
    pool = names.PoolRef(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    generation = int(meta.get("generation") or 0)
    events: list[tuple[EventType, str, str]] = []
    async with lock:
        try:
            spec = InferencePoolSpec.model_validate(plain(body.get("spec") or {}))
        except ValidationError as exc:
            message = "; ".join(field_errors(exc))
            if mem.memory_generation != generation:
                kopf.event(body, type="Warning", reason="InvalidSpec", message=message[:1024])
                mem.memory_generation = generation
            return
        facts = _facts((pool.namespace, pool.name), indexes)
        previous = plain(body.get("status") or {})
        if full:
            memo["last_full"] = time.monotonic()
        post = handler_events.poster(EVENTS, body)

        def emit(kind: EventType, reason: str, message: str) -> None:
            # Posted at once, from the worker, before the pass writes the status that records it.
            post(kind, reason, message)
            events.append((kind, reason, message))

        kind = "full" if full else "status"
        started = time.monotonic()
        outcome = "error"
        try:
            if full:
                # Two jobs: every new pool's StatefulSet goes out before any pool's router objects.
                memory = await CTX.work.run(
                    work.ENGINE,
                    functools.partial(RECONCILER.engine_stage, pool, spec, generation, mem=mem, emit=emit, full=True),
                )
                await CTX.work.run(
                    work.ROUTER,
                    functools.partial(
                        RECONCILER.rest_stage, pool, spec, generation, memory=memory, facts=facts,
                        previous_status=previous, mem=mem, emit=emit, full=True,
                    ),
                )
            else:
                await CTX.work.run(
                    work.STATUS,
                    functools.partial(
                        RECONCILER.reconcile, pool, spec, generation, facts=facts, previous_status=previous,
                        mem=mem, emit=emit, full=False,
                    ),
                )
            outcome = "ok"
        finally:
            metrics.PASSES.labels(kind, outcome).inc()
            metrics.PASS_SECONDS.labels(kind).observe(time.monotonic() - started)
            for _, reason, message in events:
                metrics.EVENTS.labels(reason).inc()
                logger.info(f"{reason}: {message}", extra={"event_reason": reason, "pool": pool.name})


@kopf.on.resume(GROUP, VERSION, POOLS, backoff=5)
@kopf.on.create(GROUP, VERSION, POOLS, backoff=5)
@kopf.on.update(GROUP, VERSION, POOLS, backoff=5)
async def pool_changed(*, body: Any, memo: Any, logger: Any, **kwargs: Any) -> None:
    await _pass(body=body, memo=memo, logger=logger, indexes=kwargs, full=True)


COALESCE_SECONDS = 0.25
# Set when an object of the pool changes: its daemon runs a status pass now rather than at the tick.
_CHANGED: dict[tuple[str, str], asyncio.Event] = {}
# Pools whose StatefulSet, router Deployment or a Service was deleted: their next pass re-applies
# every owned object at once (an engine or router outage until then), not at the next resync.
_REPAIR: set[tuple[str, str]] = set()


def _changed(namespace: str | None, pool: str | None) -> asyncio.Event | None:
    if namespace is None or pool is None:
        return None
    return _CHANGED.setdefault((namespace, pool), asyncio.Event())


@kopf.on.event("pods", labels=ENGINE)
async def pool_pod_changed(*, namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
    flag = _changed(namespace, labels.get(names.POOL))
    if flag is not None:
        flag.set()


@kopf.on.event("statefulsets", labels=ENGINE)
@kopf.on.event("deployments", labels=ROUTER)
@kopf.on.event("services", labels=ENGINE)
@kopf.on.event("services", labels=ROUTER)
async def pool_workload_changed(
    *, namespace: str | None, labels: Mapping[str, str], type: str | None, **_: Any
) -> None:
    pool = labels.get(names.POOL)
    flag = _changed(namespace, pool)
    if flag is None:
        return
    if type == "DELETED" and namespace is not None and pool is not None:
        _REPAIR.add((namespace, pool))
    flag.set()


async def _woken(flag: asyncio.Event, stopped: Any, seconds: float) -> None:
    """Until an object of the pool changes, the daemon is asked to stop (a deleted pool: it then
    ends at once rather than being cancelled), or `seconds` pass."""
    waits = {asyncio.ensure_future(flag.wait()), asyncio.ensure_future(stopped.wait())}
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()


@kopf.daemon(GROUP, VERSION, POOLS, cancellation_timeout=10)
async def pool_status(*, stopped: Any, body: Any, memo: Any, logger: Any, **kwargs: Any) -> None:
    _state(memo, body)
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    flag = _changed(*key)
    assert flag is not None
    try:
        while not stopped:
            await _woken(flag, stopped, CTX.status_seconds)
            if flag.is_set() and not stopped:
                # Replicas change in bursts: one pass for the burst, not one per pod.
                await asyncio.sleep(COALESCE_SECONDS)
            flag.clear()
            if stopped:
                return
            repair = key in _REPAIR
            _REPAIR.discard(key)
            full = repair or time.monotonic() - float(memo["last_full"]) >= CTX.resync_seconds
            try:
                await _pass(body=body, memo=memo, logger=logger, indexes=kwargs, full=full)
            except KubeError as exc:
                if exc.namespace_terminating:  # the pool goes with its namespace: nothing is wrong
                    logger.info(f"status pass skipped: namespace {key[0]} is being deleted")
                else:
                    logger.error(f"status pass failed: {exc}")
            except Exception as exc:  # the next change or tick tries again
                logger.error(f"status pass failed: {exc}")
    finally:
        _CHANGED.pop(key, None)
        _REPAIR.discard(key)
