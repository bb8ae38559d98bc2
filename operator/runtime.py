"""Running the operator: kopf settings, peering, the handler modules, the health and metrics server.

`run(options)` configures logging, sets the process context, imports every module of
`cacheroute.operator.handlers` (theirs register kopf handlers) and runs kopf next to a small HTTP
server that answers `/healthz` and `/metrics` on `--health-address`.
"""

from __future__ import annotations

import asyncio
import datetime
import getpass
import importlib
import logging
import os
import pkgutil
import random
import secrets
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kopf

from cacheroute.operator import context
from cacheroute.operator.api.peering import PEERING_FILE, PEERING_GROUP, PEERING_VERSION
from cacheroute.operator.config import OperatorConfig
from cacheroute.operator.control.kube import EVENT_SOURCE
from cacheroute.operator.fleet.cluster import Cluster, KubeError
from cacheroute.operator.work import PriorityExecutor

log = logging.getLogger("cacheroute.operator")

FINALIZER = "cacheroute.dev/operator"
ANNOTATION_PREFIX = "cacheroute.dev"
# `--priority auto`: a random priority from this range, distinct per replica with near certainty.
AUTO_PRIORITY_RANGE = (1, 2**31 - 1)
# kopf names a replica in the peering object by this variable (the chart sets it to the pod's name).
IDENTITY_ENV = "POD_ID"
# After announcing itself, a replica waits this long before kopf starts, so that a replica started
# at the same moment is announced before either looks at its peers.
PEERING_GRACE_S = 1.0


@dataclass(frozen=True)
class RunOptions:
    namespaces: tuple[str, ...]
    all_namespaces: bool
    peering: str
    standalone: bool
    priority: int
    health_host: str
    health_port: int
    config: OperatorConfig
    kubeconfig: Path | None = None
    prometheus_url: str | None = None
    resync_seconds: float = 60.0
    status_seconds: float = 5.0
    workers: int = 16
    log_level: str = "info"
    peering_labels: Mapping[str, str] = field(default_factory=dict)
    peering_annotations: Mapping[str, str] = field(default_factory=dict)
    # Seconds to wait for someone else (Helm) to create the peering object before creating it.
    peering_wait_s: float = 0.0


def parse_pairs(option: str, items: Sequence[str]) -> dict[str, str]:
    """`KEY=VALUE` items (a space-separated list each, as the environment gives them) as a dict;
    ValueError names the option and the item."""
    pairs: dict[str, str] = {}
    for item in (part for text in items for part in text.split()):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{option} {item!r} is not KEY=VALUE")
        pairs[key] = value
    return pairs


def parse_priority(text: str) -> int:
    """`auto` or a whole number; ValueError names the problem."""
    if text.strip().lower() == "auto":
        return random.SystemRandom().randint(*AUTO_PRIORITY_RANGE)
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"priority {text!r} is neither auto nor a whole number") from None


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"health-address {text!r} is not host:port")
    return host.strip("[]") or "0.0.0.0", int(port)


def api_client(kubeconfig: Path | None, connections: int = 32) -> Any:
    """A kubernetes ApiClient: the kubeconfig given, else in-cluster credentials, else ~/.kube/config.

    `connections` kept open: one per worker thread, or every burst pays new TLS handshakes.
    """
    from kubernetes import client, config

    configuration = client.Configuration()
    if kubeconfig is not None:
        _load_kubeconfig(configuration, kubeconfig)
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            _load_kubeconfig(configuration, None)
    configuration.connection_pool_maxsize = connections
    return client.ApiClient(configuration)


def _load_kubeconfig(configuration: Any, path: Path | None) -> None:
    """Credentials from the kubeconfig at `path` (None: the library's default); a file that holds
    none is a ConfigException naming it, never a parser's or a lookup's exception."""
    import yaml
    from kubernetes import client, config

    where = str(path) if path is not None else "the default kubeconfig"
    try:
        config.load_kube_config(config_file=str(path) if path is not None else None,
                                client_configuration=configuration)
    except config.ConfigException:
        raise
    except (yaml.YAMLError, TypeError, AttributeError, KeyError, ValueError) as exc:
        raise config.ConfigException(f"{where} is not a kubeconfig ({' '.join(str(exc).split())})") from exc
    if configuration.host == client.Configuration().host:
        # Where the cluster names no server, the library keeps its default host (http://localhost).
        raise config.ConfigException(f"{where}: its current context's cluster names no server")


def load_handlers(package: str = "cacheroute.operator.handlers") -> list[str]:
    """Import every module of the handler package (each registers its kopf handlers)."""
    pkg = importlib.import_module(package)
    loaded = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package}.{info.name}")
            loaded.append(info.name)
    return loaded


def _await_peering(cluster: Cluster, path: str, seconds: float) -> bool:
    """Whether the peering object at `path` exists within `seconds` (polled twice a second)."""
    deadline = time.monotonic() + seconds
    while cluster.get_path(path) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)
    return True


def _peering_targets(options: RunOptions) -> list[tuple[str, str, str | None]]:
    """(collection path, kind, namespace) of each peering object the replica keeps alive in."""
    base = f"/apis/{PEERING_GROUP}/{PEERING_VERSION}"
    if options.all_namespaces:
        return [(f"{base}/clusterkopfpeerings", "ClusterKopfPeering", None)]
    return [(f"{base}/namespaces/{ns}/kopfpeerings", "KopfPeering", ns) for ns in options.namespaces]


def own_identity() -> str:
    """This replica's name among its peers: the pod's (POD_ID), else user, host, process and a
    random part. Exported, so that kopf announces itself under the same name."""
    identity = os.environ.get(IDENTITY_ENV) or (
        f"{getpass.getuser()}@{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(3)}"
    )
    os.environ[IDENTITY_ENV] = identity
    return identity


def announce(cluster: Cluster, options: RunOptions, identity: str, lifetime_s: int) -> None:
    """Write this replica's keep-alive into the peering objects before kopf starts.

    kopf resumes at its first look at the peering object when no peer of higher priority is
    there; two replicas started at once would each find the other absent and act together until
    the other's first keep-alive arrives. Announced first, the higher priority is seen by both.
    """
    if options.standalone:
        return
    now = datetime.datetime.now(datetime.UTC).isoformat()
    entry = {"priority": options.priority, "lifetime": lifetime_s, "lastseen": now}
    for path, _kind, _namespace in _peering_targets(options):
        cluster.merge_patch_path(f"{path}/{options.peering}", {"status": {identity: entry}})


def ensure_peering(cluster: Cluster, options: RunOptions) -> None:
    """Create the peering object(s) kopf keeps its keep-alives in, unless they exist.

    With `peering_wait_s`, first wait that long for them to appear: a chart that renders the
    object creates it after the operator's Deployment (Helm creates custom resources last), and a
    replica that created it first would make `helm install` fail on "already exists".
    """
    if options.standalone:
        return
    for path, kind, namespace in _peering_targets(options):
        metadata: dict[str, Any] = {"name": options.peering}
        if options.peering_labels:
            metadata["labels"] = dict(options.peering_labels)
        if options.peering_annotations:
            metadata["annotations"] = dict(options.peering_annotations)
        if namespace:
            metadata["namespace"] = namespace
        body = {"apiVersion": f"{PEERING_GROUP}/{PEERING_VERSION}", "kind": kind, "metadata": metadata}
        if options.peering_wait_s > 0 and _await_peering(cluster, f"{path}/{options.peering}", options.peering_wait_s):
            continue
        try:
            cluster.post(path, body)
        except KubeError as exc:
            if exc.status == 404:
                where = f"namespace {namespace} or " if namespace else ""
                raise KubeError(404, f"peering: {where}kopf's peering CRDs missing (install crds/{PEERING_FILE}, "
                                     "or run with --standalone)") from None
            if exc.status != 409:
                raise


def settings_for(options: RunOptions) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.peering.name = options.peering
    settings.peering.priority = options.priority
    settings.peering.standalone = options.standalone
    settings.peering.mandatory = not options.standalone
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    # Only warnings and errors of kopf itself become Events; ours are posted explicitly.
    settings.posting.level = logging.WARNING
    # One "From" for every Event of the operator (an AffinityPlan's are posted without kopf).
    settings.posting.reporting_component = EVENT_SOURCE
    settings.execution.max_workers = options.workers
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.queueing.worker_limit = options.workers * 4
    # A deleted AffinityPlan's daemon releases its pool (one API round trip) as it stops: let it
    # finish within the deletion's processing, not at kopf's next poll a cancellation backoff later.
    settings.background.instant_exit_timeout = 0.5
    return settings


async def _health_server(host: str, port: int, operator_task: asyncio.Task[None]) -> Any:
    from aiohttp import web
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    async def healthz(_request: web.Request) -> web.Response:
        if operator_task.done():
            return web.Response(status=503, text="operator stopped\n")
        return web.Response(text="ok\n")

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.add_routes([web.get("/healthz", healthz), web.get("/metrics", metrics)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner


async def _main(options: RunOptions) -> None:
    operator = asyncio.ensure_future(
        kopf.operator(
            clusterwide=options.all_namespaces,
            namespaces=options.namespaces,
            standalone=options.standalone,
            priority=options.priority,
            peering_name=None if options.standalone else options.peering,
            settings=settings_for(options),
        )
    )
    runner = await _health_server(options.health_host, options.health_port, operator)
    log.info(
        "operator started: %s, peering %s priority %d, health on %s:%d",
        "all namespaces" if options.all_namespaces else "namespaces " + ",".join(options.namespaces),
        "off" if options.standalone else repr(options.peering),
        options.priority,
        options.health_host,
        # The port bound: --health-address host:0 picks a free one.
        runner.addresses[0][1] if runner.addresses else options.health_port,
    )
    try:
        await operator
    finally:
        await runner.cleanup()


def run(options: RunOptions) -> None:
    api = api_client(options.kubeconfig, connections=options.workers + 4)
    cluster = Cluster(api)
    context.set_context(
        context.OperatorContext(
            config=options.config,
            cluster=cluster,
            work=PriorityExecutor(options.workers),
            resync_seconds=options.resync_seconds,
            status_seconds=options.status_seconds,
            prometheus_url=options.prometheus_url,
        )
    )
    ensure_peering(cluster, options)
    announced = time.monotonic()
    announce(cluster, options, own_identity(), settings_for(options).peering.lifetime)
    loaded = load_handlers()
    log.info("handler modules: %s", ", ".join(loaded))
    if not options.standalone:
        time.sleep(max(0.0, announced + PEERING_GRACE_S - time.monotonic()))
    asyncio.run(_main(options))


def namespaces_or_all(namespaces: Sequence[str], all_namespaces: bool) -> tuple[tuple[str, ...], bool]:
    """Validated scope: exactly one of a namespace list or all namespaces."""
    if all_namespaces and namespaces:
        raise ValueError("give either --namespace (repeatable) or --all-namespaces, not both (each may come from "
                         "its variable, CACHEROUTE_OPERATOR_NAMESPACE or CACHEROUTE_OPERATOR_ALL_NAMESPACES)")
    if not all_namespaces and not namespaces:
        raise ValueError("give --namespace NAME (repeatable) or --all-namespaces")
    return tuple(dict.fromkeys(namespaces)), all_namespaces
