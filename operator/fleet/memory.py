"""The memory plan of a pool, by its mode: Analytic, Profiled (through the profiling Job) or Manual.

`decide()` is the whole decision; what it needs from the cluster (a model's config.json, the
profile cache, the profiling Job and its log) comes through a `MemoryInputs` the caller provides,
so the decision is unit-tested without a server and the API calls stay at the edge
(`fleet/cluster.py`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, Protocol

from cacheroute.operator.api.common import parse_duration
from cacheroute.operator.api.pool import ConfigMapKeyRef, InferencePoolSpec
from cacheroute.operator.config import ProfilingDefaults
from cacheroute.operator.fleet import names
from cacheroute.operator.fleet.profiling_job import (
    ProfileJobSpec,
    build_profile_job,
    plan_for_pool,
    plan_request_for_pool,
    profile_flags,
    profile_key,
    resolve_architecture,
)
from cacheroute.planner.memory import (
    MemoryPlan,
    MemoryPlanError,
    MemoryProfile,
    ModelArchitecture,
    parse_vllm_log,
    plan_from_profile,
    plan_memory,
)

State = Literal["Planned", "DoesNotFit", "Profiling", "ProfilingFailed", "InvalidModel"]
# No replica starts from these until the spec (or the model's ConfigMap) changes.
STOPPED_STATES: frozenset[State] = frozenset({"DoesNotFit", "ProfilingFailed", "InvalidModel"})


@dataclass(frozen=True)
class MemoryOutcome:
    state: State
    message: str
    plan: MemoryPlan | None = None
    profile_key: str | None = None
    # A profile measured this time, for the caller to store in the profile cache.
    new_profile: MemoryProfile | None = None

    @property
    def planned(self) -> bool:
        return self.state == "Planned" and self.plan is not None


@dataclass(frozen=True)
class JobFacts:
    """What the operator needs to know of a profiling Job and its pod."""

    name: str
    finished: bool
    succeeded: bool
    finished_at: datetime | None = None
    reason: str = ""
    # vLLM's log: the pod log when readable, else the container's termination message.
    log: str | None = None


class MemoryInputs(Protocol):
    def config_json(self, ref: ConfigMapKeyRef) -> Mapping[str, Any]:
        """The model's config.json from its ConfigMap; raises MemoryPlanError naming what is missing."""
        ...

    def cached_profile(self, key: str) -> MemoryProfile | None: ...

    def profiling_job(self, name: str) -> JobFacts | None: ...


def _architecture(spec: InferencePoolSpec, inputs: MemoryInputs) -> ModelArchitecture:
    config = inputs.config_json(spec.model.config_map_ref) if spec.model.config_map_ref else None
    return resolve_architecture(spec, config)


def profile_settings(spec: InferencePoolSpec) -> dict[str, str]:
    """Inputs besides model, image, GPU, TP and mnbt that change what a profiling boot measures."""
    return {
        "quantization": spec.model.quantization,
        "maxModelLen": str(spec.memory.max_model_len or ""),
        "prefixCaching": str(spec.prefix_caching).lower(),
        "extraArgs": json.dumps(spec.engine.extra_args),
    }


def profile_job_for(
    pool: names.PoolRef, spec: InferencePoolSpec, candidate: MemoryPlan, key: str
) -> dict[str, Any]:
    """The profiling Job booting the candidate's flags on a node of the pool's GPU product."""
    labels = {k: v for k, v in names.labels(pool, "engine").items() if k != names.COMPONENT}
    return build_profile_job(
        ProfileJobSpec(
            pool=pool.name,
            namespace=pool.namespace,
            model=spec.model.source or spec.model.name,
            served_model_name=spec.model.name,
            image=spec.engine.image,
            gpu_product=spec.gpu.product,
            gpu_resource=spec.gpu.resource_name,
            tp=spec.tensor_parallel_size,
            port=spec.engine.port,
            flags=profile_flags(candidate, spec.prefix_caching),
            key=key,
            startup_timeout_s=int(parse_duration(spec.engine.startup_timeout)),
            extra_args=tuple(spec.engine.extra_args),
            env=tuple({"name": e.name, "value": e.value} for e in spec.engine.env),
            owner_references=(pool.owner_reference(),),
            labels=labels,
        )
    )


def job_name(pool: names.PoolRef, spec: InferencePoolSpec, candidate: MemoryPlan, key: str) -> str:
    return str(profile_job_for(pool, spec, candidate, key)["metadata"]["name"])


def decide(
    pool: names.PoolRef,
    spec: InferencePoolSpec,
    inputs: MemoryInputs,
    *,
    now: datetime,
    profiling: ProfilingDefaults,
) -> tuple[MemoryOutcome, dict[str, Any] | None]:
    """The pool's memory outcome, and the profiling Job to create (if one is needed and missing)."""
    try:
        arch = _architecture(spec, inputs)
    except MemoryPlanError as exc:
        return MemoryOutcome("InvalidModel", str(exc)), None
    if spec.memory.mode != "Profiled":
        try:
            plan = plan_for_pool(spec, arch)
        except MemoryPlanError as exc:
            return MemoryOutcome("DoesNotFit", str(exc)), None
        return MemoryOutcome("Planned", _summary(plan), plan=plan), None
    return _profiled(pool, spec, arch, inputs, now, profiling)


def _profiled(  # noqa: PLR0917 - the decision's inputs, passed on from decide()
    pool: names.PoolRef,
    spec: InferencePoolSpec,
    arch: ModelArchitecture,
    inputs: MemoryInputs,
    now: datetime,
    profiling: ProfilingDefaults,
) -> tuple[MemoryOutcome, dict[str, Any] | None]:
    request = plan_request_for_pool(spec, arch)
    try:
        candidate = plan_memory(request)
    except MemoryPlanError as exc:
        # Not even the analytic candidate fits: a profiling boot would only confirm it.
        return MemoryOutcome("DoesNotFit", str(exc)), None
    mnbt = candidate.max_num_batched_tokens
    key = profile_key(
        spec.model.source or spec.model.name,
        spec.engine.image,
        spec.gpu.product,
        spec.tensor_parallel_size,
        mnbt,
        settings=profile_settings(spec),
    )
    cached = inputs.cached_profile(key)
    if cached is not None:
        return _from_profile(spec, arch, cached, mnbt, key, new=False), None
    job = profile_job_for(pool, spec, candidate, key)
    facts = inputs.profiling_job(job["metadata"]["name"])
    if facts is None:
        return MemoryOutcome("Profiling", f"started profiling Job {job['metadata']['name']}", profile_key=key), job
    if not facts.finished:
        return MemoryOutcome("Profiling", f"profiling Job {facts.name} is running", profile_key=key), None
    if facts.log is None:
        waited = (now - facts.finished_at).total_seconds() if facts.finished_at else 0.0
        if waited < profiling.log_wait_seconds:
            waiting = f"waiting for the log of profiling Job {facts.name}"
            return MemoryOutcome("Profiling", waiting, profile_key=key), None
        why = f" ({facts.reason})" if facts.reason else ""
        return MemoryOutcome(
            "ProfilingFailed", f"profiling Job {facts.name} ended{why} and its log cannot be read", profile_key=key
        ), None
    profile = parse_vllm_log(facts.log, hybrid=arch.is_hybrid)
    if profile.failed:
        first = profile.failures[0]
        return MemoryOutcome(
            "ProfilingFailed", f"profiling Job {facts.name}: vLLM failed ({first.kind}): {first.text}", profile_key=key
        ), None
    if not facts.succeeded:
        why = f": {facts.reason}" if facts.reason else ""
        return MemoryOutcome("ProfilingFailed", f"profiling Job {facts.name} failed{why}", profile_key=key), None
    return _from_profile(spec, arch, profile, mnbt, key, new=True), None


def _from_profile(
    spec: InferencePoolSpec, arch: ModelArchitecture, profile: MemoryProfile, mnbt: int, key: str, *, new: bool
) -> MemoryOutcome:
    request = plan_request_for_pool(spec, arch)
    try:
        plan = plan_from_profile(request, profile, mnbt)
    except MemoryPlanError as exc:
        failed = profile.failed or bool(profile.budget_missing(cudagraphs=request.peak_options.cudagraphs))
        state: State = "ProfilingFailed" if failed else "DoesNotFit"
        return MemoryOutcome(state, str(exc), profile_key=key, new_profile=profile if new and not failed else None)
    return MemoryOutcome(
        "Planned",
        _summary(plan),
        plan=plan,
        profile_key=key,
        new_profile=profile if new else None,
    )


def _summary(plan: MemoryPlan) -> str:
    gib = plan.kv_cache_memory_bytes / (1 << 30)
    host = plan.host
    tier = (
        f", host KV tier {host.gib:g} GiB ({host.capacity_tokens:,} tokens, {host.source})" if host.bytes else ""
    )
    return "; ".join([
        f"{plan.source}: {gib:.2f} GiB KV per GPU ({plan.kv_capacity_tokens:,} tokens per replica), "
        f"max-num-batched-tokens {plan.max_num_batched_tokens}, max-num-seqs {plan.max_num_seqs}, "
        f"max-model-len {plan.max_model_len}{tier}",
        *plan.notes,
    ])
