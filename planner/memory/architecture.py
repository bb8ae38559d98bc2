"""Model architecture descriptors, parsed from a Hugging Face `config.json`, and their weights.

Only the fields that decide GPU memory are kept: the kind of every layer's token mixer (full
attention, multi-head latent attention, Gated DeltaNet), its head geometry, the MLP (dense or
mixture of experts) and the vocabulary. Parameter counts are derived from those fields the way
vLLM's model classes lay the weights out, per tensor-parallel rank, so weights per GPU include what
TP replicates (KV projections when TP exceeds the KV heads, the MLA down-projections, routers).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from cacheroute.planner.memory.errors import MemoryPlanError
from cacheroute.planner.memory.presets import PRESET_CONFIGS, preset_key

Quantization = Literal["bf16", "fp8"]
QUANTIZATIONS: tuple[Quantization, ...] = ("bf16", "fp8")
Mixer = Literal["attention", "mla", "gdn"]
Mlp = Literal["dense", "moe"]

# Activations, KV and embeddings are 16-bit: vLLM's "auto" dtype keeps bf16/fp16 checkpoints as
# they are and casts fp32 checkpoints down to a 16-bit type.
ACTIVATION_BYTES = 2
DTYPE_BYTES: Mapping[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float32": 4,
    "float": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}
# Weight bytes per parameter of the linear layers under each quantization. FP8 leaves embeddings,
# the LM head, norms, routers and the GDN convolution/gates in BF16, as vLLM's FP8 path and the
# published FP8 checkpoints do; per-block scales add under 0.1% and are ignored.
QUANT_BYTES: Mapping[Quantization, int] = {"bf16": 2, "fp8": 1}

# Keys of hybrid families this model does not describe (Mamba-2 / Jamba / Falcon-H1 / Nemotron-H):
# refusing them beats planning them as pure attention and under-counting their state.
_UNMODELLED_KEYS = ("mamba_d_state", "ssm_state_size", "hybrid_override_pattern", "attn_layer_period", "mamba_n_heads")
_UNMODELLED_LAYER_TYPES = ("sliding_attention", "chunked_attention", "mamba", "conv")


@dataclass(frozen=True)
class GdnSpec:
    """Gated DeltaNet (linear attention) geometry of one layer."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: q and k (key_dim each) and v (value_dim)."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class MlaSpec:
    """Multi-head latent attention (DeepSeek) geometry."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None

    @property
    def latent_dim(self) -> int:
        """Elements cached per token per layer: the compressed KV plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoeSpec:
    """Mixture of experts: routed experts plus always-on shared experts."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    shared_intermediate_size: int
    shared_expert_gate: bool


@dataclass(frozen=True)
class ModelArchitecture:
    """What a model's memory depends on; build it with `architecture_from_config` or `preset`."""

    name: str
    model_type: str
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    mixers: tuple[Mixer, ...]
    mlps: tuple[Mlp, ...]
    tie_word_embeddings: bool = False
    attention_output_gate: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    gdn: GdnSpec | None = None
    mla: MlaSpec | None = None
    moe: MoeSpec | None = None
    mamba_ssm_dtype: str | None = None
    preset: str | None = None

    @property
    def num_layers(self) -> int:
        return len(self.mixers)

    @property
    def attention_layers(self) -> int:
        """Layers that keep a per-token KV cache (full attention or MLA)."""
        return sum(1 for m in self.mixers if m != "gdn")

    @property
    def gdn_layers(self) -> int:
        return sum(1 for m in self.mixers if m == "gdn")

    @property
    def is_hybrid(self) -> bool:
        return self.gdn_layers > 0

    @property
    def uses_mla(self) -> bool:
        return self.mla is not None

    def tp_problem(self, tp: int) -> str | None:
        """Why vLLM would refuse this tensor-parallel size, or None if it shards cleanly."""
        if tp < 1:
            return f"tensor parallel size must be at least 1, got {tp}"
        if self.num_attention_heads % tp:
            return (
                f"tensor parallel size {tp} does not divide num_attention_heads {self.num_attention_heads}"
                f" of {self.name}"
            )
        if not self.uses_mla:
            kv = self.num_kv_heads
            if (tp >= kv and tp % kv) or (tp < kv and kv % tp):
                return (
                    f"tensor parallel size {tp} and num_key_value_heads {kv} of {self.name} do not divide one another"
                )
        if self.gdn is not None:
            for field, heads in (
                ("linear_num_key_heads", self.gdn.num_k_heads),
                ("linear_num_value_heads", self.gdn.num_v_heads),
            ):
                if heads % tp:
                    return f"tensor parallel size {tp} does not divide {field} {heads} of {self.name}"
        return None

    def valid_tps(self, limit: int = 8) -> tuple[int, ...]:
        return tuple(t for t in range(1, limit + 1) if self.tp_problem(t) is None)

    def check_tp(self, tp: int, limit: int = 8) -> None:
        problem = self.tp_problem(tp)
        if problem is not None:
            valid = ", ".join(str(t) for t in self.valid_tps(limit)) or "none"
            raise MemoryPlanError(f"{problem}; valid tensor parallel sizes up to {limit}: {valid}")

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one rank holds: vLLM replicates KV heads when TP exceeds them."""
        return max(1, self.num_kv_heads // tp)


# ---------------------------------------------------------------------------------------- parsing


def _field(config: Mapping[str, Any], *names: str, required: bool = True, default: Any = None) -> Any:
    for name in names:
        if config.get(name) is not None:
            return config[name]
    if required:
        raise MemoryPlanError(f"config.json: field {names[0]!r} is missing")
    return default


# No dimension of a real model comes near this; larger values are a broken config, not a model.
MAX_CONFIG_INT = 2**31 - 1
MAX_LAYERS = 4096


def _positive_int(config: Mapping[str, Any], *names: str) -> int:
    value = _field(config, *names)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value > MAX_CONFIG_INT:
        raise MemoryPlanError(
            f"config.json: field {names[0]!r} must be a positive integer up to {MAX_CONFIG_INT}, got {value!r}"
        )
    return int(value)


def _optional_int(config: Mapping[str, Any], name: str, *, minimum: int = 1, default: int = 0) -> int:
    """A field that may be absent or null (`default`); when present, an integer >= `minimum`."""
    value = config.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_CONFIG_INT:
        raise MemoryPlanError(
            f"config.json: field {name!r} must be an integer in [{minimum}, {MAX_CONFIG_INT}], got {value!r}"
        )
    return int(value)


def _text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Multimodal wrappers keep the language model's fields under `text_config`."""
    merged = {k: v for k, v in config.items() if k != "text_config"}
    inner = config.get("text_config")
    if isinstance(inner, Mapping):
        merged.update(inner)
    return merged


def _mixers(config: Mapping[str, Any], num_layers: int) -> tuple[Mixer, ...]:
    if config.get("kv_lora_rank") is not None:
        mla: list[Mixer] = ["mla"] * num_layers
        return tuple(mla)
    layer_types = config.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise MemoryPlanError(
                f"config.json: field 'layer_types' must list {num_layers} layer types, got {layer_types!r}"
            )
        out: list[Mixer] = []
        for kind in layer_types:
            if kind == "full_attention":
                out.append("attention")
            elif kind == "linear_attention":
                out.append("gdn")
            else:
                raise MemoryPlanError(f"config.json: layer type {kind!r} in 'layer_types' is not modelled")
        return tuple(out)
    if config.get("linear_num_value_heads") is not None:
        interval = _positive_int(config, "full_attention_interval")
        hybrid: list[Mixer] = ["attention" if (i + 1) % interval == 0 else "gdn" for i in range(num_layers)]
        return tuple(hybrid)
    _refuse_sliding_window(config)
    dense: list[Mixer] = ["attention"] * num_layers
    return tuple(dense)


def _refuse_sliding_window(config: Mapping[str, Any]) -> None:
    """A window shorter than the context bounds the KV of some or all layers: the memory model
    counts every layer's KV for the whole context, which such a model does not hold."""
    window = config.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        return
    if config.get("use_sliding_window") is False:  # Qwen2-style: the window is declared, not used
        return
    context = config.get("max_position_embeddings")
    if isinstance(context, int) and not isinstance(context, bool) and window >= context:
        return
    raise MemoryPlanError(
        f"config.json: sliding-window attention (sliding_window {window}, shorter than the context) is not "
        "modelled: the plan would count KV its layers do not hold"
    )


def _moe(config: Mapping[str, Any]) -> MoeSpec | None:
    experts = _field(config, "num_experts", "n_routed_experts", "num_local_experts", required=False, default=0)
    if not experts:
        return None
    experts = _positive_int(config, "num_experts", "n_routed_experts", "num_local_experts")
    top_k = _positive_int(config, "num_experts_per_tok")
    inter = _positive_int(config, "moe_intermediate_size", "intermediate_size")
    shared = _optional_int(config, "shared_expert_intermediate_size", minimum=0)
    if not shared and config.get("n_shared_experts"):
        shared = _optional_int(config, "n_shared_experts", minimum=0) * inter
    gate = str(config.get("model_type", "")).startswith(("qwen3_next", "qwen2_moe", "qwen3_5"))
    return MoeSpec(experts, top_k, inter, shared, gate and shared > 0)


def _mlps(config: Mapping[str, Any], num_layers: int, moe: MoeSpec | None) -> tuple[Mlp, ...]:
    if moe is None:
        dense: list[Mlp] = ["dense"] * num_layers
        return tuple(dense)
    if config.get("first_k_dense_replace") is not None or config.get("moe_layer_freq") is not None:
        first = _optional_int(config, "first_k_dense_replace", minimum=0)
        freq = _optional_int(config, "moe_layer_freq", default=1)
        deepseek: list[Mlp] = ["moe" if i >= first and i % freq == 0 else "dense" for i in range(num_layers)]
        return tuple(deepseek)
    listed = config.get("mlp_only_layers") or []
    if not isinstance(listed, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in listed):
        raise MemoryPlanError(f"config.json: field 'mlp_only_layers' must be a list of layer indexes, got {listed!r}")
    dense_only = set(listed)
    step = _optional_int(config, "decoder_sparse_step", default=1)
    sparse: list[Mlp] = ["moe" if i not in dense_only and (i + 1) % step == 0 else "dense" for i in range(num_layers)]
    return tuple(sparse)


def architecture_from_config(
    config: Mapping[str, Any], name: str | None = None, *, source: str = "config.json"
) -> ModelArchitecture:
    """Describe a model from its parsed `config.json`; raises MemoryPlanError naming a bad field,
    and the file as `source` (the path a user gave, say)."""
    try:
        return _architecture(config, name)
    except MemoryPlanError as exc:
        if source == "config.json":
            raise
        raise MemoryPlanError(str(exc).replace("config.json", source, 1)) from None


def _architecture(config: Mapping[str, Any], name: str | None) -> ModelArchitecture:
    if not isinstance(config, Mapping):
        raise MemoryPlanError(f"config.json must be a JSON object, got {type(config).__name__}")
    cfg = _text_config(config)
    for key in _UNMODELLED_KEYS:
        if key in cfg:
            raise MemoryPlanError(
                f"config.json: field {key!r} marks a Mamba-2 style hybrid, which this memory model does not describe"
            )
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list):
        for kind in layer_types:
            if kind in _UNMODELLED_LAYER_TYPES:
                raise MemoryPlanError(f"config.json: layer type {kind!r} in 'layer_types' is not modelled")
    hidden = _positive_int(cfg, "hidden_size")
    num_layers = _positive_int(cfg, "num_hidden_layers")
    if num_layers > MAX_LAYERS:
        raise MemoryPlanError(f"config.json: field 'num_hidden_layers' is {num_layers}; at most {MAX_LAYERS} modelled")
    heads = _positive_int(cfg, "num_attention_heads")
    kv_heads = _optional_int(cfg, "num_key_value_heads", default=heads)
    if heads % kv_heads:
        # Grouped-query attention shares each KV head among a whole number of query heads.
        raise MemoryPlanError(
            f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    head_dim = _optional_int(cfg, "head_dim")
    if not head_dim:
        if hidden % heads:
            raise MemoryPlanError(
                f"config.json: field 'head_dim' is missing and hidden_size {hidden} is not a multiple of "
                f"num_attention_heads {heads}"
            )
        head_dim = hidden // heads
    mixers = _mixers(cfg, num_layers)
    moe = _moe(cfg)
    mlps = _mlps(cfg, num_layers, moe)
    intermediate = _optional_int(cfg, "intermediate_size", minimum=0)
    if "dense" in mlps and intermediate <= 0:
        raise MemoryPlanError("config.json: field 'intermediate_size' must be a positive integer for dense MLP layers")
    gdn = None
    if "gdn" in mixers:
        gdn = GdnSpec(
            num_k_heads=_positive_int(cfg, "linear_num_key_heads"),
            num_v_heads=_positive_int(cfg, "linear_num_value_heads"),
            k_head_dim=_positive_int(cfg, "linear_key_head_dim"),
            v_head_dim=_positive_int(cfg, "linear_value_head_dim"),
            conv_kernel=_positive_int(cfg, "linear_conv_kernel_dim"),
        )
    mla = None
    if "mla" in mixers:
        q_lora = cfg.get("q_lora_rank")
        mla = MlaSpec(
            kv_lora_rank=_positive_int(cfg, "kv_lora_rank"),
            qk_rope_head_dim=_positive_int(cfg, "qk_rope_head_dim"),
            qk_nope_head_dim=_positive_int(cfg, "qk_nope_head_dim"),
            v_head_dim=_positive_int(cfg, "v_head_dim"),
            q_lora_rank=_optional_int(cfg, "q_lora_rank") if q_lora else None,
        )
    model_type = str(cfg.get("model_type") or "unknown")
    ssm_dtype = cfg.get("mamba_ssm_dtype")
    if ssm_dtype is not None and ssm_dtype not in DTYPE_BYTES:
        raise MemoryPlanError(f"config.json: field 'mamba_ssm_dtype' {ssm_dtype!r} is not a known dtype")
    return ModelArchitecture(
        name=name or str(cfg.get("_name_or_path") or model_type),
        model_type=model_type,
        hidden_size=hidden,
        vocab_size=_positive_int(cfg, "vocab_size"),
        max_position_embeddings=_positive_int(cfg, "max_position_embeddings", "max_sequence_length", "seq_length"),
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        mixers=mixers,
        mlps=mlps,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_output_gate=model_type == "qwen3_next" or bool(cfg.get("attn_output_gate", False)),
        qk_norm=model_type.startswith(("qwen3", "qwen3_5")),
        attention_bias=bool(cfg.get("attention_bias", False)),
        gdn=gdn,
        mla=mla,
        moe=moe,
        mamba_ssm_dtype=ssm_dtype,
    )


def preset(name: str) -> ModelArchitecture:
    """A built-in model by preset name or Hugging Face id."""
    key = preset_key(name)
    if key is None:
        raise MemoryPlanError(
            f"model {name!r} is not a preset; use one of {', '.join(PRESET_CONFIGS)} or a config.json"
        )
    arch = architecture_from_config(PRESET_CONFIGS[key])
    return replace(arch, name=key, preset=key)


# ---------------------------------------------------------------------------------------- weights


@dataclass(frozen=True)
class ParamSplit:
    """Parameters on one rank: `linear` are quantized with the weights, `other` stay 16-bit."""

    linear: int
    other: int

    @property
    def total(self) -> int:
        return self.linear + self.other

    def __add__(self, other: ParamSplit) -> ParamSplit:
        return ParamSplit(self.linear + other.linear, self.other + other.other)


def _mixer_params(arch: ModelArchitecture, mixer: Mixer, tp: int) -> ParamSplit:
    h = arch.hidden_size
    if mixer == "attention":
        q_out = arch.num_attention_heads * arch.head_dim * (2 if arch.attention_output_gate else 1)
        kv_out = arch.kv_heads_per_rank(tp) * arch.head_dim
        linear = h * q_out // tp + 2 * h * kv_out + arch.num_attention_heads * arch.head_dim // tp * h
        other = 2 * arch.head_dim if arch.qk_norm else 0
        if arch.attention_bias:
            other += q_out // tp + 2 * kv_out
        return ParamSplit(linear, other)
    if mixer == "mla":
        mla = arch.mla
        assert mla is not None
        heads = arch.num_attention_heads // tp
        # The down-projections (q_a, kv_a) are replicated on every rank; the up-projections and the
        # output projection are sharded over heads.
        if mla.q_lora_rank:
            q = h * mla.q_lora_rank + mla.q_lora_rank * heads * mla.qk_head_dim
            norms = mla.q_lora_rank + mla.kv_lora_rank
        else:
            q = h * heads * mla.qk_head_dim
            norms = mla.kv_lora_rank
        linear = (
            q
            + h * mla.latent_dim
            + mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
            + heads * mla.v_head_dim * h
        )
        return ParamSplit(linear, norms)
    gdn = arch.gdn
    assert gdn is not None
    proj = 2 * gdn.key_dim + 2 * gdn.value_dim  # q, k, v and the output gate z
    linear = h * proj // tp + h * 2 * gdn.num_v_heads // tp + gdn.value_dim // tp * h
    other = gdn.conv_dim * gdn.conv_kernel // tp + 2 * gdn.num_v_heads // tp + gdn.v_head_dim
    return ParamSplit(linear, other)


def _mlp_params(arch: ModelArchitecture, mlp: Mlp, tp: int) -> ParamSplit:
    h = arch.hidden_size
    if mlp == "dense":
        return ParamSplit(3 * h * arch.intermediate_size // tp, 0)
    moe = arch.moe
    assert moe is not None
    linear = moe.num_experts * 3 * h * moe.intermediate_size // tp + 3 * h * moe.shared_intermediate_size // tp
    other = h * moe.num_experts + (h if moe.shared_expert_gate else 0)
    if arch.model_type == "deepseek_v3":
        other += moe.num_experts  # e_score_correction_bias
    return ParamSplit(linear, other)


def params_per_rank(arch: ModelArchitecture, tp: int = 1) -> ParamSplit:
    """Parameters one tensor-parallel rank holds (tp=1: the whole model)."""
    embed = arch.vocab_size * arch.hidden_size // tp
    total = ParamSplit(0, embed + (0 if arch.tie_word_embeddings else embed) + arch.hidden_size)
    for mixer, mlp in zip(arch.mixers, arch.mlps, strict=True):
        total = (
            total + _mixer_params(arch, mixer, tp) + _mlp_params(arch, mlp, tp) + ParamSplit(0, 2 * arch.hidden_size)
        )
    return total


def weights_bytes_per_gpu(
    arch: ModelArchitecture, quantization: Quantization, tp: int, param_count: int | None = None
) -> int:
    """Bytes of weights on one GPU; `param_count` rescales the model to a published total."""
    if quantization not in QUANT_BYTES:
        raise MemoryPlanError(f"quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    split = params_per_rank(arch, tp)
    scale = 1.0
    if param_count is not None:
        if param_count <= 0:
            raise MemoryPlanError(f"param_count must be positive, got {param_count}")
        scale = param_count / params_per_rank(arch, 1).total
    return int((split.linear * QUANT_BYTES[quantization] + split.other * ACTIVATION_BYTES) * scale)
