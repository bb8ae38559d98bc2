"""The load generator replays a trace against a real (emulated) server and measures it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cacheroute.sandbox.cli import app
from tests.support.emulator import emulator_process
from tests.support.sandbox import wait_for

pytestmark = pytest.mark.integration

SERVER = ["meta-llama/Llama-3.1-8B-Instruct", "--kv-cache-memory-bytes", "4G", "--max-model-len", "16384"]


def write_trace(path: Path) -> None:
    """A Mooncake-format trace: three conversations of two turns sharing a system prompt (block 1)."""
    rows = []
    for turn in range(2):
        for user in range(3):
            blocks = [1, 10 + user] + ([100 + user] if turn else [])
            rows.append({"timestamp": 200 * turn + 50 * user, "input_length": 512 * len(blocks) - 100,
                         "output_length": 8, "hash_ids": blocks})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_trace_is_replayed_open_loop_with_shared_prefixes_and_measured(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    out = tmp_path / "run.json"
    with emulator_process(SERVER, tmp_path) as emulator:
        result = CliRunner().invoke(app, [
            "load", emulator.url, "--trace", str(trace), "--time-scale", "1000", "--no-progress", "-o", str(out),
        ])
        assert result.exit_code == 0, result.output
        assert "served KV hit" in result.stdout
        report = json.loads(out.read_text())
        requests = report["requests"]
        assert [r["status"] for r in requests] == [200] * 6
        assert all(r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"] for r in requests)
        assert [r["prompt_tokens"] for r in requests] == [924] * 3 + [1436] * 3
        assert all(r["completion_tokens"] == 8 for r in requests)
        # Open loop at 1000x: the six requests leave within a fraction of a second of their schedule.
        assert report["summary"]["max_send_lag_s"] < 0.5
        # Every prompt after the first shares block 1 (512 tokens); a second turn shares its whole
        # first turn (924 tokens), of which the whole 16-token blocks (912) are cached.
        first_turns, second_turns = requests[:3], requests[3:]
        assert first_turns[0]["cached_tokens"] == 0
        assert all(r["cached_tokens"] == 512 for r in first_turns[1:])
        assert all(r["cached_tokens"] == 912 for r in second_turns)
        assert report["summary"]["served_kv_hit"] == pytest.approx((2 * 512 + 3 * 912) / (3 * 924 + 3 * 1436))
        assert emulator.metric("vllm:prefix_cache_hits_total") == 2 * 512 + 3 * 912


def test_only_loopback_targets_and_sane_bounds_are_accepted(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    runner = CliRunner()
    remote = runner.invoke(app, ["load", "http://203.0.113.7:8000", "--trace", str(trace)])
    assert remote.exit_code == 2
    assert "not a loopback address" in remote.output
    both = runner.invoke(app, ["load", "http://127.0.0.1:9", "--trace", str(trace), "--workload", "low-reuse"])
    assert both.exit_code == 2
    assert "exactly one of --trace and --workload" in both.output
    missing = runner.invoke(app, ["load", "http://127.0.0.1:9", "--trace", str(tmp_path / "none.jsonl")])
    assert missing.exit_code == 2
    # Refused while parsing the options (the option declares an existing file).
    assert "'--trace'" in missing.output and "does not exist" in " ".join(missing.output.split())


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_run_reports_and_writes_what_had_finished(tmp_path: Path, stop: signal.Signals) -> None:
    out = tmp_path / "run.json"
    with emulator_process(SERVER, tmp_path) as emulator:
        load = subprocess.Popen(
            [sys.executable, "-m", "cacheroute.operator.cli.main", "sandbox", "load", emulator.url,
             "--workload", "cacheroute-paper", "--keys", "5", "--qps", "4", "--duration", "120",
             "--max-input-tokens", "2000", "--no-progress", "-o", str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            wait_for(lambda: emulator.metric("vllm:request_success_total") >= 3, timeout=60,
                     what="three requests served")
            load.send_signal(stop)
            stdout, stderr = load.communicate(timeout=20)
        finally:
            load.kill()
    assert load.returncode == 130, stderr
    assert "interrupted: " in stderr and " requests had finished" in stderr
    assert "served KV hit" in stdout
    report = json.loads(out.read_text())
    assert report["settings"]["interrupted"] is True
    finished = report["requests"]
    assert 3 <= len(finished) < report["settings"]["requests"]
    assert all(r["status"] == 200 for r in finished)
