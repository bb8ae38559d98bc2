"""Profiled mode: the measured budget minus the worst-case prefill the profile cannot see."""

# ruff: noqa: E501  (vLLM log lines are quoted verbatim, at their real length)

from __future__ import annotations

import pytest

from cacheroute.planner.memory import (
    MemoryPlanError,
    PlanRequest,
    estimate_peak,
    gpu_by_name,
    parse_vllm_log,
    plan_from_profile,
    preset,
)

GIB = 1 << 30

HYBRID_LOG = """\
(EngineCore_DP0 pid=212) INFO Chunked prefill is enabled with max_num_batched_tokens=2048.
(Worker_TP0 pid=301) INFO Model loading took 37.47 GiB memory and 41.3 seconds
(Worker_TP0 pid=301) INFO Setting attention block size to 544 tokens to ensure that attention page size is >= mamba page size.
(Worker_TP0 pid=301) INFO Available KV cache memory: 35.12 GiB
(EngineCore_DP0 pid=212) INFO GPU KV cache size: 3,174,240 tokens, Maximum concurrency for 262,144 tokens per request: 12.11x
(Worker_TP0 pid=301) INFO Graph capturing finished in 14 secs, took 0.48 GiB
(Worker_TP0 pid=301) INFO CUDA graph pool memory: 0.48 GiB (actual), 0.61 GiB (estimated), difference: -0.13 GiB (-21.3%).
(Worker_TP0 pid=301) INFO Free memory on device (78.50/79.19 GiB) on startup. Desired GPU memory utilization is (0.9, 71.27 GiB). Actual usage is 38.95 GiB for consumed memory (weights + non-torch), 0.71 GiB for peak activation, and 0.48 GiB for CUDAGraph memory. Current kv cache memory in use is 35.12 GiB.
"""

DENSE_LOG = """\
INFO Model loading took 14.9888 GiB and 13.204526 seconds
INFO the current vLLM instance can use total_gpu_memory (79.11GiB) x gpu_memory_utilization (0.90) = 71.20GiB
INFO model weights take 14.99GiB; non_torch_memory takes 0.35GiB; PyTorch activation peak memory takes 1.24GiB; the rest of the memory reserved for KV Cache is 54.62GiB.
INFO GPU KV cache size: 447,440 tokens
INFO Maximum concurrency for 131,072 tokens per request: 3.41x
INFO Graph capturing finished in 10 secs, took 0.53 GiB
"""


def hybrid_request(**kw: object) -> PlanRequest:
    return PlanRequest(preset("qwen3-next-80b-a3b"), gpu_by_name("h100-80gb"), "fp8", 2, **kw)  # type: ignore[arg-type]


def test_kv_is_the_measured_budget_minus_the_unprofiled_prefill_and_the_margin() -> None:
    profile = parse_vllm_log(HYBRID_LOG, hybrid=True)
    plan = plan_from_profile(hybrid_request(), profile)
    assert plan.source == "Profiled"
    assert plan.max_num_batched_tokens == 2048
    unprofiled = estimate_peak(preset("qwen3-next-80b-a3b"), 2, 2048, plan.max_num_seqs, 262144).unprofiled_transient
    budget = (78.50 - 38.95 - 0.71 - 0.48 - 1.0) * GIB - unprofiled
    assert budget - plan.layout.bytes_per_block < plan.kv_cache_memory_bytes <= budget
    assert plan.breakdown.total == round(79.19 * GIB)
    assert plan.breakdown.weights == round(37.47 * GIB)
    assert plan.breakdown.unprofiled_transient == unprofiled > 0
    assert plan.to_status()["inputs"]["profileActivationGiB"] == "0.71"
    assert not [n for n in plan.notes if "block" in n and "predicts" in n]


def test_old_logs_without_a_startup_snapshot_still_plan() -> None:
    request = PlanRequest(preset("llama-3.1-8b"), gpu_by_name("h100-80gb"))
    plan = plan_from_profile(request, parse_vllm_log(DENSE_LOG), mnbt=8192)
    assert plan.max_num_batched_tokens == 8192
    assert plan.breakdown.activation_profiled == round(1.24 * GIB)
    assert plan.breakdown.graph_pool == round(0.53 * GIB)
    assert not plan.notes  # 54.62 GiB / 447,440 tokens = 128 KiB per token, as the model predicts


def test_kv_token_size_disagreement_is_noted() -> None:
    request = PlanRequest(preset("llama-3.1-8b"), gpu_by_name("h100-80gb"), kv_cache_dtype="fp8")
    plan = plan_from_profile(request, parse_vllm_log(DENSE_LOG), mnbt=8192)
    assert any("per token" in n and "check the model config" in n for n in plan.notes)


def test_a_failed_boot_is_an_error_naming_the_failure() -> None:
    log = HYBRID_LOG + "ValueError: max_num_seqs (1024) exceeds available Mamba cache blocks (512).\n"
    with pytest.raises(MemoryPlanError, match="mamba_blocks"):
        plan_from_profile(hybrid_request(), parse_vllm_log(log, hybrid=True))


def test_missing_budget_lines_are_named() -> None:
    log = "\n".join(line for line in HYBRID_LOG.splitlines() if "Free memory on device" not in line)
    with pytest.raises(MemoryPlanError, match="memory_summary"):
        plan_from_profile(hybrid_request(), parse_vllm_log(log, hybrid=True))


def test_the_profiled_mnbt_must_match() -> None:
    profile = parse_vllm_log(HYBRID_LOG, hybrid=True)
    with pytest.raises(MemoryPlanError, match="max_num_batched_tokens=2048, not 8192"):
        plan_from_profile(hybrid_request(), profile, mnbt=8192)
    with pytest.raises(MemoryPlanError, match="mnbt of the profiling boot is unknown"):
        plan_from_profile(PlanRequest(preset("llama-3.1-8b"), gpu_by_name("h100-80gb")), parse_vllm_log(DENSE_LOG))
