"""The standalone Envoy bootstrap is one Envoy accepts, in every body mode."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cacheroute.router.cli import app
from cacheroute.sandbox.binaries import locate

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("mode", ["NONE", "BUFFERED", "FULL_DUPLEX_STREAMED"])
def test_envoy_validates_the_printed_bootstrap(tmp_path: Path, mode: str) -> None:
    result = CliRunner().invoke(
        app,
        ["envoy-config", "--router", "10.0.0.5:9002", "--endpoints", "10.0.1.1:8000,10.0.1.2:8000",
         "--request-body-mode", mode],
    )
    assert result.exit_code == 0, result.output
    document = yaml.safe_load(result.output)
    clusters = {c["name"]: c for c in document["static_resources"]["clusters"]}
    assert clusters["original_destination"]["original_dst_lb_config"]["http_header_name"] == (
        "x-gateway-destination-endpoint"
    )
    path = tmp_path / "envoy.yaml"
    path.write_text(result.output)
    check = subprocess.run(
        [str(locate("envoy").path), "--mode", "validate", "-c", str(path), "--log-level", "error"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "OK" in check.stdout


def test_bad_router_address_is_refused() -> None:
    result = CliRunner().invoke(app, ["envoy-config", "--router", "router:9002", "--endpoints", "10.0.1.1:8000"])
    assert result.exit_code == 2
    assert "'router' is not an IP address" in result.output
