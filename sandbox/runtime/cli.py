"""`cacheroute sandbox runtime` (also `python -m cacheroute.sandbox.runtime`): run the pod runtime.

`cacheroute sandbox up` starts it as one of the sandbox's servers; this command is for running it
by hand, e.g. against a sandbox started with `--no-pod-runtime`, scoped to some namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

if TYPE_CHECKING:
    from cacheroute.sandbox.runtime.images import ImageDriver
    from cacheroute.sandbox.runtime.kubelet import RuntimeOptions

# Every `cacheroute` invocation registers this command; the runtime itself loads when it runs.
err = Console(stderr=True)


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise typer.BadParameter(f"{text!r} is not HOST:PORT")
    return host, int(port)


def _images(options: list[str]) -> tuple[ImageDriver, ...]:
    from cacheroute.sandbox.runtime.images import parse_image_option

    try:
        return tuple(parse_image_option(o) for o in options)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


async def _main(options: RuntimeOptions) -> None:
    from cacheroute.sandbox.runtime.kubelet import PodRuntime

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await PodRuntime(options).run(stop)


def run(  # noqa: PLR0917 - one parameter per option
    state_dir: Annotated[Path, typer.Option("--state-dir", file_okay=False, help="Where pod volumes and logs go.")],
    sandbox: Annotated[
        Path | None,
        typer.Option(
            "--sandbox",
            exists=True,
            file_okay=False,
            help="A sandbox state directory: its API server and admin identity.",
        ),
    ] = None,
    server: Annotated[str | None, typer.Option(help="API server URL.")] = None,
    ca: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, help="CA bundle of the API server.")] = None,
    cert: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, help="Client certificate.")] = None,
    key: Annotated[Path | None, typer.Option(exists=True, dir_okay=False, help="Client key.")] = None,
    namespace: Annotated[list[str], typer.Option("--namespace", "-n", help="Serve only these namespaces.")] = [],  # noqa: B006
    namespace_selector: Annotated[
        str, typer.Option(help="Serve only namespaces with these labels (a label selector).")
    ] = "",
    selector: Annotated[str, typer.Option("--selector", "-l", help="Serve only pods with these labels.")] = "",
    image: Annotated[
        list[str], typer.Option("--image", help="REPOSITORY=COMMAND: run this image's containers as COMMAND.")
    ] = [],  # noqa: B006
    health_address: Annotated[
        str | None, typer.Option(help="HOST:PORT of /healthz and /pods (off by default).")
    ] = None,
    restart_backoff: Annotated[
        float, typer.Option(min=0.05, max=3600.0, help="First restart back-off, seconds.")
    ] = 1.0,
    max_restart_backoff: Annotated[
        float, typer.Option(min=0.05, max=3600.0, help="Longest restart back-off, seconds.")
    ] = 60.0,
    emulator_load_seconds: Annotated[
        float | None,
        typer.Option(min=0.0, max=3600.0, help="Default emulated model load time (container env overrides)."),
    ] = None,
    kwok_logs: Annotated[bool, typer.Option(help="Publish container logs to kwok's log server.")] = True,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
) -> None:
    """Run the pods of registered images on this machine (a kubelet for the fake nodes)."""
    level = getattr(logging, log_level.upper(), None)
    if not isinstance(level, int):
        err.print(f"[red]--log-level {log_level!r} is not one of debug, info, warning, error[/]")
        raise typer.Exit(2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per API request would drown the runtime's own messages.
    logging.getLogger("httpx").setLevel(max(level, logging.WARNING))
    if sandbox is not None:
        from cacheroute.sandbox.cluster import Sandbox, SandboxError

        try:
            state = Sandbox.attach(sandbox).state
        except SandboxError as exc:
            err.print(f"[red]{exc}[/]")
            raise typer.Exit(2) from None
        server = server or state.api_server
        ca, cert, key = ca or Path(state.ca_file), cert or Path(state.client_cert), key or Path(state.client_key)
    if not (server and ca and cert and key):
        err.print("[red]give --sandbox, or all of --server, --ca, --cert and --key[/]")
        raise typer.Exit(2)
    from cacheroute.sandbox.runtime.kube import Credentials
    from cacheroute.sandbox.runtime.kubelet import RuntimeOptions, service_address

    host, port = service_address(server)
    options = RuntimeOptions(
        state_dir=state_dir,
        credentials=Credentials(server, str(ca), str(cert), str(key)),
        api_host=host,
        api_port=port,
        namespaces=tuple(namespace),
        namespace_selector=namespace_selector,
        pod_selector=selector,
        images=_images(image),
        restart_backoff_s=restart_backoff,
        max_restart_backoff_s=max(max_restart_backoff, restart_backoff),
        emulator_load_seconds=emulator_load_seconds,
        health_address=_address(health_address) if health_address else None,
        kwok_logs=kwok_logs,
    )
    state_dir.mkdir(parents=True, exist_ok=True)
    # uvloop costs fewer CPU cycles per emulated request; asyncio's own loop otherwise.
    runner = asyncio.run
    with contextlib.suppress(ImportError):
        import uvloop

        runner = uvloop.run
    runner(_main(options))


def main() -> None:
    typer.run(run)
