"""The router pod's Envoy bootstrap: everything on the pod IP, failure mode as configured; its drain."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from cacheroute.operator.cli.main import app
from cacheroute.router.drain import POLL_S, DrainOutcome, drain
from cacheroute.router.envoy import GatewayOptions, PodEnvoyOptions, pod_bootstrap

runner = CliRunner()


def listeners(document: dict) -> dict[str, dict]:  # type: ignore[type-arg]
    return {listener["name"]: listener for listener in document["static_resources"]["listeners"]}


def clusters(document: dict) -> dict[str, dict]:  # type: ignore[type-arg]
    return {c["name"]: c for c in document["static_resources"]["clusters"]}


def ext_proc(document: dict) -> dict:  # type: ignore[type-arg]
    manager = listeners(document)["ingress"]["filter_chains"][0]["filters"][0]["typed_config"]
    found: dict = next(f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")  # type: ignore[type-arg]
    return dict(found["typed_config"])


def test_listeners_and_the_picker_are_on_the_pod_ip() -> None:
    document = pod_bootstrap(PodEnvoyOptions(pod_ip="10.4.0.7", fallback="llama.ns.svc.cluster.local:8000",
                                             admin_socket="/tmp/admin.sock"))
    found = listeners(document)
    assert found["ingress"]["address"]["socket_address"] == {"address": "10.4.0.7", "port_value": 8080}
    assert found["health"]["address"]["socket_address"] == {"address": "10.4.0.7", "port_value": 8081}
    picker = clusters(document)["cacheroute_router"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert picker["endpoint"]["address"]["socket_address"] == {"address": "10.4.0.7", "port_value": 9002}
    assert clusters(document)["original_destination"]["type"] == "ORIGINAL_DST"
    assert clusters(document)["pool"]["type"] == "STRICT_DNS"
    assert document["admin"] == {"address": {"pipe": {"path": "/tmp/admin.sock"}}}
    assert ext_proc(document)["failure_mode_allow"] is True


def test_failing_closed_answers_unpicked_requests_with_503_and_needs_no_pool_cluster() -> None:
    document = pod_bootstrap(PodEnvoyOptions(pod_ip="10.4.0.7", gateway=GatewayOptions(failure_mode_allow=False)))
    assert ext_proc(document)["failure_mode_allow"] is False
    assert "pool" not in clusters(document)
    manager = listeners(document)["ingress"]["filter_chains"][0]["filters"][0]["typed_config"]
    assert manager["route_config"]["virtual_hosts"][0]["routes"][-1]["direct_response"]["status"] == 503


def test_envoy_command_prints_the_bootstrap_for_the_pod_ip_from_the_environment() -> None:
    result = runner.invoke(app, ["router", "envoy", "--print", "--no-failure-mode-allow"], env={"POD_IP": "10.9.8.7"})
    assert result.exit_code == 0, result.output
    document = yaml.safe_load(result.output)
    assert listeners(document)["ingress"]["address"]["socket_address"]["address"] == "10.9.8.7"
    assert document["admin"]["address"]["pipe"]["path"].endswith("cacheroute-envoy-admin-10.9.8.7.sock")


def test_bad_input_is_one_line_and_exit_2() -> None:
    for args in (["--pod-ip", "not-an-ip"], ["--pod-ip", "10.0.0.1", "--fallback", "nohostport"],
                 ["--pod-ip", "10.0.0.1", "--request-body-mode", "SOMETIMES"]):
        result = runner.invoke(app, ["router", "envoy", "--print", *args])
        assert result.exit_code == 2, (args, result.output)
        assert "Traceback" not in result.output


def test_envoy_puts_its_admin_socket_where_the_drain_hooks_look() -> None:
    result = runner.invoke(app, ["router", "envoy", "--print", "--admin-socket", "/run/cacheroute/envoy-admin.sock"],
                           env={"POD_IP": "10.9.8.7"})
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.output)["admin"]["address"]["pipe"]["path"] == "/run/cacheroute/envoy-admin.sock"


def test_drain_without_envoy_returns_at_once(tmp_path: Path) -> None:
    result = runner.invoke(app, ["router", "drain", "--admin-socket", str(tmp_path / "admin.sock"), "--settle", "30"])
    assert result.exit_code == 0, result.output
    assert "nothing to drain" in result.output


class _Envoy:
    """Envoy's admin as the drain sees it: requests in flight that end one per look."""

    def __init__(self, in_flight: int, ending: int) -> None:
        self.left, self.ending, self.drained = in_flight, ending, False

    def drain_listeners(self) -> None:
        self.drained = True

    def in_flight(self) -> int:
        left, self.left = self.left, max(self.left - self.ending, 0)
        return left


def _drain(envoy: _Envoy, **options: Any) -> DrainOutcome:
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    return drain(envoy, sleep=sleep, clock=lambda: now[0], **options)  # type: ignore[arg-type]


def test_drain_waits_for_the_requests_in_flight_within_its_timeout() -> None:
    done = _drain(envoy := _Envoy(3, 1), settle_s=5, timeout_s=60)
    assert envoy.drained and done.drained and done.in_flight == 0
    assert done.waited_s == pytest.approx(5 + 3 * POLL_S)
    stuck = _drain(_Envoy(3, 0), settle_s=5, timeout_s=20)
    assert not stuck.drained and stuck.in_flight == 3 and stuck.waited_s == pytest.approx(20, abs=POLL_S)
    # The picker's hook only waits: draining is Envoy's hook's to ask.
    _drain(picker := _Envoy(1, 1), settle_s=0, timeout_s=5, wait_only=True)
    assert not picker.drained
