"""A standalone vLLM emulator process (`cacheroute sandbox emulator ...`) for tests."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from cacheroute.sandbox.process import ServerProcess, free_port, spawn, wait_until

LLAMA_70B = "meta-llama/Llama-3.3-70B-Instruct"


@dataclass
class EmulatorProcess:
    process: ServerProcess
    url: str

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30)

    def metric(self, name: str) -> float:
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"no metric {name}")


@contextlib.contextmanager
def emulator_process(
    args: Sequence[str], workdir: Path, *, env: Mapping[str, str] | None = None, wait: bool = True
) -> Iterator[EmulatorProcess]:
    """`vllm serve ARGS` emulated on 127.0.0.1 and a free port; stopped afterwards."""
    port = free_port()
    argv = [sys.executable, "-m", "cacheroute.operator.cli.main", "sandbox", "emulator", *args, "--port", str(port)]
    process = spawn(
        "emulator", argv, log=workdir / "emulator.log", env={**os.environ, **(env or {})}, detach=False
    )
    emulator = EmulatorProcess(process, f"http://127.0.0.1:{port}")
    try:
        if wait:
            wait_until(
                lambda: emulator.get("/health").status_code == 200, timeout=60, what=emulator.url, process=process
            )
        yield emulator
    finally:
        process.stop(timeout=5)
