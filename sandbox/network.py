"""The sandbox's pod network: addresses that are local to this machine and valid in EndpointSlices.

A pod IP must be an address a local process can bind (the pod runtime serves pods on them) and,
for the EndpointSlice controller, one the API server accepts in an endpoint: loopback addresses
(127.0.0.0/8) are refused there. So the pod network is `198.18.0.0/16` (from the block reserved
for network benchmarks, RFC 2544), made local with one route, `local 198.18.0.0/16 dev lo`: every
address in it is this machine's, as every 127.x address is. Adding the route needs root
(CAP_NET_ADMIN); without it the sandbox falls back to loopback pod addresses (`127.1.0.0/16`),
where everything works except EndpointSlices.

Several sandboxes may share the route; each holds a claim (a file named after its state directory,
holding the pid of its API server), and the last one to go removes the route.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

LOCAL_NETWORK = "198.18.0.0/16"
LOOPBACK_NETWORK = "127.1.0.0/16"
CLAIMS_ENV = "CACHEROUTE_POD_NETWORK_CLAIMS"


@dataclass(frozen=True)
class PodNetwork:
    cidr: str
    routed: bool  # True when this machine routes `cidr` locally because the sandbox said so

    def node_cidr(self, index: int) -> str:
        """Node `index`'s pod CIDR: the `index`-th /24 of the network."""
        network = ipaddress.IPv4Network(self.cidr)
        return str(list(network.subnets(new_prefix=24))[index])


def _claims_dir() -> Path:
    configured = os.environ.get(CLAIMS_ENV)
    return Path(configured) if configured else Path("/run/cacheroute/pod-network")


def _claim_file(state_dir: Path) -> Path:
    return _claims_dir() / hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:16]


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)


def _routed_locally(cidr: str) -> bool:
    try:
        result = _ip("route", "show", "table", "local", cidr)
    except (OSError, subprocess.SubprocessError):
        return False
    return result.returncode == 0 and f"local {cidr} dev lo" in result.stdout


def claim(state_dir: Path) -> tuple[PodNetwork, str | None]:
    """The network for a new sandbox, and why it is the loopback fallback (None when it is not)."""
    try:
        if not _routed_locally(LOCAL_NETWORK):
            result = _ip("route", "replace", "local", LOCAL_NETWORK, "dev", "lo")
            if result.returncode != 0:
                return PodNetwork(LOOPBACK_NETWORK, False), result.stderr.strip() or "ip route failed"
    except (OSError, subprocess.SubprocessError) as exc:
        return PodNetwork(LOOPBACK_NETWORK, False), f"cannot run `ip route`: {exc}"
    claims = _claims_dir()
    claims.mkdir(parents=True, exist_ok=True)
    _claim_file(state_dir).write_text(f"{state_dir.resolve()}\n")
    return PodNetwork(LOCAL_NETWORK, True), None


def set_owner(state_dir: Path, pid: int, program: str) -> None:
    """Tie the claim to a live process (the API server): a claim whose process is gone is stale."""
    path = _claim_file(state_dir)
    if path.exists():
        path.write_text(f"{state_dir.resolve()}\n{pid}\n{program}\n")


def release(state_dir: Path, network: PodNetwork) -> None:
    """Drop this sandbox's claim; remove the route once no live sandbox claims it."""
    if not network.routed:
        return
    _claim_file(state_dir).unlink(missing_ok=True)
    from cacheroute.sandbox.process import pid_runs

    claims = _claims_dir()
    for path in claims.glob("*") if claims.is_dir() else []:
        lines = path.read_text().splitlines()
        if len(lines) >= 3 and lines[1].isdigit() and pid_runs(int(lines[1]), lines[2]):
            return
        if len(lines) < 3 and Path(lines[0] if lines else "/nonexistent").is_dir():
            return  # a sandbox still starting
        path.unlink(missing_ok=True)
    if _routed_locally(LOCAL_NETWORK):
        _ip("route", "del", "local", LOCAL_NETWORK, "dev", "lo")
