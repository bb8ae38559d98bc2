"""The memory plan by mode, including the Profiled mode's Job life cycle, without a server."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from cacheroute.operator.api.pool import ConfigMapKeyRef, InferencePoolSpec
from cacheroute.operator.config import ProfilingDefaults
from cacheroute.operator.fleet.memory import JobFacts, decide, job_name, profile_settings
from cacheroute.operator.fleet.names import PoolRef
from cacheroute.operator.fleet.profiling_job import plan_request_for_pool, profile_key, resolve_architecture
from cacheroute.planner.memory import MemoryPlanError, MemoryProfile, parse_vllm_log, plan_memory

POOL = PoolRef("llama", "ns", "uid-1")
NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
PROFILING = ProfilingDefaults(log_wait_seconds=60)
LLAMA_70B = {"model": {"name": "meta-llama/Llama-3.3-70B-Instruct", "quantization": "fp8"}, "tensorParallelSize": 2}
LOG = """\
INFO Chunked prefill is enabled with max_num_batched_tokens=2048.
INFO Model loading took 33.85 GiB memory and 40.1 seconds
INFO GPU KV cache size: 249,167 tokens
INFO Graph capturing finished in 12 secs, took 0.41 GiB
INFO Free memory on device (78.61/79.11 GiB) on startup. Desired GPU memory utilization is (0.9, 71.2 GiB). Actual usage is 35.80 GiB for consumed memory (weights + non-torch), 1.25 GiB for peak activation, and 0.41 GiB for CUDAGraph memory. Current kv cache memory in use is 38.02 GiB.
"""  # noqa: E501


class FakeInputs:
    def __init__(self, *, job: JobFacts | None = None, cached: MemoryProfile | None = None,
                 configs: Mapping[str, Any] | None = None) -> None:
        self.job, self.cached, self.configs = job, cached, dict(configs or {})
        self.asked_jobs: list[str] = []

    def config_json(self, ref: ConfigMapKeyRef) -> Mapping[str, Any]:
        if ref.name not in self.configs:
            raise MemoryPlanError(f"model.configMapRef: ConfigMap {ref.name} not found in ns")
        return dict(self.configs[ref.name])

    def cached_profile(self, key: str) -> MemoryProfile | None:
        return self.cached

    def profiling_job(self, name: str) -> JobFacts | None:
        self.asked_jobs.append(name)
        return self.job


def spec(**extra: Any) -> InferencePoolSpec:
    return InferencePoolSpec.model_validate({**LLAMA_70B, **extra})


def test_analytic_plans_without_reading_anything() -> None:
    outcome, job = decide(POOL, spec(), FakeInputs(), now=NOW, profiling=PROFILING)
    assert outcome.state == "Planned" and outcome.plan is not None and job is None
    assert outcome.plan.source == "Analytic" and "KV per GPU" in outcome.message


def test_the_summary_names_the_host_tier_and_why_auto_gave_none() -> None:
    sized = spec(memory={"hostKvCacheGib": "auto"}, gpu={"nodeMemoryGib": 2048})
    outcome, _ = decide(POOL, sized, FakeInputs(), now=NOW, profiling=PROFILING)
    assert "tokens per replica" in outcome.message
    assert "host KV tier 448 GiB (1,468,006 tokens, auto)" in outcome.message, outcome.message
    unknown = spec(memory={"hostKvCacheGib": "auto"})
    outcome, _ = decide(POOL, unknown, FakeInputs(), now=NOW, profiling=PROFILING)
    assert "host KV tier off: the node's allocatable memory is not known" in outcome.message, outcome.message


def test_a_model_too_large_for_its_gpus_does_not_fit_with_the_arithmetic() -> None:
    big = InferencePoolSpec.model_validate({"model": {"name": "meta-llama/Llama-3.3-70B-Instruct"}})
    outcome, job = decide(POOL, big, FakeInputs(), now=NOW, profiling=PROFILING)
    assert outcome.state == "DoesNotFit" and outcome.plan is None and job is None
    assert "does not fit" in outcome.message and "GiB missing" in outcome.message


def test_manual_pins_the_given_kv_bytes() -> None:
    manual = spec(memory={"mode": "Manual", "kvCacheMemoryBytes": 20 << 30, "maxModelLen": 32768})
    outcome, _ = decide(POOL, manual, FakeInputs(), now=NOW, profiling=PROFILING)
    assert outcome.plan is not None and outcome.plan.source == "Manual"
    assert outcome.plan.kv_cache_memory_bytes <= 20 << 30


def test_unknown_model_without_config_is_an_invalid_model_and_a_missing_configmap_says_so() -> None:
    unknown = InferencePoolSpec.model_validate({"model": {"name": "acme/secret-model"}})
    outcome, _ = decide(POOL, unknown, FakeInputs(), now=NOW, profiling=PROFILING)
    assert outcome.state == "InvalidModel" and "configMapRef" in outcome.message
    with_ref = InferencePoolSpec.model_validate({"model": {"name": "acme/m", "configMapRef": {"name": "acme-config"}}})
    outcome, _ = decide(POOL, with_ref, FakeInputs(), now=NOW, profiling=PROFILING)
    assert outcome.state == "InvalidModel" and "acme-config not found" in outcome.message


PROFILED = spec(memory={"mode": "Profiled"})


def test_profiled_starts_a_job_then_waits_for_it() -> None:
    outcome, job = decide(POOL, PROFILED, FakeInputs(), now=NOW, profiling=PROFILING)
    assert outcome.state == "Profiling" and job is not None
    assert job["metadata"]["ownerReferences"] == [POOL.owner_reference()]
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "memory-profile"  # never selected as an engine replica
    running = FakeInputs(job=JobFacts(name=job["metadata"]["name"], finished=False, succeeded=False))
    outcome, again = decide(POOL, PROFILED, running, now=NOW, profiling=PROFILING)
    assert outcome.state == "Profiling" and again is None and running.asked_jobs == [job["metadata"]["name"]]


def finished(log: str | None, *, ok: bool = True, ago: float = 1.0) -> FakeInputs:
    request = plan_request_for_pool(PROFILED, resolve_architecture(PROFILED))
    candidate = plan_memory(request)
    key = profile_key(PROFILED.model.name, PROFILED.engine.image, PROFILED.gpu.product, 2,
                      candidate.max_num_batched_tokens, settings=profile_settings(PROFILED))
    name = job_name(POOL, PROFILED, candidate, key)
    return FakeInputs(job=JobFacts(name=name, finished=True, succeeded=ok, finished_at=NOW - timedelta(seconds=ago),
                                   reason="" if ok else "BackoffLimitExceeded", log=log))


def test_profiled_pins_the_measured_plan_and_hands_the_profile_back_for_caching() -> None:
    outcome, job = decide(POOL, PROFILED, finished(LOG), now=NOW, profiling=PROFILING)
    assert outcome.state == "Planned" and job is None
    assert outcome.plan is not None and outcome.plan.source == "Profiled"
    assert outcome.new_profile is not None and outcome.new_profile.weights_gib == 33.85
    assert outcome.profile_key and outcome.profile_key.startswith("mp-")


def test_a_cached_profile_plans_without_a_job() -> None:
    inputs = FakeInputs(cached=parse_vllm_log(LOG))
    outcome, job = decide(POOL, PROFILED, inputs, now=NOW, profiling=PROFILING)
    assert outcome.state == "Planned" and job is None and inputs.asked_jobs == []
    assert outcome.new_profile is None


def test_a_log_not_readable_yet_is_awaited_then_is_a_profiling_failure() -> None:
    waiting, _ = decide(POOL, PROFILED, finished(None, ago=10), now=NOW, profiling=PROFILING)
    assert waiting.state == "Profiling" and "waiting for the log" in waiting.message
    failed, _ = decide(POOL, PROFILED, finished(None, ago=120), now=NOW, profiling=PROFILING)
    assert failed.state == "ProfilingFailed" and "cannot be read" in failed.message


def test_vllm_failures_in_the_log_are_profiling_failures_naming_them() -> None:
    oom = (
        "INFO Model loading took 33.85 GiB memory\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    )
    outcome, _ = decide(POOL, PROFILED, finished(oom, ok=False), now=NOW, profiling=PROFILING)
    assert outcome.state == "ProfilingFailed" and "cuda_oom" in outcome.message
    truncated, _ = decide(POOL, PROFILED, finished("INFO nothing useful\n"), now=NOW, profiling=PROFILING)
    assert truncated.state == "ProfilingFailed" and "lacks" in truncated.message


def test_only_inputs_of_the_plan_change_the_profile() -> None:
    def key_of(s: InferencePoolSpec) -> str | None:
        return decide(POOL, s, FakeInputs(), now=NOW, profiling=PROFILING)[0].profile_key

    base = key_of(PROFILED)
    assert key_of(spec(memory={"mode": "Profiled"}, replicas=7)) == base
    assert key_of(spec(memory={"mode": "Profiled", "maxModelLen": 32768})) != base
    assert key_of(spec(memory={"mode": "Profiled"}, engine={"image": "vllm/vllm-openai:v0.30.0"})) != base
