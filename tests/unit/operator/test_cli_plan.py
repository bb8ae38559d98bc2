"""`cacheroute plan`: from statistics or a trace to a ConfigMap payload, a manifest or a table."""

from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from cacheroute.operator.api.manifests import parse_resource
from cacheroute.operator.api.plan import AffinityPlan
from cacheroute.operator.cli.errors import CommandLine
from cacheroute.operator.cli.plan import register
from cacheroute.operator.cli.statsfile import format_stats_csv, parse_stats
from cacheroute.planner.plan import affinity_key_hash
from cacheroute.planner.plan_format import decode_plan
from tests.support.synthetic_stats import SyntheticStatsSpec, synthetic_key_stats

TRACES = Path(os.environ.get("CACHEROUTE_TRACES_DIR", Path(__file__).resolve().parents[3] / ".." / "shared" / "traces"))
runner = CliRunner()


def make_app() -> typer.Typer:
    app = typer.Typer(cls=CommandLine, pretty_exceptions_enable=False)

    @app.callback()
    def main() -> None:
        """Test entry point."""

    register(app)
    return app


APP = make_app()

STATS_CSV = """key,rate,prompt_tokens,prefix_tokens,output_tokens
,2.0,1000,0,100
alice,1.5,3000,2000,200
bob,0.2,8000,6000,300
carol,0.0,100,50,10
dave,0.5,500,0,20
"""


@pytest.fixture
def stats_csv(tmp_path: Path) -> Path:
    p = tmp_path / "stats.csv"
    p.write_text(STATS_CSV)
    return p


def invoke(*args: str) -> tuple[int, str]:
    result = runner.invoke(APP, ["plan", *args])
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def files_of(doc: dict[str, object]) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in doc["binaryData"].items()}  # type: ignore[attr-defined]


def test_json_output_is_the_configmap_payload(stats_csv: Path) -> None:
    code, out = invoke(
        "--stats",
        str(stats_csv),
        "--destinations",
        "3",
        "--kv-capacity-tokens",
        "100000",
        "--pool",
        "llama",
        "-o",
        "json",
        "--generated-at",
        "2026-01-01T00:00:00Z",
    )
    assert code == 0, out
    doc = json.loads(out)
    plan = decode_plan(files_of(doc))
    assert doc["version"] and doc["pool"] == "llama"
    assert plan.pool == "llama"
    assert plan.generated_at == "2026-01-01T00:00:00Z"
    assert [d.id for d in plan.destinations] == ["llama-0", "llama-1", "llama-2"]
    routes = plan.routes()
    assert set(routes) == {affinity_key_hash("alice"), affinity_key_hash("bob")}
    # The ConfigMaps together hold exactly the payload's files.
    assert doc["configMaps"][0]["name"] == "llama-plan"
    held = {f: d for cm in doc["configMaps"] for f, d in cm["binaryData"].items()}
    assert held == doc["binaryData"]


def test_yaml_output_is_a_valid_manual_affinity_plan(tmp_path: Path) -> None:
    stats = tmp_path / "stats.jsonl"
    stats.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"key": "alice", "rate": 1.5, "prompt_tokens": 3000, "prefix_tokens": 2000, "output_tokens": 200},
                {"key": "bob", "rate": 0.2, "prompt_tokens": 8000, "prefix_tokens": 6000, "output_tokens": 300},
                {"key": None, "rate": 3.0, "prompt_tokens": 900, "prefix_tokens": 0, "output_tokens": 50},
            ]
        )
    )
    out_file = tmp_path / "plan.yaml"
    code, out = invoke(
        "--stats",
        str(stats),
        "--destinations",
        "2",
        "--budget-tokens",
        "10000",
        "--max-churn",
        "0.25",
        "--pool",
        "llama",
        "--pin",
        "vip=llama-1,llama-0",
        "-o",
        "yaml",
        "--out",
        str(out_file),
    )
    assert code == 0, out
    # No payload version: the operator publishes a Manual plan under its own.
    assert "a Manual AffinityPlan" in out and "(plan " not in out
    # Without the replicas' KV capacity the plan holds its entries, as the Manual plan does.
    assert "note:" not in out
    doc = yaml.safe_load(out_file.read_text())
    obj = parse_resource(doc, "plan.yaml")
    assert isinstance(obj, AffinityPlan)
    assert obj.spec.mode == "Manual"
    assert obj.spec.pool_ref.name == "llama"
    pinned = {p.key: p.destinations for p in obj.spec.pinned}
    assert set(pinned) == {"alice", "bob", "vip"}
    assert pinned["vip"] == ["llama-1", "llama-0"]
    assert all(len(d) == 1 for k, d in pinned.items() if k != "vip")
    # Switched to Auto later, the plan is computed with the settings it was made with.
    assert obj.spec.budget.warm_tokens_per_destination == 10000
    assert obj.spec.stability.max_churn == 0.25


def test_yaml_output_says_when_pins_hold_keys_the_plan_would_let_yield(stats_csv: Path, tmp_path: Path) -> None:
    out_file = tmp_path / "plan.yaml"
    args = ["--stats", str(stats_csv), "--destinations", "3", "--kv-capacity-tokens", "100000", "--pool", "llama"]
    code, out = invoke(*args, "-o", "yaml", "--out", str(out_file))
    assert code == 0, out
    # alice's and bob's prefixes are most of their prompts: routers find them wherever they went,
    # so the plan lets its entries yield to load, which the pins of a Manual plan do not.
    assert "credits its entries with 0.25" in " ".join(out.split())
    assert yaml.safe_load(out_file.read_text())["spec"]["mode"] == "Manual"
    # The payload routers read carries the credit itself: nothing to say there.
    code, out = invoke(*args, "-o", "json")
    assert code == 0 and "note:" not in out
    assert decode_plan(files_of(json.loads(out))).entry_credit == 0.25


def test_table_from_a_mooncake_trace(tmp_path: Path) -> None:
    trace = TRACES / "mooncake_arxiv_trace_first1000.jsonl"
    if not trace.is_file():
        pytest.skip(f"{trace} not available")
    for key in ("first-blocks:4", "thread"):
        code, out = invoke(
            "--trace",
            str(trace),
            "--key",
            key,
            "--destinations",
            "4",
            "--kv-capacity-tokens",
            "400000",
            "--pool",
            "arxiv",
            "--window-end",
            "120",
        )
        assert code == 0, out
        assert "routed keys" in out
        assert "arxiv-3" in out


def test_replan_against_a_previous_plan_reports_forced_churn(stats_csv: Path, tmp_path: Path) -> None:
    stats = synthetic_key_stats(SyntheticStatsSpec(keys=400, seed=4))
    csv = tmp_path / "big.csv"
    csv.write_text(format_stats_csv(stats))
    first = tmp_path / "first.json"
    code, out = invoke(
        "--stats",
        str(csv),
        "--destinations",
        "4",
        "--kv-capacity-tokens",
        "60000",
        "--pool",
        "p",
        "-o",
        "json",
        "--out",
        str(first),
    )
    assert code == 0, out
    code, out = invoke(
        "--stats",
        str(csv),
        "--destinations",
        "3",
        "--kv-capacity-tokens",
        "60000",
        "--pool",
        "p",
        "--previous",
        str(first),
        "--max-churn",
        "0",
    )
    assert code == 0, out
    assert "forced" in out
    assert "churn" in out


def test_a_replan_that_routes_as_the_previous_plan_says_only_its_summary_changed(
    stats_csv: Path, tmp_path: Path
) -> None:
    common = ("--stats", str(stats_csv), "--kv-capacity-tokens", "60000", "--pool", "p", "-o", "json")
    first, second, third = (tmp_path / f"{n}.json" for n in ("first", "second", "third"))
    assert invoke(*common, "--destinations", "4", "--out", str(first))[0] == 0
    code, out = invoke(*common, "--destinations", "4", "--previous", str(first), "--out", str(second))
    assert code == 0, out
    assert "routes every request as --previous does" in out
    assert not out.startswith("{")  # --out, not standard output
    code, out = invoke(*common, "--destinations", "3", "--previous", str(first), "--out", str(third))
    assert code == 0, out
    assert "as --previous does" not in out


def test_destinations_file_with_weights(stats_csv: Path, tmp_path: Path) -> None:
    dfile = tmp_path / "dests.yaml"
    dfile.write_text(
        yaml.safe_dump(
            {
                "destinations": [
                    {"id": "big", "address": "10.0.0.1:8000", "weight": 2, "kvCapacityTokens": 50000},
                    {"id": "small", "address": "10.0.0.2:8000", "kvCapacityTokens": 50000},
                ]
            }
        )
    )
    code, out = invoke("--stats", str(stats_csv), "--destinations-file", str(dfile), "-o", "json")
    assert code == 0, out
    plan = decode_plan(files_of(json.loads(out)))
    assert [(d.id, d.weight) for d in plan.destinations] == [("big", 2.0), ("small", 1.0)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--destinations", "2"], "exactly one of --trace or --stats"),
        (["--stats", "{stats}", "--destinations", "2"], "--budget-tokens auto needs"),
        (["--stats", "{stats}"], "exactly one of --destinations N or --destinations-file"),
        (["--stats", "{stats}", "--destinations", "0", "--budget-tokens", "9"], "'--destinations': Input"),
        (["--stats", "{stats}", "--destinations", "2", "--budget-tokens", "lots"], "--budget-tokens must be 'auto'"),
        (
            ["--stats", "{stats}", "--destinations", "2", "--budget-tokens", "9", "--pin", "alice=nowhere"],
            "names destination 'nowhere'",
        ),
        (
            ["--stats", "{stats}", "--destinations", "2", "--budget-tokens", "9", "--pin", "alice=llama-0,,llama-1"],
            "has an empty destination",
        ),
        (
            ["--stats", "{stats}", "--destinations", "2", "--budget-tokens", "9", "--max-key-share", "2"],
            "'--max-key-share': Input should be less than or equal to 1",
        ),
        (["--stats", "{missing}", "--destinations", "2"], "missing.csv"),
        (["--stats", "{bad}", "--destinations", "2", "--budget-tokens", "9"], "line 3: column 'rate' must be a number"),
        (["--stats", "{stats}", "--destinations", "2", "--budget-tokens", "9", "-o", "xml"], "-o must be json"),
        (["--trace", "{stats}", "--destinations", "2", "--budget-tokens", "9", "--key", "first-blocks:x"], "--key"),
        (["--stats", "{stats}", "--destinations", "2", "--budget-tokens", "9", "--previous", "{stats}"],
         "not JSON; --previous takes the payload `cacheroute plan -o json` writes"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_code_2(
    args: list[str], message: str, stats_csv: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("key,rate,prompt_tokens,prefix_tokens,output_tokens\na,1,10,5,1\nb,fast,10,5,1\n")
    subst = {"stats": str(stats_csv), "missing": str(tmp_path / "missing.csv"), "bad": str(bad)}
    code, out = invoke(*[a.format(**subst) for a in args])
    assert code == 2
    assert message in " ".join(out.split())


def test_stats_file_round_trip_and_errors() -> None:
    stats = synthetic_key_stats(SyntheticStatsSpec(keys=50, seed=9))
    back = parse_stats(format_stats_csv(stats), fmt="csv")
    assert back.names == stats.names
    assert back.rate.tolist() == stats.rate.tolist()
    assert back.unkeyed == stats.unkeyed
    with pytest.raises(ValueError, match="header lacks column"):
        parse_stats("key,rate\na,1\n")
    with pytest.raises(ValueError, match="key 'a' already given"):
        parse_stats("key,rate,prompt_tokens,prefix_tokens,output_tokens\na,1,2,1,1\na,1,2,1,1\n")
    with pytest.raises(ValueError, match="prefix_tokens 3 exceeds prompt_tokens 2"):
        parse_stats('{"key": "a", "rate": 1, "prompt_tokens": 2, "prefix_tokens": 3, "output_tokens": 1}\n')
    with pytest.raises(ValueError, match="a second row without key"):
        parse_stats("key,rate,prompt_tokens,prefix_tokens,output_tokens\n,1,2,0,1\n,1,2,0,1\n")


def test_a_host_tier_is_worth_less_warm_budget_when_its_copy_back_costs(tmp_path: Path) -> None:
    stats = tmp_path / "stats.csv"
    stats.write_text(format_stats_csv(synthetic_key_stats(SyntheticStatsSpec(keys=2_000, seed=3))))
    dfile = tmp_path / "dests.yaml"
    dfile.write_text(yaml.safe_dump({"destinations": [
        {"id": f"llama-{i}", "address": f"10.0.0.{i}:8000", "kvCapacityTokens": 20_000,
         "hostKvCapacityTokens": 400_000}
        for i in range(4)
    ]}))

    def admitted(*cost: str) -> int:
        code, out = invoke("--stats", str(stats), "--destinations-file", str(dfile), "-o", "json", *cost)
        assert code == 0, out
        return len(decode_plan(files_of(json.loads(out))).routes())

    free, priced = admitted(), admitted("--host-copy-s-per-token", "0.00007")  # half the default prefill
    # Host-held prefixes saving half as much, the same warm capacity admits fewer keys.
    assert 0 < priced < free


def test_the_table_counts_pinned_keys_that_had_no_traffic(stats_csv: Path) -> None:
    code, out = invoke("--stats", str(stats_csv), "--destinations", "2", "--budget-tokens", "10000",
                       "--pool", "llama", "--pin", "vip=llama-1", "--pin", "alice=llama-0")
    assert code == 0, out
    assert "(2 pinned)" in out.split("share of requests")[0]  # the routed keys' row


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ('"key": "a", "rate": "1.5"', "field 'rate' must be a JSON number, got '1.5'"),
        ('"key": "a", "rate": true', "field 'rate' must be a JSON number, got True"),
        ('"key": "a", "rate": null', "field 'rate' must be a JSON number, got None"),
        ('"key": 17, "rate": 1', "field 'key' must be a string (or null for unkeyed traffic), got 17"),
        ('"key": ["a"], "rate": 1', "field 'key' must be a string"),
    ],
)
def test_json_lines_stats_refuse_values_of_the_wrong_json_type(row: str, problem: str) -> None:
    # A quoted rate or a numeric key comes from a broken exporter: CSV cannot tell, JSON can.
    text = "{" + row + ', "prompt_tokens": 2, "prefix_tokens": 1, "output_tokens": 1}\n'
    with pytest.raises(ValueError, match=re.escape(f"<stats> line 1: {problem}")):
        parse_stats(text)
    unkeyed = '{"key": null, "rate": 2, "prompt_tokens": 9.5, "prefix_tokens": 0, "output_tokens": 3}\n'
    assert parse_stats(unkeyed).unkeyed.rate == 2
