"""InferencePool: a fleet of identical vLLM destinations (the schema source of its CRD)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from cacheroute.operator.api.common import (
    API_VERSION,
    CONDITIONS_FIELD,
    ApiModel,
    Condition,
    CrossFieldRule,
    Duration,
    IntOrWords,
    ObjectMeta,
    enforce,
)
from cacheroute.planner.prefixes import DEFAULT_PREFIX_MEMORY_BLOCKS
from cacheroute.planner.routing import DEFAULT_SPILL_THRESHOLD

QUANTIZATIONS = ("bf16", "fp8")
# An HTTP header field name (RFC 9110 token): what the router's plan validation accepts.
HTTP_HEADER_NAME = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$"
# The vLLM release the operator's engine flags are checked against
# (cacheroute/operator/fleet/vllm-serve-options-v0.31.0.txt).
DEFAULT_ENGINE_IMAGE = "vllm/vllm-openai:v0.31.0"


class ConfigMapKeyRef(ApiModel):
    name: str = Field(min_length=1, max_length=253, description="ConfigMap in the pool's namespace.")
    key: str = Field(default="config.json", min_length=1, max_length=253, description="Key holding config.json.")


class ModelSpec(ApiModel):
    """What to serve."""

    name: str = Field(
        min_length=1, max_length=256, description="Served model name, e.g. meta-llama/Llama-3.3-70B-Instruct."
    )
    source: str | None = Field(
        default=None,
        max_length=1024,
        description="Where the weights come from (a Hugging Face id, pvc://claim/path, s3://...). Defaults to name.",
    )
    quantization: Literal["bf16", "fp8"] = Field(default="bf16", description="Weight precision.")
    architecture: str | None = Field(
        default=None,
        max_length=128,
        description="Architecture preset that overrides detection, e.g. llama-3.3-70b or qwen3-next-80b-a3b.",
    )
    config_map_ref: ConfigMapKeyRef | None = Field(
        default=None, description="A ConfigMap holding the model's Hugging Face config.json, used for memory planning."
    )


class EnvVar(ApiModel):
    name: str = Field(min_length=1, max_length=256, description="Variable name.")
    value: str = Field(default="", max_length=32768, description="Its value.")


class EngineSpec(ApiModel):
    """The vLLM container."""

    image: str = Field(
        default=DEFAULT_ENGINE_IMAGE, min_length=1, max_length=512, description="vLLM image (entry point vllm serve)."
    )
    port: int = Field(default=8000, ge=1, le=65535, description="vLLM's HTTP port (API, /health, /metrics).")
    extra_args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list, max_length=128, description="More vllm serve arguments, after the operator's own."
    )
    env: list[EnvVar] = Field(default_factory=list, max_length=128, description="Environment of the vLLM container.")
    startup_timeout: Duration = Field(default="30m", description="How long a replica may take to load weights.")


class GpuSpec(ApiModel):
    """The GPU the pool runs on, as GPU feature discovery labels nodes."""

    product: str = Field(
        default="NVIDIA-H100-80GB-HBM3",
        min_length=1,
        max_length=128,
        description="Value of the nodes' nvidia.com/gpu.product label; replicas are scheduled there.",
    )
    memory_gib: float = Field(default=80.0, gt=0, le=1024, description="Memory of one GPU, for the memory plan.")
    resource_name: str = Field(
        default="nvidia.com/gpu", min_length=1, max_length=253, description="Extended resource requested per GPU."
    )
    count_per_node: int = Field(default=8, ge=1, le=64, description="GPUs on one node of this product.")
    node_memory_gib: float | None = Field(
        default=None,
        gt=0,
        le=65536,
        description=(
            "Allocatable memory of one node of this product, for memory.hostKvCacheGib auto; "
            "when unset, auto leaves the host KV tier off (the memory plan says so in its notes)."
        ),
    )


class MemorySpec(ApiModel):
    """How the vLLM memory flags are chosen."""

    mode: Literal["Profiled", "Analytic", "Manual"] = Field(
        default="Analytic",
        description=(
            "Profiled boots vLLM once to measure; Analytic uses the architecture model; "
            "Manual takes the flags given."
        ),
    )
    max_model_len: int | None = Field(
        default=None, ge=256, le=10_485_760, description="Longest request in tokens (default: the model's native)."
    )
    max_num_batched_tokens: Annotated[int | Literal["auto"], IntOrWords(ge=256, le=1_048_576)] = Field(
        default="auto", description="A token count, or auto to let the memory plan choose."
    )
    safety_margin_gib: float = Field(default=1.0, ge=0, le=64, description="Memory kept free above the predicted peak.")
    kv_cache_memory_bytes: int | None = Field(default=None, ge=1, description="Required in Manual mode.")
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        default="auto",
        description="KV cache entries: auto (the model's dtype) or fp8 (--kv-cache-dtype fp8: half the bytes).",
    )
    host_kv_cache_gib: Annotated[int | Literal["auto"], IntOrWords(ge=0, le=65536)] = Field(
        default="auto",
        description=(
            "Host-memory KV tier of each replica in GiB (vLLM's native KV offloading; 0 turns it off), or auto: "
            "the replica's share of the node's allocatable memory minus hostMemoryReserveGib per GPU."
        ),
    )
    host_memory_reserve_gib: float = Field(
        default=32.0,
        ge=0,
        le=4096,
        description="Host memory kept per GPU for the engine's own processes when hostKvCacheGib is auto.",
    )


class RouterSpec(ApiModel):
    """The endpoint picker in front of the pool."""

    replicas: int = Field(
        default=2,
        ge=0,
        le=64,
        description="Router pods (any number make the same decisions; 0: none of the pool's own, for routers run "
        "elsewhere, e.g. as sidecars).",
    )
    image: str | None = Field(default=None, max_length=512, description="Defaults to the operator's own image.")
    key_header: str = Field(
        default="x-affinity-key",
        min_length=1,
        max_length=256,
        pattern=HTTP_HEADER_NAME,
        description="Request header holding the affinity key.",
    )
    body_field: str | None = Field(default="user", max_length=256, description="OpenAI request field holding the key.")
    session_header: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        pattern=HTTP_HEADER_NAME,
        description="Header used as the key when neither the header nor the field is set.",
    )
    prompt_prefix_chars: int = Field(
        default=0, ge=0, le=65536, description="If > 0, hash this many leading prompt characters when no key is given."
    )
    spill_threshold: float = Field(
        default=DEFAULT_SPILL_THRESHOLD,
        ge=1.0,
        le=100.0,
        description=(
            "Spill a planned key when its destination's load exceeds this multiple of the mean load plus a slack "
            "(load counts the prompt tokens still to prefill and the decode; docs/router.md)."
        ),
    )
    follow_prefixes: bool = Field(
        default=True,
        description="Send a request where the longest prefix of its prompt went before (a conversation's next "
        "turn to its cached history), within the spill bound, and send a request the plan does not route, with "
        "no such prefix, to the best score of the share of its prompt each endpoint holds and its load; needs "
        "Envoy's BUFFERED or FULL_DUPLEX_STREAMED request body mode.",
    )
    prefix_memory_blocks: int = Field(
        default=DEFAULT_PREFIX_MEMORY_BLOCKS,
        ge=1,
        le=16_777_216,
        description="Most prompt prefixes of 256 tokens a router remembers for followPrefixes: per endpoint as "
        "many as its KV cache holds, at most this in all (about 220 bytes each).",
    )


class GieSpec(ApiModel):
    """Publish a Gateway API Inference Extension InferencePool pointing at our router."""

    enabled: bool = Field(default=False, description="Create the GIE InferencePool (needs the GIE CRDs).")
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        default="FailOpen", description="What the gateway does when our picker does not answer."
    )


class InferencePoolSpec(ApiModel):
    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    replicas: int = Field(default=1, ge=0, le=1024, description="vLLM replicas (destinations <pool>-0 ...).")
    tensor_parallel_size: int = Field(default=1, ge=1, le=64, description="GPUs per replica, on one node.")
    gpu: GpuSpec = Field(default_factory=GpuSpec)
    memory: MemorySpec = Field(default_factory=MemorySpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    prefix_caching: bool = Field(default=True, description="vLLM's automatic prefix caching.")
    gie: GieSpec = Field(default_factory=GieSpec)

    rules: ClassVar[tuple[CrossFieldRule, ...]] = (
        CrossFieldRule(
            cel="self.gpu.countPerNode % self.tensorParallelSize == 0",
            message="tensorParallelSize must divide gpu.countPerNode (a replica lives on one node)",
            check=lambda s: s.gpu.count_per_node % s.tensor_parallel_size == 0,
            field_path=".tensorParallelSize",
        ),
        CrossFieldRule(
            cel="self.memory.mode != 'Manual' || has(self.memory.kvCacheMemoryBytes)",
            message="memory.mode Manual requires memory.kvCacheMemoryBytes",
            check=lambda s: s.memory.mode != "Manual" or s.memory.kv_cache_memory_bytes is not None,
            field_path=".memory",
        ),
    )

    @model_validator(mode="after")
    def _cross_field(self) -> InferencePoolSpec:
        enforce(self.rules, self)
        return self


class Destination(ApiModel):
    id: str = Field(description="Destination id: the pod name <pool>-<ordinal>.")
    address: str = Field(default="", description="ip:port of vLLM.")
    ready: bool = Field(default=False, description="The pod is ready (serves the model).")


class MemoryPlanStatus(ApiModel):
    kv_cache_memory_bytes: int = Field(ge=0, description="--kv-cache-memory-bytes per GPU.")
    max_num_batched_tokens: int = Field(ge=0, description="--max-num-batched-tokens.")
    max_model_len: int = Field(ge=0, description="--max-model-len.")
    max_num_seqs: int = Field(ge=0, description="--max-num-seqs.")
    kv_capacity_tokens: int = Field(ge=0, description="KV cache capacity of one replica, in tokens.")
    kv_cache_dtype: Literal["auto", "fp8"] = Field(default="auto", description="--kv-cache-dtype.")
    host_kv_cache_bytes: int = Field(
        default=0, ge=0, description="--kv-offloading-size in bytes: the host-memory KV tier of one replica."
    )
    host_kv_capacity_tokens: int = Field(default=0, ge=0, description="Host-memory KV tier of one replica, in tokens.")
    pod_memory_bytes: int = Field(
        default=0,
        ge=0,
        description=(
            "Host memory an engine pod with a host KV tier requests: the tier plus the reserve of its GPUs. "
            "0 without a tier: the pod then requests the operator's engine.memoryRequest."
        ),
    )
    source: Literal["Profiled", "Analytic", "Manual"] = Field(description="Where the plan came from.")
    inputs: dict[str, str] = Field(default_factory=dict, description="What the plan was computed from.")


class InferencePoolStatus(ApiModel):
    observed_generation: int | None = Field(default=None, ge=0, description="The spec generation last acted on.")
    replicas: int = Field(default=0, ge=0, description="Destinations that exist.")
    ready_replicas: int = Field(default=0, ge=0, description="Destinations that are ready.")
    destinations: list[Destination] = Field(
        default_factory=list, max_length=1024, description="The engine pods: what plans route to."
    )
    memory_plan: MemoryPlanStatus | None = Field(default=None, description="The vLLM memory flags in force.")
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra=CONDITIONS_FIELD,
        description="Ready, MemoryPlanned, Progressing, Degraded (docs/operations.md).",
    )


class InferencePool(ApiModel):
    """A fleet of identical vLLM replicas serving one model."""

    api_version: Literal["cacheroute.dev/v1alpha1"] = API_VERSION
    kind: Literal["InferencePool"] = "InferencePool"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: InferencePoolSpec
    status: InferencePoolStatus | None = None

    crd_plural: ClassVar[str] = "inferencepools"
    crd_short_names: ClassVar[tuple[str, ...]] = ("crpool", "crpools")
    crd_categories: ClassVar[tuple[str, ...]] = ("cacheroute",)
    crd_printer_columns: ClassVar[tuple[dict[str, Any], ...]] = (
        {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
        {"name": "Reason", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason'},
        # A pool can serve (Ready) and still be degraded (GIENotInstalled, a replica failing).
        {"name": "Degraded", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Degraded")].reason',
         "description": "AsExpected, or what degrades the pool"},
        {"name": "Available", "type": "integer", "jsonPath": ".status.readyReplicas"},
        {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
        {"name": "TP", "type": "integer", "jsonPath": ".spec.tensorParallelSize"},
        {"name": "GPU", "type": "string", "jsonPath": ".spec.gpu.product", "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    )
