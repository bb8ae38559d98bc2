"""A CustomResourceDefinition for the Gateway API Inference Extension's `InferencePool` (v1), for tests.

Written for this project from the documented fields (group inference.networking.k8s.io, version v1:
spec.selector.matchLabels, spec.targetPorts[].number, spec.appProtocol, spec.endpointPickerRef with
group, kind, name, port.number and failureMode; status.parents written by gateways). Enough schema
for the API server to check what the operator writes; not the upstream CRD.
"""

from __future__ import annotations

from typing import Any

GROUP = "inference.networking.k8s.io"


def gie_inferencepool_crd() -> dict[str, Any]:
    port = {"type": "object", "required": ["number"],
            "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}
    spec = {
        "type": "object",
        "required": ["selector", "targetPorts"],
        "properties": {
            "selector": {
                "type": "object",
                "required": ["matchLabels"],
                "properties": {
                    "matchLabels": {"type": "object", "maxProperties": 64, "additionalProperties": {"type": "string"}}
                },
            },
            "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": port},
            "appProtocol": {"type": "string", "enum": ["http", "kubernetes.io/h2c"]},
            "endpointPickerRef": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "group": {"type": "string", "default": ""},
                    "kind": {"type": "string", "default": "Service"},
                    "name": {"type": "string", "minLength": 1},
                    "port": port,
                    "failureMode": {"type": "string", "enum": ["FailOpen", "FailClose"], "default": "FailClose"},
                },
            },
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        # *.k8s.io groups need this annotation; "unapproved" marks a CRD that is not the upstream one.
        "metadata": {
            "name": f"inferencepools.{GROUP}",
            "annotations": {"api-approved.kubernetes.io": "unapproved, written for cacheroute's tests"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": "InferencePool", "plural": "inferencepools", "singular": "inferencepool",
                      "listKind": "InferencePoolList"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "required": ["spec"],
                            "properties": {
                                "spec": spec,
                                "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                            },
                        }
                    },
                }
            ],
        },
    }
