"""The host-memory KV tier of one replica: vLLM's native KV offloading (`--kv-offloading-backend
native --kv-offloading-size <GiB>`), sized from what the node can spare.

vLLM keeps prefix blocks evicted from the GPU in pinned CPU memory and copies them back on a hit
instead of recomputing them (`reference/operator_anchors.md`). `--kv-offloading-size` is the total
over the replica's TP ranks; every rank keeps its own share of each token, so the tier holds
`size / (tp x bytes per token per GPU)` tokens.

Size: a number of GiB, or `auto`: the replica's share of one node's allocatable memory
(`tp / GPUs per node`) minus a reserve per GPU for everything else the pod's processes hold in
host memory (`DEFAULT_HOST_RESERVE_BYTES_PER_GPU`), rounded down to whole GiB. On an HGX H100
node (2 TiB, 8 GPUs) that is 224 GiB per GPU, 448 GiB for a TP=2 replica.

vLLM's offloading does not support MLA caches, and hybrid (GDN/Mamba) models need its hybrid KV
cache manager turned off, which changes their memory layout: the tier is refused for both when a
size is given, and `auto` leaves it off for them with a note.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cacheroute.planner.memory.architecture import ModelArchitecture
from cacheroute.planner.memory.errors import MemoryPlanError
from cacheroute.planner.memory.gpus import GIB
from cacheroute.planner.memory.kvsize import KvLayout

# Host memory one GPU's share of the pod keeps outside the KV tier: the worker process (CUDA
# context and driver state, NCCL and pinned staging buffers, the torch runtime: ~8-12 GiB on a
# 70B TP=2 worker), the API server and tokenizer processes, and page cache for streaming the
# weights in at startup (the FP8 70B checkpoint is ~34 GiB per GPU at TP=2).
DEFAULT_HOST_RESERVE_BYTES_PER_GPU = 32 * GIB

HostKvSize = int | Literal["auto"] | None


@dataclass(frozen=True)
class HostTier:
    """The tier one replica gets (0 bytes: none) and what its pod must be able to hold."""

    bytes: int  # total over the TP ranks: `--kv-offloading-size` in bytes
    capacity_tokens: int
    # Host memory the pod needs: the tier plus the reserve of its GPUs (its memory request); 0
    # without a tier, when the pod requests the operator's configured memory instead.
    pod_memory_bytes: int
    source: Literal["off", "given", "auto"]
    note: str = ""

    @property
    def gib(self) -> float:
        return self.bytes / GIB

    def vllm_args(self) -> list[str]:
        if not self.bytes:
            return []
        gib = self.bytes / GIB
        size = str(int(gib)) if gib == int(gib) else f"{gib:.2f}"
        return ["--kv-offloading-backend", "native", "--kv-offloading-size", size]


def _unsupported(arch: ModelArchitecture) -> str:
    if arch.uses_mla:
        return f"{arch.name} uses MLA, which vLLM's native KV offloading does not support"
    if arch.is_hybrid:
        return (
            f"{arch.name} is a hybrid (GDN/Mamba) model: vLLM's KV offloading needs its hybrid KV cache manager "
            "off, which the memory model does not cover"
        )
    return ""


def host_tier(
    arch: ModelArchitecture,
    layout: KvLayout,
    *,
    size: HostKvSize,
    gpus_per_node: int,
    node_memory_bytes: int | None,
    reserve_bytes_per_gpu: int = DEFAULT_HOST_RESERVE_BYTES_PER_GPU,
) -> HostTier:
    """The host tier of one replica of `layout.tp` GPUs (module docstring)."""
    tp = layout.tp
    reserve = reserve_bytes_per_gpu * tp
    if size is None or size == 0:
        return HostTier(0, 0, 0, "off")
    why_not = _unsupported(arch)
    if size == "auto":
        if why_not:
            return HostTier(0, 0, 0, "off", f"host KV tier off: {why_not}")
        if node_memory_bytes is None:
            return HostTier(0, 0, 0, "off", "host KV tier off: the node's allocatable memory is not known")
        share = node_memory_bytes * tp // gpus_per_node - reserve
        tier = max(0, share // GIB * GIB)
        if not tier:
            return HostTier(
                0, 0, 0, "off",
                f"host KV tier off: a {tp}-GPU share of {node_memory_bytes / GIB:,.0f} GiB is not above the reserve "
                f"of {reserve / GIB:,.0f} GiB",
            )
        source: Literal["given", "auto"] = "auto"
    else:
        if size < 0:
            raise MemoryPlanError(f"host KV cache size must not be negative, got {size} bytes")
        if why_not:
            raise MemoryPlanError(f"a host KV tier is not possible: {why_not}")
        tier = size
        source = "given"
        if node_memory_bytes is not None and tier + reserve > node_memory_bytes * tp // gpus_per_node:
            raise MemoryPlanError(
                f"a host KV tier of {tier / GIB:,.1f} GiB plus the reserve of {reserve / GIB:,.0f} GiB exceeds the "
                f"replica's share of the node's memory ({node_memory_bytes * tp // gpus_per_node / GIB:,.0f} GiB)"
            )
    tokens = tier // (layout.attention_bytes_per_token * tp)
    return HostTier(tier, tokens, tier + reserve, source)
