"""The compiled request path (`cacheroute router build-native`, router/native.py).

A router with the compiled copy first on its PYTHONPATH runs it, says so in its metrics, and routes
exactly as the interpreted router does; the compiled modules pass the unit tests of the router, the
planner and the replay.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.native import native_env, native_path
from tests.support.router import (
    Engine,
    PlanVolume,
    RouterStarter,
    destination,
    exchange,
    headers_request,
    make_plan,
    start_router_process,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPOSITORY = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def compiled() -> Path:
    return native_path()


def test_a_router_runs_the_compiled_copy_and_routes_as_planned(
    compiled: Path, engines: list[Engine], volume: PlanVolume, tmp_path: Path
) -> None:
    volume.publish(make_plan(engines, {"alice": [2], "bob": [0]}))
    router = start_router_process(
        ["--plan-dir", str(volume.path), "--scrape-interval", "0.1", "--scrape-timeout", "0.5"],
        log=tmp_path / "router.log", env=native_env(compiled),
    )
    try:
        assert router.sample("cacheroute_router_build_info", request_path="compiled") == 1
        for _ in range(3):
            assert destination(exchange(router, headers_request("alice")))[0] == engines[2].address
            assert destination(exchange(router, headers_request("bob")))[0] == engines[0].address
        unplanned = destination(exchange(router, headers_request("carol")))[0]
        assert unplanned in {e.address for e in engines}
        assert router.sample("cacheroute_router_decisions_total", outcome="planned") == 6
        assert router.sample("cacheroute_router_stream_errors_total", result="handled") == 0
    finally:
        router.stop()


def test_an_interpreted_router_says_so(engines: list[Engine], volume: PlanVolume, start_router: RouterStarter) -> None:
    volume.publish(make_plan(engines, {"alice": [1]}))
    router = start_router("--plan-dir", str(volume.path))
    assert router.sample("cacheroute_router_build_info", request_path="interpreted") == 1


def test_the_compiled_modules_pass_the_unit_tests_of_the_request_path(compiled: Path) -> None:
    env = {**os.environ, **native_env(compiled)}
    probe = subprocess.run(
        [sys.executable, "-c", "import cacheroute.router.server; from cacheroute.router import native; "
         "print(native.request_path())"],
        env=env, cwd=REPOSITORY, capture_output=True, text=True, timeout=120, check=True,
    )
    assert probe.stdout.strip() == "compiled"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not integration",
         # Which path this process runs is another question (that file asks it interpreted).
         "--ignore", "tests/unit/router/test_native_path.py",
         "tests/unit/router", "tests/unit/planner", "tests/unit/replay"],
        env=env, cwd=REPOSITORY, capture_output=True, text=True, timeout=900, check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
