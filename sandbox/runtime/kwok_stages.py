"""kwok pod stages that leave the pods the runtime serves to the runtime.

kwok's default pod lifecycle marks a scheduled pod Running *and Ready* at once, and deletes a
terminating pod at once. With the pod runtime on, pods of registered images (see
`images.ImageRegistry.served`) instead get from kwok only what kwok alone can give them, an IP from
the node's pod CIDR and phase Running with containers still being created; readiness, container
states, restarts and the final deletion come from the runtime. Every other pod goes through the
same stages as kwok's defaults (ready at once, Job pods completed, deleted at once).

Stages are matched on every change of a pod; exactly one stage may match a pod at a time, so the
runtime's pods are excluded from the default stages by the registry's CEL predicate.
"""

from __future__ import annotations

from typing import Any

API_VERSION = "kwok.x-k8s.io/v1alpha1"
_POD = {"apiGroup": "v1", "kind": "Pod"}
_NOT_DELETING = {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"}
_NO_IP = {"key": ".status.podIP", "operator": "DoesNotExist"}
_ADDRESSES = """
hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
podIP: {{ PodIPWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) \
( or .metadata.name "" ) ( or .metadata.namespace "" ) | Quote }}
phase: Running
startTime: {{ $now | Quote }}
"""

# Init containers are not run by kwok nor by the runtime: they are reported done (sidecars running).
_INIT_DONE = """
initContainerStatuses:
{{ range .spec.initContainers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  ready: true
  restartCount: 0
  {{ if eq .restartPolicy "Always" }}
  started: true
  state: {running: {startedAt: {{ $now | Quote }}}}
  {{ else }}
  state: {terminated: {exitCode: 0, reason: Completed, startedAt: {{ $now | Quote }}, finishedAt: {{ $now | Quote }}}}
  {{ end }}
{{ end }}"""

# What kwok does by default: every condition true, every container running and ready.
_READY = (
    """{{ $now := Now }}
conditions:
- {type: Initialized, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: Ready, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: ContainersReady, status: "True", lastTransitionTime: {{ $now | Quote }}}
{{ range .spec.readinessGates }}
- {type: {{ .conditionType | Quote }}, status: "True", lastTransitionTime: {{ $now | Quote }}}
{{ end }}
containerStatuses:
{{ range .spec.containers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  ready: true
  restartCount: 0
  state: {running: {startedAt: {{ $now | Quote }}}}
{{ end }}"""
    + _INIT_DONE
    + _ADDRESSES
)

# For the runtime's pods: an address and phase Running, containers not started, nothing ready.
_ASSIGNED = (
    """{{ $now := Now }}
conditions:
- {type: PodReadyToStartContainers, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: Initialized, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: Ready, status: "False", reason: ContainersNotReady, lastTransitionTime: {{ $now | Quote }}}
- {type: ContainersReady, status: "False", reason: ContainersNotReady, lastTransitionTime: {{ $now | Quote }}}
containerStatuses:
{{ range .spec.containers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  ready: false
  started: false
  restartCount: 0
  state: {waiting: {reason: ContainerCreating}}
{{ end }}"""
    + _INIT_DONE
    + _ADDRESSES
)

_COMPLETED = """{{ $now := Now }}
containerStatuses:
{{ range .spec.containers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  ready: false
  started: false
  restartCount: 0
  state: {terminated: {exitCode: 0, reason: Completed, startedAt: {{ $now | Quote }}, finishedAt: {{ $now | Quote }}}}
{{ end }}
phase: Succeeded
"""


def _stage(name: str, expressions: list[dict[str, Any]], next_: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "Stage",
        "metadata": {"name": name},
        "spec": {"resourceRef": dict(_POD), "selector": {"matchExpressions": expressions}, "next": next_},
    }


def pod_stages(served: str | None) -> list[dict[str, Any]]:
    """kwok's pod stages; `served` is the CEL predicate of the runtime's pods (None: no runtime)."""
    others = [{"cel": {"expression": f"!({served})"}}] if served else []
    mine = [{"cel": {"expression": served}}] if served else []
    stages = [
        _stage("pod-ready", [_NOT_DELETING, _NO_IP, *others], {"statusTemplate": _READY}),
        _stage(
            "pod-complete",
            [
                _NOT_DELETING,
                {"key": ".status.phase", "operator": "In", "values": ["Running"]},
                {"key": ".metadata.ownerReferences.[].kind", "operator": "In", "values": ["Job"]},
            ],
            {"statusTemplate": _COMPLETED},
        ),
        _stage(
            "pod-delete",
            [{"key": ".metadata.deletionTimestamp", "operator": "Exists"}, *others],
            {"finalizers": {"empty": True}, "delete": True},
        ),
    ]
    if served:
        stages.append(_stage("pod-runtime-assign", [_NOT_DELETING, _NO_IP, *mine], {"statusTemplate": _ASSIGNED}))
    return stages


def logs_crd() -> dict[str, Any]:
    """kwok's `Logs` resource (per pod: which file holds which container's log), schema left open."""
    open_object = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "logs.kwok.x-k8s.io"},
        "spec": {
            "group": "kwok.x-k8s.io",
            "names": {"kind": "Logs", "listKind": "LogsList", "plural": "logs", "singular": "logs"},
            "scope": "Namespaced",
            "versions": [
                {
                    "name": "v1alpha1",
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {"spec": open_object, "status": open_object},
                        }
                    },
                }
            ],
        },
    }
