"""`cacheroute operator run`: the kopf operator that turns InferencePools into vLLM fleets.

Every option can also come from the environment as `CACHEROUTE_OPERATOR_<OPTION>` (upper case,
dashes as underscores); a repeatable option takes a space-separated list there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cacheroute.operator.cli.errors import fail
from cacheroute.operator.config import ConfigError, load_config

app = typer.Typer(
    help="The operator: InferencePools become running, routable vLLM fleets.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
ENV = "CACHEROUTE_OPERATOR_"


def _env(name: str) -> str:
    return ENV + name


@app.callback()
def operator() -> None:
    """The kopf operator."""


@app.command()
def run(  # noqa: PLR0917 - one parameter per command-line option
    namespace: Annotated[
        list[str] | None,
        typer.Option("--namespace", "-n", envvar=_env("NAMESPACE"), help="Namespace to serve (repeatable)."),
    ] = None,
    all_namespaces: Annotated[
        bool, typer.Option("--all-namespaces", "-A", envvar=_env("ALL_NAMESPACES"), help="Serve every namespace.")
    ] = False,
    peering: Annotated[
        str, typer.Option(envvar=_env("PEERING"), help="kopf peering object shared by the operator's replicas.")
    ] = "cacheroute",
    standalone: Annotated[
        bool, typer.Option(envvar=_env("STANDALONE"), help="No peering: for a single replica without the kopf CRDs.")
    ] = False,
    peering_label: Annotated[
        list[str] | None,
        typer.Option(
            envvar=_env("PEERING_LABEL"),
            help="KEY=VALUE label of the peering object when the operator creates it (repeatable).",
        ),
    ] = None,
    peering_annotation: Annotated[
        list[str] | None,
        typer.Option(
            envvar=_env("PEERING_ANNOTATION"),
            help="KEY=VALUE annotation of the peering object when the operator creates it (repeatable); "
            "the chart passes Helm's ownership so that helm adopts an object the operator created first.",
        ),
    ] = None,
    peering_wait: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=3600.0,
            envvar=_env("PEERING_WAIT"),
            help="Seconds to wait for the peering object to appear before creating it (the chart renders it, "
            "after the operator's Deployment).",
        ),
    ] = 0.0,
    priority: Annotated[
        str,
        typer.Option(
            envvar=_env("PRIORITY"),
            help="Peering priority, or auto for a random one: replicas need distinct priorities, the highest acts.",
        ),
    ] = "auto",
    health_address: Annotated[
        str, typer.Option(envvar=_env("HEALTH_ADDRESS"), help="host:port of /healthz and /metrics.")
    ] = "0.0.0.0:8080",
    prometheus_url: Annotated[
        str | None, typer.Option(envvar=_env("PROMETHEUS_URL"), help="Prometheus of AffinityPlans that name none.")
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", exists=True, dir_okay=False, envvar=_env("CONFIG"), help="Operator configuration file (YAML)."
        ),
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
    resync_interval: Annotated[
        float,
        typer.Option(
            min=0.1,
            max=86_400.0,
            envvar=_env("RESYNC_INTERVAL"),
            help="Seconds between full re-applies (drift repair).",
        ),
    ] = 60.0,
    status_interval: Annotated[
        float,
        typer.Option(
            min=0.1, max=3600.0, envvar=_env("STATUS_INTERVAL"), help="Seconds between status refreshes of a pool."
        ),
    ] = 5.0,
    workers: Annotated[
        int,
        typer.Option(min=1, max=256, envvar=_env("WORKERS"), help="Threads for API work; pools reconcile in parallel."),
    ] = 16,
    log_level: Annotated[str, typer.Option(envvar=_env("LOG_LEVEL"), help="debug, info, warning or error.")] = "info",
    log_format: Annotated[str, typer.Option(envvar=_env("LOG_FORMAT"), help="json or text.")] = "json",
) -> None:
    """Run the operator until SIGTERM."""
    from cacheroute.operator import logs, runtime

    try:
        namespaces, everywhere = runtime.namespaces_or_all(namespace or [], all_namespaces)
        chosen_priority = runtime.parse_priority(priority)
        labels = runtime.parse_pairs("peering-label", peering_label or [])
        annotations = runtime.parse_pairs("peering-annotation", peering_annotation or [])
        host, port = runtime.parse_address(health_address)
        if log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log-level {log_level!r} is not one of debug, info, warning, error")
        log_format = log_format.lower()
        if log_format not in ("json", "text"):
            raise ValueError(f"log-format {log_format!r} is not json or text")
        if resync_interval <= 0 or status_interval <= 0:
            raise ValueError("resync-interval and status-interval must be > 0")
        if workers < 1:
            raise ValueError(f"workers {workers} must be >= 1")
        if kubeconfig is not None and not kubeconfig.is_file():
            raise ValueError(f"kubeconfig {kubeconfig} is not a file")
        operator_config = load_config(config)
    except (ValueError, ConfigError) as exc:
        raise fail(str(exc)) from None
    logs.configure(log_level, log_format)
    options = runtime.RunOptions(
        namespaces=namespaces,
        all_namespaces=everywhere,
        peering=peering,
        standalone=standalone,
        priority=chosen_priority,
        peering_labels=labels,
        peering_annotations=annotations,
        peering_wait_s=peering_wait,
        health_host=host,
        health_port=port,
        config=operator_config,
        kubeconfig=kubeconfig,
        prometheus_url=prometheus_url,
        resync_seconds=resync_interval,
        status_seconds=status_interval,
        workers=workers,
        log_level=log_level,
    )
    from aiohttp import ClientConnectionError
    from kubernetes.config import ConfigException
    from urllib3.exceptions import HTTPError as TransportError

    from cacheroute.operator.fleet.cluster import KubeError

    try:
        runtime.run(options)
    except ConfigException as exc:
        # The kubeconfig (or the pod's ServiceAccount files) could not be read into credentials.
        raise fail(f"kubeconfig: {exc}") from None
    except (TransportError, ClientConnectionError) as exc:
        # The operator's client (urllib3) or, with --standalone, kopf's first watch (aiohttp).
        reason = getattr(exc, "reason", None) or exc
        raise fail(f"operator failed: cannot reach the API server ({reason})", 1) from None
    except (OSError, KubeError) as exc:
        raise fail(f"operator failed: {exc}", 1) from None


def register(parent: typer.Typer) -> None:
    parent.add_typer(app, name="operator")
