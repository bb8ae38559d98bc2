"""The profiling Job's wrapper: it stops vLLM once ready and leaves the memory lines in the termination message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cacheroute.operator.fleet.profiling_job import READINESS_THEN_EXIT
from cacheroute.planner.memory import parse_vllm_log
from cacheroute.sandbox.process import free_port

FAKE_VLLM = r'''
import http.server, os, sys
print("INFO some startup chatter", flush=True)
print("INFO Model loading took 33.85 GiB memory and 40.1 seconds", flush=True)
print("INFO Graph capturing finished in 12 secs, took 0.41 GiB", flush=True)
print("INFO Free memory on device (78.61/79.11 GiB) on startup. Desired GPU memory utilization is (0.9, 71.2 GiB). "
      "Actual usage is 35.80 GiB for consumed memory (weights + non-torch), 1.25 GiB for peak activation, and "
      "0.41 GiB for CUDAGraph memory. Current kv cache memory in use is 38.02 GiB.", flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(os.environ["CACHEROUTE_PROFILE_PORT"])), H).serve_forever()
'''


def run_wrapper(tmp_path: Path, program: str) -> tuple[int, str, str]:
    script = tmp_path / "vllm.py"
    script.write_text(program)
    message = tmp_path / "termination-log"
    env = {**os.environ, "CACHEROUTE_PROFILE_PORT": str(free_port()), "CACHEROUTE_PROFILE_POLL_S": "0.2",
           "CACHEROUTE_PROFILE_TIMEOUT_S": "60", "CACHEROUTE_PROFILE_MESSAGE_FILE": str(message)}
    result = subprocess.run(["/bin/bash", "-c", READINESS_THEN_EXIT, "wrapper", sys.executable, str(script)],
                            env=env, capture_output=True, text=True, timeout=120, check=False)
    return result.returncode, result.stdout, message.read_text() if message.exists() else ""


def test_ready_vllm_is_stopped_and_its_memory_lines_become_the_message(tmp_path: Path) -> None:
    code, stdout, message = run_wrapper(tmp_path, FAKE_VLLM)
    assert code == 0
    assert "Model loading took" in stdout  # the whole log still goes to the pod log
    assert "chatter" not in message
    profile = parse_vllm_log(message)
    assert profile.weights_gib == 33.85 and profile.budget_missing() == ()


def test_a_failed_start_passes_its_status_and_keeps_the_error(tmp_path: Path) -> None:
    failing = (
        'print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", flush=True)\n'
        "raise SystemExit(3)\n"
    )
    code, _, message = run_wrapper(tmp_path, failing)
    assert code == 3
    assert parse_vllm_log(message).failures[0].kind == "cuda_oom"
