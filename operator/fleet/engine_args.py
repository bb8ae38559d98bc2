"""vLLM's command line for a pool's engine container (the image's entry point is `vllm serve`)."""

from __future__ import annotations

from cacheroute.operator.api.pool import InferencePoolSpec
from cacheroute.planner.memory import MemoryPlan

# Expanded by the kubelet from the container's env (downward API): every process binds the pod IP.
POD_IP = "$(POD_IP)"


def prefix_caching_flag(enabled: bool) -> str:
    return "--enable-prefix-caching" if enabled else "--no-enable-prefix-caching"


def engine_args(spec: InferencePoolSpec, plan: MemoryPlan) -> list[str]:
    """Model, served name, address, TP, prefix caching, the memory plan's flags, then the user's extras."""
    return [
        spec.model.source or spec.model.name,
        "--served-model-name",
        spec.model.name,
        "--host",
        POD_IP,
        "--port",
        str(spec.engine.port),
        "--tensor-parallel-size",
        str(spec.tensor_parallel_size),
        prefix_caching_flag(spec.prefix_caching),
        *plan.vllm_args(),
        *spec.engine.extra_args,
    ]
