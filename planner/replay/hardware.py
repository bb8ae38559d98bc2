"""Step-time and KV-capacity model of one destination (a vLLM replica).

One engine step processes `prefill_tokens` new prompt tokens (chunked prefill) and one token for
each of `decode_seqs` running sequences. Its duration is modelled as

    step = overhead + max(weight_read, compute_per_token * (prefill_tokens + decode_seqs))
           + attention_per_pair * prefill_attention_pairs + kv_read_per_token * decode_kv_tokens

- `weight_read`: every step streams all weights once from HBM; small decode batches are bound by it.
- `compute_per_token`: dense GEMM time per token once the step is compute bound (large prefill
  chunks); it overlaps with the weight stream, hence the `max`.
- `attention_per_pair`: prefill attention FLOPs grow with (query token x context token) pairs.
- `kv_read_per_token`: decode attention streams the KV of every running sequence.

The constants are calibrated approximations, not measurements of ours. For the default profile
(Llama-3.3-70B FP8 weights, TP=2 on 2 x H100 SXM 80 GB) they come from:

- Llama-3.3-70B config: 80 layers, hidden 8192, 64 query heads, 8 KV heads, head dim 128,
  ~70.6 B parameters -> 2 x 70.6 GFLOP of GEMM per token, 4 x 64 x 128 x 80 = 2.6 MFLOP of
  attention per (query, key) pair, KV 2 x 8 x 128 x 80 x 2 B = 320 KiB per token in bf16,
  160 KiB per GPU at TP=2 (`reference/vllm_memory.md` §5).
- H100 SXM datasheet: 3.35 TB/s HBM3, 989 TFLOPS dense bf16, 1,979 TFLOPS dense FP8.
- NVIDIA NIM benchmark for Llama-3.3-70b-instruct on 2 x H100 80G, fp8, TP2, 5,000 input /
  500 output tokens (docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance, NIM 1.8.0):
  concurrency 1 -> TTFT 406.77 ms, ITL 18.58 ms; concurrency 25 -> ITL 38.75 ms.
  * ITL 18.58 ms at batch 1 with ~5.3k context: overhead 4.0 ms + weight stream 14.3 ms
    (33.9 GiB per GPU at ~2.55 TB/s, 76 % of peak) + 5.3k x 64 ns of KV read.
  * TTFT 406.77 ms for 5,000 tokens: 4.0 ms + 5,000 x 73 us (GEMMs at ~49 % of FP8 peak over two
    GPUs) + 12.5 M pairs x 2.6 ns (attention at ~50 % of bf16 peak).
  * With these constants a decode-only step of 25 sequences at ~5.3k context costs ~27 ms; the
    NIM figure of 38.75 ms at concurrency 25 also includes prefill chunks interleaved with the
    decodes, which the replay models explicitly.

KV capacity follows vLLM's budget (`reference/vllm_memory.md` §1): per GPU,
`total * gpu_memory_utilization - weights - activation/graph/runtime overheads`, divided by the
per-GPU bytes of one token of KV. The default (bf16 KV, vLLM's `--kv-cache-dtype auto`) is
~232k tokens per destination; with `--kv-cache-dtype fp8` it doubles (`PROFILES`).

Host-memory KV tier (vLLM's native offloading, `--kv-offloading-size`): `host_kv_capacity_tokens`
more tokens of prefix cache in pinned CPU memory (0: none, vLLM's default). A hit there is
copied back at `kv_bytes_per_token_per_gpu / host_link_bytes_per_s` seconds per token: every GPU
of the replica copies its own share of each token over its own link, in parallel. For H100 SXM
(HGX boards) the link is PCIe Gen5 x16, 64 GB/s per direction, and the two GPUs of a TP=2 pair
hang off one PCIe switch whose x16 uplink to the CPU they share: `H100_HOST_LINK_BYTES_PER_S`
= 25 GB/s per GPU (half of the ~50 GB/s a pinned x16 copy reaches). At 160 KiB per token per GPU
(bf16 KV) that is 6.6 us per token, 3.3 us in fp8, against ~75 us to recompute one.

The copy is charged to the engine step that admits the request, in full: nothing else runs
meanwhile. vLLM issues the copies asynchronously on their own CUDA stream, meant to overlap
with compute, but H100 traces of its CPU offloading connector show decode steps slowing down by
more than the copy while host-to-device DMA runs; charging the whole copy is the conservative
end of that range.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GIB = 1024**3

# H100 SXM 80GB as torch reports it (85,031,714,816 bytes).
H100_80GB_GIB = 79.19
# vLLM's default --gpu-memory-utilization on current main (`reference/vllm_memory.md` §3).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
# Llama-3.3-70B FP8 checkpoint: ~67.7 GiB of weights (FP8 linear layers, bf16 embeddings and
# lm_head), split over TP=2.
LLAMA33_70B_FP8_WEIGHTS_GIB = 67.7
# Per GPU, outside the KV pool: profiled activation peak at max-num-batched-tokens 8192 (~1.5 GiB),
# CUDA-graph pool (~0.5 GiB), NCCL/cuBLAS workspaces and the CUDA context (~1.5 GiB).
LLAMA33_70B_TP2_RUNTIME_OVERHEAD_GIB = 3.5
# KV bytes per token per GPU at TP=2: 2 (K, V) x 8 KV heads / 2 ranks x 128 dims x 80 layers.
LLAMA33_70B_TP2_KV_BYTES_BF16 = 2 * 4 * 128 * 80 * 2
LLAMA33_70B_TP2_KV_BYTES_FP8 = 2 * 4 * 128 * 80 * 1
# Host-to-device bandwidth of one H100 SXM GPU for KV copies (module docstring).
H100_HOST_LINK_BYTES_PER_S = 25e9


def kv_capacity_tokens(
    *,
    gpu_memory_gib: float,
    tensor_parallel: int,
    weights_gib: float,
    runtime_overhead_gib_per_gpu: float,
    kv_bytes_per_token_per_gpu: int,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
) -> int:
    """Tokens of KV one destination holds, vLLM-style (every rank holds the same token count)."""
    per_gpu = (
        gpu_memory_gib * gpu_memory_utilization
        - weights_gib / tensor_parallel
        - runtime_overhead_gib_per_gpu
    )
    if per_gpu <= 0:
        raise ValueError(f"no memory left for KV cache ({per_gpu:.2f} GiB per GPU)")
    return int(per_gpu * GIB // kv_bytes_per_token_per_gpu)


@dataclass(frozen=True)
class EngineProfile:
    """Timing and memory constants of one destination; see the module docstring."""

    name: str
    step_overhead_s: float
    weight_read_s: float
    compute_s_per_token: float
    attention_s_per_pair: float
    kv_read_s_per_token: float
    kv_capacity_tokens: int
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    description: str = ""
    # The host-memory tier (0 tokens: none) and what a copy back from it costs.
    host_kv_capacity_tokens: int = 0
    kv_bytes_per_token_per_gpu: int = 0
    host_link_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("step_overhead_s", "weight_read_s", "compute_s_per_token",
                     "attention_s_per_pair", "kv_read_s_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"profile {self.name}: {name} must not be negative")
        if self.kv_capacity_tokens <= 0:
            raise ValueError(f"profile {self.name}: kv_capacity_tokens must be positive")
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError(f"profile {self.name}: batch limits must be positive")
        if self.host_kv_capacity_tokens < 0 or self.kv_bytes_per_token_per_gpu < 0 or self.host_link_bytes_per_s < 0:
            raise ValueError(f"profile {self.name}: host tier figures must not be negative")
        if self.host_kv_capacity_tokens and not (self.kv_bytes_per_token_per_gpu and self.host_link_bytes_per_s):
            raise ValueError(
                f"profile {self.name}: a host KV tier needs the KV bytes per token and the host link bandwidth"
            )

    @property
    def host_copy_s_per_token(self) -> float:
        """Seconds to copy one token of KV back from host memory (0 without a host tier)."""
        if not self.host_kv_capacity_tokens:
            return 0.0
        return self.kv_bytes_per_token_per_gpu / self.host_link_bytes_per_s

    def prefill_time(self, tokens: int, context: int = 0) -> float:
        """Seconds of compute to prefill `tokens` new tokens after `context` cached ones."""
        return self.compute_s_per_token * tokens + self.attention_s_per_pair * tokens * (
            context + 0.5 * tokens
        )

    def with_kv_capacity(self, tokens: int) -> EngineProfile:
        return replace(self, kv_capacity_tokens=tokens)

    def with_host_tier(self, tokens: int) -> EngineProfile:
        """This profile with `tokens` of host-memory KV (0: none)."""
        return replace(self, host_kv_capacity_tokens=tokens)



H100_LLAMA33_70B_FP8_TP2 = EngineProfile(
    name="h100-llama3.3-70b-fp8-tp2",
    kv_read_s_per_token=LLAMA33_70B_TP2_KV_BYTES_BF16 / 2.55e12,
    kv_capacity_tokens=kv_capacity_tokens(
        gpu_memory_gib=H100_80GB_GIB,
        tensor_parallel=2,
        weights_gib=LLAMA33_70B_FP8_WEIGHTS_GIB,
        runtime_overhead_gib_per_gpu=LLAMA33_70B_TP2_RUNTIME_OVERHEAD_GIB,
        kv_bytes_per_token_per_gpu=LLAMA33_70B_TP2_KV_BYTES_BF16,
    ),
    description="Llama-3.3-70B FP8 weights, bf16 KV (vLLM default), TP=2 on 2 x H100 SXM 80GB",
    kv_bytes_per_token_per_gpu=LLAMA33_70B_TP2_KV_BYTES_BF16,
    host_link_bytes_per_s=H100_HOST_LINK_BYTES_PER_S,
    step_overhead_s=0.0040,
    weight_read_s=0.0143,
    compute_s_per_token=73e-6,
    attention_s_per_pair=2.6e-9,
)

H100_LLAMA33_70B_FP8_TP2_FP8KV = EngineProfile(
    name="h100-llama3.3-70b-fp8-tp2-fp8kv",
    kv_read_s_per_token=LLAMA33_70B_TP2_KV_BYTES_FP8 / 2.55e12,
    kv_capacity_tokens=kv_capacity_tokens(
        gpu_memory_gib=H100_80GB_GIB,
        tensor_parallel=2,
        weights_gib=LLAMA33_70B_FP8_WEIGHTS_GIB,
        runtime_overhead_gib_per_gpu=LLAMA33_70B_TP2_RUNTIME_OVERHEAD_GIB,
        kv_bytes_per_token_per_gpu=LLAMA33_70B_TP2_KV_BYTES_FP8,
    ),
    description="as h100-llama3.3-70b-fp8-tp2 with --kv-cache-dtype fp8 (half the KV bytes)",
    kv_bytes_per_token_per_gpu=LLAMA33_70B_TP2_KV_BYTES_FP8,
    host_link_bytes_per_s=H100_HOST_LINK_BYTES_PER_S,
    step_overhead_s=H100_LLAMA33_70B_FP8_TP2.step_overhead_s,
    weight_read_s=H100_LLAMA33_70B_FP8_TP2.weight_read_s,
    compute_s_per_token=H100_LLAMA33_70B_FP8_TP2.compute_s_per_token,
    attention_s_per_pair=H100_LLAMA33_70B_FP8_TP2.attention_s_per_pair,
)

PROFILES: dict[str, EngineProfile] = {
    p.name: p for p in (H100_LLAMA33_70B_FP8_TP2, H100_LLAMA33_70B_FP8_TP2_FP8KV)
}
DEFAULT_PROFILE = H100_LLAMA33_70B_FP8_TP2


def get_profile(name: str) -> EngineProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown engine profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None
