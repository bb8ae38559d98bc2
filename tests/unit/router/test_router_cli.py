"""`cacheroute router serve` refuses bad settings with a clear message."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from cacheroute.router.cli import app
from cacheroute.router.settings import RouterSettings, SettingsError, parse_address

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--endpoints", "10.0.0.1:80,nonsense"], "'nonsense' is not ip:port"),
        (["--endpoints", "host.example:80"], "is not an IP address"),
        (["--spill-threshold", "0.5"], "spill-threshold 0.5 must be >= 1.0"),
        (["--pool", "llama"], "needs namespace"),
        (["--body-mode", "sometimes"], "body-mode 'sometimes' is not one of"),
        (["--fallbacks", "40"], "fallbacks 40 must be between 0 and 16"),
        (["--log-level", "loud"], "log-level 'loud'"),
        (["--event-loop", "fast"], "event-loop 'fast' is not one of"),
        (["--unplanned", "sticky"], "unplanned 'sticky' is not one of key-p2c, p2c"),
    ],
)
def test_bad_settings_exit_with_a_message(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["serve", *args])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_every_option_has_an_environment_variable() -> None:
    serve_command = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    options = [p for p in serve_command.params if p.name != "help"]
    assert len(options) >= 20
    for option in options:
        assert option.envvar == f"CACHEROUTE_ROUTER_{option.name.upper()}", option.name


def test_environment_sets_options() -> None:
    result = runner.invoke(app, ["serve"], env={"CACHEROUTE_ROUTER_SPILL_THRESHOLD": "0.2"})
    assert result.exit_code == 2
    assert "spill-threshold 0.2" in result.output


def test_addresses_are_normalised() -> None:
    assert parse_address(" 10.0.0.1:0080 ") == "10.0.0.1:80"
    assert parse_address("[::1]:9000") == "[::1]:9000"
    with pytest.raises(SettingsError):
        parse_address("10.0.0.1:70000")
    assert RouterSettings(endpoints=("10.0.0.1:80",)).endpoints == ("10.0.0.1:80",)
