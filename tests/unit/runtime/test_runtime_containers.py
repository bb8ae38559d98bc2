"""Container processes: mounts in a private namespace, or a clear refusal where that is not allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from cacheroute.sandbox.runtime import containers
from cacheroute.sandbox.runtime.containers import ContainerStartError, Mount, ProcessRun, mount_script
from cacheroute.sandbox.runtime.logs import LogFile, plain_text


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
