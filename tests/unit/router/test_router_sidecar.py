"""The router pod's Envoy bootstrap: everything on the pod IP, failure mode as configured."""

from __future__ import annotations

import yaml
from typer.testing import CliRunner

from cacheroute.operator.cli.main import app
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
