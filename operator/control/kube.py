"""The API calls of the control loop: the pool, the AffinityPlan's status, the plan ConfigMaps.

The kubernetes client blocks, so every call here is synchronous and the loop runs it in a worker
thread. Not-found comes back as None; other API errors raise `ApiError` with a one-line message.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from urllib3.exceptions import HTTPError

from cacheroute.operator.api.common import GROUP, VERSION
from cacheroute.operator.fleet.cluster import namespace_terminating

log = logging.getLogger(__name__)

POOL_PLURAL = "inferencepools"
# The "From" of the operator's Events in `kubectl describe`.
EVENT_SOURCE = "cacheroute-operator"
PLAN_PLURAL = "affinityplans"


class ApiError(RuntimeError):
    """An API server call failed (not a missing object)."""


def _fail(what: str, exc: Any) -> ApiError:
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None) or type(exc).__name__
    return ApiError(f"{what} failed: {status or ''} {reason}".replace("  ", " ").strip())


def default_api_client() -> Any:
    """An API client: in-cluster credentials, else the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        return config.new_client_from_config()
    return client.ApiClient(configuration)


# An Event repeated about one object (same type and reason) within this long is one Event counted
# again, as Kubernetes' own recorders aggregate: a plan rejected every period reads "x15 over 25m"
# in `kubectl describe`, not fifteen Events.
EVENT_SERIES_S = 600.0
_SERIES_KEPT = 4096


@dataclass
class _Told:
    name: str
    count: int
    at: float  # monotonic time of the last telling


class ControlApi:
    """Typed-enough wrappers over the kubernetes client for one API server."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self._exception = client.ApiException
        self._series: dict[tuple[str, str, str, str], _Told] = {}
        self._series_lock = threading.Lock()

    def get_pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            obj: dict[str, Any] = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, POOL_PLURAL, name)
        except self._exception as exc:
            if exc.status == 404:
                return None
            raise _fail(f"reading InferencePool {namespace}/{name}", exc) from None
        return obj

    def get_plan(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            obj: dict[str, Any] = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLAN_PLURAL, name)
        except self._exception as exc:
            if exc.status == 404:
                return None
            raise _fail(f"reading AffinityPlan {namespace}/{name}", exc) from None
        return obj

    def patch_plan_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        try:
            self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLAN_PLURAL, name, {"status": dict(status)}
            )
        except self._exception as exc:
            if exc.status == 404:
                return  # deleted while the period ran
            raise _fail(f"updating the status of AffinityPlan {namespace}/{name}", exc) from None

    def read_configmap_files(self, namespace: str, name: str) -> tuple[dict[str, bytes], Mapping[str, str]] | None:
        """(binaryData files, annotations) of a ConfigMap; None when it does not exist."""
        try:
            cm = self.core.read_namespaced_config_map(name, namespace)
        except self._exception as exc:
            if exc.status == 404:
                return None
            raise _fail(f"reading ConfigMap {namespace}/{name}", exc) from None
        files = {k: base64.b64decode(v) for k, v in (cm.binary_data or {}).items()}
        return files, dict(cm.metadata.annotations or {})

    def configmap_annotations(self, namespace: str, name: str) -> Mapping[str, str] | None:
        """A ConfigMap's annotations, its data left on the server (metadata only: a plan's header
        ConfigMap holds up to a MiB); None when it does not exist."""
        try:
            response = self.core.api_client.call_api(
                "/api/v1/namespaces/{namespace}/configmaps/{name}", "GET",
                {"namespace": namespace, "name": name},
                [],
                {"Accept": "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"},
                response_type="object",
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
            )
        except self._exception as exc:
            if exc.status == 404:
                return None
            raise _fail(f"reading ConfigMap {namespace}/{name}", exc) from None
        return dict(((response or {}).get("metadata") or {}).get("annotations") or {})

    def set_configmap_annotation(self, namespace: str, name: str, key: str, value: str | None) -> None:
        """Set one annotation of a ConfigMap (None removes it); nothing when the ConfigMap does not exist."""
        try:
            self.core.patch_namespaced_config_map(name, namespace, {"metadata": {"annotations": {key: value}}})
        except self._exception as exc:
            if exc.status != 404:
                raise _fail(f"writing ConfigMap {namespace}/{name}", exc) from None

    def write_configmap_files(
        self,
        namespace: str,
        name: str,
        files: Mapping[str, bytes | None],
        *,
        annotations: Mapping[str, str],
        create_metadata: Mapping[str, Any],
    ) -> None:
        """Set (or, with None, remove) files of a ConfigMap's binaryData, creating it if absent.

        A merge patch touches only the named files and annotations: labels and owners that the
        pool's reconciler sets stay as they are.
        """
        data = {k: base64.b64encode(v).decode("ascii") if v is not None else None for k, v in files.items()}
        patch = {"metadata": {"annotations": dict(annotations)}, "binaryData": data}
        try:
            self.core.patch_namespaced_config_map(name, namespace, patch)
            return
        except self._exception as exc:
            if exc.status != 404:
                raise _fail(f"writing ConfigMap {namespace}/{name}", exc) from None
        body = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {**create_metadata, "name": name, "namespace": namespace, "annotations": dict(annotations)},
            "binaryData": {k: v for k, v in data.items() if v is not None},
        }
        try:
            self.core.create_namespaced_config_map(namespace, body)
        except self._exception as exc:
            if exc.status == 409:  # created meanwhile (by the pool's reconciler): patch that one
                try:
                    self.core.patch_namespaced_config_map(name, namespace, patch)
                    return
                except self._exception as again:
                    raise _fail(f"writing ConfigMap {namespace}/{name}", again) from None
            raise _fail(f"creating ConfigMap {namespace}/{name}", exc) from None

    def post_event(self, involved: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        """Post an Event about the object `involved` (a body) and return once the API server holds
        it. A refusal is logged, not raised: an Event is worth less than the work it tells of."""
        meta = involved.get("metadata") or {}
        namespace = str(meta.get("namespace") or "default")
        now = datetime.now(UTC).isoformat()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta.get('name', 'cacheroute')}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": involved.get("apiVersion"), "kind": involved.get("kind"),
                "name": meta.get("name"), "namespace": namespace, "uid": meta.get("uid"),
            },
            "type": kind,
            "reason": reason,
            "message": message,
            "source": {"component": EVENT_SOURCE},
            "reportingComponent": EVENT_SOURCE,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        key = (namespace, str(meta.get("uid") or meta.get("name")), kind, reason)
        try:
            if self._count_again(key, namespace, message, now):
                return
            created = self.core.create_namespaced_event(namespace, body)
        except (self._exception, HTTPError, OSError) as exc:
            self._not_posted(exc, namespace, kind, reason, message)
            return
        with self._series_lock:
            if len(self._series) >= _SERIES_KEPT:
                self._series.clear()
            self._series[key] = _Told(created.metadata.name, 1, time.monotonic())

    def _count_again(self, key: tuple[str, str, str, str], namespace: str, message: str, now: str) -> bool:
        """Count a repeat on the Event that told it first, when recent; False when there is none
        (or it expired from the API server meanwhile). Two repeats at once may count as one."""
        with self._series_lock:
            told = self._series.get(key)
            if told is None or time.monotonic() - told.at > EVENT_SERIES_S:
                return False
            count = told.count + 1
        patch = {"count": count, "lastTimestamp": now, "message": message}
        try:
            self.core.patch_namespaced_event(told.name, namespace, patch)
        except self._exception as exc:
            if exc.status == 404:
                return False
            raise
        with self._series_lock:
            told.count = max(told.count, count)
            told.at = time.monotonic()
        return True

    @staticmethod
    def _not_posted(exc: Exception, namespace: str, kind: str, reason: str, message: str) -> None:
        if namespace_terminating(exc):
            # Its objects are going too: nobody will read the Event, and nothing is wrong.
            log.info("%s Event %s not posted: namespace %s is being deleted", kind, reason, namespace)
            return
        log.warning("%s Event %s (%s) not posted: %s", kind, reason, message, _fail("posting it", exc))
