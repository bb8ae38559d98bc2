"""A simulated GPU cluster on one machine: real control plane, fake H100 nodes, Prometheus, Envoy.

The main entry points are `Sandbox` (start, attach, stop) and `SandboxOptions`; they are loaded
on first use so that `python -m cacheroute.sandbox.binaries` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cacheroute.sandbox.cluster import Sandbox, SandboxError, SandboxOptions

__all__ = ["Sandbox", "SandboxError", "SandboxOptions"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from cacheroute.sandbox import cluster

        return getattr(cluster, name)
    raise AttributeError(f"module 'cacheroute.sandbox' has no attribute {name!r}")
