"""The chooser: flags that keep the worst case inside the GPU and maximise servable KV."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from cacheroute.planner.memory import (
    MemoryPlanError,
    PlanRequest,
    custom_gpu,
    gpu_by_name,
    plan_manual,
    plan_memory,
    preset,
)

GIB = 1 << 30
H100 = gpu_by_name("h100-80gb")


def request(name: str, quantization: str = "bf16", tp: int = 1, **kw: object) -> PlanRequest:
    return PlanRequest(model=preset(name), gpu=H100, quantization=quantization, tp=tp, **kw)  # type: ignore[arg-type]


def test_breakdown_adds_up_to_the_gpu_and_flags_agree_with_it() -> None:
    plan = plan_memory(request("llama-3.3-70b", "fp8", 2))
    b = plan.breakdown
    assert sum(value for _, value in b.rows()) == b.total == H100.total_bytes
    assert 0 <= b.free < plan.layout.bytes_per_block
    assert plan.kv_cache_memory_bytes == b.kv_cache == plan.num_blocks * plan.layout.bytes_per_block
    assert plan.kv_capacity_tokens == plan.num_blocks * 16
    args = plan.vllm_args()
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(plan.kv_cache_memory_bytes)
    assert args[args.index("--max-num-batched-tokens") + 1] == "2048"
    assert args[args.index("--max-model-len") + 1] == "131072"
    util = float(args[args.index("--gpu-memory-utilization") + 1])
    assert 0.5 < util < 1
    # vLLM's startup check: util x total must not exceed what is free after the CUDA context and NCCL.
    assert b.peak is not None
    assert util * b.total <= b.total - b.peak.cuda_context - b.peak.nccl - b.margin + 1e-4 * b.total


def test_seventy_b_fp8_on_one_h100_fails_with_the_missing_memory_and_a_tp_that_fits() -> None:
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(request("llama-3.3-70b", "fp8", 1))
    message = str(err.value)
    missing = float(re.search(r"([\d.]+) GiB missing per GPU", message).group(1))  # type: ignore[union-attr]
    # One 131,072-token request needs 131072 x 320 KiB = 40 GiB of KV; FP8 weights alone take ~67.7 GiB.
    assert 30 < missing < 40
    assert "40.00 GiB of KV" in message
    assert "TP=2 fits" in message
    assert re.search(r"lower --max-model-len to at most [\d,]+", message)
    assert plan_memory(request("llama-3.3-70b", "fp8", 2)).max_model_len == 131072


def test_weights_larger_than_the_gpu_point_to_a_larger_tp() -> None:
    with pytest.raises(MemoryPlanError, match="TP=4 fits"):
        plan_memory(request("qwen3-next-80b-a3b", "bf16", 2))


@pytest.mark.parametrize(
    ("model", "quantization", "tp"), [("llama-3.3-70b", "bf16", 1), ("qwen3-next-80b-a3b", "bf16", 2)]
)
def test_the_missing_memory_is_the_sum_of_the_parts_the_message_lists(model: str, quantization: str, tp: int) -> None:
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(request(model, quantization, tp))
    message = str(err.value)
    figure = r"([\d.]+) GiB"
    total = float(re.search(r"\(" + figure + r" per GPU\)", message).group(1))  # type: ignore[union-attr]
    missing = float(re.search(figure + " missing per GPU", message).group(1))  # type: ignore[union-attr]
    parts = [float(x) for x in re.findall(r"(?:of KV|weights|transients|graphs|non-torch|margin) " + figure, message)]
    parts += [float(x) for x in re.findall(figure + " of KV", message)]
    assert len(parts) == 6
    assert sum(parts) - total == pytest.approx(missing, abs=0.03)


def test_nothing_fits_says_so() -> None:
    with pytest.raises(MemoryPlanError, match="No tensor parallel size up to 8 fits"):
        plan_memory(request("deepseek-v3", "fp8", 8))


def test_tp_not_dividing_the_heads_is_refused() -> None:
    with pytest.raises(MemoryPlanError, match="tensor parallel size 3 does not divide num_attention_heads 64"):
        plan_memory(request("qwen3-32b", tp=3))


def test_hybrid_smaller_mnbt_frees_kv_and_the_breakdown_says_how_much() -> None:
    plan = plan_memory(request("qwen3-next-80b-a3b", "fp8", 2))
    by_mnbt = {c.mnbt: c for c in plan.candidates}
    kv = [by_mnbt[m].kv_cache_bytes for m in sorted(by_mnbt)]
    assert kv == sorted(kv, reverse=True) and kv[0] > kv[-1]
    assert plan.max_num_batched_tokens == 2048
    gained = plan.breakdown.kv_vs_vllm_default_bytes
    assert plan.breakdown.vllm_default_mnbt == 8192
    assert gained == by_mnbt[2048].kv_cache_bytes - by_mnbt[8192].kv_cache_bytes
    assert gained is not None and gained > 0.4 * GIB
    assert plan.to_dict()["kvVsVllmDefaultBytes"] == gained


def test_hybrid_max_num_seqs_stays_within_the_mamba_state_blocks() -> None:
    plan = plan_memory(request("qwen3-next-80b-a3b", "fp8", 2))
    assert plan.max_num_seqs < 1024
    assert plan.max_num_seqs * plan.layout.state_blocks_per_seq <= plan.num_blocks * 0.5
    assert plan.max_num_seqs <= plan.num_blocks
    assert any("max-num-seqs lowered" in n for n in plan.notes)
    with pytest.raises(MemoryPlanError, match=r"exceeds the \d+ mamba state blocks"):
        # vLLM refuses max_num_seqs above the block count; a 20 GiB margin leaves ~1,600 blocks.
        plan_memory(request("qwen3-next-80b-a3b", "fp8", 2, max_num_seqs=2048, safety_margin_bytes=20 * GIB))


def test_max_model_len_is_capped_by_native_length_and_by_kv() -> None:
    with pytest.raises(MemoryPlanError, match="exceeds the native context"):
        plan_memory(request("qwen3-32b", max_model_len=65536))
    fitted = plan_memory(request("llama-3.3-70b", "fp8", 1, auto_max_model_len=True))
    assert 0 < fitted.max_model_len <= fitted.max_request_tokens < 131072
    assert fitted.max_model_len <= fitted.kv_capacity_tokens


def test_floor_and_explicit_mnbt_are_respected() -> None:
    assert plan_memory(request("llama-3.1-8b", mnbt_floor=4096)).max_num_batched_tokens == 4096
    assert plan_memory(request("llama-3.1-8b", mnbt=8192)).max_num_batched_tokens == 8192
    tolerant = plan_memory(request("llama-3.1-8b", kv_tolerance=0.05))
    assert tolerant.max_num_batched_tokens > 2048


def test_fp8_kv_doubles_the_token_capacity_roughly() -> None:
    auto = plan_memory(request("llama-3.1-8b"))
    fp8 = plan_memory(request("llama-3.1-8b", kv_cache_dtype="fp8"))
    assert fp8.kv_capacity_tokens == pytest.approx(2 * auto.kv_capacity_tokens, rel=0.01)
    assert fp8.vllm_args()[-2:] == ["--kv-cache-dtype", "fp8"]


def test_plans_are_deterministic() -> None:
    one = plan_memory(request("qwen3-next-80b-a3b", "fp8", 2))
    two = plan_memory(request("qwen3-next-80b-a3b", "fp8", 2))
    assert json.dumps(one.to_dict(), sort_keys=True) == json.dumps(two.to_dict(), sort_keys=True)


def test_status_fields_match_the_plan() -> None:
    plan = plan_memory(request("llama-3.3-70b", "fp8", 2))
    status = plan.to_status()
    assert status["source"] == "Analytic"
    assert status["kv_cache_memory_bytes"] == plan.kv_cache_memory_bytes
    assert status["inputs"]["tensorParallelSize"] == "2"
    assert status["inputs"]["quantization"] == "fp8"
    # No host tier: the pod requests the operator's configured memory, and the status says no other.
    assert status["host_kv_cache_bytes"] == 0 and status["pod_memory_bytes"] == 0


def test_manual_mode_keeps_the_given_bytes_and_refuses_too_many() -> None:
    analytic = plan_memory(request("llama-3.1-8b"))
    manual = plan_manual(request("llama-3.1-8b"), 20 * GIB)
    assert manual.source == "Manual"
    assert manual.kv_cache_memory_bytes <= 20 * GIB
    assert manual.breakdown.free > 10 * GIB
    with pytest.raises(MemoryPlanError, match="more than the worst case"):
        plan_manual(request("llama-3.1-8b"), analytic.kv_cache_memory_bytes + 2 * GIB)


def test_a_larger_gpu_holds_more_kv() -> None:
    h100 = plan_memory(request("llama-3.3-70b", "fp8", 2))
    h200 = plan_memory(replace(request("llama-3.3-70b", "fp8", 2), gpu=gpu_by_name("h200-141gb")))
    assert h200.kv_cache_memory_bytes - h100.kv_cache_memory_bytes == pytest.approx(
        gpu_by_name("h200-141gb").total_bytes - H100.total_bytes, abs=h100.layout.bytes_per_block
    )
    small = custom_gpu(24)
    with pytest.raises(MemoryPlanError):
        plan_memory(replace(request("llama-3.1-8b"), gpu=small))


def test_bad_requests_name_the_value() -> None:
    with pytest.raises(MemoryPlanError, match="kv_tolerance"):
        plan_memory(request("llama-3.1-8b", kv_tolerance=1.5))
    with pytest.raises(MemoryPlanError, match="below max_num_seqs"):
        plan_memory(request("llama-3.1-8b", mnbt=128, max_num_seqs=256))
