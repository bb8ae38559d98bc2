"""The host-memory KV tier a memory plan gives each replica, and the flags it puts on the pod."""

from __future__ import annotations

import pytest

from cacheroute.planner.memory import MemoryPlanError, plan_memory
from cacheroute.planner.memory.architecture import preset
from cacheroute.planner.memory.gpus import GIB, H100_80GB
from cacheroute.planner.memory.request import PlanRequest

NODE = 2048 * GIB  # an HGX H100 node: 8 GPUs, 2 TiB


def request(model: str = "llama-3.3-70b", **kw: object) -> PlanRequest:
    return PlanRequest(model=preset(model), gpu=H100_80GB, quantization="fp8", tp=2, **kw)  # type: ignore[arg-type]


def test_auto_takes_the_replicas_share_of_the_node_less_the_reserve_and_fp8_doubles_its_tokens() -> None:
    bf16 = plan_memory(request(host_kv="auto", node_memory_bytes=NODE))
    fp8 = plan_memory(request(host_kv="auto", node_memory_bytes=NODE, kv_cache_dtype="fp8"))
    assert bf16.host_kv_cache_bytes == fp8.host_kv_cache_bytes == 448 * GIB
    assert fp8.host_kv_capacity_tokens == 2 * bf16.host_kv_capacity_tokens
    # fp8 KV also doubles the GPU tokens of the same bytes.
    assert fp8.kv_capacity_tokens == pytest.approx(2 * bf16.kv_capacity_tokens, rel=0.01)
    args = fp8.vllm_args()
    assert args[-4:] == ["--kv-offloading-backend", "native", "--kv-offloading-size", "448"]
    assert "--kv-cache-dtype" in args


def test_no_tier_unless_asked_and_known() -> None:
    assert "--kv-offloading-size" not in plan_memory(request()).vllm_args()
    unknown = plan_memory(request(host_kv="auto"))
    assert unknown.host_kv_cache_bytes == 0
    assert any("not known" in n for n in unknown.notes)


def test_a_size_beyond_the_nodes_share_is_refused_and_a_hybrid_gets_none_from_auto() -> None:
    with pytest.raises(MemoryPlanError, match="exceeds the replica's share"):
        plan_memory(request(host_kv=600 * GIB, node_memory_bytes=NODE))
    hybrid = plan_memory(request("qwen3-next-80b-a3b", host_kv="auto", node_memory_bytes=NODE))
    assert hybrid.host_kv_cache_bytes == 0
    assert any("hybrid" in n for n in hybrid.notes)
