"""Environment variables and command lines resolved as the kubelet resolves them."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from cacheroute.sandbox.runtime.podenv import (
    ConfigError,
    command_line,
    container_env,
    expand,
    map_python_path,
    quantity,
    service_variables,
)

POD: dict[str, Any] = {
    "metadata": {"name": "web-0", "namespace": "shop", "uid": "u-1", "labels": {"app": "web"}},
    "spec": {"nodeName": "kwok-h100-1", "serviceAccountName": "router"},
    "status": {"podIP": "127.1.1.5", "hostIP": "127.0.0.1"},
}
OBJECTS = {
    ("configmap", "shop", "settings"): {"data": {"mode": "fast", "level": "3"}},
    ("secret", "shop", "creds"): {"data": {"token": base64.b64encode(b"s3cret").decode()}},
}


def lookup(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    return OBJECTS.get((kind, namespace, name))


def test_dollar_references_expand_like_kubernetes() -> None:
    env = {"POD_IP": "127.1.1.5", "PORT": "8000"}
    assert expand("--host=$(POD_IP):$(PORT)", env) == "--host=127.1.1.5:8000"
    assert expand("$(MISSING) stays", env) == "$(MISSING) stays"
    assert expand("$$(POD_IP) escaped, $$ too", env) == "$(POD_IP) escaped, $ too"
    assert expand("unclosed $(POD_IP", env) == "unclosed $(POD_IP"


def test_environment_from_values_fields_configmaps_and_secrets_in_order() -> None:
    container = {
        "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "CFG_"}],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "SA", "valueFrom": {"fieldRef": {"fieldPath": "spec.serviceAccountName"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}}},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
            {"name": "ADDR", "value": "$(POD_IP):$(LATER)"},
            {"name": "LATER", "value": "9"},
            {"name": "CFG_mode", "value": "overridden"},
            {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu", "divisor": "1m"}}},
        ],
        "resources": {"limits": {"cpu": "2"}},
    }
    env = container_env(POD, container, lookup, service_variables("127.0.0.1", 6443))
    assert env["POD_IP"] == "127.1.1.5"
    assert (env["NAME"], env["NS"], env["NODE"], env["SA"], env["APP"]) == (
        "web-0", "shop", "kwok-h100-1", "router", "web"
    )
    assert env["MODE"] == "fast"
    assert env["TOKEN"] == "s3cret"
    # Only variables defined before it expand.
    assert env["ADDR"] == "127.1.1.5:$(LATER)"
    assert env["CFG_level"] == "3"
    assert env["CFG_mode"] == "overridden"
    assert env["CPU"] == "2000"
    assert env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
    assert env["KUBERNETES_SERVICE_PORT"] == "6443"


def test_missing_references_block_the_container_unless_optional() -> None:
    missing_key = {"env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "nope"}}}]}
    with pytest.raises(ConfigError, match="couldn't find key nope"):
        container_env(POD, missing_key, lookup, {})
    optional = {"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "gone", "key": "k", "optional": True}}}]}
    assert "X" not in container_env(POD, optional, lookup, {})
    with pytest.raises(ConfigError, match="configmap 'absent' not found"):
        container_env(POD, {"envFrom": [{"configMapRef": {"name": "absent"}}]}, lookup, {})


def test_command_and_args_replace_the_entry_point_as_in_kubernetes() -> None:
    env = {"POD_IP": "127.1.1.5"}
    entry = ["/venv/bin/cacheroute"]
    assert command_line({"args": ["router", "serve", "--grpc-host=$(POD_IP)"]}, env, entry) == [
        "/venv/bin/cacheroute", "router", "serve", "--grpc-host=127.1.1.5"
    ]
    assert command_line({"command": ["sh", "-c", "echo $(POD_IP)"]}, env, entry) == ["sh", "-c", "echo 127.1.1.5"]
    assert command_line({}, env, entry, image_args=["--help"]) == ["/venv/bin/cacheroute", "--help"]


def test_quantities() -> None:
    assert quantity("500m") == pytest.approx(0.5)
    assert quantity("1Gi") == 1 << 30
    assert quantity("2e3") == 2000
    with pytest.raises(ConfigError):
        quantity("lots")


def test_a_pythonpath_entry_naming_an_image_folder_points_at_its_local_copy() -> None:
    env = {"PYTHONPATH": "/opt/cacheroute/native:/extra", "HOME": "/opt/cacheroute/native"}
    map_python_path(env, {"/opt/cacheroute/native": "/cache/router-native-1"})
    assert env == {"PYTHONPATH": "/cache/router-native-1:/extra", "HOME": "/opt/cacheroute/native"}
    unmapped = {"PYTHONPATH": "/opt/cacheroute/native"}
    map_python_path(unmapped, {})
    assert unmapped == {"PYTHONPATH": "/opt/cacheroute/native"}
