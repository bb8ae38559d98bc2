"""GPUs the planner knows, by the memory CUDA reports for them (not the marketing size)."""

from __future__ import annotations

from dataclasses import dataclass

from cacheroute.planner.memory.errors import MemoryPlanError

GIB = 1 << 30


@dataclass(frozen=True)
class GpuModel:
    """One GPU product: its node label, the memory CUDA reports, and how many sit on a node."""

    name: str
    product_label: str
    total_bytes: int
    count_per_node: int = 8
    # vLLM's batch defaults depend on the GPU (EngineArgs.get_batch_defaults): >= 70 GiB and not an
    # A100 gets mnbt 8192 / max_num_seqs 1024 for `vllm serve`, anything else 2048 / 256.
    large: bool = True

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    @property
    def default_max_num_seqs(self) -> int:
        return 1024 if self.large else 256

    @property
    def default_max_num_batched_tokens(self) -> int:
        return 8192 if self.large else 2048


# Totals are what torch.cuda.mem_get_info reports, which is what vLLM budgets against. Public vLLM
# startup logs on H100 80GB HBM3 show "total_gpu_memory (79.11GiB)" to "(79.33GiB)" depending on the
# driver; we take the lowest so that a plan never assumes memory a node may not have.
H100_80GB = GpuModel("h100-80gb", "NVIDIA-H100-80GB-HBM3", int(79.11 * GIB))
# H200: the device notes of this project's H200 machines say "about 139 GiB"; lowest assumed.
H200_141GB = GpuModel("h200-141gb", "NVIDIA-H200", int(139.0 * GIB))

GPUS: dict[str, GpuModel] = {g.name: g for g in (H100_80GB, H200_141GB)}


def gpu_by_name(name: str) -> GpuModel:
    """A known GPU by short name (`h100-80gb`) or by its node product label."""
    key = name.strip().lower()
    for gpu in GPUS.values():
        if key in (gpu.name, gpu.product_label.lower()):
            return gpu
    raise MemoryPlanError(f"gpu {name!r} is not known; use one of {', '.join(GPUS)} or give its memory in GiB")


# Matches the InferencePool's gpu.memoryGib bound; a GPU with more memory does not exist yet.
MAX_GPU_MEMORY_GIB = 1024.0


def custom_gpu(memory_gib: float, product_label: str = "custom", count_per_node: int = 8) -> GpuModel:
    """A GPU given only by the memory CUDA reports for it."""
    if not 0 < memory_gib <= MAX_GPU_MEMORY_GIB:
        raise MemoryPlanError(f"gpu memory must be in (0, {MAX_GPU_MEMORY_GIB}] GiB, got {memory_gib} GiB")
    return GpuModel(product_label.lower(), product_label, int(memory_gib * GIB), count_per_node, memory_gib >= 70)
