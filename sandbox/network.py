"""The sandbox's pod network: addresses that are local to this machine and valid in EndpointSlices.

A pod IP must be an address a local process can bind (the pod runtime serves pods on them) and,
for the EndpointSlice controller, one the API server accepts in an endpoint: loopback addresses
(127.0.0.0/8) are refused there. So the pod network is `198.18.0.0/16` (from the block reserved
for network benchmarks, RFC 2544), made local with one route, `local 198.18.0.0/16 dev lo`: every
address in it belongs to the namespace, as every 127.x address does.

That route is only ever added inside a private network namespace (`isolate`, which `make test`
and `make demo` use): traffic to pod addresses then cannot leave the namespace, whatever the
machine's own routes say. In the machine's own namespace the route is added only when the user
asks for it (`CACHEROUTE_POD_NETWORK_HOST_ROUTE=1`, for a machine of one's own); otherwise, or
without root (CAP_NET_ADMIN), the sandbox falls back to loopback pod addresses (`127.1.0.0/16`),
where everything works except EndpointSlices.

On the host, several sandboxes may share the route; each holds a claim (a file named after its
state directory, holding the pid of its API server), and the last one to go removes the route.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

LOCAL_NETWORK = "198.18.0.0/16"
LOOPBACK_NETWORK = "127.1.0.0/16"
CLAIMS_ENV = "CACHEROUTE_POD_NETWORK_CLAIMS"
HOST_ROUTE_ENV = "CACHEROUTE_POD_NETWORK_HOST_ROUTE"
ISOLATED_ENV = "CACHEROUTE_ISOLATED_NETNS"


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


def is_pod_address(host: str) -> bool:
    """Whether `host` is a sandbox pod address that is local here (the pod network is routed to
    this namespace's loopback): traffic to it cannot leave the machine."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address in ipaddress.ip_network(LOCAL_NETWORK) and _routed_locally(LOCAL_NETWORK)


def _namespace_id() -> str:
    try:
        return str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        return ""


def isolated() -> bool:
    """Whether this process runs in the private network namespace that `isolate` made.

    `isolate` records the namespace's inode in the environment; a process that inherited the
    variable but runs in another namespace (the machine's) does not match it. A process that
    entered such a namespace without the variable (`nsenter -t PID -n`) is in one as well when the
    namespace is as `isolate` makes them: loopback its only interface (nothing in it reaches
    another machine), the pod network already routed to it.
    """
    marker = os.environ.get(ISOLATED_ENV)
    if marker:
        return marker == _namespace_id()
    return _loopback_only() and _routed_locally(LOCAL_NETWORK)


def _loopback_only() -> bool:
    try:
        result = _ip("-o", "link", "show")
    except (OSError, subprocess.SubprocessError):
        return False
    names = [line.split(":")[1].strip() for line in result.stdout.splitlines() if line.count(":") >= 2]
    return result.returncode == 0 and names == ["lo"]


def _add_route() -> str | None:
    """Route the pod network to this namespace's loopback; the reason when that failed."""
    try:
        if _routed_locally(LOCAL_NETWORK):
            return None
        result = _ip("route", "replace", "local", LOCAL_NETWORK, "dev", "lo")
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot run `ip route`: {exc}"
    return None if result.returncode == 0 else (result.stderr.strip() or "ip route failed")


def claim(state_dir: Path) -> tuple[PodNetwork, str | None]:
    """The network for a new sandbox, and why it is the loopback fallback (None when it is not)."""
    if isolated():
        # The route dies with the namespace: nothing to claim or release.
        failed = _add_route()
        return (PodNetwork(LOOPBACK_NETWORK, False), failed) if failed else (PodNetwork(LOCAL_NETWORK, False), None)
    if os.environ.get(HOST_ROUTE_ENV) != "1":
        return PodNetwork(LOOPBACK_NETWORK, False), (
            "the machine's own network namespace; run the sandbox inside `cacheroute sandbox isolate -- COMMAND` "
            f"(or set {HOST_ROUTE_ENV}=1 on a machine of your own)"
        )
    failed = _add_route()
    if failed:
        return PodNetwork(LOOPBACK_NETWORK, False), failed
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
    if not network.routed or isolated():
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


class IsolationError(RuntimeError):
    """A private network namespace cannot be made here (no root, no `unshare`)."""


def isolate_command(argv: list[str]) -> list[str]:
    """The command line that runs `argv` in a new network namespace holding the pod network.

    The namespace has its own loopback (127.0.0.0/8, brought up) and the pod network routed to it;
    no other interface, so nothing started inside can reach, or be reached from, another machine.
    """
    if not argv:
        raise IsolationError("no command to run")
    unshare = shutil.which("unshare")
    if unshare is None:
        raise IsolationError("`unshare` (util-linux) is not installed")
    return [unshare, "--net", "--", sys.executable, "-m", "cacheroute.sandbox.network", *argv]


def _enter(argv: list[str]) -> None:
    """Inside the new namespace: bring loopback up, route the pod network to it, exec `argv`."""
    up = _ip("link", "set", "lo", "up")
    if up.returncode != 0:
        raise IsolationError(f"cannot bring up loopback: {up.stderr.strip()}")
    failed = _add_route()
    if failed:
        raise IsolationError(f"cannot route the pod network {LOCAL_NETWORK}: {failed}")
    os.environ[ISOLATED_ENV] = _namespace_id()
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    try:
        _enter(sys.argv[1:])
    except (IsolationError, OSError) as exc:
        print(f"cacheroute sandbox isolate: {exc}", file=sys.stderr)
        sys.exit(1)
