"""Installing CustomResourceDefinitions into a sandbox (tests, demo) with the Python client."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from kubernetes.client import ApiClient


def load_crds(paths: Iterable[Path]) -> list[dict[str, Any]]:
    documents = []
    for path in sorted(paths):
        for document in yaml.safe_load_all(path.read_text()):
            if document is None:
                continue
            if document.get("kind") != "CustomResourceDefinition":
                raise ValueError(f"{path}: expected kind CustomResourceDefinition, found {document.get('kind')!r}")
            documents.append(document)
    if not documents:
        raise ValueError("no CustomResourceDefinition found")
    return documents


def apply_crds(api_client: ApiClient, crds: list[dict[str, Any]], timeout: float = 30.0) -> list[str]:
    """Create or replace each CRD, then wait until all are Established; returns their names."""
    from kubernetes import client

    api = client.ApiextensionsV1Api(api_client)
    names = []
    for crd in crds:
        name = crd["metadata"]["name"]
        try:
            api.create_custom_resource_definition(crd)
        except client.ApiException as exc:
            if exc.status != 409:
                raise
            current = api.read_custom_resource_definition(name)
            replacement = {**crd, "metadata": {**crd["metadata"], "resourceVersion": current.metadata.resource_version}}
            api.replace_custom_resource_definition(name, replacement)
        names.append(name)
    deadline = time.monotonic() + timeout
    pending = set(names)
    while pending:
        for name in list(pending):
            conditions = api.read_custom_resource_definition(name).status.conditions or []
            if any(c.type == "Established" and c.status == "True" for c in conditions):
                pending.discard(name)
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"CRDs not Established after {timeout:.0f}s: {', '.join(sorted(pending))}")
        if pending:
            time.sleep(0.1)
    return names


def adopt_crds(api_client: Any, release: str, namespace: str, names: Iterable[str]) -> None:
    """Hand existing CRDs (applied from crds/ by hand, or by another release) to a Helm release,
    as docs/install.md tells users; a CRD that does not exist is skipped."""
    from kubernetes import client

    crds = client.ApiextensionsV1Api(api_client)
    for name in names:
        patch = {"metadata": {
            "labels": {"app.kubernetes.io/managed-by": "Helm"},
            "annotations": {"meta.helm.sh/release-name": release, "meta.helm.sh/release-namespace": namespace},
        }}
        try:
            crds.patch_custom_resource_definition(name, patch)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
