"""What one GPU holds besides the KV cache, for a candidate (mnbt, max_num_seqs): the analytic
model of the architecture (`analytic_overheads`), or what a profiling boot measured
(`measured_overheads`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cacheroute.planner.memory.architecture import weights_bytes_per_gpu
from cacheroute.planner.memory.gpus import GIB
from cacheroute.planner.memory.peak import CUDA_CONTEXT_BYTES, NCCL_BYTES, PeakBreakdown, estimate_peak
from cacheroute.planner.memory.request import PlanRequest
from cacheroute.planner.memory.vllm_log import MemoryProfile


@dataclass(frozen=True)
class Overheads:
    """Everything on one GPU except the KV cache, by the breakdown's categories."""

    weights: int
    activation_profiled: int
    unprofiled_transient: int
    graph_pool: int
    non_torch: int
    # In use before vLLM's startup snapshot (CUDA context, NCCL): outside the utilisation budget.
    pre_snapshot: int
    peak: PeakBreakdown | None = None

    @property
    def total(self) -> int:
        return self.weights + self.activation_profiled + self.unprofiled_transient + self.graph_pool + self.non_torch


# (max_num_batched_tokens, max_num_seqs) -> what the GPU holds besides the KV cache.
OverheadModel = Callable[[int, int], Overheads]


def analytic_overheads(request: PlanRequest) -> OverheadModel:
    """Weights (given or from the parameter count) and the analytic worst-case peak."""
    weights = request.weights_bytes or weights_bytes_per_gpu(
        request.model, request.quantization, request.tp, request.param_count
    )

    def overheads(mnbt: int, seqs: int) -> Overheads:
        peak = estimate_peak(
            request.model, request.tp, mnbt, seqs, request.target_model_len, options=request.peak_options
        )
        return Overheads(
            weights=weights,
            activation_profiled=peak.activation_profiled,
            unprofiled_transient=peak.unprofiled_transient,
            graph_pool=peak.graph_pool,
            non_torch=peak.non_torch,
            pre_snapshot=peak.cuda_context + peak.nccl,
            peak=peak,
        )

    return overheads


def _bytes(gib: float) -> int:
    return round(gib * GIB)


def measured_overheads(request: PlanRequest, profile: MemoryProfile, total: int) -> OverheadModel:
    """Overheads as a profiling boot measured them; only what its profiler cannot see is analytic."""
    assert profile.weights_gib is not None and profile.consumed_gib is not None and profile.activation_gib is not None
    weights = _bytes(profile.weights_gib)
    if profile.startup_free_gib is not None:
        context = total - _bytes(profile.startup_free_gib)
    else:
        # V0 logs do not print the startup snapshot; use the analytic context and NCCL figures.
        context = CUDA_CONTEXT_BYTES + (NCCL_BYTES if request.tp > 1 else 0)
    non_torch = context + max(0, _bytes(profile.consumed_gib) - weights)
    graph = _bytes(profile.graph_gib or 0.0) if request.peak_options.cudagraphs else 0
    activation = _bytes(profile.activation_gib)

    def overheads(mnbt: int, seqs: int) -> Overheads:
        # Measured at the profiled concurrency; a lower max_num_seqs only shrinks the measured parts,
        # so they are kept as measured (the safe side) and only the unprofiled part is recomputed.
        peak = estimate_peak(
            request.model, request.tp, mnbt, seqs, request.target_model_len, options=request.peak_options
        )
        return Overheads(
            weights=weights,
            activation_profiled=activation,
            unprofiled_transient=peak.unprofiled_transient,
            graph_pool=graph,
            non_torch=non_torch,
            pre_snapshot=context,
            peak=peak,
        )

    return overheads
