"""What the memory plan reads from the cluster: config.json, the profile cache, the profiling Job and its log."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from cacheroute.operator.api.pool import ConfigMapKeyRef
from cacheroute.operator.fleet.cluster import Cluster, KubeError
from cacheroute.operator.fleet.memory import JobFacts
from cacheroute.operator.fleet.profiling_job import (
    LABEL_PROFILE_KEY,
    PROFILE_CACHE_CONFIGMAP,
    ProfileCache,
    profile_cache_configmap,
)
from cacheroute.planner.memory import MemoryPlanError, MemoryProfile

PROFILE_CONTAINER = "vllm"


def _time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


class ClusterMemoryInputs:
    """`MemoryInputs` of one namespace, read through the API."""

    def __init__(self, cluster: Cluster, namespace: str) -> None:
        self.cluster = cluster
        self.namespace = namespace

    def config_json(self, ref: ConfigMapKeyRef) -> Mapping[str, Any]:
        cm = self.cluster.get("v1", "ConfigMap", self.namespace, ref.name)
        if cm is None:
            raise MemoryPlanError(f"model.configMapRef: ConfigMap {ref.name} not found in {self.namespace}")
        text = (cm.get("data") or {}).get(ref.key)
        if text is None:
            raise MemoryPlanError(f"model.configMapRef: ConfigMap {ref.name} has no key {ref.key!r}")
        try:
            config = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MemoryPlanError(f"model.configMapRef: {ref.name}/{ref.key} is not JSON ({exc})") from exc
        if not isinstance(config, dict):
            raise MemoryPlanError(f"model.configMapRef: {ref.name}/{ref.key} is not a JSON object")
        return config

    def _cache(self) -> tuple[ProfileCache, dict[str, Any] | None]:
        cm = self.cluster.get("v1", "ConfigMap", self.namespace, PROFILE_CACHE_CONFIGMAP)
        cache, _bad = ProfileCache.from_configmap_data((cm or {}).get("data"))
        return cache, cm

    def cached_profile(self, key: str) -> MemoryProfile | None:
        cache, _ = self._cache()
        return cache.get(key)

    def store_profile(self, key: str, profile: MemoryProfile, inputs: Mapping[str, str]) -> None:
        """Add a profile to the cache ConfigMap (read-modify-write; retried on a concurrent write)."""
        for _attempt in range(5):
            cache, current = self._cache()
            cache.put(key, profile, datetime.now(UTC), inputs)
            desired = profile_cache_configmap(self.namespace, cache)
            try:
                if current is None:
                    self.cluster.create(desired)
                else:
                    desired["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                    self.cluster.update(desired)
                return
            except KubeError as exc:
                if exc.status != 409:
                    raise
        raise KubeError(409, f"ConfigMap {PROFILE_CACHE_CONFIGMAP}: too many concurrent writers")

    def profiling_job(self, name: str) -> JobFacts | None:
        job = self.cluster.get("batch/v1", "Job", self.namespace, name)
        if job is None:
            return None
        status = job.get("status") or {}
        conditions = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
        done = conditions.get("Complete") or conditions.get("SuccessCriteriaMet")
        failed = conditions.get("Failed") or conditions.get("FailureTarget")
        if not done and not failed:
            return JobFacts(name=name, finished=False, succeeded=False)
        end = done or failed or {}
        key = ((job.get("metadata") or {}).get("labels") or {}).get(LABEL_PROFILE_KEY, "")
        return JobFacts(
            name=name,
            finished=True,
            succeeded=bool(done),
            finished_at=_time(end.get("lastTransitionTime")) or _time(status.get("completionTime")),
            reason=str(end.get("reason") or "") + (f": {end['message']}" if end.get("message") else ""),
            log=self._log(key),
        )

    def _log(self, key: str) -> str | None:
        """vLLM's startup log from the Job's pod: the pod log, else its termination message."""
        pods = self.cluster.list("v1", "Pod", self.namespace, f"{LABEL_PROFILE_KEY}={key}")
        pods.sort(key=lambda p: str((p.get("metadata") or {}).get("creationTimestamp") or ""), reverse=True)
        for pod in pods:
            name = pod["metadata"]["name"]
            text = self.cluster.pod_log(self.namespace, name, PROFILE_CONTAINER)
            if text and text.strip():
                return text
            for cs in (pod.get("status") or {}).get("containerStatuses") or []:
                message = ((cs.get("state") or {}).get("terminated") or {}).get("message")
                if cs.get("name") == PROFILE_CONTAINER and message:
                    return str(message)
        return None
