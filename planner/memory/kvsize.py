"""KV cache geometry on one GPU: bytes per token, recurrent state per sequence, pages and blocks.

Follows vLLM's `kv_cache_interface` and `kv_cache_utils` (see reference/vllm_memory.md §2):

- full attention caches `2 * kv_heads_per_rank * head_dim * dtype` bytes per token per layer, with
  KV heads replicated when TP exceeds them; MLA caches `kv_lora_rank + qk_rope_head_dim` elements
  per token per layer on every rank (not divided by TP);
- a Gated DeltaNet layer keeps, per sequence, a convolution state `(conv_dim / TP, kernel - 1)` and an
  SSM state `(n_v / TP, v_dim, k_dim)`;
- on hybrids the attention block is raised until an attention page holds a whole mamba page, the
  mamba page is padded up to it, and layers are grouped so all groups share one block pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil
from typing import Literal

from cacheroute.planner.memory.architecture import ACTIVATION_BYTES, DTYPE_BYTES, ModelArchitecture
from cacheroute.planner.memory.errors import MemoryPlanError

KvCacheDtype = Literal["auto", "fp8"]
KV_CACHE_DTYPES: tuple[KvCacheDtype, ...] = ("auto", "fp8")
MambaCacheMode = Literal["none", "align", "all"]
MAMBA_CACHE_MODES: tuple[MambaCacheMode, ...] = ("none", "align", "all")

# vLLM's default --block-size.
ATTENTION_BLOCK_TOKENS = 16
# FlashMLA (the MLA decode kernel on Hopper) works on 64-token pages; vLLM forces that block size.
MLA_BLOCK_TOKENS = 64
# Hybrid alignment rounds the attention block to the backend's minimum kernel block, 16 tokens for
# the FlashAttention/FlashInfer backends used on H100 (Platform._align_hybrid_block_size).
HYBRID_BLOCK_ALIGN = 16
# Mamba-state blocks a running sequence holds per mamba group: one in mode `none`; two in `align`,
# vLLM's mode when prefix caching is on (the running state and the last block-aligned checkpoint).
_MAMBA_BLOCKS_PER_SEQ: dict[MambaCacheMode, int] = {"none": 1, "align": 2, "all": 1}


def _kv_dtype_bytes(kv_cache_dtype: KvCacheDtype) -> int:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise MemoryPlanError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return 1 if kv_cache_dtype == "fp8" else ACTIVATION_BYTES


def attention_bytes_per_token_per_layer(arch: ModelArchitecture, tp: int, kv_cache_dtype: KvCacheDtype = "auto") -> int:
    """KV bytes one token occupies in one attention layer on one GPU."""
    dtype = _kv_dtype_bytes(kv_cache_dtype)
    if arch.mla is not None:
        return arch.mla.latent_dim * dtype
    return 2 * arch.kv_heads_per_rank(tp) * arch.head_dim * dtype


def attention_kv_bytes_per_token(arch: ModelArchitecture, tp: int, kv_cache_dtype: KvCacheDtype = "auto") -> int:
    """KV bytes one token occupies across all attention layers on one GPU."""
    return attention_bytes_per_token_per_layer(arch, tp, kv_cache_dtype) * arch.attention_layers


def ssm_dtype_for(arch: ModelArchitecture, override: str | None = None) -> str:
    """The SSM state dtype: `--mamba-ssm-cache-dtype`, else the config's `mamba_ssm_dtype`, else bf16."""
    dtype = override or arch.mamba_ssm_dtype or "bfloat16"
    if dtype not in DTYPE_BYTES:
        raise MemoryPlanError(f"mamba ssm dtype {dtype!r} is not one of {', '.join(sorted(DTYPE_BYTES))}")
    return dtype


def gdn_state_shapes(
    arch: ModelArchitecture, tp: int, num_spec_tokens: int = 0
) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(conv, ssm) state shapes of one GDN layer on one rank (mamba_utils.gated_delta_net_state_shape)."""
    gdn = arch.gdn
    if gdn is None:
        raise MemoryPlanError(f"{arch.name} has no Gated DeltaNet layers")
    conv = (gdn.conv_dim // tp, gdn.conv_kernel - 1 + num_spec_tokens)
    ssm = (gdn.num_v_heads // tp, gdn.v_head_dim, gdn.k_head_dim)
    return conv, ssm


def gdn_state_bytes_per_layer(arch: ModelArchitecture, tp: int, ssm_dtype: str | None = None) -> int:
    """Recurrent state of one sequence in one GDN layer on one GPU (the unpadded mamba page)."""
    conv, ssm = gdn_state_shapes(arch, tp)
    # The convolution state follows the model dtype; only the SSM state has its own dtype flag.
    return conv[0] * conv[1] * ACTIVATION_BYTES + ssm[0] * ssm[1] * ssm[2] * DTYPE_BYTES[ssm_dtype_for(arch, ssm_dtype)]


def gdn_state_bytes_per_seq(arch: ModelArchitecture, tp: int, ssm_dtype: str | None = None) -> int:
    """Recurrent state of one sequence across all GDN layers on one GPU, before page padding."""
    if arch.gdn is None:
        return 0
    return gdn_state_bytes_per_layer(arch, tp, ssm_dtype) * arch.gdn_layers


@dataclass(frozen=True)
class KvLayout:
    """How vLLM lays the KV cache out on one GPU for one model, TP and dtype choice."""

    tp: int
    kv_cache_dtype: KvCacheDtype
    ssm_dtype: str | None
    mamba_cache_mode: MambaCacheMode
    block_size: int
    attention_bytes_per_token_per_layer: int
    attention_bytes_per_token: int
    mamba_page_bytes: int
    page_bytes: int
    group_size: int
    attention_groups: int
    mamba_groups: int
    padding_layers: int
    num_layers: int

    @property
    def hybrid(self) -> bool:
        return self.mamba_groups > 0

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id takes: one page in each of the `group_size` shared tensors."""
        return self.page_bytes * self.group_size

    @property
    def mamba_padding_pct(self) -> float:
        """How much the mamba page is padded to match the attention page, in percent."""
        if not self.mamba_page_bytes:
            return 0.0
        return 100.0 * (self.page_bytes - self.mamba_page_bytes) / self.mamba_page_bytes

    @property
    def state_blocks_per_seq(self) -> int:
        """Blocks a running sequence holds for recurrent state (all mamba groups together)."""
        return self.mamba_groups * _MAMBA_BLOCKS_PER_SEQ[self.mamba_cache_mode]

    @property
    def state_bytes_per_seq(self) -> int:
        """Recurrent state bytes per running sequence as allocated (padded pages, `align` checkpoints)."""
        return self.state_blocks_per_seq * self.bytes_per_block

    def num_blocks(self, kv_cache_bytes: int) -> int:
        return max(0, kv_cache_bytes // self.bytes_per_block)

    def tokens_with(self, num_blocks: int, num_seqs: int) -> int:
        """Attention tokens the pool holds while `num_seqs` sequences keep their recurrent state."""
        if self.mamba_cache_mode == "all" and self.hybrid:
            # Every block of tokens also checkpoints the state in every mamba group.
            return num_blocks // (self.attention_groups + self.mamba_groups) * self.block_size
        free = num_blocks - num_seqs * self.state_blocks_per_seq
        return max(0, free // self.attention_groups * self.block_size)

    def max_request_tokens(self, num_blocks: int) -> int:
        """The longest single request the pool can hold (vLLM refuses a max-model-len above it)."""
        return self.tokens_with(num_blocks, 1)

    def bytes_for_request(self, tokens: int) -> int:
        """KV bytes one request of `tokens` tokens needs, state included, in whole blocks."""
        attention_blocks = ceil(tokens / self.block_size)
        if self.mamba_cache_mode == "all" and self.hybrid:
            return attention_blocks * (self.attention_groups + self.mamba_groups) * self.bytes_per_block
        return (attention_blocks * self.attention_groups + self.state_blocks_per_seq) * self.bytes_per_block

    def max_state_seqs(self, num_blocks: int) -> int:
        """vLLM's hard ceiling on max_num_seqs for hybrids: one state block per sequence (#38270)."""
        return num_blocks if self.hybrid else 0


def _groups(attention_layers: int, gdn_layers: int) -> tuple[int, int, int]:
    """(group_size, attention groups, mamba groups) as vLLM's uniform-page grouping picks them."""
    if not gdn_layers:
        return attention_layers, 1, 0
    if not attention_layers:
        return gdn_layers, 0, 1
    low, high = min(attention_layers, gdn_layers), max(attention_layers, gdn_layers)
    size = high if high < 1.5 * low else low
    return size, ceil(attention_layers / size), ceil(gdn_layers / size)


def kv_layout(
    arch: ModelArchitecture,
    tp: int,
    kv_cache_dtype: KvCacheDtype = "auto",
    ssm_dtype: str | None = None,
    mamba_cache_mode: MambaCacheMode = "align",
) -> KvLayout:
    """The KV cache layout vLLM builds for this model on one GPU."""
    arch.check_tp(tp, limit=max(tp, 8))
    if mamba_cache_mode not in MAMBA_CACHE_MODES:
        raise MemoryPlanError(f"mamba_cache_mode {mamba_cache_mode!r} is not one of {', '.join(MAMBA_CACHE_MODES)}")
    per_layer = attention_bytes_per_token_per_layer(arch, tp, kv_cache_dtype)
    group_size, attention_groups, mamba_groups = _groups(arch.attention_layers, arch.gdn_layers)
    block = MLA_BLOCK_TOKENS if arch.uses_mla else ATTENTION_BLOCK_TOKENS
    mamba_page = 0
    dtype_name = None
    if arch.is_hybrid:
        dtype_name = ssm_dtype_for(arch, ssm_dtype)
        mamba_page = gdn_state_bytes_per_layer(arch, tp, dtype_name)
        if per_layer * block < mamba_page:
            block = HYBRID_BLOCK_ALIGN * ceil(mamba_page / (HYBRID_BLOCK_ALIGN * per_layer))
    padding = (attention_groups + mamba_groups) * group_size - arch.num_layers
    return KvLayout(
        tp=tp,
        kv_cache_dtype=kv_cache_dtype,
        ssm_dtype=dtype_name,
        mamba_cache_mode=mamba_cache_mode if arch.is_hybrid else "none",
        block_size=block,
        attention_bytes_per_token_per_layer=per_layer,
        attention_bytes_per_token=per_layer * arch.attention_layers,
        mamba_page_bytes=mamba_page,
        page_bytes=per_layer * block,
        group_size=group_size,
        attention_groups=attention_groups,
        mamba_groups=mamba_groups,
        padding_layers=padding,
        num_layers=arch.num_layers,
    )
