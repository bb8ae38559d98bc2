"""Test helpers for the Helm chart: the pinned helm against the sandbox, and server-side dry runs.

- `Helm(sandbox)`: `helm lint|template|install|upgrade|uninstall` with the sandbox's kubeconfig;
  a failing command raises `HelmError` carrying helm's own message;
- `server_side_apply(api, objects, dry_run=True)`: each object sent as a server-side apply with
  strict field validation, so the API server (schemas, admission, RBAC of the caller) judges it
  without keeping anything when `dry_run`;
- `prometheus_operator_crds()`: ServiceMonitor and PodMonitor CRDs written for these tests from
  the Prometheus Operator's documented fields (not the upstream CRDs), so the chart's monitors can
  be dry-run against a schema that refuses unknown fields.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cacheroute.sandbox.apierrors import api_message
from cacheroute.sandbox.binaries import locate
from cacheroute.sandbox.cluster import Sandbox

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "cacheroute"
SANDBOX_VALUES = CHART / "ci" / "sandbox-values.yaml"
FIELD_MANAGER = "cacheroute-tests"


class HelmError(RuntimeError):
    """helm exited non-zero; the message is its stderr."""


def set_args(values: Mapping[str, Any]) -> list[str]:
    """`--set-json path=value` for each value (JSON keeps types: "2" stays a string, 2 a number)."""
    out: list[str] = []
    for path, value in values.items():
        out += ["--set-json", f"{path}={json.dumps(value)}"]
    return out


@dataclass
class Helm:
    sandbox: Sandbox | None = None
    timeout: float = 300.0
    binary: str = field(default_factory=lambda: str(locate("helm").path))

    def run(self, *args: str, timeout: float | None = None) -> str:
        env = self.sandbox.env() if self.sandbox is not None else None
        done = subprocess.run(
            [self.binary, *args], capture_output=True, text=True, env=env, timeout=timeout or self.timeout, check=False
        )
        if done.returncode != 0:
            raise HelmError(done.stderr.strip() or done.stdout.strip())
        return done.stdout

    def lint(self, values: Mapping[str, Any] | None = None, files: Sequence[Path] = ()) -> str:
        return self.run("lint", "--strict", str(CHART), *_files(files), *set_args(values or {}))

    def template(
        self, release: str, namespace: str, values: Mapping[str, Any] | None = None, files: Sequence[Path] = ()
    ) -> list[dict[str, Any]]:
        text = self.run("template", release, str(CHART), "--namespace", namespace, *_files(files),
                        *set_args(values or {}))
        return [doc for doc in yaml.safe_load_all(text) if doc]

    def install(self, release: str, namespace: str, values: Mapping[str, Any], files: Sequence[Path] = ()) -> str:
        return self.run("install", release, str(CHART), "--namespace", namespace, *_files(files),
                        *set_args(values), "--wait", "--timeout", f"{int(self.timeout)}s")

    def upgrade(self, release: str, namespace: str, values: Mapping[str, Any], files: Sequence[Path] = ()) -> str:
        return self.run("upgrade", release, str(CHART), "--namespace", namespace, *_files(files),
                        *set_args(values), "--wait", "--timeout", f"{int(self.timeout)}s")

    def uninstall(self, release: str, namespace: str) -> str:
        return self.run("uninstall", release, "--namespace", namespace, "--wait", "--timeout", f"{int(self.timeout)}s")

    def status(self, release: str, namespace: str) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.run("status", release, "--namespace", namespace, "-o", "json"))
        return out


def _files(files: Sequence[Path]) -> list[str]:
    return [arg for path in files for arg in ("--values", str(path))]


def server_side_apply(api: Any, objects: Iterable[Mapping[str, Any]], *, dry_run: bool = True) -> list[str]:
    """Apply each object server-side (strict field validation); returns the errors, one line each."""
    from kubernetes import dynamic
    from kubernetes.client import ApiException

    client = dynamic.DynamicClient(api)
    errors = []
    for obj in objects:
        kind, name = obj["kind"], obj["metadata"]["name"]
        try:
            resource = client.resources.get(api_version=obj["apiVersion"], kind=kind)
            client.server_side_apply(
                resource,
                body=dict(obj),
                namespace=obj["metadata"].get("namespace"),
                field_manager=FIELD_MANAGER,
                force_conflicts=True,
                dry_run="All" if dry_run else None,
                query_params=[("fieldValidation", "Strict")],
            )
        except ApiException as exc:
            errors.append(f"{kind}/{name}: {api_message(exc)}")
        except dynamic.exceptions.ResourceNotFoundError as exc:
            errors.append(f"{kind}/{name}: {exc}")
    return errors


def _object_schema(properties: Mapping[str, Any], required: Sequence[str] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": dict(properties)}
    if required:
        out["required"] = list(required)
    return out


def _label_selector() -> dict[str, Any]:
    requirement = _object_schema(
        {"key": {"type": "string"}, "operator": {"type": "string"},
         "values": {"type": "array", "items": {"type": "string"}}},
        ["key", "operator"],
    )
    return _object_schema(
        {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
         "matchExpressions": {"type": "array", "items": requirement}}
    )


def _endpoint(port_fields: Mapping[str, Any]) -> dict[str, Any]:
    duration = {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                                             "(([0-9]+)s)?(([0-9]+)ms)?)$"}
    return _object_schema(
        {**port_fields, "path": {"type": "string"}, "scheme": {"type": "string", "enum": ["http", "https"]},
         "interval": duration, "scrapeTimeout": duration, "honorLabels": {"type": "boolean"}}
    )


def _monitor_crd(kind: str, plural: str, endpoints: str, port_fields: Mapping[str, Any]) -> dict[str, Any]:
    spec = _object_schema(
        {
            "jobLabel": {"type": "string"},
            "podTargetLabels": {"type": "array", "items": {"type": "string"}},
            "namespaceSelector": _object_schema(
                {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}
            ),
            "selector": _label_selector(),
            endpoints: {"type": "array", "items": _endpoint(port_fields)},
        },
        ["selector"],
    )
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": _object_schema({
                        "apiVersion": {"type": "string"}, "kind": {"type": "string"},
                        "metadata": {"type": "object"}, "spec": spec,
                    }, ["spec"])},
                }
            ],
        },
    }


def prometheus_operator_crds() -> list[dict[str, Any]]:
    """ServiceMonitor (`spec.endpoints[].port`: a Service port name) and PodMonitor
    (`spec.podMetricsEndpoints[].port`: a container port name, or `portNumber`)."""
    return [
        _monitor_crd("ServiceMonitor", "servicemonitors", "endpoints",
                     {"port": {"type": "string"}, "targetPort": {"x-kubernetes-int-or-string": True}}),
        _monitor_crd("PodMonitor", "podmonitors", "podMetricsEndpoints",
                     {"port": {"type": "string"}, "portNumber": {"type": "integer", "minimum": 1, "maximum": 65535}}),
    ]


def example_objects(namespace: str) -> list[dict[str, Any]]:
    """Every manifest of examples/, placed in `namespace` (as `kubectl apply -n NS -f examples/`)."""
    objects = []
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                doc["metadata"]["namespace"] = namespace
                objects.append(doc)
    return objects
