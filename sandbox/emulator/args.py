"""What an emulated vLLM server is, read from the pod's own `vllm serve` command line.

The KV cache is sized as vLLM sizes it: `--kv-cache-memory-bytes` divided by the bytes one block
takes on one GPU for this model, tensor-parallel size and `--kv-cache-dtype`
(`planner.memory.kv_layout`); without that flag, from the analytic memory plan of the GPU the
node carries. Step times come from an engine profile of the shadow replay
(`planner.replay.hardware`), with the pod's own batch limits and KV capacity.

Flags the emulator has no use for are accepted and ignored, as long as they look like flags;
knobs vLLM does not have come from the container's environment (`CACHEROUTE_EMULATOR_*`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cacheroute.planner.memory import (
    KvCacheDtype,
    MemoryPlanError,
    ModelArchitecture,
    PlanRequest,
    gpu_by_name,
    kv_layout,
    plan_memory,
    preset,
)
from cacheroute.planner.memory.presets import preset_key
from cacheroute.planner.replay.hardware import (
    DEFAULT_PROFILE,
    H100_HOST_LINK_BYTES_PER_S,
    PROFILES,
    EngineProfile,
    get_profile,
)

ENV_PREFIX = "CACHEROUTE_EMULATOR_"
ENV_PROFILE = ENV_PREFIX + "PROFILE"
ENV_ARCHITECTURE = ENV_PREFIX + "ARCHITECTURE"
ENV_GPU = ENV_PREFIX + "GPU"
ENV_LOAD_SECONDS = ENV_PREFIX + "LOAD_SECONDS"
ENV_DEFAULT_MAX_TOKENS = ENV_PREFIX + "DEFAULT_MAX_TOKENS"
ENV_STREAM_INTERVAL = ENV_PREFIX + "STREAM_INTERVAL"

DEFAULT_PORT = 8000
DEFAULT_GPU = "h100-80gb"
# Completions default to 16 tokens (OpenAI's and vLLM's default); an emulated chat model has no
# end-of-sequence token, so it "stops" after this many.
DEFAULT_CHAT_MAX_TOKENS = 64
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Streamed output between the first and the last token is sent in batches this often (seconds):
# the first token and the end are sent the moment the engine produces them.
DEFAULT_STREAM_INTERVAL = 0.1
VLLM_VERSION = "0.11.0"

GIB = 1 << 30
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)\s*$")
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class EmulatorArgsError(ValueError):
    """The command line or the environment does not describe a server the emulator can run."""


def human_int(text: str, flag: str) -> int:
    """vLLM's human-readable integers: `25.6k` is 25,600, `1G` is 2**30 (lower case decimal)."""
    match = _SIZE.match(text)
    if match is None:
        raise EmulatorArgsError(f"{flag} {text!r} is not a number (digits with an optional k/K/m/M/g/G/t/T)")
    number, suffix = float(match.group(1)), match.group(2)
    scale = _BINARY.get(suffix) or _DECIMAL[suffix.lower()]
    value = number * scale
    if value != math.floor(value):
        raise EmulatorArgsError(f"{flag} {text!r} is not a whole number")
    return int(value)


@dataclass(frozen=True)
class EmulatorConfig:
    """One emulated vLLM server."""

    model: str
    served_model_names: tuple[str, ...]
    host: str | None
    port: int
    api_key: str | None
    tensor_parallel_size: int
    max_model_len: int
    block_size: int
    prefix_caching: bool
    kv_cache_dtype: str
    capacity_source: str
    profile: EngineProfile
    host_kv_capacity_tokens: int = 0
    load_delay_s: float = 0.0
    default_chat_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS
    stream_interval_s: float = DEFAULT_STREAM_INTERVAL
    notes: tuple[str, ...] = ()

    @property
    def served_name(self) -> str:
        return self.served_model_names[0]

    @property
    def kv_capacity_tokens(self) -> int:
        return self.profile.kv_capacity_tokens

    @property
    def max_num_batched_tokens(self) -> int:
        return self.profile.max_num_batched_tokens

    @property
    def max_num_seqs(self) -> int:
        return self.profile.max_num_seqs

    def describe(self) -> dict[str, object]:
        return {
            "model": self.model,
            "served_model_names": list(self.served_model_names),
            "tensor_parallel_size": self.tensor_parallel_size,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "prefix_caching": self.prefix_caching,
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "capacity_source": self.capacity_source,
            "host_kv_capacity_tokens": self.host_kv_capacity_tokens,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "profile": self.profile.name,
            "load_delay_s": self.load_delay_s,
            "notes": list(self.notes),
        }


def serve_arguments(command: Sequence[str] | None, args: Sequence[str]) -> list[str]:
    """The arguments after `vllm serve`, from a container's command (entry point override) and args.

    The image's entry point is `vllm serve`; a container that overrides it must still start vLLM's
    server: `vllm serve ...` or `python -m vllm.entrypoints.openai.api_server ...` (whose model
    comes from `--model`).
    """
    argv = [*(command or []), *args]
    if not command:
        return list(args)
    head = [part.rsplit("/", 1)[-1] for part in argv[:3]]
    if head[:2] == ["vllm", "serve"]:
        return argv[2:]
    if len(head) >= 3 and head[0].startswith("python") and head[1] == "-m" and argv[2] in (
        "vllm.entrypoints.openai.api_server",
        "vllm.entrypoints.cli.main",
    ):
        rest = argv[3:]
        return rest[1:] if argv[2] == "vllm.entrypoints.cli.main" and rest[:1] == ["serve"] else rest
    raise EmulatorArgsError(
        f"command {' '.join(command)!r} does not start vLLM's server (expected `vllm serve` or "
        "`python -m vllm.entrypoints.openai.api_server`)"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm serve", add_help=False, allow_abbrev=False, exit_on_error=False)
    add = parser.add_argument
    add("--model")
    add("--served-model-name", nargs="+")
    add("--host")
    add("--port", type=int, default=DEFAULT_PORT)
    add("--api-key")
    add("--tensor-parallel-size", "-tp", type=int, default=1)
    add("--max-model-len")
    add("--max-num-batched-tokens")
    add("--max-num-seqs")
    add("--kv-cache-memory-bytes")
    add("--gpu-memory-utilization", type=float)
    add("--kv-cache-dtype", default="auto")
    add("--block-size", type=int)
    add("--quantization", "-q")
    add("--kv-offloading-size", type=float)
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    return parser


def flags_read() -> list[str]:
    """The `vllm serve` flags the emulator acts on (others are accepted and ignored)."""
    return [opt for action in _parser()._actions for opt in action.option_strings if opt.startswith("--")]


def _normalise(argv: Sequence[str]) -> list[str]:
    """vLLM accepts `--flag_name` for `--flag-name`; argparse does not."""
    out = []
    for arg in argv:
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            out.append("--" + name.replace("_", "-") + eq + value)
        else:
            out.append(arg)
    return out


def _env_float(env: Mapping[str, str], name: str, default: float, minimum: float = 0.0) -> float:
    text = env.get(name)
    if text is None or text == "":
        return default
    try:
        value = float(text)
    except ValueError:
        raise EmulatorArgsError(f"{name}={text!r} is not a number") from None
    if not math.isfinite(value) or value < minimum:
        raise EmulatorArgsError(f"{name}={text!r} must be at least {minimum}")
    return value


def _check_range(flag: str, value: float, lo: float, hi: float) -> None:
    """Refuse NaN, infinities and values outside [lo, hi], as vLLM's own checks would (or should)."""
    if not math.isfinite(value) or not lo <= value <= hi:
        raise EmulatorArgsError(f"{flag} {value!r} must be a finite number in [{lo:g}, {hi:g}]")


def _architecture(model: str, served_names: Sequence[str], env: Mapping[str, str]) -> ModelArchitecture | None:
    """The preset of the environment's override, else of the weights' name, else of a served name.

    Weights often load from a path or a quantized export (`pvc://...`, `org/Model-FP8-dynamic`) while
    the served name is the canonical one, which names the architecture as vLLM's config.json would.
    """
    override = env.get(ENV_ARCHITECTURE)
    if override:
        if preset_key(override) is None:
            raise EmulatorArgsError(f"{ENV_ARCHITECTURE}={override!r} is not a known architecture preset")
        return preset(override)
    for name in (model, *served_names):
        if preset_key(name) is not None:
            return preset(name)
    return None


def _profile(env: Mapping[str, str], kv_cache_dtype: str) -> EngineProfile:
    name = env.get(ENV_PROFILE)
    try:
        profile = get_profile(name) if name else DEFAULT_PROFILE
    except ValueError as exc:
        raise EmulatorArgsError(f"{ENV_PROFILE}: {exc}") from None
    if kv_cache_dtype.startswith("fp8") and not profile.name.endswith("-fp8kv"):
        # The replay ships fp8-KV variants of its profiles (half the KV bytes read per decode step).
        profile = PROFILES.get(profile.name + "-fp8kv", profile)
    return profile


def _quantization(model: str, flag: str | None) -> str:
    if flag:
        return "fp8" if flag.lower().startswith("fp8") else "bf16"
    return "fp8" if "fp8" in model.lower() else "bf16"


def parse_vllm_args(argv: Sequence[str], env: Mapping[str, str] | None = None) -> EmulatorConfig:
    """The emulated server for `vllm serve ARGV` (ARGV starts with the model, or has `--model`)."""
    env = env or {}
    argv = _normalise(argv)
    model = None
    if argv and not argv[0].startswith("-"):
        model, argv = argv[0], argv[1:]
    try:
        known, extra = _parser().parse_known_args(argv)
    except (argparse.ArgumentError, ValueError) as exc:
        raise EmulatorArgsError(f"vllm serve: {exc}") from None
    model = model or known.model
    if not model:
        raise EmulatorArgsError("vllm serve: no model given (the first argument, or --model)")
    if extra and not extra[0].startswith("-"):
        raise EmulatorArgsError(f"vllm serve: unexpected argument {extra[0]!r}")
    notes = [f"ignored flag {arg}" for arg in extra if arg.startswith("--")]
    load_delay = _env_float(env, ENV_LOAD_SECONDS, 0.0)
    chat_max_tokens = int(_env_float(env, ENV_DEFAULT_MAX_TOKENS, DEFAULT_CHAT_MAX_TOKENS, 1.0))
    stream_interval = _env_float(env, ENV_STREAM_INTERVAL, DEFAULT_STREAM_INTERVAL, 0.001)

    tp = known.tensor_parallel_size
    if tp < 1:
        raise EmulatorArgsError(f"--tensor-parallel-size must be at least 1, got {tp}")
    _check_range("--port", known.port, 1, 65535)
    _check_range("--tensor-parallel-size", tp, 1, 64)
    if known.gpu_memory_utilization is not None:
        _check_range("--gpu-memory-utilization", known.gpu_memory_utilization, 0.001, 1.0)
    if known.block_size is not None:
        _check_range("--block-size", known.block_size, 1, 4096)
    if known.kv_offloading_size is not None:
        _check_range("--kv-offloading-size", known.kv_offloading_size, 0.0, 1e6)
    kv_dtype = known.kv_cache_dtype
    if kv_dtype not in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16"):
        raise EmulatorArgsError(f"--kv-cache-dtype {kv_dtype!r} is not one of auto, fp8, fp8_e4m3, fp8_e5m2")
    dtype: KvCacheDtype = "fp8" if kv_dtype.startswith("fp8") else "auto"
    gpu_name = env.get(ENV_GPU) or DEFAULT_GPU
    try:
        gpu = gpu_by_name(gpu_name)
    except MemoryPlanError as exc:
        raise EmulatorArgsError(f"{ENV_GPU}: {exc}") from None
    mnbt = (
        human_int(known.max_num_batched_tokens, "--max-num-batched-tokens")
        if known.max_num_batched_tokens
        else gpu.default_max_num_batched_tokens
    )
    max_seqs = human_int(known.max_num_seqs, "--max-num-seqs") if known.max_num_seqs else gpu.default_max_num_seqs
    if mnbt < 1 or max_seqs < 1:
        raise EmulatorArgsError("--max-num-batched-tokens and --max-num-seqs must be positive")
    arch = _architecture(model, known.served_model_name or [], env)
    max_model_len = (
        human_int(known.max_model_len, "--max-model-len")
        if known.max_model_len
        else (arch.max_position_embeddings if arch is not None else 0)
    )
    profile = _profile(env, kv_dtype)
    block_size = known.block_size or 16
    bytes_per_token = 0
    if arch is not None:
        try:
            layout = kv_layout(arch, tp, dtype)
        except MemoryPlanError as exc:
            raise EmulatorArgsError(f"{model}: {exc}") from None
        block_size = known.block_size or layout.block_size
        bytes_per_token = layout.bytes_per_block // layout.block_size
    if known.kv_cache_memory_bytes:
        kv_bytes = human_int(known.kv_cache_memory_bytes, "--kv-cache-memory-bytes")
        if arch is None:
            raise EmulatorArgsError(
                f"--kv-cache-memory-bytes needs the model's KV geometry, and {model!r} is not a known "
                f"architecture; set {ENV_ARCHITECTURE} to one of the memory planner's presets"
            )
        capacity = layout.tokens_with(layout.num_blocks(kv_bytes), 0)
        source = "--kv-cache-memory-bytes"
    elif arch is not None:
        request = PlanRequest(
            model=arch,
            gpu=gpu,
            quantization="fp8" if _quantization(model, known.quantization) == "fp8" else "bf16",
            tp=tp,
            kv_cache_dtype=dtype,
            max_model_len=max_model_len or None,
            mnbt=mnbt,
            max_num_seqs=max_seqs,
        )
        try:
            capacity = plan_memory(request).kv_capacity_tokens
        except MemoryPlanError as exc:
            raise EmulatorArgsError(f"{model} does not fit: {exc}") from None
        source = f"memory plan ({gpu.name})"
    else:
        capacity = profile.kv_capacity_tokens
        source = f"profile {profile.name}"
        notes.append(f"{model!r} is not a known architecture: KV capacity of profile {profile.name}")
    if capacity <= 0:
        raise EmulatorArgsError(f"the KV cache of {model} holds no tokens (capacity from {source})")
    if not max_model_len:
        max_model_len = capacity
    if max_model_len > capacity:
        raise EmulatorArgsError(
            f"the model's max seq len ({max_model_len}) is larger than the maximum number of tokens that can be "
            f"stored in KV cache ({capacity}); raise --kv-cache-memory-bytes or lower --max-model-len"
        )
    profile = dataclasses.replace(
        profile, kv_capacity_tokens=capacity, max_num_batched_tokens=mnbt, max_num_seqs=max_seqs
    )
    host_tokens = 0
    if known.kv_offloading_size:
        if not bytes_per_token:
            raise EmulatorArgsError("--kv-offloading-size needs the model's KV geometry (a known architecture)")
        # vLLM's size is the sum over the TP ranks, each of which holds its share of every token.
        host_tokens = int(known.kv_offloading_size * GIB / tp // bytes_per_token)
        profile = dataclasses.replace(
            profile,
            host_kv_capacity_tokens=host_tokens,
            kv_bytes_per_token_per_gpu=bytes_per_token,
            host_link_bytes_per_s=profile.host_link_bytes_per_s or H100_HOST_LINK_BYTES_PER_S,
        )
    api_key = known.api_key or env.get("VLLM_API_KEY") or None
    return EmulatorConfig(
        model=model,
        served_model_names=tuple(known.served_model_name or [model]),
        host=known.host,
        port=known.port,
        api_key=api_key,
        tensor_parallel_size=tp,
        max_model_len=max_model_len,
        block_size=block_size,
        prefix_caching=known.enable_prefix_caching,
        kv_cache_dtype=kv_dtype,
        capacity_source=source,
        profile=profile,
        host_kv_capacity_tokens=host_tokens,
        load_delay_s=load_delay,
        default_chat_max_tokens=chat_max_tokens,
        stream_interval_s=stream_interval,
        notes=tuple(notes),
    )
