"""The worst-case peak: capture sizes, profiled activation, what the profiler misses, graph pool."""

from __future__ import annotations

import pytest

from cacheroute.planner.memory import architecture_from_config, capture_sizes, estimate_peak, preset
from cacheroute.planner.memory.peak import activation_bytes_per_token

GIB = 1 << 30


def test_capture_sizes_follow_vllms_ladder() -> None:
    sizes = capture_sizes(max_num_seqs=1024, mnbt=8192)
    assert sizes[:5] == (1, 2, 4, 8, 16)
    assert sizes[-3:] == (480, 496, 512)
    assert len(sizes) == 3 + 31 + 17
    # max = min(max_num_seqs * 2, 512), capped at mnbt; mnbt itself added when it is the cap.
    assert max(capture_sizes(max_num_seqs=64, mnbt=8192)) == 128
    assert capture_sizes(max_num_seqs=1024, mnbt=300)[-2:] == (288, 300)


def test_profiled_activation_is_linear_in_mnbt() -> None:
    arch = preset("llama-3.3-70b")
    a, b, c = (estimate_peak(arch, 2, m, 256, 131072).activation_profiled for m in (2048, 4096, 6144))
    assert b - a == c - b > 0


def test_llama_8b_activation_is_near_public_vllm_logs() -> None:
    # Public vLLM startup logs on H100 for Llama-3-8B at mnbt 8192 / 256 sequences report a
    # "PyTorch activation peak memory" of 1.19-1.24 GiB.
    peak = estimate_peak(preset("llama-3.1-8b"), 1, 8192, 256, 131072)
    assert peak.activation_profiled / GIB == pytest.approx(1.21, rel=0.2)


# The #52872 reporter's model: a 64-layer hybrid (16 full attention + 48 GDN) on an RTX 5090, with the
# geometry published for the 27B members of that family. vLLM defaults there to 256 sequences.
REPORTER = architecture_from_config(
    {
        "model_type": "qwen3_5_text",
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 64,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "full_attention_interval": 4,
        "attn_output_gate": True,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "vocab_size": 248320,
        "max_position_embeddings": 262144,
    }
)
# mnbt -> (profiled activation GiB, CUDA-graph pool GiB) as #52872 measured them.
MEASURED_52872 = {8192: (2.84, 0.89), 4096: (2.42, 0.52), 3072: (2.32, 0.52), 2048: (2.21, 0.52)}


def test_hybrid_activation_slope_is_near_the_52872_measurement() -> None:
    # 2.21 -> 2.84 GiB for mnbt 2048 -> 8192: 107.5 KiB per token.
    assert activation_bytes_per_token(REPORTER, 1) / 1024 == pytest.approx(107.5, rel=0.3)


def test_graph_pool_never_undercounts_52872_and_stays_close() -> None:
    for mnbt, (_, pool) in MEASURED_52872.items():
        predicted = estimate_peak(REPORTER, 1, mnbt, 256, 262144).graph_pool / GIB
        assert pool - 0.01 <= predicted <= pool + 0.15, mnbt


def test_mnbt_8192_to_3072_frees_what_52872_measured() -> None:
    # 9.82 - 8.89 = 0.93 GiB more KV at mnbt 3072 (activation 2.84 -> 2.32, graph pool 0.89 -> 0.52).
    big, small = (estimate_peak(REPORTER, 1, m, 256, 262144) for m in (8192, 3072))
    freed = (big.activation_profiled + big.graph_pool) - (small.activation_profiled + small.graph_pool)
    assert freed / GIB == pytest.approx(0.93, rel=0.15)


def test_gdn_transient_matches_the_reference_estimate() -> None:
    # Reference: ~ mnbt x n_v/TP x ~2 KB per token-head, ~0.5 GiB at 8192 tokens x 32 heads, plus one
    # partly filled chunk state per prefilling sequence (none here: one sequence).
    peak = estimate_peak(preset("qwen3-next-80b-a3b"), 1, 8192, 1, 262144)
    assert peak.gdn_kernel / GIB == pytest.approx(0.5, rel=0.15)
    assert estimate_peak(preset("qwen3-next-80b-a3b"), 2, 8192, 1, 262144).gdn_kernel < peak.gdn_kernel


def test_dense_models_have_no_gdn_transient_but_mla_has_a_workspace() -> None:
    assert estimate_peak(preset("llama-3.1-8b"), 1, 8192, 256, 131072).gdn_kernel == 0
    assert estimate_peak(preset("deepseek-v2-lite"), 1, 8192, 256, 163840).mla_workspace > 0.5 * GIB


def test_only_hybrids_have_an_mnbt_dependent_graph_pool() -> None:
    arch = preset("qwen3-next-80b-a3b")
    assert estimate_peak(arch, 1, 8192, 256, 262144).graph_pool > estimate_peak(arch, 1, 3072, 256, 262144).graph_pool
    dense = preset("llama-3.1-8b")
    assert (
        estimate_peak(dense, 1, 3072, 256, 131072).graph_pool == estimate_peak(dense, 1, 8192, 256, 131072).graph_pool
    )


def test_eager_mode_has_no_graph_pool_and_tp_adds_nccl() -> None:
    from cacheroute.planner.memory import PeakOptions

    arch = preset("llama-3.3-70b")
    assert estimate_peak(arch, 2, 2048, 256, 131072, options=PeakOptions(cudagraphs=False)).graph_pool == 0
    assert estimate_peak(arch, 2, 2048, 256, 131072).non_torch > estimate_peak(arch, 1, 2048, 256, 131072).non_torch
