"""Container processes: mounts in a private namespace, or a clear refusal where that is not allowed."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

import pytest

from cacheroute.sandbox.runtime import containers
from cacheroute.sandbox.runtime.containers import ContainerStartError, EmulatorRun, Mount, ProcessRun, mount_script
from cacheroute.sandbox.runtime.logs import LogFile, plain_text

if TYPE_CHECKING:
    from cacheroute.sandbox.emulator.server import Emulator


def test_mounts_are_bound_parents_first_then_the_command_runs() -> None:
    script = mount_script([
        Mount(Path("/pods/p/volumes/token"), "/var/run/secrets/kubernetes.io/serviceaccount", read_only=True),
        Mount(Path("/pods/p/volumes/plan dir"), "/etc/plan"),
    ])
    lines = script.splitlines()
    assert lines[0] == "set -e"
    assert lines[1] == "mount --bind '/pods/p/volumes/plan dir' /etc/plan"
    assert lines[2] == "mount --bind /pods/p/volumes/token /var/run/secrets/kubernetes.io/serviceaccount"
    assert lines[3] == "mount -o remount,bind,ro /var/run/secrets/kubernetes.io/serviceaccount"
    assert lines[-1] == 'exec "$@"'


async def test_without_mount_namespaces_a_container_with_volumes_fails_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(containers._checked, "unshare", "unshare: unshare failed: Operation not permitted")
    reason = r"not permitted here: unshare: unshare failed.*run the sandbox as root"
    with pytest.raises(ContainerStartError, match=reason):
        await ProcessRun.start(
            ["true"], env={}, cwd=tmp_path, mounts=[Mount(tmp_path, str(tmp_path / "m"))], log=LogFile(tmp_path / "l")
        )


async def test_a_process_without_volumes_runs_and_its_output_is_logged(tmp_path: Path) -> None:
    log = LogFile(tmp_path / "c" / "0.log")
    run = await ProcessRun.start(
        ["sh", "-c", "echo out; echo err >&2; exit 4"], env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path, mounts=[], log=log
    )
    assert await run.wait() == 4
    assert sorted(plain_text(tmp_path / "c" / "0.log").split()) == ["err", "out"]


class _ServerThatNeverStops:
    """An emulated engine whose shutdown hangs (a handler that ignores cancellation, say)."""

    def start(self) -> asyncio.Task[None]:
        self.serving = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
        return self.serving

    async def stop(self) -> None:
        await asyncio.Event().wait()


async def test_an_emulated_engine_that_does_not_stop_is_killed_after_its_grace(tmp_path: Path) -> None:
    server = _ServerThatNeverStops()
    run = EmulatorRun(cast("Emulator", server), LogFile(tmp_path / "0.log"))
    began = time.monotonic()
    await asyncio.wait_for(run.stop(0.1), 10)
    assert time.monotonic() - began < containers._LEAST_STOP_S + 1
    assert await run.wait() == 137
    assert "did not stop within 2s: killed" in plain_text(tmp_path / "0.log")
    server.serving.cancel()
