"""Where the sandbox's pod network may exist: inside `cacheroute sandbox isolate`, never on the host."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cacheroute.sandbox import network


def _claim_in(command_prefix: list[str], tmp_path: Path) -> dict[str, object]:
    probe = (
        "import json, pathlib; from cacheroute.sandbox import network as n; "
        f"net, why = n.claim(pathlib.Path({str(tmp_path)!r})); "
        "print(json.dumps({'cidr': net.cidr, 'why': why, 'isolated': n.isolated()}))"
    )
    done = subprocess.run(
        [*command_prefix, sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_the_machine_namespace_gets_loopback_pods_and_advice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Where no `isolate` namespace is: here, or, inside `make test` (which runs in one), a new bare one.
    prefix = ["unshare", "--net", "--"] if network.isolated() else []
    monkeypatch.delenv(network.HOST_ROUTE_ENV, raising=False)
    monkeypatch.delenv(network.ISOLATED_ENV, raising=False)
    found = _claim_in(prefix, tmp_path)
    assert found["cidr"] == network.LOOPBACK_NETWORK
    assert found["isolated"] is False
    assert "cacheroute sandbox isolate" in str(found["why"])


def test_an_inherited_marker_from_another_namespace_does_not_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(network.ISOLATED_ENV, "1")  # not this namespace's inode
    assert not network.isolated()


def test_isolate_routes_pod_addresses_inside_only(tmp_path: Path) -> None:
    try:
        prefix = network.isolate_command(["true"])[:-1]
    except network.IsolationError as exc:
        pytest.skip(str(exc))
    inside = _claim_in(prefix, tmp_path)
    if inside["cidr"] != network.LOCAL_NETWORK and "Operation not permitted" in str(inside["why"]):
        pytest.skip("no CAP_NET_ADMIN here")
    assert inside == {"cidr": network.LOCAL_NETWORK, "why": None, "isolated": True}
    host_routes = subprocess.run(["ip", "route", "show", "table", "local", network.LOCAL_NETWORK],
                                 check=False, capture_output=True, text=True, timeout=10)
    assert network.LOCAL_NETWORK not in host_routes.stdout or network.isolated()


def test_a_namespace_entered_without_the_marker_counts_only_when_it_routes_the_pod_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(network.HOST_ROUTE_ENV, raising=False)
    try:
        # `isolate`'s namespace, entered as `nsenter` would: without the variable `isolate` sets.
        prefix = network.isolate_command(["env", "-u", network.ISOLATED_ENV, "true"])[:-1]
    except network.IsolationError as exc:
        pytest.skip(str(exc))
    inside = _claim_in(prefix, tmp_path)
    if inside["cidr"] != network.LOCAL_NETWORK and "Operation not permitted" in str(inside["why"]):
        pytest.skip("no CAP_NET_ADMIN here")
    assert inside == {"cidr": network.LOCAL_NETWORK, "why": None, "isolated": True}
    # Some other private namespace, without the pod network's route: not taken for one.
    monkeypatch.delenv(network.ISOLATED_ENV, raising=False)
    bare = _claim_in(["unshare", "--net", "--"], tmp_path)
    assert bare["isolated"] is False and bare["cidr"] == network.LOOPBACK_NETWORK


def test_isolate_without_a_command_is_an_error() -> None:
    with pytest.raises(network.IsolationError, match="no command"):
        network.isolate_command([])
