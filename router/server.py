"""The router process: gRPC ext_proc and health services, plan sources, scraping, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cacheroute.planner.plan import host_port
from cacheroute.router import native
from cacheroute.router.endpoints import EndpointPool, SliceEndpoint
from cacheroute.router.envoy import MAX_REQUEST_BYTES
from cacheroute.router.extproc import SERVICE as EXT_PROC_SERVICE
from cacheroute.router.extproc import RouterCore
from cacheroute.router.metrics import RouterMetrics
from cacheroute.router.picker import Picker
from cacheroute.router.plans import DirectoryPlanSource, PlanStore
from cacheroute.router.scrape import Scraper
from cacheroute.router.service import ExternalProcessor
from cacheroute.router.settings import RouterSettings
from cacheroute.router.supervise import Supervisor

log = logging.getLogger(__name__)

LIVENESS = "liveness"
READINESS = "readiness"
# A payload assembled from several ConfigMaps (watched, or projected into the plan volume) may be
# caught half-written; give it this long to complete.
PLAN_SETTLE_SECONDS = 3.0


class BindError(OSError):
    """A listening address the router cannot bind; the message names it and says why."""


def check_bindable(host: str, port: int, what: str) -> None:
    """Raise BindError unless a TCP server could listen on host:port now.

    gRPC reports a failed bind as a RuntimeError after logging several lines of its own; trying
    the address first gives one line that names the option and the reason.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        raise BindError(f"{what} {host}:{port}: cannot resolve {host!r} ({exc})") from None
    for family, kind, proto, _name, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise BindError(f"{what} {host}:{port}: cannot listen ({exc.strerror or exc})") from None


class Router:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.pool = EndpointPool(scraping=settings.scrape_interval > 0)
        self.picker = Picker(
            self.pool,
            spill_threshold=settings.spill_threshold,
            spill_slack=settings.spill_slack,
            fallbacks=settings.fallbacks,
            keys=settings.keys,
            seed=settings.seed,
            unplanned=settings.unplanned,
            tokens_per_unit=settings.tokens_per_load_unit,
            in_flight_weight=settings.in_flight_weight,
            widen_planned=settings.widen_planned,
            follow_prefixes=settings.follow_prefixes,
            prefix_memory_blocks=settings.prefix_memory_blocks,
            endpoint_kv_tokens=settings.endpoint_kv_tokens,
        )
        self.metrics = RouterMetrics(
            self.pool, sketch_size=settings.sketch_size, export_key_names=settings.export_key_names,
            envoy_admin_socket=settings.envoy_admin_socket,
        )
        self.core = RouterCore(
            self.picker,
            self.metrics,
            max_body_bytes=settings.max_body_bytes,
            default_body_mode=settings.default_body_mode,
        )
        self.store = PlanStore(self.pool, self.picker, self.metrics)
        self.health = health.aio.HealthServicer()
        self.scraper = Scraper(
            self.pool,
            interval=settings.scrape_interval,
            timeout=settings.scrape_timeout,
            on_failure=lambda e: self.metrics.scrape_failures.labels(e.address).inc(),
        )
        self.grpc_port = 0
        self.metrics_port = 0
        self._server: grpc.aio.Server | None = None
        self._metrics_server: Any = None
        self.supervisor = Supervisor(
            on_change=self._health_changed,
            on_state=self._task_state,
            on_restart=lambda name: self.metrics.task_restarts.labels(name).inc(),
        )
        self._health_state: bool | None = None
        self._was_ready = False

    def _task_state(self, name: str, up: bool) -> None:
        self.metrics.task_up.labels(name).set(1 if up else 0)
        # Restarts are exported at 0 from the task's start: a counter that appears only at its
        # first restart reads "no data" in dashboards and alerts.
        self.metrics.task_restarts.labels(name)

    # --- readiness --------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Ready to route: a plan is in effect or some endpoint is known, and (when scraping)
        every endpoint has been scraped once, so its readiness is known; and no background task
        is down (waiting to be restarted after a failure). Once ready, the router stays ready
        while its tasks run: endpoints a later plan adds are simply not picked until scraped."""
        if not self._was_ready:
            scraped = self.settings.scrape_interval <= 0 or all(e.scraped for e in self.pool.by_address.values())
            self._was_ready = (self.store.loaded or self.pool.known) and scraped
        return self._was_ready and not self.supervisor.down

    def _health_changed(self) -> None:
        if self.ready == self._health_state:
            return
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(self._publish_health())

    async def _publish_health(self) -> None:
        ready = self.ready
        if ready == self._health_state:
            return
        self._health_state = ready
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in (READINESS, EXT_PROC_SERVICE, ""):
            await self.health.set(service, status)
        if ready and not self.pool.known:
            # A plan made offline (`cacheroute plan`) names destinations without addresses.
            log.warning("router ready with no endpoint to route to: the plan gives no address and no --service or "
                        "--endpoints names one: no request can be routed")
        else:
            log.info("router %s", "ready" if ready else "not ready")

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        loop = asyncio.get_running_loop()
        # Both listening addresses are checked before anything starts, so a bad one is one error.
        check_bindable(s.grpc_host, s.grpc_port, "grpc")
        check_bindable(s.metrics_host, s.metrics_port, "metrics")
        self.pool.on_change(self._health_changed)
        self.pool.on_change(self.scraper.wake)
        self.store.on_applied(self._health_changed)
        self.scraper.on_round(self._health_changed)
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self._publish_health()
        self.pool.set_static(s.endpoints)

        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_concurrent_streams", 100_000),
                # A buffered body comes in one message: as large as any Envoy in front may hold.
                ("grpc.max_receive_message_length", MAX_REQUEST_BYTES + (1 << 20)),
            ],
        )
        ExternalProcessor(self.core).add_to(server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        try:
            # In brackets for IPv6: gRPC reads `::1:9002` as a name.
            self.grpc_port = server.add_insecure_port(host_port(s.grpc_host, s.grpc_port))
        except RuntimeError as exc:
            raise BindError(f"grpc {s.grpc_host}:{s.grpc_port}: cannot listen ({exc})") from None
        if self.grpc_port == 0:
            raise BindError(f"grpc {s.grpc_host}:{s.grpc_port}: cannot listen")
        await server.start()
        self._server = server
        try:
            self._metrics_server = self.metrics.serve(s.metrics_host, s.metrics_port)
        except OSError as exc:
            where = f"{s.metrics_host}:{s.metrics_port}"
            raise BindError(f"metrics {where}: cannot listen ({exc.strerror or exc})") from None
        self.metrics_port = int(self._metrics_server.server_address[1])

        tasks = self.supervisor
        tasks.spawn("plan-store", self.store.run)
        if s.plan_dir is not None:
            source = DirectoryPlanSource(
                s.plan_dir, self.store, interval=s.plan_poll_interval, settle=PLAN_SETTLE_SECONDS
            )
            with contextlib.suppress(OSError):
                await source.poll_async()
            tasks.spawn("plan-dir", source.run)
        if s.scrape_interval > 0:
            tasks.spawn("scraper", self.scraper.run)
        if s.watches_configmaps or s.service is not None:
            from cacheroute.router import kube

            api = await asyncio.to_thread(kube.api_client, s.kubeconfig)
            if s.watches_configmaps:
                assert s.namespace is not None and s.pool is not None
                origin = f"ConfigMaps {s.namespace}/{s.pool}-plan*"
                plan_watch = kube.ConfigMapPlanWatch(
                    api, namespace=s.namespace, pool=s.pool, on_files=self._configmap_files, loop=loop,
                    on_error=lambda error: self.store.reject(origin, error),
                )
                tasks.spawn("watch-configmaps", plan_watch.run)
            if s.service is not None:
                assert s.namespace is not None
                slices = kube.EndpointSliceWatch(
                    api, namespace=s.namespace, service=s.service, target_port=s.target_port,
                    on_endpoints=self._slices, loop=loop,
                )
                tasks.spawn("watch-endpointslices", slices.run)
        request_path = native.request_path()
        self.metrics.build_info.info({"request_path": request_path})
        log.info("ext_proc gRPC on %s:%d, metrics on %s:%d, event loop %s.%s, request path %s", s.grpc_host,
                 self.grpc_port, s.metrics_host, self.metrics_port, type(loop).__module__, type(loop).__name__,
                 request_path)

    def _configmap_files(self, files: dict[str, bytes]) -> None:
        self.store.submit(files, origin=f"ConfigMaps {self.settings.namespace}/{self.settings.pool}-plan*",
                          settle=PLAN_SETTLE_SECONDS)

    def _slices(self, endpoints: dict[str, SliceEndpoint]) -> None:
        self.pool.set_slices(endpoints)

    async def stop(self, grace: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace)
        await self.supervisor.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        if self.metrics.envoy is not None:
            self.metrics.envoy.close()

    async def serve_forever(self) -> None:
        try:
            await self.start()
        except BaseException:
            await self.stop(grace=0)
            raise
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping")
        await self.stop()

