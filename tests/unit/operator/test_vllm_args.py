"""Every flag the operator gives vLLM exists, with that meaning, in the pinned release's option list."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import pytest

from cacheroute.operator.api.pool import DEFAULT_ENGINE_IMAGE, InferencePoolSpec
from cacheroute.operator.config import EngineDefaults
from cacheroute.operator.fleet import memory
from cacheroute.operator.fleet.engine_args import engine_args
from cacheroute.operator.fleet.names import PoolRef
from cacheroute.operator.fleet.profiling_job import plan_for_pool, plan_request_for_pool, resolve_architecture
from cacheroute.operator.fleet.statefulset import build_statefulset
from cacheroute.planner.memory import parse_vllm_log, plan_from_profile, plan_memory

OPTIONS_FILE = "vllm-serve-options-v0.31.0.txt"


@dataclass(frozen=True)
class Option:
    name: str
    kind: str
    meaning: str


def recorded_options() -> dict[str, Option]:
    text = resources.files("cacheroute.operator.fleet").joinpath(OPTIONS_FILE).read_text("utf-8")
    out = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, kind, meaning = line.split(None, 2)
        out[name] = Option(name, kind, meaning)
    return out


def check_against_release(args: list[str]) -> list[str]:
    """Problems of a vLLM argument list against the recorded options (empty when all is well)."""
    options = recorded_options()
    problems = []
    if not args or args[0].startswith("-"):
        problems.append("the first argument must be the model (vllm serve [model_tag])")
    i = 1
    while i < len(args):
        flag = args[i]
        if not flag.startswith("--"):
            problems.append(f"{flag!r} is not an option")
            i += 1
            continue
        name = flag
        negated = flag.startswith("--no-") and ("--" + flag[5:]) in options
        if negated:
            name = "--" + flag[5:]
        option = options.get(name)
        if option is None:
            problems.append(f"{flag} is not an option of vLLM v0.31.0")
            i += 1
            continue
        if option.kind == "flag":
            i += 1
            continue
        if negated:
            problems.append(f"{flag}: only flags have a --no- form")
        value = args[i + 1] if i + 1 < len(args) else ""
        if option.kind == "int" and not value.isdigit():
            problems.append(f"{flag} {value!r}: expected a whole number")
        elif option.kind == "float":
            try:
                number = float(value)
            except ValueError:
                problems.append(f"{flag} {value!r}: expected a number")
            else:
                if name == "--gpu-memory-utilization" and not 0 < number <= 1:
                    problems.append(f"{flag} {value}: a share of GPU memory is in (0, 1]")
        elif option.kind.startswith("choice:") and value not in option.kind.removeprefix("choice:").split(","):
            problems.append(f"{flag} {value!r}: not one of {option.kind}")
        i += 2
    return problems


def test_the_option_list_is_the_release_the_default_image_pins() -> None:
    assert DEFAULT_ENGINE_IMAGE == "vllm/vllm-openai:v0.31.0"
    assert OPTIONS_FILE.endswith(DEFAULT_ENGINE_IMAGE.rsplit(":", 1)[1] + ".txt")


def test_the_memory_plan_flags_exist_in_the_release() -> None:
    options = recorded_options()
    needed = {
        "--kv-cache-memory-bytes": "int", "--max-num-batched-tokens": "int", "--max-model-len": "int",
        "--max-num-seqs": "int", "--gpu-memory-utilization": "float", "--tensor-parallel-size": "int",
        "--served-model-name": "str", "--enable-prefix-caching": "flag",
    }
    for name, kind in needed.items():
        assert options[name].kind == kind, name
    assert "KV cache size per GPU in bytes" in options["--kv-cache-memory-bytes"].meaning


SPECS = {
    "llama-70b-fp8-tp2": {"model": {"name": "meta-llama/Llama-3.3-70B-Instruct", "quantization": "fp8"},
                          "tensorParallelSize": 2},
    "llama-8b-no-prefix-caching": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "prefixCaching": False,
                                   "engine": {"extraArgs": ["--enforce-eager"]}},
    "qwen3-next-hybrid-fp8": {"model": {"name": "Qwen/Qwen3-Next-80B-A3B-Instruct", "quantization": "fp8",
                                        "architecture": "qwen3-next-80b-a3b"}, "tensorParallelSize": 2},
    "manual": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
               "memory": {"mode": "Manual", "kvCacheMemoryBytes": 30 << 30, "maxModelLen": 32768}},
    "long-context-mnbt": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
                          "memory": {"maxModelLen": 65536, "maxNumBatchedTokens": 8192}},
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_engine_arguments_are_options_of_the_pinned_release(name: str) -> None:
    spec = InferencePoolSpec.model_validate(SPECS[name])
    plan = plan_for_pool(spec, resolve_architecture(spec))
    sts = build_statefulset(PoolRef("p", "ns", "uid"), spec, plan, EngineDefaults())
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args == engine_args(spec, plan)
    assert check_against_release(args) == []


PROFILE_LOG = """\
INFO Chunked prefill is enabled with max_num_batched_tokens=2048.
INFO Model loading took 33.85 GiB memory and 40.1 seconds
INFO GPU KV cache size: 249,167 tokens
INFO Graph capturing finished in 12 secs, took 0.41 GiB
INFO Free memory on device (78.61/79.11 GiB) on startup. Desired GPU memory utilization is (0.9, 71.2 GiB). Actual usage is 35.80 GiB for consumed memory (weights + non-torch), 1.25 GiB for peak activation, and 0.41 GiB for CUDAGraph memory. Current kv cache memory in use is 38.02 GiB.
"""  # noqa: E501


def test_profiled_and_profiling_flags_are_options_of_the_pinned_release() -> None:
    spec = InferencePoolSpec.model_validate({**SPECS["llama-70b-fp8-tp2"], "memory": {"mode": "Profiled"}})
    arch = resolve_architecture(spec)
    request = plan_request_for_pool(spec, arch)
    candidate = plan_memory(request)
    job = memory.profile_job_for(PoolRef("p", "ns", "uid"), spec, candidate, "mp-0123456789")
    job_args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert job_args[:2] == ["vllm", "serve"]
    assert check_against_release(job_args[2:]) == []
    pinned = plan_from_profile(request, parse_vllm_log(PROFILE_LOG), candidate.max_num_batched_tokens)
    assert check_against_release(engine_args(spec, pinned)) == []


def test_the_checker_catches_what_vllm_would_refuse() -> None:
    problems = check_against_release(["m", "--kv-cache-bytes", "1"])
    assert problems[0] == "--kv-cache-bytes is not an option of vLLM v0.31.0"
    assert check_against_release(["m", "--gpu-memory-utilization", "1.5"])
    assert check_against_release(["m", "--kv-cache-dtype", "int4"])
    assert check_against_release(["--max-model-len", "1"])
