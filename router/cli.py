"""`cacheroute router`: run the endpoint picker."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Annotated

import typer

from cacheroute.planner.plan import MAX_PROMPT_PREFIX_CHARS, SPILL_THRESHOLD_RANGE
from cacheroute.planner.prefixes import DEFAULT_PREFIX_MEMORY_BLOCKS
from cacheroute.planner.routing import DEFAULT_SPILL_SLACK
from cacheroute.planner.tokenload import DEFAULT_IN_FLIGHT_WEIGHT, DEFAULT_TOKENS_PER_LOAD_UNIT
from cacheroute.router import drain, eventloop, sidecar
from cacheroute.router.envoy import DEFAULT_MAX_REQUEST_BYTES, MAX_REQUEST_BYTES
from cacheroute.router.settings import (
    BODY_MODES,
    DEFAULT_GRPC_PORT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_METRICS_PORT,
    DEFAULT_SKETCH_SIZE,
    MAX_BODY_BYTES_LIMIT,
    MAX_ENDPOINT_KV_TOKENS,
    MAX_PREFIX_MEMORY_BLOCKS,
    MAX_SKETCH_SIZE,
    KeyOverrides,
    RouterSettings,
    SettingsError,
    parse_address,
)

app = typer.Typer(
    help="Envoy ext_proc endpoint picker that follows the planned prefix-affinity table.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
ENV = "CACHEROUTE_ROUTER_"
MAX_PORT = 65535


def _fail(message: str, code: int = 2) -> typer.Exit:
    """Print one line naming the input and the problem; return the exit to raise."""
    sys.stderr.write("error: " + " ".join(str(message).split()) + "\n")
    return typer.Exit(code)


def _env(name: str) -> str:
    return ENV + name


@app.callback()
def router() -> None:
    """The data plane: an Envoy ext_proc endpoint picker."""


@app.command()
def serve(  # noqa: PLR0917 - one parameter per command-line option
    grpc_port: Annotated[
        int,
        typer.Option(
            min=0, max=MAX_PORT, envvar=_env("GRPC_PORT"), help="ext_proc and gRPC health port (0: any free)."
        ),
    ] = DEFAULT_GRPC_PORT,
    grpc_host: Annotated[
        str,
        typer.Option(
            envvar=_env("GRPC_HOST"),
            help="Address the gRPC server binds. The default 0.0.0.0 listens on every interface: right inside a pod "
            "(its only interface is the pod IP, where gateways connect); elsewhere give a specific address.",
        ),
    ] = "0.0.0.0",
    metrics_port: Annotated[
        int, typer.Option(min=0, max=MAX_PORT, envvar=_env("METRICS_PORT"), help="Prometheus /metrics port.")
    ] = DEFAULT_METRICS_PORT,
    metrics_host: Annotated[
        str, typer.Option(envvar=_env("METRICS_HOST"), help="Address /metrics binds (0.0.0.0: every interface).")
    ] = "0.0.0.0",
    envoy_admin_socket: Annotated[
        Path | None,
        typer.Option(
            dir_okay=False,
            envvar=_env("ENVOY_ADMIN_SOCKET"),
            help="The pod's Envoy's admin socket (router envoy --admin-socket): /metrics serves its statistics too "
            "(envoy_*, and cacheroute_router_envoy_up).",
        ),
    ] = None,
    plan_dir: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            file_okay=False,
            envvar=_env("PLAN_DIR"),
            help="Mounted plan ConfigMap directory (all plan files in one).",
        ),
    ] = None,
    namespace: Annotated[
        str | None, typer.Option(envvar=_env("NAMESPACE"), help="Namespace of the plan ConfigMaps and Service.")
    ] = None,
    pool: Annotated[
        str | None,
        typer.Option(envvar=_env("POOL"), help="Pool whose ConfigMaps <pool>-plan[-N] to watch through the API."),
    ] = None,
    kubeconfig: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            dir_okay=False,
            envvar=_env("KUBECONFIG"),
            help="Kubeconfig (default: in-cluster, then ~/.kube).",
        ),
    ] = None,
    plan_poll_interval: Annotated[
        float,
        typer.Option(
            min=0.01, max=3600.0, envvar=_env("PLAN_POLL_INTERVAL"), help="Seconds between checks of --plan-dir."
        ),
    ] = 0.2,
    endpoints: Annotated[
        str,
        typer.Option(envvar=_env("ENDPOINTS"), help="Extra endpoints, ip:port separated by commas or spaces."),
    ] = "",
    service: Annotated[
        str | None,
        typer.Option(envvar=_env("SERVICE"), help="Headless Service whose EndpointSlices list the endpoints."),
    ] = None,
    target_port: Annotated[
        int | None,
        typer.Option(
            min=1, max=MAX_PORT, envvar=_env("TARGET_PORT"), help="Port on EndpointSlice addresses (default: first)."
        ),
    ] = None,
    key_header: Annotated[
        str | None, typer.Option(envvar=_env("KEY_HEADER"), help="Header holding the affinity key (plan default).")
    ] = None,
    body_field: Annotated[
        str | None,
        typer.Option(envvar=_env("BODY_FIELD"), help="JSON body field holding the key, e.g. user; '' turns it off."),
    ] = None,
    session_header: Annotated[
        str | None, typer.Option(envvar=_env("SESSION_HEADER"), help="Session header used as key; '' turns it off.")
    ] = None,
    prompt_prefix_chars: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=MAX_PROMPT_PREFIX_CHARS,
            envvar=_env("PROMPT_PREFIX_CHARS"),
            help="Hash this many characters of system prompt + first user message as the key; 0 turns it off.",
        ),
    ] = None,
    spill_threshold: Annotated[
        float | None,
        typer.Option(
            min=SPILL_THRESHOLD_RANGE[0],
            max=SPILL_THRESHOLD_RANGE[1],
            envvar=_env("SPILL_THRESHOLD"),
            help="Spill a planned key when its destination's load exceeds this x mean + slack (plan default).",
        ),
    ] = None,
    spill_slack: Annotated[
        float,
        typer.Option(
            min=0.0, max=1e6, envvar=_env("SPILL_SLACK"), help="Absolute headroom (requests) before spilling."
        ),
    ] = DEFAULT_SPILL_SLACK,
    fallbacks: Annotated[
        int,
        typer.Option(
            min=0,
            max=16,
            envvar=_env("FALLBACKS"),
            help="Fallback endpoints listed after the primary. Keep 0 behind an Envoy ORIGINAL_DST cluster, "
            "which accepts a single address only.",
        ),
    ] = 0,
    unplanned: Annotated[
        str,
        typer.Option(
            envvar=_env("UNPLANNED"),
            help="Keys outside the plan: key-p2c (the less loaded of two endpoints derived from the key) or p2c.",
        ),
    ] = "key-p2c",
    tokens_per_load_unit: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=1e9,
            envvar=_env("TOKENS_PER_LOAD_UNIT"),
            help="Prompt tokens in flight on an endpoint that weigh as much as one more request in flight "
            "(token-aware load; the prompt size is estimated from the body). 0 counts requests only.",
        ),
    ] = DEFAULT_TOKENS_PER_LOAD_UNIT,
    in_flight_weight: Annotated[
        float,
        typer.Option(
            min=0.0, max=1.0, envvar=_env("IN_FLIGHT_WEIGHT"),
            help="Weight of a request in flight in an endpoint's load; a queued request weighs 1.",
        ),
    ] = DEFAULT_IN_FLIGHT_WEIGHT,
    widen_planned: Annotated[
        bool,
        typer.Option(
            envvar=_env("WIDEN_PLANNED"),
            help="A computed route's candidates become the key's two ring endpoints followed by its planned "
            "endpoints, as many as its entry is long (pinned routes keep their entry).",
        ),
    ] = False,
    follow_prefixes: Annotated[
        bool,
        typer.Option(
            envvar=_env("FOLLOW_PREFIXES"),
            help="Send a request where the longest prefix of its prompt went before (the next turn of a "
            "conversation to its history's cache), within the spill bound's load limit, and, with key-seeded "
            "p2c, an unplanned request with no such prefix to the endpoint of the best score of prompt share "
            "held and load; needs the body (buffered or full-duplex body mode).",
        ),
    ] = True,
    prefix_memory_blocks: Annotated[
        int,
        typer.Option(
            min=1,
            max=MAX_PREFIX_MEMORY_BLOCKS,
            envvar=_env("PREFIX_MEMORY_BLOCKS"),
            help="Most prompt prefixes of 256 tokens the router remembers for --follow-prefixes: per endpoint "
            "its share of what the plan's destinations hold in KV cache (without a plan: --endpoint-kv-tokens), "
            "at most this in all (least recently routed to the endpoint out; about 220 bytes each).",
        ),
    ] = DEFAULT_PREFIX_MEMORY_BLOCKS,
    endpoint_kv_tokens: Annotated[
        int,
        typer.Option(
            min=0,
            max=MAX_ENDPOINT_KV_TOKENS,
            envvar=_env("ENDPOINT_KV_TOKENS"),
            help="KV cache tokens one endpoint holds, GPU and host memory (the pool's memory plan): sizes the "
            "prefix memory while no plan gives its destinations' capacities. 0: not known (the memory holds "
            "--prefix-memory-blocks until a plan arrives, and may follow prefixes the caches evicted).",
        ),
    ] = 0,
    scrape_interval: Annotated[
        float,
        typer.Option(
            min=0.0, max=3600.0, envvar=_env("SCRAPE_INTERVAL"), help="Seconds between /metrics scrapes; 0 turns off."
        ),
    ] = 0.5,
    scrape_timeout: Annotated[
        float, typer.Option(min=0.001, max=600.0, envvar=_env("SCRAPE_TIMEOUT"), help="Timeout of a scrape (s).")
    ] = 1.0,
    max_body_bytes: Annotated[
        int,
        typer.Option(
            min=0,
            max=MAX_BODY_BYTES_LIMIT,
            envvar=_env("MAX_BODY_BYTES"),
            help="Larger bodies are not parsed for a key (p2c).",
        ),
    ] = DEFAULT_MAX_BODY_BYTES,
    body_mode: Annotated[
        str,
        typer.Option(
            envvar=_env("BODY_MODE"),
            help=f"Body mode assumed when Envoy does not say ({', '.join(BODY_MODES)}).",
        ),
    ] = "none",
    sketch_size: Annotated[
        int,
        typer.Option(
            min=1,
            max=MAX_SKETCH_SIZE,
            envvar=_env("SKETCH_SIZE"),
            help="Keys with their own metric series (heaviest first).",
        ),
    ] = DEFAULT_SKETCH_SIZE,
    export_key_names: Annotated[
        bool,
        typer.Option(envvar=_env("EXPORT_KEY_NAMES"), help="Label key metrics with clear keys instead of hashes."),
    ] = False,
    event_loop: Annotated[
        str,
        typer.Option(
            envvar=_env("EVENT_LOOP"),
            help="auto (uvloop when installed, else asyncio's own), asyncio or uvloop: uvloop costs less CPU "
            "per request.",
        ),
    ] = "auto",
    log_level: Annotated[str, typer.Option(envvar=_env("LOG_LEVEL"), help="debug, info, warning or error.")] = "info",
) -> None:
    """Serve Envoy ext_proc (endpoint-picker protocol), gRPC health and Prometheus metrics."""
    level = getattr(logging, log_level.upper(), None) if log_level.isalpha() else None
    if not isinstance(level, int):
        raise _fail(f"log-level {log_level!r} is not one of debug, info, warning, error")
    try:
        settings = RouterSettings(
            grpc_host=grpc_host,
            grpc_port=grpc_port,
            metrics_host=metrics_host,
            metrics_port=metrics_port,
            envoy_admin_socket=envoy_admin_socket,
            plan_dir=plan_dir,
            # An empty value (a variable set to nothing) is no value.
            namespace=namespace or None,
            pool=pool or None,
            kubeconfig=kubeconfig,
            plan_poll_interval=plan_poll_interval,
            endpoints=tuple(e for e in re.split(r"[,\s]+", endpoints) if e),
            service=service or None,
            target_port=target_port,
            keys=KeyOverrides(key_header, body_field, session_header, prompt_prefix_chars),
            spill_threshold=spill_threshold,
            spill_slack=spill_slack,
            fallbacks=fallbacks,
            unplanned=unplanned,
            tokens_per_load_unit=tokens_per_load_unit,
            in_flight_weight=in_flight_weight,
            widen_planned=widen_planned,
            follow_prefixes=follow_prefixes,
            prefix_memory_blocks=prefix_memory_blocks,
            endpoint_kv_tokens=endpoint_kv_tokens,
            scrape_interval=scrape_interval,
            scrape_timeout=scrape_timeout,
            max_body_bytes=max_body_bytes,
            sketch_size=sketch_size,
            export_key_names=export_key_names,
            default_body_mode=body_mode,
            event_loop=event_loop,
        )
        eventloop.resolve(settings.event_loop)
    except (SettingsError, eventloop.EventLoopError) as exc:
        raise _fail(str(exc)) from None
    if plan_dir is None and settings.pool is None and settings.service is None and not settings.endpoints:
        raise _fail("give where routes come from: --plan-dir or --pool (a plan), --service or --endpoints "
                    "(endpoints without one)")
    if plan_dir is not None and not plan_dir.is_dir():
        raise _fail(f"plan-dir {plan_dir} is not a directory")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs each read of Envoy's statistics at info level: one line per scrape, every second.
    quiet = logging.getLogger().level if logging.getLogger().level <= logging.DEBUG else logging.WARNING
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(quiet)
    from cacheroute.router.server import BindError, Router

    try:
        eventloop.run(Router(settings).serve_forever(), settings.event_loop)
    except BindError as exc:
        # A port in use or an address not on this host: the settings, not the world.
        raise _fail(str(exc)) from None
    except OSError as exc:
        raise _fail(f"router failed: {exc}", 1) from None


@app.command("envoy-config")
def envoy_config(
    router_address: Annotated[
        str, typer.Option("--router", envvar=_env("ADDRESS"), help="ip:port of the router's gRPC service.")
    ],
    endpoints: Annotated[
        str,
        typer.Option(envvar=_env("ENDPOINTS"), help="Pool endpoints (ip:port, commas) for the fail-open cluster."),
    ],
    listen_port: Annotated[int, typer.Option(min=1, max=MAX_PORT, help="Port Envoy listens on for clients.")] = 8080,
    request_body_mode: Annotated[
        str, typer.Option(help="ext_proc request body mode: NONE, BUFFERED or FULL_DUPLEX_STREAMED.")
    ] = "BUFFERED",
    max_request_bytes: Annotated[
        int,
        typer.Option(
            min=1, max=MAX_REQUEST_BYTES,
            help="Largest request body Envoy holds for the router in the buffered modes (413 past it).",
        ),
    ] = DEFAULT_MAX_REQUEST_BYTES,
) -> None:
    """Print an Envoy bootstrap (YAML) that routes through the router: the standalone deployment."""
    import yaml

    from cacheroute.router.envoy import GatewayOptions, gateway_bootstrap

    try:
        router = parse_address(router_address, "router")
        pool = [parse_address(e) for e in re.split(r"[,\s]+", endpoints) if e]
        document = gateway_bootstrap(
            router, pool, GatewayOptions(listen_port=listen_port, request_body_mode=request_body_mode.upper(),
                                         max_request_bytes=max_request_bytes),
        )
    except (SettingsError, ValueError) as exc:
        raise _fail(str(exc)) from None
    typer.echo(yaml.safe_dump(document, sort_keys=False), nl=False)


@app.command("build-native")
def build_native(
    out: Annotated[
        Path, typer.Option(file_okay=False, help="New folder for the compiled copy (put it first on PYTHONPATH).")
    ],
) -> None:
    """Compile the request path with mypyc (needs mypy, setuptools and a C compiler).

    The router runs it when OUT is first on its PYTHONPATH; the image keeps it in
    /opt/cacheroute/native and its router container runs with it. `cacheroute_router_build_info`
    and the router's start-up line say which path a router runs."""
    from cacheroute.router import native

    if out.exists() and any(out.iterdir()):
        raise _fail(f"out {out}: not empty; build into a new folder")
    typer.echo(f"compiling {len(native.COMPILED_MODULES)} modules into {out} ...", err=True)
    try:
        native.build(out)
    except (native.BuildError, OSError) as exc:
        raise _fail(str(exc), 1) from None
    typer.echo(str(out))


# The router pod's Envoy container (`cacheroute router envoy`), kept in its own module.
sidecar.register(app)
drain.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
