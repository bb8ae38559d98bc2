"""Choosing the router's event loop: uvloop when asked for or available, asyncio otherwise."""

from __future__ import annotations

import asyncio

import pytest

from cacheroute.router import eventloop
from cacheroute.router.settings import RouterSettings, SettingsError


def loop_module(choice: str) -> str:
    seen: list[str] = []

    async def record() -> None:
        seen.append(type(asyncio.get_running_loop()).__module__)

    eventloop.run(record(), choice)
    return seen[0]


def test_auto_takes_uvloop_when_installed_and_asyncio_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("uvloop")
    assert eventloop.resolve("auto") == "uvloop"
    assert loop_module("auto").startswith("uvloop")
    assert loop_module("asyncio").startswith("asyncio")
    monkeypatch.setattr(eventloop, "uvloop_available", lambda: False)
    assert eventloop.resolve("auto") == "asyncio"
    assert loop_module("auto").startswith("asyncio")


def test_uvloop_asked_for_but_missing_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eventloop, "uvloop_available", lambda: False)
    with pytest.raises(eventloop.EventLoopError, match="not installed"):
        eventloop.resolve("uvloop")
    main_ran = False

    async def main() -> None:
        nonlocal main_ran
        main_ran = True

    with pytest.raises(eventloop.EventLoopError):
        eventloop.run(main(), "uvloop")
    assert not main_ran


def test_unknown_loops_are_refused() -> None:
    with pytest.raises(eventloop.EventLoopError, match="not one of"):
        eventloop.resolve("trio")
    with pytest.raises(SettingsError, match="event-loop 'trio'"):
        RouterSettings(event_loop="trio")


def test_serve_refuses_a_missing_uvloop_with_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from cacheroute.router.cli import app

    monkeypatch.setattr(eventloop, "uvloop_available", lambda: False)
    result = CliRunner().invoke(app, ["serve", "--event-loop", "uvloop"])
    assert result.exit_code == 2
    assert "uvloop is not installed" in result.output
