"""The sandbox's commands report a failure as the rest of the command line does: one line."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from cacheroute.operator.cli.main import app

runner = CliRunner()


def test_status_of_a_sandbox_that_is_not_there_is_one_line_however_long(tmp_path: Path) -> None:
    missing = tmp_path / ("a-state-directory-with-a-long-name-" * 4)
    result = runner.invoke(app, ["sandbox", "status", "--state-dir", str(missing)], env={"COLUMNS": "60"})
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: no sandbox in ") and lines[0].endswith("start one with `cacheroute sandbox up`")


def test_load_refuses_a_run_that_cannot_cover_its_keys_in_one_line() -> None:
    args = ["sandbox", "load", "http://127.0.0.1:9", "--workload", "cacheroute-paper", "--qps", "8", "--keys", "1500"]
    result = runner.invoke(app, args, env={"COLUMNS": "60"})
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: --workload cacheroute-paper: ") and "cannot cover 1500 keys" in lines[0]


def test_the_sandbox_a_shell_was_pointed_at_is_the_one_status_and_down_look_for() -> None:
    # What `eval "$(cacheroute sandbox up --name trial)"` exports; --name given still wins.
    env = {"COLUMNS": "200", "CACHEROUTE_SANDBOX_NAME": "no-such-trial"}
    for command in (["status"], ["down"]):
        result = runner.invoke(app, ["sandbox", *command], env=env)
        assert result.exit_code == 1
        assert "/sandbox/no-such-trial" in result.stderr, result.stderr
    named = runner.invoke(app, ["sandbox", "status", "--name", "other-trial"], env=env)
    assert "/sandbox/other-trial" in named.stderr, named.stderr
