"""`cacheroute replay`: tables, JSON and plots from a trace or a generated workload."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cacheroute.operator.cli.replay import register

TRACES = Path(os.environ.get("CACHEROUTE_TRACES_DIR", Path(__file__).resolve().parents[3] / ".." / "shared" / "traces"))
ARXIV = TRACES / "mooncake_arxiv_trace_first1000.jsonl"
runner = CliRunner()


def make_app() -> typer.Typer:
    app = typer.Typer(pretty_exceptions_enable=False)

    @app.callback()
    def main() -> None:
        """Test entry point."""

    register(app)
    return app


@pytest.mark.skipif(not ARXIV.is_file(), reason="shared traces absent")
def test_replay_of_a_trace_writes_figures_json_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = runner.invoke(make_app(), [
        "replay", "--trace", str(ARXIV), "--key", "thread", "--destinations", "8",
        "--policies", "p2c,prefix-tree,cacheroute-noplan", "--qps", "1,2", "--duration", "120", "--out", str(out),
    ])
    assert res.exit_code == 0, res.output
    assert "prefix-tree" in res.output and "KV hit" in res.output
    report = json.loads((out / "replay.json").read_text())
    assert report["input"]["key"] == "thread"
    assert [(r["policy"], r["qps"]) for r in report["results"]] == [
        ("p2c", 1.0), ("p2c", 2.0), ("prefix-tree", 1.0), ("prefix-tree", 2.0),
        ("cacheroute-noplan", 1.0), ("cacheroute-noplan", 2.0),
    ]
    for r in report["results"]:
        assert r["metrics"]["policy"] == r["policy"]  # a variant's figures under the name asked for
        assert 0.0 <= r["metrics"]["kv_hit"] <= 1.0
        assert r["metrics"]["measured"] > 0
    for png in ("ttft_p99_vs_qps.png", "kv_hit.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_capacity_search_on_a_generated_workload(tmp_path: Path) -> None:
    res = runner.invoke(make_app(), [
        "replay", "--workload", "low-reuse", "--duration", "30", "--destinations", "4", "--policies", "p2c",
        "--capacity", "--slo-p99-ttft", "3", "--out", str(tmp_path),
    ])
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "replay.json").read_text())
    cap = report["results"][0]
    assert cap["policy"] == "p2c" and cap["capacity_qps"] > 0
    # Without a terminal, progress is a line per finished run on stderr.
    assert f"[1/1] capacity of p2c: {cap['capacity_qps']:.3g} QPS" in res.stderr
    assert any(p["passed"] for p in cap["probes"]) and any(not p["passed"] for p in cap["probes"])
    assert report["workload_stats"]["requests"] > 100


def test_a_trace_too_short_to_bound_the_capacity_reports_a_lower_bound_and_why(tmp_path: Path) -> None:
    res = runner.invoke(make_app(), [
        "replay", "--workload", "sampled", "--seed", "4242", "--duration", "60", "--destinations", "8",
        "--policies", "gie-prefix,cacheroute-noplan", "--capacity", "--slo-p99-ttft", "5", "--out", str(tmp_path),
    ], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    results = json.loads((tmp_path / "replay.json").read_text())["results"]
    # Each result under the name it was asked by, not the name variants of one policy share.
    assert [r["policy"] for r in results] == ["gie-prefix", "cacheroute-noplan"]
    assert [r["best"]["policy"] for r in results] == ["gie-prefix", "cacheroute-noplan"]
    cap = results[0]
    assert cap["bounded"] is False and 0 < cap["capacity_qps"] < 1_000  # not millions of requests a second
    assert ">= " in res.output and "not bounded by this trace" in res.output and "--duration" in res.output


def test_a_capacity_of_zero_says_that_not_even_the_lowest_rate_met_the_objective() -> None:
    res = runner.invoke(make_app(), [
        "replay", "--workload", "low-reuse", "--duration", "30", "--destinations", "4", "--policies", "p2c",
        "--capacity", "--slo-p99-ttft", "0.001",
    ], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    note = next(line for line in res.output.splitlines() if line.startswith("note: p2c:"))
    assert "no rate meets p99 TTFT <= 0.001 s" in note and "the lowest tried" in note and "--slo-p99-ttft" in note


def test_a_sampled_workload_is_drawn_from_the_seed_and_reported(tmp_path: Path) -> None:
    reports = []
    for seed, out in (("7", tmp_path / "a"), ("7", tmp_path / "b"), ("8", tmp_path / "c")):
        res = runner.invoke(make_app(), [
            "replay", "--workload", "sampled", "--seed", seed, "--duration", "20", "--destinations", "4",
            "--policies", "p2c", "--qps", "2", "--out", str(out),
        ])
        assert res.exit_code == 0, res.output
        reports.append(json.loads((out / "replay.json").read_text()))
    a, b, c = (r["input"]["workload"] for r in reports)
    assert a == b and a["name"] == "sampled-7" and a["seed"] == 7
    assert c["keys"] != a["keys"] and c["prefix_median_tokens"] != a["prefix_median_tokens"]
    assert reports[0]["results"] == reports[1]["results"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policies", "p2c"], "exactly one of --workload and --trace"),
        (["--workload", "nope"], "unknown workload"),
        (["--workload", "low-reuse", "--policies", "magic"], "unknown policy 'magic'"),
        (["--workload", "low-reuse", "--qps", "1,x"], "--qps must be numbers"),
        (["--workload", "low-reuse", "--qps", "3", "--capacity"], "not both"),
        (["--trace", "/nonexistent/trace.jsonl"], "does not exist"),
        (["--workload", "low-reuse", "--profile", "tpu"], "unknown engine profile"),
    ],
)
def test_bad_input_is_reported_without_a_traceback(args: list[str], message: str) -> None:
    res = runner.invoke(make_app(), ["replay", *args])
    assert res.exit_code == 2
    assert message in res.output
    assert "Traceback" not in res.output


def test_a_whole_trace_too_short_to_bound_the_capacity_asks_for_a_longer_trace(tmp_path: Path) -> None:
    lines = [{"timestamp": 1000 * i, "input_length": 600, "output_length": 10, "hash_ids": [i % 3, 100 + i]}
             for i in range(40)]
    path = tmp_path / "short.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    res = runner.invoke(make_app(), [
        "replay", "--trace", str(path), "--destinations", "4", "--policies", "p2c", "--capacity",
        "--slo-p99-ttft", "30",
    ], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    assert "The whole trace was replayed: give a longer one" in res.output and "--duration" not in res.output


def test_an_interrupt_while_rendering_leaves_the_previous_set_of_files_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cacheroute.operator.cli.replay as replay_cli

    args = ["replay", "--workload", "low-reuse", "--duration", "20", "--destinations", "4", "--policies", "p2c",
            "--out", str(tmp_path)]
    assert runner.invoke(make_app(), [*args, "--qps", "1"]).exit_code == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert set(before) == {"replay.json", "ttft_p99_vs_qps.png", "kv_hit.png"}
    rendered = replay_cli._png

    def interrupted_at_the_second_plot(fig: object) -> bytes:
        if interrupted_at_the_second_plot.calls:  # type: ignore[attr-defined]
            raise KeyboardInterrupt
        interrupted_at_the_second_plot.calls += 1  # type: ignore[attr-defined]
        return rendered(fig)

    interrupted_at_the_second_plot.calls = 0  # type: ignore[attr-defined]
    monkeypatch.setattr(replay_cli, "_png", interrupted_at_the_second_plot)
    runner.invoke(make_app(), [*args, "--qps", "2"])
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_request_no_destination_can_hold_is_bad_input_not_an_internal_error(tmp_path: Path) -> None:
    lines = [{"timestamp": 1000 * i, "input_length": 600, "output_length": 10, "hash_ids": [i, 100 + i]}
             for i in range(5)]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    res = runner.invoke(make_app(), [
        "replay", "--trace", str(path), "--destinations", "2", "--policies", "p2c", "--qps", "1",
        "--kv-capacity-tokens", "500",
    ], env={"COLUMNS": "400"})
    assert res.exit_code == 2, res.output
    assert "5 request(s) need more KV than one destination holds (500 tokens)" in res.output
    assert "internal error" not in res.output


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs a folder that takes no file")
def test_an_out_folder_that_takes_no_file_is_refused_before_any_replay() -> None:
    # /proc takes no file even for root, whose permission bits would say it can.
    res = runner.invoke(make_app(), [
        "replay", "--workload", "low-reuse", "--duration", "20", "--destinations", "4", "--policies", "p2c",
        "--qps", "1", "--out", "/proc/cacheroute-replay",
    ])
    assert res.exit_code == 2, res.output
    assert "--out /proc/cacheroute-replay: cannot write in /proc" in res.output
    assert "p2c" not in res.output  # not one run
