"""Operator glue of the memory plan: the profiling Job, the profile cache, and status conversion.

Profiled mode boots vLLM once on a node of the pool's GPU product with the candidate flags, waits for
it to report ready, stops it, and parses its startup log (`cacheroute.planner.memory.parse_vllm_log`).
Profiles are cached per (model, image, GPU product, TP, mnbt and the other memory flags) in one
ConfigMap, one JSON entry per profile, so a pool that is recreated or scaled does not boot again.
This module only builds objects and (de)serialises; the kopf handlers do the API calls.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cacheroute.operator.api.pool import InferencePoolSpec, MemoryPlanStatus
from cacheroute.planner.memory import (
    GPUS,
    MemoryPlan,
    MemoryPlanError,
    MemoryProfile,
    ModelArchitecture,
    PlanRequest,
    architecture_from_config,
    custom_gpu,
    plan_from_profile,
    plan_manual,
    plan_memory,
    preset,
)
from cacheroute.planner.memory.presets import preset_key

GIB = 1 << 30
PROFILE_CACHE_CONFIGMAP = "cacheroute-memory-profiles"
PROFILE_KEY_PREFIX = "mp-"
# A ConfigMap holds at most 1 MiB; keep room for metadata.
MAX_CACHE_DATA_BYTES = 1024 * 1024 - 64 * 1024
DEFAULT_MAX_ENTRIES = 64
# Utilisation of the profiling boot: it only has to start, so stay clear of the startup check.
PROFILE_GPU_MEMORY_UTILIZATION = 0.90
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_POOL = "cacheroute.dev/pool"
LABEL_PROFILE_KEY = "cacheroute.dev/profile-key"

# Runs the vLLM command given as arguments, polls /health, and exits once the server is ready, so
# the pod ends with the whole startup log in it. The memory lines of that log also go to the
# container's termination message, which outlives the log (the operator reads the log first and
# falls back to the message). Exit status: 0 ready, 124 not ready in time, otherwise vLLM's own
# failure status.
READINESS_THEN_EXIT = r"""set -u
port="${CACHEROUTE_PROFILE_PORT:-8000}"
timeout="${CACHEROUTE_PROFILE_TIMEOUT_S:-1800}"
poll="${CACHEROUTE_PROFILE_POLL_S:-5}"
log="$(mktemp)"
message="${CACHEROUTE_PROFILE_MESSAGE_FILE:-/dev/termination-log}"
lines='took|KV cache|Free memory on device|CUDA graph|concurrency|block size|Padding mamba|padding layers'
lines="$lines|Auto-fit|max_num_batched_tokens|out of memory|OutOfMemory|No available memory|exceeds available"
summarize() {
  grep -E "$lines" "$log" | tail -c 4000 > "$message" 2>/dev/null || true
}
"$@" > >(tee "$log") 2>&1 &
pid=$!
start=$SECONDS
while :; do
  if ! kill -0 "$pid" 2>/dev/null; then
    wait "$pid"
    rc=$?
    echo "cacheroute-profile: vLLM exited with status $rc before it was ready" >&2
    summarize
    if [ "$rc" -eq 0 ]; then exit 1; fi
    exit "$rc"
  fi
  if python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' \
      "http://127.0.0.1:${port}/health" >/dev/null 2>&1; then
    echo "cacheroute-profile: vLLM is ready after $((SECONDS - start))s; stopping it"
    kill -TERM "$pid"
    wait "$pid"
    summarize
    exit 0
  fi
  if [ $((SECONDS - start)) -ge "$timeout" ]; then
    echo "cacheroute-profile: vLLM was not ready after ${timeout}s" >&2
    kill -TERM "$pid"
    wait "$pid"
    summarize
    exit 124
  fi
  sleep "$poll"
done
"""

# ------------------------------------------------------------------------------------ plan inputs


def resolve_architecture(spec: InferencePoolSpec, config_json: Mapping[str, Any] | None = None) -> ModelArchitecture:
    """The model's architecture: the spec's preset override, a config.json (from its ConfigMap), or a preset name."""
    if spec.model.architecture:
        return preset(spec.model.architecture)
    if config_json is not None:
        return architecture_from_config(config_json, name=spec.model.name)
    if preset_key(spec.model.name) is not None:
        return preset(spec.model.name)
    raise MemoryPlanError(
        f"model {spec.model.name!r} is not a preset: set spec.model.architecture or spec.model.configMapRef"
    )


def plan_request_for_pool(
    spec: InferencePoolSpec, arch: ModelArchitecture, node_memory_gib: float | None = None
) -> PlanRequest:
    """The planner's request for an InferencePool spec; `node_memory_gib` is the allocatable memory of
    the pool's nodes as the operator observed it (`spec.gpu.nodeMemoryGib` otherwise)."""
    known = next((g for g in GPUS.values() if g.product_label == spec.gpu.product), None)
    gpu = known or custom_gpu(spec.gpu.memory_gib, spec.gpu.product, spec.gpu.count_per_node)
    if known is not None and known.count_per_node != spec.gpu.count_per_node:
        gpu = custom_gpu(known.total_gib, known.product_label, spec.gpu.count_per_node)
    mnbt = spec.memory.max_num_batched_tokens
    host = spec.memory.host_kv_cache_gib
    node_memory = node_memory_gib if node_memory_gib is not None else spec.gpu.node_memory_gib
    return PlanRequest(
        model=arch,
        gpu=gpu,
        quantization=spec.model.quantization,
        tp=spec.tensor_parallel_size,
        kv_cache_dtype=spec.memory.kv_cache_dtype,
        max_model_len=spec.memory.max_model_len,
        mnbt=None if mnbt == "auto" else mnbt,
        safety_margin_bytes=int(spec.memory.safety_margin_gib * GIB),
        prefix_caching=spec.prefix_caching,
        host_kv="auto" if host == "auto" else (host * GIB or None),
        node_memory_bytes=int(node_memory * GIB) if node_memory is not None else None,
        host_reserve_bytes_per_gpu=int(spec.memory.host_memory_reserve_gib * GIB),
    )


def plan_for_pool(
    spec: InferencePoolSpec,
    arch: ModelArchitecture,
    profile: MemoryProfile | None = None,
    profiled_mnbt: int | None = None,
) -> MemoryPlan:
    """The pool's plan by its memory mode. Profiled without a profile yet gives the Analytic plan,
    whose flags are the ones the profiling Job boots with."""
    request = plan_request_for_pool(spec, arch)
    if spec.memory.mode == "Manual":
        if spec.memory.kv_cache_memory_bytes is None:
            raise MemoryPlanError("memory.mode Manual requires memory.kvCacheMemoryBytes")
        return plan_manual(request, spec.memory.kv_cache_memory_bytes)
    if spec.memory.mode == "Profiled" and profile is not None:
        return plan_from_profile(request, profile, profiled_mnbt)
    return plan_memory(request)


def memory_plan_status(plan: MemoryPlan) -> MemoryPlanStatus:
    """What goes into InferencePool status.memoryPlan."""
    return MemoryPlanStatus.model_validate(plan.to_status())


# ------------------------------------------------------------------------------------ profile key


def profile_key(
    model: str, image: str, gpu_product: str, tp: int, mnbt: int, *, settings: Mapping[str, str] | None = None
) -> str:
    """Stable cache key of a profiling boot; `settings` holds the other flags that change memory."""
    payload = {
        "model": model,
        "image": image,
        "gpuProduct": gpu_product,
        "tensorParallelSize": tp,
        "maxNumBatchedTokens": mnbt,
        "settings": dict(sorted((settings or {}).items())),
    }
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return PROFILE_KEY_PREFIX + digest[:20]


# ------------------------------------------------------------------------------------ profiling Job


@dataclass(frozen=True)
class ProfileJobSpec:
    """Everything the profiling Job needs; `flags` are the candidate's memory flags."""

    pool: str
    namespace: str
    model: str
    image: str
    gpu_product: str
    tp: int
    flags: tuple[str, ...]
    key: str
    served_model_name: str | None = None
    gpu_resource: str = "nvidia.com/gpu"
    port: int = 8000
    startup_timeout_s: int = 1800
    shm_size: str = "16Gi"
    extra_args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    volumes: tuple[Mapping[str, Any], ...] = ()
    volume_mounts: tuple[Mapping[str, Any], ...] = ()
    tolerations: tuple[Mapping[str, Any], ...] = (
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    )
    owner_references: tuple[Mapping[str, Any], ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)


def profile_flags(plan: MemoryPlan, prefix_caching: bool = True) -> tuple[str, ...]:
    """The flags of a profiling boot for a planned candidate: vLLM sizes its own KV (no pinned bytes)."""
    flags = [
        "--max-num-batched-tokens",
        str(plan.max_num_batched_tokens),
        "--max-num-seqs",
        str(plan.max_num_seqs),
        "--max-model-len",
        str(plan.max_model_len),
        "--gpu-memory-utilization",
        f"{PROFILE_GPU_MEMORY_UTILIZATION:.2f}",
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
    ]
    if plan.kv_cache_dtype != "auto":
        flags += ["--kv-cache-dtype", plan.kv_cache_dtype]
    if plan.mamba_ssm_dtype is not None:
        flags += ["--mamba-ssm-cache-dtype", plan.mamba_ssm_dtype]
    return tuple(flags)


def _job_name(pool: str, key: str) -> str:
    suffix = "-memprofile-" + key.removeprefix(PROFILE_KEY_PREFIX)[:10]
    return pool[: 63 - len(suffix)].rstrip("-") + suffix


def build_profile_job(spec: ProfileJobSpec) -> dict[str, Any]:
    """A batch/v1 Job that boots vLLM once on a target node and exits once it is ready."""
    if spec.tp < 1:
        raise ValueError(f"tp must be at least 1, got {spec.tp}")
    labels = {
        "app.kubernetes.io/name": "cacheroute",
        LABEL_COMPONENT: "memory-profile",
        LABEL_POOL: spec.pool,
        LABEL_PROFILE_KEY: spec.key,
        **spec.labels,
    }
    args = [
        "vllm",
        "serve",
        spec.model,
        "--served-model-name",
        spec.served_model_name or spec.model,
        "--tensor-parallel-size",
        str(spec.tp),
        "--host",
        "127.0.0.1",
        "--port",
        str(spec.port),
        *spec.flags,
        *spec.extra_args,
    ]
    env = [
        {"name": "CACHEROUTE_PROFILE_PORT", "value": str(spec.port)},
        {"name": "CACHEROUTE_PROFILE_TIMEOUT_S", "value": str(spec.startup_timeout_s)},
        # Have vLLM print its CUDA-graph estimate and the full budget line on every version that knows it.
        {"name": "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "value": "1"},
        *[dict(e) for e in spec.env],
    ]
    gpus = str(spec.tp)
    metadata: dict[str, Any] = {
        "name": _job_name(spec.pool, spec.key),
        "namespace": spec.namespace,
        "labels": labels,
        "annotations": {LABEL_PROFILE_KEY: spec.key},
    }
    if spec.owner_references:
        metadata["ownerReferences"] = [dict(o) for o in spec.owner_references]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata,
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": spec.startup_timeout_s + 600,
            "ttlSecondsAfterFinished": 3600,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 60,
                    "nodeSelector": {"nvidia.com/gpu.product": spec.gpu_product},
                    "tolerations": [dict(t) for t in spec.tolerations],
                    "containers": [
                        {
                            "name": "vllm",
                            "image": spec.image,
                            "imagePullPolicy": "IfNotPresent",
                            "command": ["/bin/bash", "-c", READINESS_THEN_EXIT, "cacheroute-profile"],
                            "terminationMessagePolicy": "File",
                            "args": args,
                            "env": env,
                            "ports": [{"name": "http", "containerPort": spec.port}],
                            "resources": {
                                "limits": {spec.gpu_resource: gpus},
                                "requests": {spec.gpu_resource: gpus},
                            },
                            "volumeMounts": [
                                {"name": "dshm", "mountPath": "/dev/shm"},
                                *[dict(m) for m in spec.volume_mounts],
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}},
                        *[dict(v) for v in spec.volumes],
                    ],
                },
            },
        },
    }


# ------------------------------------------------------------------------------------ profile cache


class CachedProfile(BaseModel):
    """One cached profiling result, as stored in the cache ConfigMap."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")
    inputs: dict[str, str] = Field(default_factory=dict)
    recorded_at: datetime
    profile: dict[str, Any]

    def memory_profile(self) -> MemoryProfile:
        return MemoryProfile.from_dict(self.profile)


def _entry_name(key: str) -> str:
    return f"{key}.json"


class ProfileCache:
    """Profiles by key, bounded in count and in ConfigMap bytes; the oldest go first."""

    def __init__(self, entries: Sequence[CachedProfile] = (), max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self._entries: dict[str, CachedProfile] = {e.key: e for e in entries}
        self._evict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: str) -> MemoryProfile | None:
        entry = self._entries.get(key)
        return entry.memory_profile() if entry is not None else None

    def entry(self, key: str) -> CachedProfile | None:
        return self._entries.get(key)

    def put(
        self, key: str, profile: MemoryProfile, recorded_at: datetime, inputs: Mapping[str, str] | None = None
    ) -> None:
        self._entries[key] = CachedProfile(
            key=key, inputs=dict(inputs or {}), recorded_at=recorded_at, profile=profile.to_dict()
        )
        self._evict()

    def _serialised(self) -> dict[str, str]:
        return {
            _entry_name(k): json.dumps(e.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
            for k, e in sorted(self._entries.items())
        }

    def _evict(self) -> None:
        def oldest() -> str:
            return min(self._entries.values(), key=lambda e: (e.recorded_at, e.key)).key

        while len(self._entries) > self.max_entries:
            del self._entries[oldest()]
        while self._entries and sum(len(k) + len(v) for k, v in self._serialised().items()) > MAX_CACHE_DATA_BYTES:
            del self._entries[oldest()]

    def to_configmap_data(self) -> dict[str, str]:
        """The ConfigMap `data`: one `<key>.json` entry per profile, deterministic bytes."""
        return self._serialised()

    @classmethod
    def from_configmap_data(
        cls, data: Mapping[str, str] | None, max_entries: int = DEFAULT_MAX_ENTRIES
    ) -> tuple[ProfileCache, list[str]]:
        """The cache held in a ConfigMap, and the entries that could not be read (skipped, not fatal)."""
        good: list[CachedProfile] = []
        bad: list[str] = []
        for name, text in sorted((data or {}).items()):
            try:
                entry = CachedProfile.model_validate_json(text)
                entry.memory_profile()
            except (ValidationError, ValueError, TypeError, KeyError):
                bad.append(name)
                continue
            if _entry_name(entry.key) != name:
                bad.append(name)
                continue
            good.append(entry)
        return cls(good, max_entries), bad


def profile_cache_configmap(namespace: str, cache: ProfileCache, name: str = PROFILE_CACHE_CONFIGMAP) -> dict[str, Any]:
    """The cache ConfigMap object as the operator writes it."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "cacheroute", LABEL_COMPONENT: "memory-profile-cache"},
        },
        "data": cache.to_configmap_data(),
    }
