"""Container probes, run as the kubelet runs them against the pod IP.

`httpGet` succeeds on a status from 200 to 399; `tcpSocket` when a connection opens; `grpc` when
the standard health service answers SERVING; `exec` when the command, run inside the container's
mount namespace with its environment, exits with 0. Each attempt is bounded by
`timeoutSeconds`. `ProbeState` turns attempts into a verdict with `successThreshold` and
`failureThreshold`, as the kubelet's prober does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

Obj = Mapping[str, Any]


@dataclass(frozen=True)
class ProbeSpec:
    handler: Obj
    initial_delay: float
    period: float
    timeout: float
    success_threshold: int
    failure_threshold: int

    @classmethod
    def parse(cls, probe: Obj | None, *, kind: str) -> ProbeSpec | None:
        if not probe:
            return None
        return cls(
            handler=probe,
            initial_delay=float(probe.get("initialDelaySeconds") or 0),
            period=float(probe.get("periodSeconds") or 10),
            timeout=float(probe.get("timeoutSeconds") or 1),
            # Liveness and startup probes must use 1; the API server enforces it.
            success_threshold=int(probe.get("successThreshold") or 1) if kind == "readiness" else 1,
            failure_threshold=int(probe.get("failureThreshold") or 3),
        )


class ProbeState:
    """Consecutive results -> the probe's verdict (None until the first threshold is reached)."""

    def __init__(self, spec: ProbeSpec, initial: bool | None = None) -> None:
        self.spec = spec
        self.verdict = initial
        self._streak = 0
        self._last: bool | None = None

    def record(self, ok: bool) -> bool | None:
        self._streak = self._streak + 1 if ok == self._last else 1
        self._last = ok
        if ok and self._streak >= self.spec.success_threshold:
            self.verdict = True
        elif not ok and self._streak >= self.spec.failure_threshold:
            self.verdict = False
        return self.verdict


def _port(value: Any, ports: Mapping[str, int]) -> int:
    if isinstance(value, int):
        return value
    text = str(value)
    if text.isdigit():
        return int(text)
    if text in ports:
        return ports[text]
    raise ValueError(f"named port {text!r} is not a port of the container")


class Prober:
    """Runs probe attempts; shares one HTTP client."""

    def __init__(self) -> None:
        self._http = httpx.AsyncClient(verify=False, follow_redirects=False)

    async def close(self) -> None:
        await self._http.aclose()

    async def attempt(
        self,
        spec: ProbeSpec,
        pod_ip: str,
        ports: Mapping[str, int],
        *,
        exec_in: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> tuple[bool, str]:
        """(success, message) of one attempt."""
        handler = spec.handler
        try:
            if "httpGet" in handler:
                return await self._http_get(handler["httpGet"], pod_ip, ports, spec.timeout)
            if "tcpSocket" in handler:
                return await self._tcp(handler["tcpSocket"], pod_ip, ports, spec.timeout)
            if "grpc" in handler:
                return await self._grpc(handler["grpc"], pod_ip, spec.timeout)
            if "exec" in handler:
                return await self._exec(handler["exec"], spec.timeout, exec_in, env)
        except ValueError as exc:
            return False, str(exc)
        return False, "the probe has no handler the runtime supports"

    async def _http_get(self, spec: Obj, pod_ip: str, ports: Mapping[str, int], limit: float) -> tuple[bool, str]:
        scheme = str(spec.get("scheme") or "HTTP").lower()
        host = str(spec.get("host") or pod_ip)
        port = _port(spec.get("port"), ports)
        path = str(spec.get("path") or "/")
        if not path.startswith("/"):
            path = "/" + path
        headers = {str(h.get("name")): str(h.get("value", "")) for h in spec.get("httpHeaders") or []}
        headers.setdefault("User-Agent", "kube-probe/1.33")
        url = f"{scheme}://{host}:{port}{path}"
        try:
            response = await self._http.get(url, headers=headers, timeout=limit)
        except httpx.HTTPError as exc:
            return False, f"Get {url!r}: {type(exc).__name__} {exc}".strip()
        if 200 <= response.status_code < 400:
            return True, ""
        return False, f"HTTP probe failed with statuscode: {response.status_code}"

    async def _tcp(self, spec: Obj, pod_ip: str, ports: Mapping[str, int], limit: float) -> tuple[bool, str]:
        host = str(spec.get("host") or pod_ip)
        port = _port(spec.get("port"), ports)
        try:
            _reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), limit)
        except (OSError, TimeoutError) as exc:
            return False, f"dial tcp {host}:{port}: {exc or 'timeout'}"
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True, ""

    async def _grpc(self, spec: Obj, pod_ip: str, limit: float) -> tuple[bool, str]:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        port = int(spec.get("port", 0))
        target = f"{pod_ip}:{port}"
        async with grpc.aio.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                reply = await stub.Check(
                    health_pb2.HealthCheckRequest(service=str(spec.get("service") or "")), timeout=limit
                )
            except grpc.aio.AioRpcError as exc:
                return False, f"gRPC health check of {target} failed: {exc.code().name}"
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            return True, ""
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return False, f"service unhealthy (responded with {status})"

    async def _exec(
        self, spec: Obj, limit: float, exec_in: Sequence[str] | None, env: Mapping[str, str] | None
    ) -> tuple[bool, str]:
        command = [str(part) for part in spec.get("command") or []]
        if not command:
            return False, "exec probe without a command"
        if exec_in is None:
            return False, "exec probes need a process container"
        process = await asyncio.create_subprocess_exec(
            *exec_in,
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=dict(env or {}),
        )
        try:
            output, _ = await asyncio.wait_for(process.communicate(), limit)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            return False, f"command timed out after {limit:.0f}s"
        if process.returncode == 0:
            return True, ""
        return False, f"command failed with exit code {process.returncode}: {output.decode(errors='replace')[-200:]}"
