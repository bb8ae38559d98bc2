"""A container's environment and command line, resolved as the kubelet resolves them.

- `envFrom` first, then `env` in order; a later variable overrides an earlier one;
- `value` may refer to variables defined before it (and to the service variables) as `$(NAME)`;
  `$$` escapes a `$`; an undefined reference stays as written;
- `valueFrom`: `fieldRef` (metadata.name/namespace/uid, labels and annotations by key,
  spec.nodeName, spec.serviceAccountName, status.podIP/podIPs/hostIP/hostIPs),
  `resourceFieldRef` (limits and requests), `configMapKeyRef`, `secretKeyRef`;
- then `command` and `args` are expanded against the final environment the same way.

The service variables of the `kubernetes` Service point at the real API server: there is no
kube-proxy in the sandbox, so its ClusterIP would lead nowhere.
"""

from __future__ import annotations

import base64
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

Obj = Mapping[str, Any]
# (kind "configmap" | "secret", namespace, name) -> the object, or None when it does not exist.
Lookup = Callable[[str, str, str], Obj | None]

_FIELD_LABEL = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")
_SUFFIXES: dict[str, Decimal | int] = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}


class ConfigError(ValueError):
    """The container cannot be configured yet (kubelet: CreateContainerConfigError)."""


def expand(text: str, variables: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion."""
    out: list[str] = []
    i = 0
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "$" and i + 1 < n:
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2 : end]
                    if name in variables:
                        out.append(variables[name])
                    else:
                        out.append(text[i : end + 1])
                    i = end + 1
                    continue
        out.append(ch)
        i += 1
    return "".join(out)


def quantity(text: str) -> Decimal:
    """A Kubernetes resource quantity as a number (`500m` is 0.5, `1Gi` is 2**30)."""
    match = re.fullmatch(r"([+-]?[0-9.]+)(?:[eE]([+-]?\d+))?([A-Za-z]*)", text.strip())
    if match is None or match.group(3) not in _SUFFIXES:
        raise ConfigError(f"{text!r} is not a resource quantity")
    try:
        value = Decimal(match.group(1))
    except InvalidOperation:
        raise ConfigError(f"{text!r} is not a resource quantity") from None
    if match.group(2):
        value *= Decimal(10) ** int(match.group(2))
    return value * Decimal(_SUFFIXES[match.group(3)])


def field_value(pod: Obj, path: str) -> str:
    meta = pod.get("metadata", {})
    spec = pod.get("spec", {})
    status = pod.get("status", {})
    simple: dict[str, Any] = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName") or "default",
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
        "status.podIPs": ",".join(p.get("ip", "") for p in status.get("podIPs") or []) or status.get("podIP"),
        "status.hostIPs": ",".join(p.get("ip", "") for p in status.get("hostIPs") or []) or status.get("hostIP"),
    }
    if path in simple:
        return str(simple[path] or "")
    match = _FIELD_LABEL.match(path)
    if match:
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1]) or {}
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    raise ConfigError(f"fieldRef {path!r} is not supported")


def resource_value(container: Obj, ref: Obj) -> str:
    resource = str(ref.get("resource", ""))
    section, _, name = resource.partition(".")
    if section not in ("limits", "requests") or not name:
        raise ConfigError(f"resourceFieldRef {resource!r} is not supported")
    resources = container.get("resources") or {}
    raw = (resources.get(section) or {}).get(name) or (resources.get("limits") or {}).get(name)
    if raw is None:
        # The kubelet falls back to the node's allocatable; the fake nodes are large.
        return "0"
    divisor = quantity(str(ref.get("divisor") or "1"))
    return str(math.ceil(quantity(str(raw)) / divisor))


def _key_ref(lookup: Lookup, kind: str, namespace: str, ref: Obj) -> str | None:
    name = str(ref.get("name", ""))
    key = str(ref.get("key", ""))
    optional = bool(ref.get("optional"))
    obj = lookup(kind, namespace, name)
    if obj is None:
        if optional:
            return None
        raise ConfigError(f"{kind} {name!r} not found")
    data = _data(kind, obj)
    if key not in data:
        if optional:
            return None
        raise ConfigError(f"couldn't find key {key} in {kind} {namespace}/{name}")
    return data[key].decode(errors="replace")


def _data(kind: str, obj: Obj) -> dict[str, bytes]:
    """The decoded contents of a ConfigMap (data and binaryData) or a Secret."""
    out: dict[str, bytes] = {}
    if kind == "secret":
        for key, value in (obj.get("data") or {}).items():
            out[key] = base64.b64decode(value)
        for key, value in (obj.get("stringData") or {}).items():
            out[key] = str(value).encode()
        return out
    for key, value in (obj.get("data") or {}).items():
        out[key] = str(value).encode()
    for key, value in (obj.get("binaryData") or {}).items():
        out[key] = base64.b64decode(value)
    return out


def object_data(kind: str, obj: Obj) -> dict[str, bytes]:
    return _data(kind, obj)


def service_variables(api_host: str, api_port: int) -> dict[str, str]:
    """The `kubernetes` Service's variables, as the kubelet injects them into every container."""
    address = f"tcp://{api_host}:{api_port}"
    return {
        "KUBERNETES_SERVICE_HOST": api_host,
        "KUBERNETES_SERVICE_PORT": str(api_port),
        "KUBERNETES_SERVICE_PORT_HTTPS": str(api_port),
        "KUBERNETES_PORT": address,
        f"KUBERNETES_PORT_{api_port}_TCP": address,
        f"KUBERNETES_PORT_{api_port}_TCP_PROTO": "tcp",
        f"KUBERNETES_PORT_{api_port}_TCP_PORT": str(api_port),
        f"KUBERNETES_PORT_{api_port}_TCP_ADDR": api_host,
    }


def container_env(pod: Obj, container: Obj, lookup: Lookup, service: Mapping[str, str]) -> dict[str, str]:
    """The variables the pod spec gives `container`, plus the service variables."""
    namespace = str(pod.get("metadata", {}).get("namespace", "default"))
    env: dict[str, str] = dict(service)
    for source in container.get("envFrom") or []:
        prefix = str(source.get("prefix") or "")
        for kind, field in (("configmap", "configMapRef"), ("secret", "secretRef")):
            ref = source.get(field)
            if ref is None:
                continue
            obj = lookup(kind, namespace, str(ref.get("name", "")))
            if obj is None:
                if ref.get("optional"):
                    continue
                raise ConfigError(f"{kind} {ref.get('name')!r} not found")
            for key, raw in _data(kind, obj).items():
                env[prefix + key] = raw.decode(errors="replace")
    for item in container.get("env") or []:
        name = str(item.get("name", ""))
        if "value" in item or "valueFrom" not in item:
            env[name] = expand(str(item.get("value") or ""), env)
            continue
        source = item["valueFrom"]
        value: str | None
        if "fieldRef" in source:
            value = field_value(pod, str(source["fieldRef"].get("fieldPath", "")))
        elif "resourceFieldRef" in source:
            value = resource_value(container, source["resourceFieldRef"])
        elif "configMapKeyRef" in source:
            value = _key_ref(lookup, "configmap", namespace, source["configMapKeyRef"])
        elif "secretKeyRef" in source:
            value = _key_ref(lookup, "secret", namespace, source["secretKeyRef"])
        else:
            raise ConfigError(f"env {name}: unsupported valueFrom {sorted(source)}")
        if value is not None:
            env[name] = value
    return env


def command_line(
    container: Obj, env: Mapping[str, str], entrypoint: Sequence[str], image_args: Sequence[str] = ()
) -> list[str]:
    """The argv the container runs: its command (else the image's entry point) and its args, expanded."""
    command = [expand(str(part), env) for part in container.get("command") or []]
    if "args" in container and container.get("args") is not None:
        args = [expand(str(part), env) for part in container.get("args") or []]
    else:
        args = list(image_args) if not command else []
    return [*(command or list(entrypoint)), *args]


def map_python_path(env: dict[str, str], folders: Mapping[str, str]) -> None:
    """Point the entries of `env`'s PYTHONPATH that name an image folder of `folders` at the local
    folder standing for it; other entries stay as they are."""
    raw = env.get("PYTHONPATH")
    if raw and folders:
        env["PYTHONPATH"] = os.pathsep.join(folders.get(entry, entry) for entry in raw.split(os.pathsep))
