"""The profiling Job, its readiness-then-exit wrapper run for real, the profile cache and status glue."""

# ruff: noqa: E501  (vLLM log lines are quoted verbatim, at their real length)

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from cacheroute.operator.api.pool import InferencePoolSpec
from cacheroute.operator.fleet.profiling_job import (
    MAX_CACHE_DATA_BYTES,
    READINESS_THEN_EXIT,
    ProfileCache,
    ProfileJobSpec,
    build_profile_job,
    memory_plan_status,
    plan_request_for_pool,
    profile_cache_configmap,
    profile_flags,
    profile_key,
    resolve_architecture,
)
from cacheroute.planner.memory import MemoryPlanError, parse_vllm_log, plan_from_profile, plan_memory

STARTUP_LOG = """\
INFO Chunked prefill is enabled with max_num_batched_tokens=2048.
INFO Model loading took 33.85 GiB memory and 40.1 seconds
INFO Available KV cache memory: 32.10 GiB
INFO GPU KV cache size: 210,368 tokens, Maximum concurrency for 131,072 tokens per request: 1.60x
INFO Graph capturing finished in 9 secs, took 0.41 GiB
INFO Free memory on device (77.70/79.11 GiB) on startup. Desired GPU memory utilization is (0.9, 71.2 GiB). Actual usage is 35.80 GiB for consumed memory (weights + non-torch), 1.25 GiB for peak activation, and 0.41 GiB for CUDAGraph memory. Current kv cache memory in use is 32.10 GiB.
"""

# Stands in for `vllm serve` in the wrapper: prints the startup log, then serves /health until SIGTERM
# (or fails, or never becomes ready, as asked).
FAKE_VLLM = r"""
import http.server, sys
mode, port = sys.argv[1], int(sys.argv[sys.argv.index("--port") + 1])
sys.stdout.write(open(sys.argv[2]).read()); sys.stdout.flush()
if mode == "fail":
    print("ValueError: No available memory for the cache blocks.", file=sys.stderr)
    sys.exit(1)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if mode == "ok" else 503); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def pool_spec() -> InferencePoolSpec:
    return InferencePoolSpec.model_validate(
        {
            "model": {"name": "meta-llama/Llama-3.3-70B-Instruct", "quantization": "fp8"},
            "tensorParallelSize": 2,
            "engine": {"image": "vllm/vllm-openai:v0.11.0"},
        }
    )


def job_spec(**kw: object) -> ProfileJobSpec:
    plan = plan_memory(plan_request_for_pool(pool_spec(), resolve_architecture(pool_spec())))
    fields: dict[str, object] = {
        "pool": "llama",
        "namespace": "serving",
        "model": "meta-llama/Llama-3.3-70B-Instruct",
        "image": "vllm/vllm-openai:v0.11.0",
        "gpu_product": "NVIDIA-H100-80GB-HBM3",
        "tp": 2,
        "flags": profile_flags(plan),
        "key": profile_key("meta-llama/Llama-3.3-70B-Instruct", "vllm/vllm-openai:v0.11.0", "H100", 2, 2048),
    }
    fields.update(kw)
    return ProfileJobSpec(**fields)  # type: ignore[arg-type]


def test_job_targets_the_gpu_product_with_tp_gpus_and_shared_memory() -> None:
    job = build_profile_job(job_spec())
    assert (job["apiVersion"], job["kind"]) == ("batch/v1", "Job")
    assert (
        re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"]) and len(job["metadata"]["name"]) <= 63
    )
    assert job["spec"]["backoffLimit"] == 0
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    container = pod["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in pod["volumes"]
    args = container["args"]
    assert args[:3] == ["vllm", "serve", "meta-llama/Llama-3.3-70B-Instruct"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--max-num-batched-tokens") + 1] == "2048"
    assert "--kv-cache-memory-bytes" not in args  # the boot measures vLLM's own budget
    assert container["command"][:2] == ["/bin/bash", "-c"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"] == "1"


def test_long_pool_names_still_give_valid_job_names() -> None:
    name = build_profile_job(job_spec(pool="a" * 80))["metadata"]["name"]
    assert len(name) <= 63 and name.endswith(job_spec().key.removeprefix("mp-")[:10])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_wrapper(tmp_path: Path, mode: str, timeout_s: int = 60) -> subprocess.CompletedProcess[str]:
    fake = tmp_path / "fake_vllm.py"
    fake.write_text(FAKE_VLLM)
    log = tmp_path / "startup.log"
    log.write_text(STARTUP_LOG)
    port = _free_port()
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        "CACHEROUTE_PROFILE_PORT": str(port),
        "CACHEROUTE_PROFILE_TIMEOUT_S": str(timeout_s),
        "CACHEROUTE_PROFILE_POLL_S": "0.2",
    }
    command = ["bash", "-c", READINESS_THEN_EXIT, "cacheroute-profile", sys.executable, str(fake), mode, str(log)]
    return subprocess.run(
        [*command, "--port", str(port)], check=False, env=env, capture_output=True, text=True, timeout=90
    )


def test_wrapper_exits_zero_once_ready_and_leaves_a_parsable_log(tmp_path: Path) -> None:
    done = run_wrapper(tmp_path, "ok")
    assert done.returncode == 0, done.stderr
    assert "vLLM is ready" in done.stdout
    profile = parse_vllm_log(done.stdout)
    assert profile.missing == ()
    request = plan_request_for_pool(pool_spec(), resolve_architecture(pool_spec()))
    plan = plan_from_profile(request, profile)
    assert plan.source == "Profiled" and plan.kv_cache_memory_bytes > 20 * (1 << 30)


def test_wrapper_passes_on_vllms_failure(tmp_path: Path) -> None:
    done = run_wrapper(tmp_path, "fail")
    assert done.returncode == 1
    assert "exited with status 1 before it was ready" in done.stderr
    assert parse_vllm_log(done.stdout + done.stderr).failures[0].kind == "no_cache_memory"


def test_wrapper_gives_up_after_its_timeout(tmp_path: Path) -> None:
    done = run_wrapper(tmp_path, "never-ready", timeout_s=1)
    assert done.returncode == 124
    assert "not ready after 1s" in done.stderr


def test_profile_key_is_stable_and_separates_inputs() -> None:
    key = profile_key("m", "img:1", "NVIDIA-H100-80GB-HBM3", 2, 2048, settings={"a": "1", "b": "2"})
    assert key == profile_key("m", "img:1", "NVIDIA-H100-80GB-HBM3", 2, 2048, settings={"b": "2", "a": "1"})
    assert re.fullmatch(r"mp-[0-9a-f]{20}", key)
    others = {
        profile_key("m2", "img:1", "NVIDIA-H100-80GB-HBM3", 2, 2048),
        profile_key("m", "img:2", "NVIDIA-H100-80GB-HBM3", 2, 2048),
        profile_key("m", "img:1", "NVIDIA-H200", 2, 2048),
        profile_key("m", "img:1", "NVIDIA-H100-80GB-HBM3", 4, 2048),
        profile_key("m", "img:1", "NVIDIA-H100-80GB-HBM3", 2, 4096),
        profile_key("m", "img:1", "NVIDIA-H100-80GB-HBM3", 2, 2048),
    }
    assert len(others) == 6 and key not in others


def test_cache_round_trips_through_configmap_data() -> None:
    profile = parse_vllm_log(STARTUP_LOG)
    cache = ProfileCache()
    at = datetime(2026, 1, 1, tzinfo=UTC)
    cache.put("mp-aaa", profile, at, inputs={"model": "llama"})
    data = cache.to_configmap_data()
    assert list(data) == ["mp-aaa.json"]
    restored, bad = ProfileCache.from_configmap_data(
        {**data, "junk.json": "{not json", "mp-b.json": data["mp-aaa.json"]}
    )
    assert bad == ["junk.json", "mp-b.json"]  # unreadable, and an entry filed under the wrong key
    assert restored.get("mp-aaa") == profile
    assert restored.entry("mp-aaa").inputs == {"model": "llama"}  # type: ignore[union-attr]
    assert restored.to_configmap_data() == data
    manifest = profile_cache_configmap("serving", restored)
    assert manifest["kind"] == "ConfigMap" and manifest["data"] == data


def test_cache_evicts_the_oldest_beyond_its_bounds() -> None:
    profile = parse_vllm_log(STARTUP_LOG)
    start = datetime(2026, 1, 1, tzinfo=UTC)
    cache = ProfileCache(max_entries=3)
    for i in range(5):
        cache.put(f"mp-{i}", profile, start + timedelta(minutes=i))
    assert sorted(cache.to_configmap_data()) == ["mp-2.json", "mp-3.json", "mp-4.json"]
    big = ProfileCache(max_entries=1000)
    for i in range(40):
        big.put(f"mp-{i:02d}", profile, start + timedelta(minutes=i), inputs={"pad": "x" * 50_000})
    assert sum(len(k) + len(v) for k, v in big.to_configmap_data().items()) <= MAX_CACHE_DATA_BYTES
    assert "mp-39" in big and "mp-00" not in big


def test_status_and_pool_inputs() -> None:
    spec = pool_spec()
    request = plan_request_for_pool(spec, resolve_architecture(spec))
    assert request.gpu.name == "h100-80gb" and request.tp == 2 and request.quantization == "fp8"
    status = memory_plan_status(plan_memory(request))
    wire = status.model_dump(by_alias=True)
    assert wire["source"] == "Analytic" and wire["kvCacheMemoryBytes"] > 0 and wire["maxModelLen"] == 131072
    unknown = InferencePoolSpec.model_validate({"model": {"name": "acme/secret-model"}})
    with pytest.raises(MemoryPlanError, match="configMapRef"):
        resolve_architecture(unknown)


def test_plan_for_pool_follows_the_memory_mode() -> None:
    from cacheroute.operator.fleet.profiling_job import plan_for_pool

    base = pool_spec().model_dump(by_alias=True)
    arch = resolve_architecture(pool_spec())
    assert plan_for_pool(pool_spec(), arch).source == "Analytic"
    profiled = InferencePoolSpec.model_validate({**base, "memory": {"mode": "Profiled"}})
    assert plan_for_pool(profiled, arch).source == "Analytic"  # no profile yet: boot with the analytic flags
    assert plan_for_pool(profiled, arch, parse_vllm_log(STARTUP_LOG)).source == "Profiled"
    manual = InferencePoolSpec.model_validate({**base, "memory": {"mode": "Manual", "kvCacheMemoryBytes": 20 << 30}})
    plan = plan_for_pool(manual, arch)
    assert plan.source == "Manual" and plan.kv_cache_memory_bytes <= 20 << 30
