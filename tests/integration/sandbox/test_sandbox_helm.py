"""The pinned helm installs a chart into the sandbox."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from cacheroute.sandbox.binaries import HELM_VERSION, locate
from cacheroute.sandbox.cluster import Sandbox

pytestmark = pytest.mark.integration


def write_chart(directory: Path) -> Path:
    chart = directory / "probe"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("greeting: hello\n")
    (chart / "templates" / "configmap.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-probe\n"
        "data:\n  greeting: {{ .Values.greeting | quote }}\n"
    )
    return chart


def test_helm_installs_a_chart(sandbox: Sandbox, kube_api: Any, namespace: str, tmp_path: Path) -> None:
    helm = str(locate("helm").path)
    version = subprocess.run([helm, "version", "--short"], capture_output=True, text=True, check=True).stdout
    assert version.startswith(HELM_VERSION)
    subprocess.run(
        [
            helm,
            "install",
            "demo",
            str(write_chart(tmp_path)),
            "--namespace",
            namespace,
            "--set",
            "greeting=hi",
            "--wait",
            "--timeout",
            "60s",
        ],
        env=sandbox.env(),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    configmap = client.CoreV1Api(kube_api).read_namespaced_config_map("demo-probe", namespace)
    assert configmap.data == {"greeting": "hi"}
    listed = subprocess.run(
        [helm, "list", "--namespace", namespace, "-o", "json"],
        env=sandbox.env(),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert [(r["name"], r["status"]) for r in json.loads(listed)] == [("demo", "deployed")]
