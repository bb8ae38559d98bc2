"""The worst-case memory peak of one vLLM GPU, apart from weights and KV cache, per mnbt.

Four parts, each a function of `max-num-batched-tokens` (mnbt) and `max-num-seqs`:

1. **Profiled activation**: what vLLM's `profile_run` sees when it pushes mnbt dummy tokens through
   the model with attention and GDN kernels skipped, plus the dummy sampler run. Linear in mnbt.
2. **Unprofiled transient**: what a real prefill of mnbt tokens adds and the profile never runs
   (issue #52872): the GDN chunked delta-rule intermediates, attention/MLA workspaces, and the
   sampler's top-k/top-p sort.
3. **CUDA-graph pool**: a cost per captured graph, the largest capture's activations, and, on GDN
   hybrids, the FULL-graph profiling transient that grows linearly with mnbt (#50780, #52872).
4. **Non-torch**: CUDA context, cuBLAS/compiler workspaces, NCCL and custom all-reduce buffers.

Every constant below names its source; those marked *estimate* are our own sizing of a mechanism the
source describes, not a measured vLLM figure. `#NNNNN` are vLLM's GitHub issues and pull requests
(summarised in reference/vllm_memory.md). Sizes are bytes on one GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from cacheroute.planner.memory.architecture import ACTIVATION_BYTES, ModelArchitecture
from cacheroute.planner.memory.gpus import GIB
from cacheroute.planner.memory.kvsize import MLA_BLOCK_TOKENS

MIB = 1 << 20

# ----------------------------------------------------------------------------- profiled activation
# Per token, the residual stream, the layer input and the normalised copy live across a layer:
# 3 x hidden x 2 B. Estimate. That mnbt costs KV through this term is shown by PR #48322 (KV cache
# 40,464 -> 36,720 tokens for mnbt 2048 -> 8192). With the largest sublayer working set below it
# gives 1.09 GiB for Llama-3-8B at mnbt 8192 / 256 sequences, against 1.19-1.24 GiB "PyTorch
# activation peak memory" in public vLLM startup logs on H100, and 132 KiB per token for a 64-layer
# GDN hybrid against the 107.5 KiB/token slope #52872 measured (2.21 -> 2.84 GiB, mnbt 2048 -> 8192).
STREAM_COPIES = 3
# The dummy sampler run computes logits for min(mnbt, max_num_seqs) rows: fp32 logits and fp32
# probabilities, 8 B per vocabulary entry per row. Estimate.
SAMPLER_PROFILED_BYTES = 8

# ---------------------------------------------------------------------------- unprofiled transient
# Gated delta rule (FLA chunked kernels), per token and value head, K/V the head dims: the chunk
# states h (K x V bf16 per 64-token chunk), v_new, w, u (bf16), the fp32 chunk matrix A (64 x 4 B)
# and the output o. #54775 measured the h + v_new + w + u + A live set at 72 KiB/token for 48 heads
# of 128 x 128 (1.5 KiB per token-head); adding o gives 1.75 KiB, inside the reference's "~2 KB per
# token-head" (reference/vllm_memory.md, operator implication 1).
GDN_CHUNK_TOKENS = 64
GDN_FP32_BYTES = 4
# h is allocated per chunk of every sequence, so each prefilling sequence can add one partly filled
# chunk (#54775: "h scales with sum(ceil(seq_i / 64))", worst case many short sequences).
# Attention prefill kernels keep fp32 softmax statistics and split partial sums per token and query
# head. Estimate: 8 B per token-head.
ATTENTION_KERNEL_BYTES_PER_TOKEN_HEAD = 8
# MLA prefill decompresses the cached latents of earlier chunks into a workspace of
# min(max(8 x max_model_len, 4 x max_num_seqs x block), 64K) tokens (vLLM's MLA metadata builder),
# and up-projects them to K and V of qk_head_dim per head; #57449 reports this workspace OOMing at
# runtime. New tokens are up-projected the same way.
MLA_WORKSPACE_CAP_TOKENS = 64 * 1024
# The sampler's top-k / top-p path sorts every row: fp32 values and int64 indices, 12 B per entry.
# Builds whose profile skips it (the MRV2 runner's own comment, reference §1) never charge it.
SAMPLER_SORT_BYTES = 12

# ---------------------------------------------------------------------------------- CUDA graphs
# Cost of one captured graph beyond the shared activations of the largest capture. Fitted to
# #52872's 0.52 GiB pool at mnbt <= 4096 (51 PIECEWISE + 35 FULL graphs, capture sizes up to 512)
# after its mnbt-linear part below; vLLM's own estimator charges at least 1 MiB per graph. Estimate.
GRAPH_BYTES_PER_CAPTURE = 4 * MIB
# vLLM's capture-size ladder (reference §3): [1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16).
CAPTURE_LADDER_STEP_SMALL = 8
CAPTURE_LADDER_STEP_LARGE = 16
CAPTURE_LADDER_KNEE = 256
MAX_CAPTURE_SIZE = 512
# The first FULL capture during graph profiling runs seq_lens = mnbt // num_tokens, so on GDN hybrids
# the charged "graph memory" grows linearly with mnbt (#50780). #52872: the pool went 0.52 -> 0.89 GiB
# for mnbt 3072 -> 8192 on a model with 48 GDN value heads per rank, i.e. 0.37 GiB over 6144 tokens
# x 48 heads = 1,347 B per token and value head. We charge it linearly from 0, which over-counts
# #52872's flat 2048-4096 range by at most 0.12 GiB (the safe side).
GRAPH_TRANSIENT_BYTES_PER_TOKEN_VHEAD = 1347

# --------------------------------------------------------------------------------------- non-torch
# CUDA context and kernel images before vLLM's first snapshot: public vLLM "Free memory on device
# (F/T GiB) on startup" lines on single GPUs show 0.50-0.63 GiB already in use. Estimate: 0.6 GiB.
CUDA_CONTEXT_BYTES = int(0.6 * GIB)
# cuBLAS/cuBLASLt workspaces, Triton and torch.compile kernels after the snapshot: public startup
# logs report "non_torch_memory takes 0.04-0.65GiB" at TP=1. Estimate: 0.5 GiB.
RUNTIME_WORKSPACE_BYTES = int(0.5 * GIB)
# NCCL communicator buffers and vLLM's custom all-reduce IPC buffers when TP > 1. Estimate: 1 GiB.
NCCL_BYTES = 1 * GIB


@dataclass(frozen=True)
class PeakOptions:
    """How the engine runs: CUDA graphs on or off, and whether to charge the graph-profiling transient."""

    cudagraphs: bool = True
    # With --kv-cache-memory-bytes vLLM does not charge the transient to the KV budget and it is
    # released after profiling; charging it anyway costs at most its size in KV and keeps the plan
    # right on builds and modes whose FULL graphs do retain it.
    charge_graph_profiling_transient: bool = True
    # The sampler sort is charged unless the build is known to profile it.
    charge_sampler_sort: bool = True


@dataclass(frozen=True)
class PeakBreakdown:
    """Bytes on one GPU outside weights and KV cache, by cause."""

    mnbt: int
    max_num_seqs: int
    activation_tokens: int
    sampler_profiled: int
    gdn_kernel: int
    attention_kernel: int
    mla_workspace: int
    sampler_sort: int
    graph_resident: int
    graph_profiling_transient: int
    piecewise_graphs: int
    full_graphs: int
    max_capture_size: int
    cuda_context: int
    runtime_workspaces: int
    nccl: int

    @property
    def activation_profiled(self) -> int:
        return self.activation_tokens + self.sampler_profiled

    @property
    def unprofiled_transient(self) -> int:
        return self.gdn_kernel + self.attention_kernel + self.mla_workspace + self.sampler_sort

    @property
    def graph_pool(self) -> int:
        return self.graph_resident + self.graph_profiling_transient

    @property
    def non_torch(self) -> int:
        return self.cuda_context + self.runtime_workspaces + self.nccl

    @property
    def total(self) -> int:
        return self.activation_profiled + self.unprofiled_transient + self.graph_pool + self.non_torch

    def details(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """The parts of each breakdown row, keyed by the row they belong to."""
        return {
            "activation (profiled)": (("tokens", self.activation_tokens), ("sampler", self.sampler_profiled)),
            "unprofiled transient": (
                ("gdn kernels", self.gdn_kernel),
                ("attention kernels", self.attention_kernel),
                ("mla workspace", self.mla_workspace),
                ("sampler top-k/top-p sort", self.sampler_sort),
            ),
            "cuda-graph pool": (
                (f"{self.piecewise_graphs} piecewise + {self.full_graphs} full graphs", self.graph_resident),
                ("graph-profiling transient", self.graph_profiling_transient),
            ),
            "non-torch": (
                ("cuda context", self.cuda_context),
                ("runtime workspaces", self.runtime_workspaces),
                ("nccl / all-reduce", self.nccl),
            ),
        }


_DEFAULT_OPTIONS = PeakOptions()


def capture_sizes(max_num_seqs: int, mnbt: int, num_spec_tokens: int = 0) -> tuple[int, ...]:
    """vLLM's default CUDA-graph capture sizes for these limits (sizes above mnbt dropped)."""
    largest = min(max_num_seqs * (1 + num_spec_tokens) * 2, MAX_CAPTURE_SIZE, mnbt)
    ladder = [1, 2, 4]
    ladder += range(CAPTURE_LADDER_STEP_SMALL, CAPTURE_LADDER_KNEE, CAPTURE_LADDER_STEP_SMALL)
    ladder += range(CAPTURE_LADDER_KNEE, largest + 1, CAPTURE_LADDER_STEP_LARGE)
    sizes = {s for s in ladder if s <= largest}
    if mnbt <= largest:
        sizes.add(mnbt)
    return tuple(sorted(sizes))


def activation_bytes_per_token(arch: ModelArchitecture, tp: int) -> int:
    """Profiled activation per batched token: the stream plus the largest sublayer working set."""
    h = arch.hidden_size
    sets = []
    if "attention" in arch.mixers:
        q_out = arch.num_attention_heads * arch.head_dim * (2 if arch.attention_output_gate else 1) // tp
        kv = 2 * arch.kv_heads_per_rank(tp) * arch.head_dim
        sets.append(q_out + kv + arch.num_attention_heads // tp * arch.head_dim)
    if arch.mla is not None:
        mla = arch.mla
        heads = arch.num_attention_heads // tp
        sets.append((mla.q_lora_rank or 0) + heads * mla.qk_head_dim + mla.latent_dim + heads * mla.v_head_dim)
    if arch.gdn is not None:
        gdn = arch.gdn
        # Projections run before the layer's early return; the core output buffer is preallocated.
        sets.append((2 * gdn.key_dim + 2 * gdn.value_dim + 2 * gdn.num_v_heads + gdn.value_dim) // tp)
    if "dense" in arch.mlps:
        sets.append(3 * arch.intermediate_size // tp)  # gate_up output and the activated half
    if arch.moe is not None and "moe" in arch.mlps:
        moe = arch.moe
        inter = moe.intermediate_size // tp
        # Fused-MoE caches per token: top_k x (2N gate_up + N activated + hidden routed output),
        # fp32 router logits, and the shared experts' gate_up + activated outputs.
        routed = moe.experts_per_token * (3 * inter + h)
        sets.append(routed + moe.num_experts * 2 + 3 * moe.shared_intermediate_size // tp)
    return (STREAM_COPIES * h + max(sets)) * ACTIVATION_BYTES


def _gdn_kernel_bytes(arch: ModelArchitecture, tp: int, mnbt: int, max_num_seqs: int) -> int:
    gdn = arch.gdn
    if gdn is None:
        return 0
    k, v = gdn.k_head_dim, gdn.v_head_dim
    h_chunk = k * v * ACTIVATION_BYTES
    per_token_head = (
        h_chunk // GDN_CHUNK_TOKENS  # h
        + 3 * v * ACTIVATION_BYTES  # v_new, u, o
        + k * ACTIVATION_BYTES  # w
        + GDN_CHUNK_TOKENS * GDN_FP32_BYTES  # A
    )
    prefilling_seqs = min(max_num_seqs, mnbt // 2)
    return (mnbt * per_token_head + prefilling_seqs * h_chunk) * (gdn.num_v_heads // tp)


def _mla_workspace_bytes(arch: ModelArchitecture, tp: int, mnbt: int, max_num_seqs: int, max_model_len: int) -> int:
    mla = arch.mla
    if mla is None:
        return 0
    heads = arch.num_attention_heads // tp
    workspace = min(max(8 * max_model_len, 4 * max_num_seqs * MLA_BLOCK_TOKENS), MLA_WORKSPACE_CAP_TOKENS)
    latent = workspace * mla.latent_dim * ACTIVATION_BYTES
    context_kv = workspace * heads * 2 * mla.qk_head_dim * ACTIVATION_BYTES
    new_kv = mnbt * heads * 2 * mla.qk_head_dim * ACTIVATION_BYTES
    return latent + context_kv + new_kv


def estimate_peak(
    arch: ModelArchitecture,
    tp: int,
    mnbt: int,
    max_num_seqs: int,
    max_model_len: int,
    *,
    options: PeakOptions = _DEFAULT_OPTIONS,
    max_full_batch: int | None = None,
) -> PeakBreakdown:
    """Everything but weights and KV on one GPU at this mnbt and concurrency, worst case."""
    rows = min(mnbt, max_num_seqs)
    sizes = capture_sizes(max_num_seqs, mnbt) if options.cudagraphs else ()
    full_limit = max_num_seqs if max_full_batch is None else min(max_num_seqs, max_full_batch)
    full = sum(1 for s in sizes if s <= full_limit)
    per_token = activation_bytes_per_token(arch, tp)
    largest = max(sizes, default=0)
    transient = 0
    if options.cudagraphs and arch.gdn is not None and options.charge_graph_profiling_transient:
        transient = mnbt * (arch.gdn.num_v_heads // tp) * GRAPH_TRANSIENT_BYTES_PER_TOKEN_VHEAD
    attention_heads = arch.num_attention_heads // tp if arch.attention_layers else 0
    return PeakBreakdown(
        mnbt=mnbt,
        max_num_seqs=max_num_seqs,
        activation_tokens=mnbt * per_token,
        sampler_profiled=rows * arch.vocab_size * SAMPLER_PROFILED_BYTES,
        gdn_kernel=_gdn_kernel_bytes(arch, tp, mnbt, max_num_seqs),
        attention_kernel=mnbt * attention_heads * ATTENTION_KERNEL_BYTES_PER_TOKEN_HEAD,
        mla_workspace=_mla_workspace_bytes(arch, tp, mnbt, max_num_seqs, max_model_len),
        sampler_sort=rows * arch.vocab_size * SAMPLER_SORT_BYTES if options.charge_sampler_sort else 0,
        graph_resident=(len(sizes) + full) * GRAPH_BYTES_PER_CAPTURE + largest * per_token,
        graph_profiling_transient=transient,
        piecewise_graphs=len(sizes),
        full_graphs=full,
        max_capture_size=largest,
        cuda_context=CUDA_CONTEXT_BYTES,
        runtime_workspaces=RUNTIME_WORKSPACE_BYTES,
        nccl=NCCL_BYTES if tp > 1 else 0,
    )
