"""`cacheroute router serve` refuses bad settings with a clear message."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cacheroute.planner.plan import host_port
from cacheroute.router.cli import app
from cacheroute.router.settings import RouterSettings, SettingsError, parse_address
from cacheroute.sandbox.process import wait_until

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--endpoints", "10.0.0.1:80,nonsense"], "'nonsense' is not ip:port"),
        (["--endpoints", "host.example:80"], "is not an IP address"),
        (["--spill-threshold", "0.5"], "--spill-threshold"),
        (["--spill-threshold", "nan"], "--spill-threshold"),
        (["--scrape-interval", "nan"], "--scrape-interval"),
        (["--scrape-interval", "inf"], "--scrape-interval"),
        (["--scrape-timeout", "0"], "--scrape-timeout"),
        (["--plan-poll-interval", "1e-9"], "--plan-poll-interval"),
        (["--spill-slack", "-1"], "--spill-slack"),
        (["--max-body-bytes", "99999999999"], "--max-body-bytes"),
        (["--sketch-size", "0"], "--sketch-size"),
        (["--endpoint-kv-tokens", "-1"], "--endpoint-kv-tokens"),
        (["--in-flight-weight", "1.5"], "--in-flight-weight"),
        (["--grpc-port", "70000"], "--grpc-port"),
        (["--pool", "llama"], "needs namespace"),
        (["--body-mode", "sometimes"], "body-mode 'sometimes' is not one of"),
        (["--fallbacks", "40"], "--fallbacks"),
        (["--log-level", "loud"], "log-level 'loud'"),
        (["--event-loop", "fast"], "event-loop 'fast' is not one of"),
        (["--unplanned", "sticky"], "unplanned 'sticky' is not one of key-p2c, p2c"),
        ([], "give where routes come from: --plan-dir or --pool (a plan), --service or --endpoints"),
        (["--endpoints", "10.0.0.1:80", "--namespace", "llm"], "namespace is where pool's ConfigMaps"),
        (["--endpoints", "10.0.0.1:80", "--target-port", "8000"], "target-port is the port on a service's"),
        (["--pool", "", "--service", "", "--namespace", ""], "give where routes come from"),
        (["--endpoints", "10.0.0.1:80", "--key-header", "bad header"],
         "key-header 'bad header' is not an HTTP header name"),
        (["--endpoints", "10.0.0.1:80", "--session-header", "x:y"], "session-header 'x:y' is not an HTTP header"),
    ],
)
def test_bad_settings_exit_with_a_message(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["serve", *args])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"spill_threshold": float("nan")}, "spill-threshold nan must be a finite number >= 1 and <= 100"),
        ({"spill_threshold": 0.5}, "spill-threshold 0.5 must be a finite number >= 1"),
        ({"scrape_interval": float("nan")}, "scrape-interval nan must be a finite number >= 0"),
        ({"scrape_interval": float("inf")}, "scrape-interval inf must be a finite number"),
        ({"scrape_timeout": 0.0}, "scrape-timeout 0.0 must be a finite number > 0"),
        ({"plan_poll_interval": 1e-9}, "plan-poll-interval 1e-09 must be a finite number >= 0.01"),
        ({"spill_slack": float("-inf")}, "spill-slack -inf must be a finite number >= 0"),
        ({"max_body_bytes": 1 << 40}, "max-body-bytes 1099511627776 must be a finite number >= 0"),
        ({"sketch_size": 0}, "sketch-size 0 must be"),
        ({"endpoint_kv_tokens": -5}, "endpoint-kv-tokens -5 must be a finite number >= 0"),
        ({"in_flight_weight": float("nan")}, "in-flight-weight nan must be a finite number >= 0 and <= 1"),
        ({"fallbacks": 40}, "fallbacks 40 must be a finite number >= 0 and <= 16"),
        ({"grpc_port": 70000}, "grpc-port 70000 is not a TCP port"),
        ({"grpc_host": " "}, "grpc-host must not be empty"),
    ],
)
def test_settings_refuse_non_finite_and_out_of_range_values(settings: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError) as caught:
        RouterSettings(**settings)  # type: ignore[arg-type]
    assert message in str(caught.value)


def test_every_option_has_an_environment_variable() -> None:
    serve_command = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    options = [p for p in serve_command.params if p.name != "help"]
    assert len(options) >= 20
    for option in options:
        assert option.envvar == f"CACHEROUTE_ROUTER_{option.name.upper()}", option.name


def test_environment_sets_options() -> None:
    result = runner.invoke(app, ["serve"], env={"CACHEROUTE_ROUTER_SPILL_THRESHOLD": "0.2"})
    assert result.exit_code == 2
    assert "--spill-threshold" in result.output


def test_addresses_are_normalised() -> None:
    assert parse_address(" 10.0.0.1:0080 ") == "10.0.0.1:80"
    assert parse_address("[::1]:9000") == "[::1]:9000"
    with pytest.raises(SettingsError):
        parse_address("10.0.0.1:70000")
    assert RouterSettings(endpoints=("10.0.0.1:80",)).endpoints == ("10.0.0.1:80",)


def test_an_ipv6_listening_address_binds_bare_or_in_brackets() -> None:
    assert RouterSettings(grpc_host="[::1]", metrics_host="::1").grpc_host == "::1"
    assert host_port("::1", 9002) == "[::1]:9002"
    assert host_port("10.0.0.7", 9002) == "10.0.0.7:9002"


def test_the_router_serves_grpc_on_an_ipv6_address(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET6) as probe:
        try:
            probe.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback here")
    log = tmp_path / "router.log"
    with log.open("w") as out:
        router = subprocess.Popen(
            [sys.executable, "-m", "cacheroute.router.cli", "serve", "--grpc-host", "::1", "--grpc-port", "0",
             "--metrics-host", "::1", "--metrics-port", "0", "--endpoints", "127.0.0.1:1", "--scrape-interval", "0"],
            stdout=out, stderr=subprocess.STDOUT,
        )
        try:
            wait_until(lambda: "ext_proc gRPC on" in log.read_text() or router.poll() is not None, timeout=60,
                       what="the router listening or exiting")
        finally:
            router.terminate()
            router.wait(timeout=30)
    assert re.search(r"ext_proc gRPC on ::1:[1-9][0-9]*, metrics on ::1:[1-9]", log.read_text()), log.read_text()
