"""The API calls of reconciliation: server-side apply, create-only, reads, discovery, status.

Everything here is a thin, synchronous edge over the `kubernetes` client's ApiClient (kopf runs
the callers in worker threads). Objects travel as plain dicts in their wire form.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cacheroute.operator.api.common import GROUP, VERSION
from cacheroute.operator.fleet.names import FIELD_MANAGER


class KubeError(RuntimeError):
    """An API call failed; `status` is the HTTP status (0 when the server was not reached),
    `causes` the reasons the server's answer details (`NamespaceTerminating`, ...)."""

    def __init__(self, status: int, message: str, causes: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.causes = causes

    @property
    def namespace_terminating(self) -> bool:
        """Refused because the namespace is being deleted: its objects are going too."""
        return self.status == 403 and "NamespaceTerminating" in self.causes


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str

    def collection(self, namespace: str) -> str:
        group, _, version = self.api_version.rpartition("/")
        prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
        return f"{prefix}/namespaces/{namespace}/{self.plural}"


KINDS: dict[tuple[str, str], Kind] = {
    (k.api_version, k.kind): k
    for k in (
        Kind("v1", "Service", "services"),
        Kind("v1", "ServiceAccount", "serviceaccounts"),
        Kind("v1", "ConfigMap", "configmaps"),
        Kind("v1", "Pod", "pods"),
        Kind("apps/v1", "StatefulSet", "statefulsets"),
        Kind("apps/v1", "Deployment", "deployments"),
        Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
        Kind("rbac.authorization.k8s.io/v1", "Role", "roles"),
        Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
        Kind("batch/v1", "Job", "jobs"),
        Kind("inference.networking.k8s.io/v1", "InferencePool", "inferencepools"),
        Kind(f"{GROUP}/{VERSION}", "InferencePool", "inferencepools"),
    )
}


def kind_of(obj: Mapping[str, Any]) -> Kind:
    return KINDS[(str(obj["apiVersion"]), str(obj["kind"]))]


def _error(exc: Exception) -> KubeError:
    status = int(getattr(exc, "status", 0) or 0)
    body = getattr(exc, "body", None)
    message = str(exc)
    causes: tuple[str, ...] = ()
    if body:
        try:
            answer = json.loads(body)
            message = answer.get("message", message)
            details = answer.get("details") or {}
            causes = tuple(str(c.get("reason", "")) for c in details.get("causes") or [] if isinstance(c, dict))
        except (ValueError, AttributeError):
            message = str(body)[:500]
    return KubeError(status, message, causes)


def namespace_terminating(exc: Exception) -> bool:
    """Whether an API call was refused because its namespace is being deleted (its objects are
    going too): a `KubeError`, or the client's own exception."""
    return (exc if isinstance(exc, KubeError) else _error(exc)).namespace_terminating


class Cluster:
    """The API server, as reconciliation uses it."""

    def __init__(self, api_client: Any, discovery_ttl: float = 30.0) -> None:
        self.api = api_client
        self._discovery_ttl = discovery_ttl
        self._discovered: dict[str, tuple[float, bool]] = {}
        self._lock = threading.Lock()

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        raw: bool = False,
    ) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            result = self.api.call_api(
                path,
                method,
                query_params=list((query or {}).items()),
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                body=body,
                response_type=None if raw else "object",
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
                _preload_content=not raw,
                _request_timeout=30,
            )
            if raw:
                return bytes(result.data).decode("utf-8", "replace")
        except ApiException as exc:
            raise _error(exc) from None
        except OSError as exc:  # connection refused, reset, timeout
            raise KubeError(0, f"{method} {path}: {exc}") from None
        return result

    # --- writes ------------------------------------------------------------------------------------

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply, taking over fields someone else changed (a hand edit is undone)."""
        kind = kind_of(obj)
        meta = obj["metadata"]
        path = f"{kind.collection(meta['namespace'])}/{meta['name']}"
        out: dict[str, Any] = self._call(
            "PATCH",
            path,
            body=dict(obj),
            query={"fieldManager": FIELD_MANAGER, "force": "true"},
            content_type="application/apply-patch+yaml",
        )
        return out

    def create_if_missing(self, obj: Mapping[str, Any]) -> bool:
        """Create the object unless it exists (its content is then left alone); True if created."""
        kind = kind_of(obj)
        try:
            self._call("POST", kind.collection(obj["metadata"]["namespace"]), body=dict(obj),
                       query={"fieldManager": FIELD_MANAGER})
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def post(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST to a path (objects outside KINDS, e.g. kopf's peering objects)."""
        out: dict[str, Any] = self._call("POST", path, body=dict(body), query={"fieldManager": FIELD_MANAGER})
        return out

    def merge_patch_path(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """A JSON merge patch of the object at a path (kinds outside KINDS, e.g. peering objects)."""
        out: dict[str, Any] = self._call(
            "PATCH", path, body=dict(body), query={"fieldManager": FIELD_MANAGER},
            content_type="application/merge-patch+json",
        )
        return out

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        kind = kind_of(obj)
        out: dict[str, Any] = self._call(
            "POST", kind.collection(obj["metadata"]["namespace"]), body=dict(obj), query={"fieldManager": FIELD_MANAGER}
        )
        return out

    def update(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """PUT with the object's resourceVersion: fails with 409 if it changed meanwhile."""
        kind = kind_of(obj)
        meta = obj["metadata"]
        out: dict[str, Any] = self._call(
            "PUT", f"{kind.collection(meta['namespace'])}/{meta['name']}", body=dict(obj),
            query={"fieldManager": FIELD_MANAGER},
        )
        return out

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        k = KINDS[(api_version, kind)]
        try:
            self._call("DELETE", f"{k.collection(namespace)}/{name}", body={"propagationPolicy": "Background"})
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def patch_pool_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        k = KINDS[(f"{GROUP}/{VERSION}", "InferencePool")]
        # Lists are replaced whole by a merge patch, which is what destinations and conditions need.
        self._call(
            "PATCH",
            f"{k.collection(namespace)}/{name}/status",
            body={"status": dict(status)},
            content_type="application/merge-patch+json",
        )

    # --- reads -------------------------------------------------------------------------------------

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        k = KINDS[(api_version, kind)]
        try:
            out: dict[str, Any] = self._call("GET", f"{k.collection(namespace)}/{name}")
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise
        return out

    def get_path(self, path: str) -> dict[str, Any] | None:
        """The object at an API path (for kinds outside `KINDS`); None when it does not exist."""
        try:
            out: dict[str, Any] = self._call("GET", path)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise
        return out

    def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        k = KINDS[(api_version, kind)]
        out = self._call("GET", k.collection(namespace), query={"labelSelector": label_selector})
        return list(out.get("items") or [])

    def pod_log(self, namespace: str, name: str, container: str, limit_bytes: int = 4 << 20) -> str | None:
        """The container's log, or None when the server cannot get it (yet)."""
        path = f"/api/v1/namespaces/{namespace}/pods/{name}/log"
        try:
            text = self._call(
                "GET", path, query={"container": container, "limitBytes": str(limit_bytes)}, raw=True
            )
        except KubeError as exc:
            if exc.status in (0, 400, 404, 500, 502, 503):
                return None
            raise
        return str(text)

    def serves(self, group: str, version: str, plural: str) -> bool:
        """Whether the API server serves this resource (a CRD installed), cached for a while."""
        key = f"{group}/{version}/{plural}"
        now = time.monotonic()
        with self._lock:
            cached = self._discovered.get(key)
        if cached and now - cached[0] < self._discovery_ttl:
            return cached[1]
        try:
            listing = self._call("GET", f"/apis/{group}/{version}")
            found = any(r.get("name") == plural for r in listing.get("resources") or [])
        except KubeError as exc:
            if exc.status != 404:
                raise
            found = False
        with self._lock:
            self._discovered[key] = (now, found)
        return found
