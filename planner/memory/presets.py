"""Built-in models, stored as the fields of their Hugging Face `config.json` that memory depends on.

Presets go through the same parser as a user's config, so a preset and the real file give the same
plan. Fields are copied from the published configs of the named repositories; parameter counts that
the parser derives from them are checked against the published totals in the unit tests:
Llama-3.1-8B 8.03B, Llama-3.3-70B 70.55B, Qwen3-32B 32.76B, Qwen3-Next-80B-A3B 79.67B,
DeepSeek-V2-Lite 15.7B, DeepSeek-V3 671B (without its multi-token-prediction layer, which vLLM does
not load unless speculative decoding asks for it).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

_LLAMA_31_8B: dict[str, Any] = {
    "_name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

_LLAMA_33_70B: dict[str, Any] = {
    "_name_or_path": "meta-llama/Llama-3.3-70B-Instruct",
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

_QWEN3_32B: dict[str, Any] = {
    "_name_or_path": "Qwen/Qwen3-32B",
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

_QWEN3_NEXT_80B: dict[str, Any] = {
    "_name_or_path": "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

_DEEPSEEK_V2_LITE: dict[str, Any] = {
    "_name_or_path": "deepseek-ai/DeepSeek-V2-Lite-Chat",
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 102400,
    "max_position_embeddings": 163840,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

_DEEPSEEK_V3: dict[str, Any] = {
    "_name_or_path": "deepseek-ai/DeepSeek-V3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

PRESET_CONFIGS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "llama-3.1-8b": _LLAMA_31_8B,
        "llama-3.3-70b": _LLAMA_33_70B,
        "qwen3-32b": _QWEN3_32B,
        "qwen3-next-80b-a3b": _QWEN3_NEXT_80B,
        "deepseek-v2-lite": _DEEPSEEK_V2_LITE,
        "deepseek-v3": _DEEPSEEK_V3,
    }
)

# Names people type for the same models (Hugging Face ids, instruct variants, FP8 checkpoints).
ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "meta-llama/llama-3.1-8b": "llama-3.1-8b",
        "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b",
        "meta-llama/meta-llama-3.1-8b-instruct": "llama-3.1-8b",
        "meta-llama/llama-3.3-70b-instruct": "llama-3.3-70b",
        "qwen/qwen3-32b": "qwen3-32b",
        "qwen/qwen3-32b-fp8": "qwen3-32b",
        "qwen/qwen3-next-80b-a3b-instruct": "qwen3-next-80b-a3b",
        "qwen/qwen3-next-80b-a3b-thinking": "qwen3-next-80b-a3b",
        "qwen/qwen3-next-80b-a3b-instruct-fp8": "qwen3-next-80b-a3b",
        "deepseek-ai/deepseek-v2-lite": "deepseek-v2-lite",
        "deepseek-ai/deepseek-v2-lite-chat": "deepseek-v2-lite",
        "deepseek-ai/deepseek-v3": "deepseek-v3",
    }
)


def preset_key(name: str) -> str | None:
    """The preset a model name refers to, or None."""
    key = name.strip().lower()
    if key in PRESET_CONFIGS:
        return key
    return ALIASES.get(key)
