"""The capacity bench's figures: drawn from whatever sections a report holds, ratios taken against
the best per-request router, and a clear refusal of a file that is not a report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.bench import bench_capacity, capacity_plots

PNG = b"\x89PNG\r\n\x1a\n"


def row(qps: float, policy: str, engine: str = "gpu") -> dict[str, Any]:
    probes = [[qps * 0.9, 1.0, True], [qps, 3.0, True], [qps * 1.05, None, False]]
    return {"policy": policy, "engine": engine, "capacity_qps": qps, "kv_hit": 0.6, "probes": probes}


def workload(**capacity: float) -> dict[str, Any]:
    return {"policies": {label.replace("_", "-"): row(q, label.replace("_", "-")) for label, q in capacity.items()}}


def report() -> dict[str, Any]:
    paper = workload(p2c=100.0, key_p2c=110.0, preble=120.0, cacheroute=126.0, cacheroute_guard=126.0)
    paper.update(slo_p99_ttft_s=3.5, check={"value": 1.05, "target": 1.3, "baseline": "preble"})
    product = {"policies": {"vLLM defaults + p2c": row(100.0, "p2c", "vllm-default"),
                            "operator + CacheRoute": row(230.0, "cacheroute", "operator")},
               "check": {"value": 2.3, "target": 2.3}, "ideal_cache_ceiling": {"capacity_qps": 240.0, "ratio": 2.4}}
    return {
        "bench": "capacity", "quick": True, "rel_tol": 0.03, "started": "2026-12-04T00:00:00Z",
        "paper": paper, "product": product,
        "traces": {"mooncake_arxiv_trace_first1000.jsonl": workload(p2c=4.0, gie_prefix=5.0, cacheroute=5.5,
                                                                    cacheroute_guard=5.0, cacheroute_noscore=9.0)},
        "low_reuse": workload(p2c=36.0, key_p2c=40.0, cacheroute=38.0),
    }


def test_ratios_are_against_the_best_per_request_router_only() -> None:
    ratios = capacity_plots.workload_ratios(report())
    # CacheRoute's own variants (noscore at 9.0) are not baselines; gie-prefix (5.0) is the best.
    assert ratios[0] == pytest.approx(("arxiv", 1.1, 1.0))
    # key-seeded p2c, not plain p2c, is the bar on low-reuse; no guarded run, no guarded ratio.
    name, ratio, guarded = ratios[1]
    assert (name, guarded) == ("low-reuse", None)
    assert ratio == pytest.approx(0.95)


def test_cli_draws_both_figures_beside_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run-1.json"
    path.write_text(json.dumps(report()))
    assert capacity_plots.main([str(path)]) == 0
    out = capsys.readouterr().out
    for name in ("run-1.png", "run-1_probes.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG)
        assert f"wrote {tmp_path / name}" in out


def test_a_report_without_the_paper_workload_gets_no_probe_figure(tmp_path: Path) -> None:
    partial = report()
    del partial["paper"], partial["product"]
    written = capacity_plots.write_figures(partial, tmp_path / "figures", "capacity")
    assert [p.name for p in written] == ["capacity.png"]
    assert written[0].read_bytes().startswith(PNG)


def test_a_policy_that_never_kept_its_slo_is_still_drawn(tmp_path: Path) -> None:
    overloaded = report()
    for policy in overloaded["paper"]["policies"].values():
        policy["capacity_qps"] = 0.0
        policy["probes"] = [[q, None, False] for q, _p99, _ok in policy["probes"]]
    fig = capacity_plots.probes_figure(overloaded["paper"])
    low, high = fig.axes[0].get_xlim()
    # The rates tried still span the axis, left to right, though no capacity was found.
    assert low < 90.0 < high
    written = capacity_plots.write_figures(overloaded, tmp_path, "capacity")
    assert [p.name for p in written] == ["capacity.png", "capacity_probes.png"]


def test_a_baseline_of_0_qps_reads_n_a_instead_of_failing(tmp_path: Path) -> None:
    zero = report()
    for label in ("p2c", "key-p2c", "preble"):
        zero["paper"]["policies"][label]["capacity_qps"] = 0.0
    # A ratio over 0 QPS is NaN, which the bench's JSON holds as null.
    zero["paper"]["check"]["value"] = None
    zero["ablation"] = {"engines": {"host": "host"},
                        "policies": {"neither": row(0.0, "cacheroute-before"), "all three": row(250.0, "cacheroute",
                                                                                                  "host")},
                        "ratio_vs_neither": {"neither": None, "all three": None}}
    fig = capacity_plots.summary_figure(zero)
    assert fig is not None
    assert "CacheRoute n/a the best" in fig.axes[0].get_title()
    assert any("n/a" in text.get_text() for text in fig.axes[1].texts)
    assert capacity_plots.write_figures(zero, tmp_path, "capacity")[0].read_bytes().startswith(PNG)


def test_the_paper_slo_is_drawn_for_reports_that_did_not_record_it() -> None:
    paper = report()["paper"]
    del paper["slo_p99_ttft_s"]
    lines = capacity_plots.probes_figure(paper).axes[0].get_lines()
    assert any(list(line.get_ydata()) == [bench_capacity.SLO] * 2 for line in lines)


def test_a_smaller_report_of_the_same_name_leaves_no_stale_figure(tmp_path: Path) -> None:
    capacity_plots.write_figures(report(), tmp_path, "capacity")
    assert (tmp_path / "capacity_probes.png").exists()
    traces_only = {k: v for k, v in report().items() if k not in ("paper", "product")}
    assert capacity_plots.write_figures(traces_only, tmp_path, "capacity") == [tmp_path / "capacity.png"]
    assert not (tmp_path / "capacity_probes.png").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such report"),
        ("{not json", "not a JSON report"),
        (json.dumps({"bench": "replay"}), "not a capacity bench report"),
        (json.dumps({"bench": "capacity", "started": "x"}), "holds no section to draw"),
        (json.dumps({"bench": "capacity", "paper": {"policies": {"p2c": {"policy": "p2c"}}}}), "lacks 'capacity_qps'"),
    ],
)
def test_what_cannot_be_drawn_exits_2_saying_why(content: str | None, message: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "capacity.json"
    if content is not None:
        path.write_text(content)
    assert capacity_plots.main([str(path), "--out-dir", str(tmp_path / "figures")]) == 2
    assert message in capsys.readouterr().err


def test_an_output_folder_that_is_a_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "capacity.json"
    path.write_text(json.dumps(report()))
    assert capacity_plots.main([str(path), "--out-dir", str(path)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


@pytest.mark.parametrize(("out", "message"),
                         [("", "is a directory"), ("a-file/capacity.json", "is a file, not a folder")])
def test_bench_refuses_an_output_it_cannot_write_before_replaying(out: str, message: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a-file").write_text("")
    assert bench_capacity.main(["--out", str(tmp_path / out), "--only", "paper"]) == 2
    assert message in capsys.readouterr().err
