"""Every `cacheroute` sub-command answers bad input with one line and exit status 2, never a traceback.

The sub-commands and their options are discovered from the typer app, so a command or option
added later is walked too: every numeric option must declare a range (`min` and `max`), every
path option must say what it names (`exists`, `file_okay=False` or `dir_okay=False`), and values
outside each are refused with one line that names the option.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import pytest
import typer
import typer.testing
from typer.testing import CliRunner

from cacheroute.operator.cli.main import app

runner = CliRunner()

# What each command needs besides the option under test, so that the option is what fails.
BASE_ARGS: dict[str, list[str]] = {
    "memory-plan": ["--model", "llama-3.1-8b"],
    "router envoy-config": ["--router", "127.0.0.1:9002", "--endpoints", "127.0.0.1:8000"],
    # Without --sandbox or credentials the runtime stops before it starts anything.
    "sandbox runtime": ["--state-dir", "{state}"],
    # Port 1 of loopback: were the bad value accepted, the target check fails at once.
    "sandbox load": ["http://127.0.0.1:1"],
    # --print: were the bad value accepted, the bootstrap is printed instead of Envoy started.
    "router envoy": ["--pod-ip", "127.0.0.1", "--print"],
    # A kubeconfig that is no kubeconfig: were the bad value accepted, the operator fails at once.
    "operator run": ["--kubeconfig", "{file}", "--standalone"],
}


def leaf_commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    children = getattr(command, "commands", None)
    if children is None:
        yield " ".join(path), command
        return
    for name, child in children.items():
        yield from leaf_commands(child, (*path, name))


def annotation(param: Any) -> Any:
    descriptor = param.type_descriptor
    kind = descriptor.annotation
    if get_origin(kind) in (Union, type(int | None)):
        kind = next(a for a in get_args(kind) if a is not type(None))
    if get_origin(kind) is list:
        kind = get_args(kind)[0]
    return kind


def is_number(param: Any) -> bool:
    return annotation(param) in (int, float)


def is_path(param: Any) -> bool:
    return bool(param.type_descriptor.is_path)


def option_name(param: Any) -> str:
    return str(param.opts[0] if param.opts[0].startswith("-") else param.name)


ROOT = typer.main.get_command(app)
COMMANDS = dict(leaf_commands(ROOT))


def numeric_cases() -> Iterator[tuple[str, str, str]]:
    for path, command in COMMANDS.items():
        for param in command.params:
            if param.name == "help" or not is_number(param):
                continue
            integer = annotation(param) is int
            lo, hi = param.min, param.max
            # Not a number, not finite, past every range; then just outside the declared range.
            values = ["abc", "nan", "inf", "-inf", str(10**30) if integer else "1e300"]
            if lo is not None:
                values.append(str(lo - 1) if integer else repr(lo - 1.0))
            if hi is not None:
                values.append(str(hi + 1) if integer else repr(hi * 2 + 1.0))
            for value in values:
                yield path, option_name(param), value


def path_cases() -> Iterator[tuple[str, str, str]]:
    for path, command in COMMANDS.items():
        for param in command.params:
            if not is_path(param):
                continue
            info = param.type_descriptor.parameter_info
            name = option_name(param)
            if info.exists:
                yield path, name, "{missing}"
                if not info.dir_okay:
                    yield path, name, "{directory}"
                if not info.file_okay:
                    yield path, name, "{file}"
            elif not info.file_okay:
                yield path, name, "{file}"
            elif not info.dir_okay:
                yield path, name, "{directory}"


def test_every_command_is_discovered_and_declares_its_inputs() -> None:
    assert {"plan", "replay", "memory-plan", "validate", "crds", "router serve", "router envoy-config",
            "router envoy", "operator run", "sandbox up", "sandbox down", "sandbox status",
            "sandbox binaries ensure"} <= set(COMMANDS)
    undeclared = []
    for path, command in COMMANDS.items():
        for param in command.params:
            if param.name != "help" and is_number(param) and (param.min is None or param.max is None):
                undeclared.append(f"{path} {option_name(param)}: no range")
            if is_path(param):
                info = param.type_descriptor.parameter_info
                if not (info.exists or not info.file_okay or not info.dir_okay):
                    undeclared.append(f"{path} {option_name(param)}: exists, file_okay or dir_okay not declared")
    assert not undeclared, undeclared
    assert sum(1 for _ in numeric_cases()) > 150
    assert sum(1 for _ in path_cases()) > 15


@pytest.fixture
def guarded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """Paths for the cases, and an environment in which a command that wrongly ran would fail fast:
    no sandbox binaries, no home directory with state, and the router's ports taken."""
    # One command tree for all cases: building it is most of an invocation's cost.
    monkeypatch.setattr(typer.testing, "_get_command", lambda _app: ROOT)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("CACHEROUTE_BIN_CACHE", str(tmp_path / "no-binaries"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "a-dir").mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield {
            "missing": str(tmp_path / "missing" / "nothing"),
            "directory": str(tmp_path / "a-dir"),
            "file": str(tmp_path / "a-file"),
            "taken": str(taken.getsockname()[1]),
            "state": str(tmp_path / "state"),
        }


def run_bad(path: str, args: list[str], guarded: dict[str, str]) -> Any:
    base = [arg.format(**guarded) for arg in BASE_ARGS.get(path, [])]
    if path == "router serve" and not any(a in args for a in ("--grpc-port", "--grpc-host")):
        # Were the bad value accepted, the router would fail to bind instead of serving forever.
        base += ["--grpc-host", "127.0.0.1", "--grpc-port", guarded["taken"]]
    if path == "validate":
        return runner.invoke(app, [*path.split(), *args])
    return runner.invoke(app, [*path.split(), *base, *args])


def check_one_line(result: Any, name: str) -> None:
    assert "Traceback" not in result.output, result.output
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert name in lines[0], (name, lines[0])


@pytest.mark.parametrize(("path", "option", "value"), list(numeric_cases()))
def test_bad_numbers_are_refused_in_one_line(path: str, option: str, value: str, guarded: dict[str, str]) -> None:
    result = run_bad(path, [option, value], guarded)
    check_one_line(result, option)
    if value in ("nan", "inf", "-inf") and option.startswith("-"):
        # Not "should be at most N": a NaN is not above any bound.
        assert f"{value} is not a finite number" in result.stderr, result.stderr
        if "(env var: " in result.stderr:  # the option's environment variable named whole
            assert f"'): {value} is not a finite number" in result.stderr, result.stderr


@pytest.mark.parametrize(("path", "option", "value"), list(path_cases()))
def test_bad_paths_are_refused_in_one_line(path: str, option: str, value: str, guarded: dict[str, str]) -> None:
    given = value.format(**guarded)
    args = [given] if not option.startswith("-") else [option, given]
    result = run_bad(path, args, guarded)
    check_one_line(result, given if not option.startswith("-") else option)


def test_numeric_values_in_range_pass_the_parser() -> None:
    """The ranges are not so tight that the documented defaults fail them."""
    for path, command in COMMANDS.items():
        for param in command.params:
            if param.name == "help" or not is_number(param) or param.default is None:
                continue
            assert param.min <= param.default <= param.max, (path, param.name)
            assert math.isfinite(param.default)
