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


@pytest.mark.parametrize(
    "entered",
    # As `isolate` runs its command; and as `nsenter` enters its namespace, without the variable it sets.
    [[], ["env", "-u", network.ISOLATED_ENV]],
    ids=["isolate", "nsenter"],
)
def test_isolate_routes_pod_addresses_inside_only(
    entered: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(network.HOST_ROUTE_ENV, raising=False)
    try:
        prefix = network.isolate_command([*entered, "true"])[:-1]
    except network.IsolationError as exc:
        pytest.skip(str(exc))
    inside = _claim_in(prefix, tmp_path)
    if inside["cidr"] != network.LOCAL_NETWORK and "Operation not permitted" in str(inside["why"]):
        pytest.skip("no CAP_NET_ADMIN here")
    assert inside == {"cidr": network.LOCAL_NETWORK, "why": None, "isolated": True}
    host_routes = subprocess.run(["ip", "route", "show", "table", "local", network.LOCAL_NETWORK],
                                 check=False, capture_output=True, text=True, timeout=10)
    assert network.LOCAL_NETWORK not in host_routes.stdout or network.isolated()


def test_another_private_namespace_without_the_pod_network_is_not_taken_for_isolates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(network.HOST_ROUTE_ENV, raising=False)
    monkeypatch.delenv(network.ISOLATED_ENV, raising=False)
    try:
        made = subprocess.run(["unshare", "--net", "true"], check=False, capture_output=True, timeout=10)
    except FileNotFoundError:
        pytest.skip("`unshare` (util-linux) is not installed")
    if made.returncode != 0:
        pytest.skip("no new network namespace here")
    bare = _claim_in(["unshare", "--net", "--"], tmp_path)
    assert bare["isolated"] is False and bare["cidr"] == network.LOOPBACK_NETWORK


def test_isolate_without_a_command_is_an_error() -> None:
    with pytest.raises(network.IsolationError, match="no command"):
        network.isolate_command([])
