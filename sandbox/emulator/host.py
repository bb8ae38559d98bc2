"""Creating emulators from containers (the pod runtime) or from a command line (standalone).

A pod has no network namespace of its own here: "every interface of the pod" (vLLM's default
`--host`, or `0.0.0.0`) is the pod IP. A specific `--host` is bound as given.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Mapping, Sequence

from cacheroute.sandbox.emulator.args import EmulatorConfig, parse_vllm_args, serve_arguments
from cacheroute.sandbox.emulator.server import Emulator, LogSink

_ANY = ("", "0.0.0.0", "::", "[::]")


def bind_address(config: EmulatorConfig, pod_ip: str) -> str:
    return pod_ip if config.host is None or config.host in _ANY else config.host


def container_emulator(
    command: Sequence[str] | None,
    args: Sequence[str],
    env: Mapping[str, str],
    pod_ip: str,
    *,
    log: LogSink | None = None,
) -> Emulator:
    """The emulator for a `vllm/vllm-openai` container (raises `EmulatorArgsError` on bad args)."""
    config = parse_vllm_args(serve_arguments(command, args), env)
    return Emulator(config, bind_address(config, pod_ip), log=log)


async def _serve(emulator: Emulator) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await emulator.start()
    await stop.wait()
    await emulator.stop()


def serve_standalone(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """`vllm serve ARGV` emulated in this process until SIGTERM or SIGINT (binds 127.0.0.1 by default)."""
    config = parse_vllm_args(argv, env)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    emulator = Emulator(config, bind_address(config, "127.0.0.1"))
    runner = asyncio.run
    with contextlib.suppress(ImportError):
        import uvloop

        runner = uvloop.run  # fewer CPU cycles per request, as in the pod runtime
    with contextlib.suppress(KeyboardInterrupt):
        runner(_serve(emulator))
