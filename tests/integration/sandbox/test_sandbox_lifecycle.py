"""Starting, inspecting and stopping sandboxes, including a start that fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from kubernetes import client, config
from typer.testing import CliRunner

from cacheroute.sandbox import nodes
from cacheroute.sandbox.cli import app
from cacheroute.sandbox.cluster import Sandbox, SandboxOptions
from cacheroute.sandbox.process import StartError
from tests.support.sandbox import wait_for

pytestmark = pytest.mark.integration

CORE = {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "prometheus", "pod-runtime"}


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text` (our servers all name their state dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def processes_working_in(directory: str) -> list[int]:
    """Live processes whose working directory is under `directory` (pods of the runtime)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "cwd").startswith(directory):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_status_shows_every_component_healthy_with_its_url(sandbox: Sandbox) -> None:
    result = CliRunner().invoke(app, ["status", "--state-dir", str(sandbox.state_dir), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rows = {row["name"]: row for row in report["components"]}
    assert set(rows) >= CORE
    assert all(rows[name]["healthy"] for name in CORE), rows
    assert rows["kube-apiserver"]["url"].startswith("https://127.0.0.1:")
    assert report["kubeconfig"] == str(sandbox.kubeconfig)


def test_envoy_started_through_the_sandbox_is_listed_and_stopped(sandbox: Sandbox) -> None:
    envoy = sandbox.start_envoy("static_resources: {}", name="envoy-status-probe")
    rows = {row.name: row for row in Sandbox.attach(sandbox.state_dir).status()}
    assert rows["envoy-status-probe"].healthy
    assert rows["envoy-status-probe"].url == envoy.admin_url
    sandbox.forget("envoy-status-probe")
    assert not envoy.process.alive()
    assert "envoy-status-probe" not in Sandbox.attach(sandbox.state_dir).state.components


def test_status_of_a_missing_sandbox_is_a_clear_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["status", "--state-dir", str(tmp_path / "nothing")])
    assert result.exit_code == 1
    assert "no sandbox in" in result.output
    assert "Traceback" not in result.output


def test_failed_start_reports_the_component_log_and_leaves_nothing_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path / "kube-apiserver"
    broken.write_text("#!/bin/sh\necho 'error: cannot load the serving certificate' >&2\nexit 3\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CACHEROUTE_KUBE_APISERVER", str(broken))
    state_dir = tmp_path / "state"
    with pytest.raises(StartError) as failed:
        Sandbox.up(SandboxOptions(state_dir=state_dir, prometheus=False, detach=False, timeout=60))
    message = str(failed.value)
    assert message.startswith("kube-apiserver died")
    assert "exited with code 3" in message
    assert "cannot load the serving certificate" in message
    assert processes_mentioning(str(state_dir)) == []  # etcd, started first, was stopped
    assert not state_dir.exists()


@pytest.mark.slow
def test_cli_up_then_down_stops_every_process_and_removes_the_state(tmp_path: Path) -> None:
    state_dir = tmp_path / "cli"
    command = [sys.executable, "-m", "cacheroute.sandbox.cli"]
    up = subprocess.run(
        [*command, "up", "--state-dir", str(state_dir), "--nodes", "1", "--no-prometheus"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    try:
        assert up.returncode == 0, up.stderr
        assert up.stdout == f"export KUBECONFIG={state_dir / 'kubeconfig'}\n"
        # The servers outlive the command that started them: the control plane, kwok, the pod runtime.
        assert len(processes_mentioning(str(state_dir))) == 6
        status = subprocess.run(
            [*command, "status", "--state-dir", str(state_dir), "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert all(row["healthy"] for row in json.loads(status.stdout)["components"])
        # A pod the runtime runs is a process of this machine (working in the pod's directory)...
        api = config.new_client_from_config(config_file=str(state_dir / "kubeconfig"))
        with api:
            wait_for(
                lambda: bool(client.CoreV1Api(api).list_namespaced_service_account("default").items),
                timeout=60,
                what="the default ServiceAccount",
            )
            client.CoreV1Api(api).create_namespaced_pod("default", {
                "metadata": {"name": "sleeper"},
                "spec": {**nodes.gpu_scheduling(), "containers": [
                    {"name": "c", "image": "ghcr.io/cacheroute/cacheroute:0.1.0", "command": ["sleep", "3600"]}]},
            })
        wait_for(lambda: bool(processes_working_in(str(state_dir))), timeout=60, what="the pod's process")
    finally:
        down = subprocess.run(
            [*command, "down", "--state-dir", str(state_dir)], capture_output=True, text=True, timeout=120, check=False
        )
    assert down.returncode == 0, down.stderr
    assert processes_mentioning(str(state_dir)) == []
    # ...which `down` stops with the runtime.
    assert processes_working_in(str(state_dir)) == []
    assert not state_dir.exists()


def test_a_paused_component_hangs_until_resumed_and_down_still_stops_it(tmp_path: Path) -> None:
    state_dir = tmp_path / "drill"
    sandbox = Sandbox.up(SandboxOptions(state_dir=state_dir, nodes=1, detach=False, pod_runtime=None, timeout=120))
    where = ["--state-dir", str(state_dir)]

    def rows() -> dict[str, dict[str, object]]:
        result = CliRunner().invoke(app, ["status", *where, "--json"])
        return {row["name"]: row for row in json.loads(result.stdout)["components"]}

    def answers() -> bool:
        try:
            return httpx.get(f"{sandbox.state.prometheus_url}/-/ready", timeout=1.0).status_code == 200
        except httpx.TimeoutException:
            return False

    try:
        paused = CliRunner().invoke(app, ["pause", "prometheus", *where])
        assert paused.exit_code == 0, paused.output
        row = rows()["prometheus"]
        assert (row["running"], row["paused"], row["healthy"]) == (True, True, False)
        assert not answers()  # the port is open, nothing answers: a hung Prometheus
        again = CliRunner().invoke(app, ["pause", "prometheus", *where])
        assert again.exit_code == 0 and "prometheus was paused already" in again.output
        resumed = CliRunner().invoke(app, ["resume", "prometheus", *where])
        assert resumed.exit_code == 0, resumed.output
        not_paused = CliRunner().invoke(app, ["resume", "prometheus", *where])
        assert not_paused.exit_code == 0 and "prometheus was not paused" in not_paused.output
        wait_for(answers, timeout=30, what="Prometheus answering again")
        assert rows()["prometheus"]["paused"] is False
        unknown = CliRunner().invoke(app, ["pause", "grafana", *where])
        assert unknown.exit_code == 2 and "no component 'grafana' in this sandbox" in unknown.output
        CliRunner().invoke(app, ["pause", "prometheus", *where])
    finally:
        down = CliRunner().invoke(app, ["down", *where])
    assert down.exit_code == 0, down.output
    assert processes_mentioning(str(state_dir)) == []
