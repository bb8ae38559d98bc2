"""Architectures from config.json and presets: parameter counts, weights per GPU, TP rules."""

from __future__ import annotations

import pytest

from cacheroute.planner.memory import (
    PRESET_CONFIGS,
    MemoryPlanError,
    architecture_from_config,
    params_per_rank,
    preset,
    weights_bytes_per_gpu,
)

GIB = 1 << 30

# Published parameter counts (reference/vllm_memory.md §5 and the model cards); DeepSeek-V3 without
# its multi-token-prediction layer.
PUBLISHED_PARAMS = {
    "llama-3.1-8b": 8.03e9,
    "llama-3.3-70b": 70.55e9,
    "qwen3-32b": 32.76e9,
    "qwen3-next-80b-a3b": 79.67e9,
    "deepseek-v2-lite": 15.7e9,
    "deepseek-v3": 671e9,
}


@pytest.mark.parametrize(("name", "published"), sorted(PUBLISHED_PARAMS.items()))
def test_parameter_counts_match_the_published_totals(name: str, published: float) -> None:
    assert params_per_rank(preset(name), 1).total == pytest.approx(published, rel=0.005)


# reference/vllm_memory.md §5: weights BF16 / FP8.
@pytest.mark.parametrize(
    ("name", "bf16", "fp8"),
    [
        ("llama-3.1-8b", (14.5, 15.5), (8.0, 8.6)),
        ("llama-3.3-70b", (130.5, 132.0), (66.0, 68.0)),
        ("qwen3-32b", (60.5, 61.5), (31.0, 32.1)),
        ("qwen3-next-80b-a3b", (147.5, 149.0), (74.0, 76.0)),
    ],
)
def test_weights_per_quantization_match_the_reference_table(
    name: str, bf16: tuple[float, float], fp8: tuple[float, float]
) -> None:
    arch = preset(name)
    assert bf16[0] <= weights_bytes_per_gpu(arch, "bf16", 1) / GIB <= bf16[1]
    assert fp8[0] <= weights_bytes_per_gpu(arch, "fp8", 1) / GIB <= fp8[1]


def test_weights_shard_over_tp_but_replicated_kv_projections_do_not() -> None:
    arch = preset("llama-3.3-70b")
    whole = weights_bytes_per_gpu(arch, "bf16", 1)
    # Norms are replicated, so TP=2 is a hair over half.
    assert weights_bytes_per_gpu(arch, "bf16", 2) == pytest.approx(whole / 2, rel=1e-4)
    # 8 KV heads at TP=16 are replicated: each rank holds more than 1/16 of the model.
    assert weights_bytes_per_gpu(arch, "bf16", 16) > whole / 16


def test_param_count_override_rescales_the_weights() -> None:
    arch = preset("llama-3.1-8b")
    base = weights_bytes_per_gpu(arch, "bf16", 1)
    doubled = weights_bytes_per_gpu(arch, "bf16", 1, param_count=2 * params_per_rank(arch, 1).total)
    assert doubled == pytest.approx(2 * base, rel=1e-9)


def test_presets_and_the_same_config_parse_identically() -> None:
    for name, config in PRESET_CONFIGS.items():
        parsed = architecture_from_config(config, name=name)
        assert parsed.mixers == preset(name).mixers
        assert params_per_rank(parsed, 2) == params_per_rank(preset(name), 2)


def test_qwen3_next_is_a_hybrid_of_12_attention_and_36_gdn_layers() -> None:
    arch = preset("qwen3-next-80b-a3b")
    assert arch.attention_layers == 12 and arch.gdn_layers == 36 and arch.is_hybrid
    assert arch.mixers[3] == "attention" and arch.mixers[0] == "gdn"
    assert arch.gdn is not None and (arch.gdn.num_k_heads, arch.gdn.num_v_heads) == (16, 32)


def test_layer_types_list_is_honoured_and_text_config_is_unwrapped() -> None:
    config = dict(PRESET_CONFIGS["qwen3-next-80b-a3b"])
    config.pop("full_attention_interval")
    config["layer_types"] = ["linear_attention", "full_attention"] * 24
    wrapped = {"architectures": ["Wrapper"], "text_config": config}
    arch = architecture_from_config(wrapped)
    assert arch.attention_layers == 24 and arch.gdn_layers == 24


def test_head_dim_defaults_to_hidden_over_heads() -> None:
    config = {k: v for k, v in PRESET_CONFIGS["llama-3.1-8b"].items() if k != "head_dim"}
    assert architecture_from_config(config).head_dim == 128


def test_a_missing_kv_head_count_means_one_kv_head_per_attention_head() -> None:
    config = {k: v for k, v in PRESET_CONFIGS["llama-3.1-8b"].items() if k != "num_key_value_heads"}
    assert architecture_from_config(config).num_kv_heads == 32


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hidden_size": None}, "hidden_size"),
        ({"num_hidden_layers": -4}, "num_hidden_layers"),
        ({"vocab_size": "big"}, "vocab_size"),
        ({"layer_types": ["sliding_attention"] * 32}, "sliding_attention"),
        ({"mamba_d_state": 128}, "mamba_d_state"),
        ({"num_key_value_heads": -8}, "num_key_value_heads"),
        ({"num_key_value_heads": 0}, "num_key_value_heads"),
        ({"num_key_value_heads": 5}, "num_key_value_heads 5"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(change: dict[str, object], field: str) -> None:
    config = {**PRESET_CONFIGS["llama-3.1-8b"], **change}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(MemoryPlanError, match=field):
        architecture_from_config(config)


def test_tp_not_dividing_attention_heads_is_refused_with_the_valid_sizes() -> None:
    arch = preset("llama-3.3-70b")
    with pytest.raises(MemoryPlanError, match=r"tensor parallel size 3 does not divide num_attention_heads 64") as err:
        arch.check_tp(3)
    assert "1, 2, 4, 8" in str(err.value)


def test_tp_must_also_divide_the_gdn_heads() -> None:
    config = {**PRESET_CONFIGS["qwen3-next-80b-a3b"], "num_attention_heads": 24, "linear_num_key_heads": 12}
    arch = architecture_from_config(config)
    with pytest.raises(MemoryPlanError, match="linear_num_key_heads 12"):
        arch.check_tp(8)


def test_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(MemoryPlanError, match=r"llama-3\.3-70b"):
        preset("gpt-5")
