"""The chart installed with helm, the demo's manifests applied through the API, readiness awaited.

Nothing here is specific to a test: this is what a user does with `helm install` and
`kubectl apply`, against the sandbox's API server, with the waits a script would add.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from cacheroute.sandbox import crds
from cacheroute.sandbox.apierrors import api_message
from cacheroute.sandbox.binaries import locate
from cacheroute.sandbox.cluster import Sandbox
from cacheroute.sandbox.demo.settings import CHART, MANIFESTS, SANDBOX_VALUES, DemoSettings

GROUP, VERSION = "cacheroute.dev", "v1alpha1"
OUR_CRDS = ("inferencepools.cacheroute.dev", "affinityplans.cacheroute.dev")
FIELD_MANAGER = "cacheroute-demo"


class DemoError(RuntimeError):
    """A step of the demo did not happen; the message says which and what was seen."""


def await_true(check: Callable[[], bool], what: str, timeout: float, interval: float = 0.5) -> None:
    """Poll `check` until it holds; a check that raises counts as "not yet" until the deadline,
    except with DemoError: an outcome that waiting cannot change."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            if check():
                return
        except DemoError:
            raise
        except Exception as exc:  # a server still starting refuses, a new object is not there yet
            last = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last})" if last else ""
            raise DemoError(f"timed out after {timeout:.0f}s waiting for {what}{detail}")
        time.sleep(interval)


# --- helm ------------------------------------------------------------------------------------------


def helm_values(settings: DemoSettings, prometheus_url: str) -> dict[str, Any]:
    """The chart's values for the demo, on top of the chart's sandbox values file."""
    return {
        # One operator replica: the machine is small, and peering is not what the demo shows.
        "operator.replicas": 1,
        "operator.watch.allNamespaces": False,
        "operator.watch.namespaces": [settings.namespace],
        "prometheus.url": prometheus_url,
        # The pod runtime honours probe periods and grace periods as a kubelet would: short ones
        # make the set-up and the tear-down seconds instead of minutes.
        "operator.readinessProbe": {"periodSeconds": 1},
        "engine.probePeriodSeconds": 1,
        "engine.drainSeconds": 1,
        "engine.terminationGracePeriodSeconds": 5,
    }


def helm_install(sandbox: Sandbox, settings: DemoSettings, prometheus_url: str) -> str:
    """`helm install RELEASE helm/cacheroute --wait`; returns helm's notes."""
    args = ["install", settings.release, str(CHART), "--namespace", settings.namespace, "--create-namespace",
            "--values", str(SANDBOX_VALUES)]
    for path, value in helm_values(settings, prometheus_url).items():
        args += ["--set-json", f"{path}={json.dumps(value)}"]
    args += ["--wait", "--timeout", f"{int(settings.step_timeout_s)}s"]
    return _helm(sandbox, args, settings.step_timeout_s + 30)


def helm_uninstall(sandbox: Sandbox, settings: DemoSettings) -> None:
    _helm(sandbox, ["uninstall", settings.release, "--namespace", settings.namespace, "--wait",
                    "--timeout", "120s"], 150)


def _helm(sandbox: Sandbox, args: Sequence[str], timeout: float) -> str:
    binary = str(locate("helm").path)
    done = subprocess.run([binary, *args], capture_output=True, text=True, env=sandbox.env(), timeout=timeout,
                          check=False)
    if done.returncode != 0:
        raise DemoError(f"helm {args[0]}: {(done.stderr or done.stdout).strip()}")
    return done.stdout


def adopt_crds(api: Any, settings: DemoSettings) -> None:
    """Hand CRDs applied earlier to this release; a fresh cluster has none and this does nothing."""
    crds.adopt_crds(api, settings.release, settings.namespace, OUR_CRDS)


# --- manifests -------------------------------------------------------------------------------------


def demo_manifests(settings: DemoSettings) -> list[dict[str, Any]]:
    """examples/demo/*.yaml in the demo's namespace, with the run's fleet size and window."""
    objects: list[dict[str, Any]] = []
    for path in sorted(Path(MANIFESTS).glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            doc["metadata"]["namespace"] = settings.namespace
            if doc["kind"] == "InferencePool":
                doc["metadata"]["name"] = settings.pool
                doc["spec"]["replicas"] = settings.destinations
                doc["spec"].setdefault("router", {})["followPrefixes"] = settings.follow_prefixes
            elif doc["kind"] == "AffinityPlan":
                doc["metadata"]["name"] = settings.plan
                doc["spec"]["poolRef"]["name"] = settings.pool
                doc["spec"].setdefault("guard", {})["enabled"] = settings.guard
            objects.append(doc)
    return objects


def apply(api: Any, objects: Sequence[Mapping[str, Any]]) -> None:
    """Server-side apply with strict field validation, as `kubectl apply --server-side` does."""
    from kubernetes import dynamic
    from kubernetes.client import ApiException

    dyn = dynamic.DynamicClient(api)
    for obj in objects:
        resource = dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        try:
            dyn.server_side_apply(resource, body=dict(obj), namespace=obj["metadata"].get("namespace"),
                                  field_manager=FIELD_MANAGER, force_conflicts=True,
                                  query_params=[("fieldValidation", "Strict")])
        except ApiException as exc:
            raise DemoError(f"{obj['kind']}/{obj['metadata']['name']}: {api_message(exc)}") from None


def get_object(api: Any, namespace: str, plural: str, name: str) -> dict[str, Any]:
    from kubernetes import client

    obj: dict[str, Any] = client.CustomObjectsApi(api).get_namespaced_custom_object(
        GROUP, VERSION, namespace, plural, name)
    return obj


def condition(obj: Mapping[str, Any], kind: str) -> dict[str, Any]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return dict(c)
    return {}


def set_plan_mode(api: Any, settings: DemoSettings, mode: str, *, metrics_window: str | None = None) -> None:
    from kubernetes import client

    spec: dict[str, str] = {"mode": mode}
    if metrics_window is not None:
        spec["metricsWindow"] = metrics_window
    client.CustomObjectsApi(api).patch_namespaced_custom_object(
        GROUP, VERSION, settings.namespace, "affinityplans", settings.plan, {"spec": spec})


def await_pool_ready(api: Any, settings: DemoSettings) -> dict[str, Any]:
    """Every destination ready (the real readiness probes of the emulators)."""
    def ready() -> bool:
        pool = get_object(api, settings.namespace, "inferencepools", settings.pool)
        status = pool.get("status") or {}
        return (condition(pool, "Ready").get("status") == "True"
                and status.get("readyReplicas") == settings.destinations)

    await_true(ready, f"InferencePool {settings.pool}: {settings.destinations} destinations ready",
               settings.step_timeout_s)
    return get_object(api, settings.namespace, "inferencepools", settings.pool)


def router_addresses(api: Any, settings: DemoSettings) -> list[str]:
    """Pod IPs of the pool's ready router pods (no kube-proxy in the sandbox: clients use pod IPs)."""
    from kubernetes import client

    selector = f"cacheroute.dev/pool={settings.pool},app.kubernetes.io/component=router"
    pods = client.CoreV1Api(api).list_namespaced_pod(settings.namespace, label_selector=selector).items
    return sorted(
        p.status.pod_ip for p in pods
        if p.metadata.deletion_timestamp is None and p.status.pod_ip
        and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
    )


def kubectl_get(api: Any, namespace: str, plural: str) -> list[list[str]]:
    """The API server's own table of `kubectl get PLURAL` (header row first), from the CRD's
    printer columns: what kubectl prints, without kubectl."""
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{plural}"
    data = api.call_api(path, "GET", header_params={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
                        response_type="object", auth_settings=["BearerToken"], _return_http_data_only=True,
                        _preload_content=True)
    columns = [c["name"] for c in data.get("columnDefinitions", []) if c.get("priority", 0) == 0]
    keep = [i for i, c in enumerate(data.get("columnDefinitions", [])) if c.get("priority", 0) == 0]
    rows = [[_cell(row["cells"][i]) for i in keep] for row in data.get("rows", [])]
    return [[c.upper() for c in columns], *rows]


def _cell(value: Any) -> str:
    if value is None:
        return "<none>"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
