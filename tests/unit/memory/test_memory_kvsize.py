"""KV bytes per token, recurrent state per sequence and hybrid pages, against the reference's arithmetic."""

from __future__ import annotations

import pytest

from cacheroute.planner.memory import attention_kv_bytes_per_token, gdn_state_bytes_per_seq, kv_layout, preset

KIB = 1024
MIB = 1 << 20


# reference/vllm_memory.md §5, BF16 KV per GPU at TP 1/2/4/8.
@pytest.mark.parametrize(
    ("name", "kib"),
    [
        ("llama-3.1-8b", (128, 64, 32, 16)),
        ("llama-3.3-70b", (320, 160, 80, 40)),
        ("qwen3-32b", (256, 128, 64, 32)),
        ("qwen3-next-80b-a3b", (24, 12, 12, 12)),
    ],
)
def test_attention_kv_per_token_matches_the_reference_table(name: str, kib: tuple[int, ...]) -> None:
    arch = preset(name)
    assert tuple(attention_kv_bytes_per_token(arch, tp) // KIB for tp in (1, 2, 4, 8)) == kib


def test_fp8_kv_halves_the_bytes_per_token() -> None:
    arch = preset("llama-3.3-70b")
    assert attention_kv_bytes_per_token(arch, 2, "fp8") * 2 == attention_kv_bytes_per_token(arch, 2)


def test_mla_caches_576_elements_per_token_per_layer_on_every_rank() -> None:
    arch = preset("deepseek-v3")
    per_layer = 576 * 2
    assert attention_kv_bytes_per_token(arch, 1) == 61 * per_layer
    assert attention_kv_bytes_per_token(arch, 8) == 61 * per_layer  # not divided by TP
    assert kv_layout(arch, 8).block_size == 64


def test_qwen3_next_gdn_state_per_sequence() -> None:
    arch = preset("qwen3-next-80b-a3b")
    # conv 49,152 B + ssm 1,048,576 B per layer, 36 layers.
    assert gdn_state_bytes_per_seq(arch, 1) == 36 * (49_152 + 1_048_576)
    assert gdn_state_bytes_per_seq(arch, 1) / MIB == pytest.approx(37.7, abs=0.05)
    assert gdn_state_bytes_per_seq(arch, 1, "float32") / MIB == pytest.approx(73.7, abs=0.05)
    assert gdn_state_bytes_per_seq(arch, 2) / MIB == pytest.approx(18.8, abs=0.05)


def test_qwen3_next_hybrid_block_is_544_tokens_with_1_49_percent_padding() -> None:
    layout = kv_layout(preset("qwen3-next-80b-a3b"), 1)
    assert layout.block_size == 544
    assert layout.mamba_padding_pct == pytest.approx(1.49, abs=0.005)
    assert (layout.group_size, layout.attention_groups, layout.mamba_groups, layout.padding_layers) == (12, 1, 3, 0)
    assert kv_layout(preset("qwen3-next-80b-a3b"), 1, ssm_dtype="float32").block_size == 1056


def test_hybrid_capacity_reserves_state_blocks_for_running_sequences() -> None:
    layout = kv_layout(preset("qwen3-next-80b-a3b"), 2)
    blocks = 1000
    assert layout.tokens_with(blocks, 0) == blocks * 544
    # align mode: 2 state blocks in each of the 3 GDN groups per running sequence.
    assert layout.tokens_with(blocks, 100) == (blocks - 600) * 544
    assert layout.max_request_tokens(blocks) == (blocks - 6) * 544
    assert kv_layout(preset("qwen3-next-80b-a3b"), 2, mamba_cache_mode="none").state_blocks_per_seq == 3


def test_pure_attention_layout_is_one_group_of_all_layers() -> None:
    layout = kv_layout(preset("llama-3.1-8b"), 1)
    assert (layout.block_size, layout.group_size, layout.mamba_groups) == (16, 32, 0)
    assert layout.bytes_per_block == 16 * 128 * KIB
    assert layout.tokens_with(10, 5) == 160
