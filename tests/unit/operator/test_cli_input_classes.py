"""The kinds of bad input found in the command line, each answered with one line and exit status 2.

Each case stands for its class (issue #11): non-finite and absurd numbers in options and in
files, fields of the wrong JSON type, inverted ranges, unusable paths, text that is not UTF-8,
manifests the API server would refuse. Writing never loses the previous file.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from cacheroute.operator.cli.main import app
from cacheroute.operator.files import write_atomically, write_with
from cacheroute.router.kube import PayloadError, configmap_files

runner = CliRunner()
TRACE_LINE = {"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}
STATS = "key,rate,prompt_tokens,prefix_tokens,output_tokens\nalice,1.5,3000,2000,200\nbob,0.5,800,600,30\n"


def one_line_error(args: list[str], *needles: str) -> str:
    result = runner.invoke(app, args)
    assert "Traceback" not in result.output, result.output
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def trace(tmp_path: Path, *changes: dict[str, Any], raw: str | None = None) -> Path:
    lines = [json.dumps({**TRACE_LINE, "timestamp": 1000 * i}) for i in range(5)]
    lines += [json.dumps({**TRACE_LINE, **c}) if c else "" for c in changes]
    if raw is not None:
        lines.append(raw)
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


# --- memory-plan: a config.json with fields of the wrong type or range -----------------------------

LLAMA_CONFIG = {
    "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_hidden_layers": 32, "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    ("field", "value"),
    [("head_dim", "128"), ("head_dim", -128), ("head_dim", 1.5), ("intermediate_size", "big"),
     ("num_hidden_layers", 10**12), ("vocab_size", True), ("max_position_embeddings", "8k")],
)
def test_memory_plan_config_fields_of_the_wrong_type(tmp_path: Path, field: str, value: object) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**LLAMA_CONFIG, field: value}))
    one_line_error(["memory-plan", "--model", str(config)], field)


@pytest.mark.parametrize(
    ("content", "problem"),
    [(b"\xff\xfe{}", "not UTF-8"), (b"[" * 100_000, "nested too deeply"), (b'{"x": ' + b"9" * 5000 + b"}", "config"),
     (b"[1, 2]", "JSON object")],
)
def test_memory_plan_config_files_that_are_not_configs(tmp_path: Path, content: bytes, problem: str) -> None:
    config = tmp_path / "config.json"
    config.write_bytes(content)
    one_line_error(["memory-plan", "--model", str(config)], problem)
    one_line_error(["memory-plan", "--model", str(tmp_path)], "is not a file")


def test_memory_plan_gpu_memory_beyond_any_gpu() -> None:
    for value in ("inf", "1e12", "nan", "0"):
        one_line_error(["memory-plan", "--model", "llama-3.1-8b", "--gpu-memory-gib", value], "--gpu-memory-gib")
    one_line_error(["memory-plan", "--model", "llama-3.1-8b", "--mnbt", "99999999999999999999"], "--mnbt")


# --- plan: bad numbers in traces and statistics, inverted windows, unusable paths -----------------


@pytest.mark.parametrize(
    ("change", "raw", "problem"),
    [
        ({}, '{"timestamp": NaN, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}', "NaN"),
        ({}, '{"timestamp": Infinity, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}', "Infinity"),
        ({"timestamp": 1e300}, None, "timestamp"),
        ({"input_length": 1e300}, None, "input_length"),
        ({"output_length": 10**30}, None, "output_length"),
        ({"hash_ids": [10**30, 1]}, None, "hash_ids"),
        ({}, '{"timestamp": 1, "input_length": ' + "9" * 5000 + "}", "trace.jsonl line 6"),
        ({}, "[" * 100_000, "trace.jsonl line 6"),
        ({}, '{"timestamp": 1, "input_length": 600, "hash_ids": [1, 2]}', "field 'output_length' is missing"),
    ],
)
def test_plan_trace_with_bad_numbers(tmp_path: Path, change: dict[str, Any], raw: str | None, problem: str) -> None:
    path = trace(tmp_path, change, raw=raw) if change else trace(tmp_path, raw=raw)
    one_line_error(["plan", "--trace", str(path), "--destinations", "2", "--budget-tokens", "9000"], problem)
    one_line_error(["replay", "--trace", str(path), "--policies", "p2c"], problem)


def test_plan_inverted_or_empty_window(tmp_path: Path) -> None:
    path = trace(tmp_path)
    base = ["plan", "--trace", str(path), "--destinations", "2", "--budget-tokens", "9000"]
    one_line_error([*base, "--window-start", "3", "--window-end", "1"], "--window-start 3 must come before")
    one_line_error([*base, "--window-start", "1.5", "--window-end", "1.9"], "holds no request")
    one_line_error([*base, "--window-start", "1e9"], "window start 1e+09 s is after the last request", "(4 s)")
    one_line_error([*base, "--window-start", "nan"], "--window-start")


def test_plan_out_in_a_missing_folder_is_refused_before_any_work(tmp_path: Path) -> None:
    stats = tmp_path / "stats.csv"
    stats.write_text(STATS)
    base = ["plan", "--stats", str(stats), "--destinations", "2", "--budget-tokens", "9000", "-o", "json"]
    one_line_error([*base, "--out", str(tmp_path / "nowhere" / "plan.json")], "--out", "does not exist")
    one_line_error([*base, "--out", str(tmp_path)], "--out")
    (tmp_path / "afile").write_text("x")
    one_line_error([*base, "--out", str(tmp_path / "afile" / "plan.json")], "afile is a file, not a folder")


def test_plan_out_never_replaces_a_device_or_a_pipe(tmp_path: Path) -> None:
    stats = tmp_path / "stats.csv"
    stats.write_text(STATS)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    base = ["plan", "--stats", str(stats), "--destinations", "2", "--budget-tokens", "9000", "-o", "json"]
    one_line_error([*base, "--out", str(fifo)], "--out", "not a regular file")
    assert fifo.is_fifo()
    # A link to one is refused too; a link to a file is written through, and stays a link.
    link = tmp_path / "link.json"
    link.symlink_to(fifo)
    one_line_error([*base, "--out", str(link)], "not a regular file")
    target = tmp_path / "target.json"
    target.write_text("old")
    link.unlink()
    link.symlink_to(target)
    result = runner.invoke(app, [*base, "--out", str(link)])
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and json.loads(target.read_text())["binaryData"]
    with pytest.raises(OSError, match="not a regular file"):
        write_atomically(fifo, "x")
    assert fifo.is_fifo()


@pytest.mark.parametrize(
    ("content", "problem"),
    [(b"key,rate\n\xff\xfe,1\n", "not UTF-8"), (b"key,rate,prompt_tokens,prefix_tokens,output_tokens\na,inf,1,1,1\n",
     "finite"), (b"key,rate,prompt_tokens,prefix_tokens,output_tokens\na,1e400,1,1,1\n", "finite"),
     (b'{"key": "a", "rate": NaN, "prompt_tokens": 1, "prefix_tokens": 0, "output_tokens": 1}\n', "rate"),
     (b"key,rate,prompt_tokens,prefix_tokens,output_tokens\na,1,1,1,1,7\n", "line 2: 6 cells for 5 columns"),
     (b"key,rate,prompt_tokens,prefix_tokens,output_tokens\na,1e308,1e300,50,10\n",
      "line 2: column 'rate' must be at most")],
)
def test_plan_statistics_that_are_not_usable(tmp_path: Path, content: bytes, problem: str) -> None:
    stats = tmp_path / "stats.csv"
    stats.write_bytes(content)
    one_line_error(["plan", "--stats", str(stats), "--destinations", "2", "--budget-tokens", "9"], problem)


def test_plan_names_the_api_server_would_refuse_are_refused_before_any_work(tmp_path: Path) -> None:
    stats = tmp_path / "stats.csv"
    stats.write_text(STATS)
    out = tmp_path / "plan.yaml"
    base = ["plan", "--stats", str(stats), "--destinations", "2", "--budget-tokens", "9000", "-o", "yaml",
            "--out", str(out)]
    one_line_error([*base, "--name", "Bad_Name"], "--name 'Bad_Name'", "RFC 1123")
    one_line_error([*base, "--pool", "9pool"], "--pool '9pool'", "starting with a letter")
    assert not out.exists()


def test_plan_destinations_file_not_utf8_or_not_addresses(tmp_path: Path) -> None:
    stats = tmp_path / "stats.csv"
    stats.write_text(STATS)
    fleet = tmp_path / "fleet.yaml"
    base = ["plan", "--stats", str(stats), "--destinations-file", str(fleet), "--budget-tokens", "9000"]
    fleet.write_bytes(b"- id: a\n  address: \xff\n")
    one_line_error(base, "not UTF-8")
    fleet.write_text("- {id: a, address: not-an-address}\n- {id: b, address: '10.0.0.2:8000'}\n")
    one_line_error(base, "not-an-address")
    fleet.write_text("- {id: a, address: 10.0.0.1:8000, weight: .inf}\n")
    one_line_error(base, "weight")
    fleet.write_text("[]\n")
    one_line_error([*base[:-2], "--budget-tokens", "auto"], "fleet.yaml: no destinations in it")


# --- replay --------------------------------------------------------------------------------------


def test_replay_durations_and_slo_out_of_range(tmp_path: Path) -> None:
    one_line_error(["replay", "--workload", "low-reuse", "--duration", "0.001", "--policies", "p2c"],
                   "--duration 0.001: ")
    # Requests that all arrive at once span no time: an input problem, not an internal error.
    trace = tmp_path / "burst.jsonl"
    trace.write_text("".join(
        f'{{"timestamp": {t}, "input_length": 600, "output_length": 8, "hash_ids": [{i}, {i + 9}]}}\n'
        for i, t in enumerate([0, 0, 0, 900])
    ))
    one_line_error(["replay", "--trace", str(trace), "--duration", "0.5", "--policies", "p2c"],
                   "at least two requests over a positive time")
    one_line_error(["replay", "--workload", "low-reuse", "--slo-p99-ttft", "inf", "--capacity"], "--slo-p99-ttft")
    one_line_error(["replay", "--workload", "low-reuse", "--qps", "1e400"], "--qps", "1e400 is not a finite number")
    one_line_error(["replay", "--workload", "low-reuse", "--qps", "nan"], "--qps", "nan is not a finite number")
    # A rate left out between two commas is refused, not skipped.
    one_line_error(["replay", "--workload", "low-reuse", "--qps", "1,,2"], "--qps '1,,2' has an empty item")
    one_line_error(["replay", "--workload", "low-reuse", "--qps", "1,"], "--qps '1,' has an empty item")
    one_line_error(["replay", "--workload", "low-reuse", "--policies", "p2c,,cacheroute"], "has an empty item")


# --- validate: what the API server would refuse --------------------------------------------------


def manifest(**spec: object) -> dict[str, Any]:
    return {"apiVersion": "cacheroute.dev/v1alpha1", "kind": "InferencePool", "metadata": {"name": "llama"},
            "spec": {"model": {"name": "m"}, **spec}}


@pytest.mark.parametrize(
    ("doc", "problem"),
    [
        (manifest(replicas="3"), "spec.replicas"),
        (manifest(replicas=True), "spec.replicas"),
        (manifest(replicas=3.0), "spec.replicas"),
        ({**manifest(), "metadata": {"name": "Llama_Pool"}}, "RFC 1123"),
        ({**manifest(), "metadata": {"name": "9llama"}}, "starting with a letter"),
        ({**manifest(), "metadata": {"name": "l" * 60}}, "at most 52"),
        ({**manifest(), "metadata": {}}, "metadata.name: required"),
        (manifest(memory={"mode": "Manual", "kvCacheMemoryBytes": 2**64}), "does not fit a 64-bit integer"),
        (manifest(gpu={"memoryGib": float("inf")}), "not a finite number"),
        ({**manifest(), "metadata": {"name": "llama", "labels": {"tier": 1}}}, "metadata.labels.tier"),
    ],
)
def test_validate_refuses_what_the_api_server_would(tmp_path: Path, doc: dict[str, Any], problem: str) -> None:
    import yaml

    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(doc))
    one_line_error(["validate", str(path)], problem)


def test_validate_accepts_a_good_manifest_and_refuses_empty_or_unreadable_files(tmp_path: Path) -> None:
    import yaml

    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(manifest(replicas=3)))
    assert runner.invoke(app, ["validate", str(good)]).exit_code == 0
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing here\n")
    one_line_error(["validate", str(empty)], "empty.yaml", "no manifest")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    one_line_error(["validate", str(binary)], "binary.yaml", "not UTF-8")
    aliases = tmp_path / "aliases.yaml"
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 8)]
    aliases.write_text("\n".join(levels) + "\nkind: InferencePool\napiVersion: cacheroute.dev/v1alpha1\n")
    one_line_error(["validate", str(aliases)], "YAML aliases")


# --- nothing lost --------------------------------------------------------------------------------


def test_a_failed_write_leaves_the_previous_file_whole(tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    target.write_text("previous")
    os.chmod(target, 0o640)

    def half_then_fail(staged: Path) -> None:
        staged.write_text("half of the new")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_with(target, half_then_fail)
    assert target.read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no temporary file left behind
    write_atomically(target, "new")
    assert target.read_text() == "new"
    assert os.stat(target).st_mode & 0o777 == 0o640  # the replacement keeps the file's mode


def test_a_plan_without_routes_does_not_replace_one_with_routes(tmp_path: Path) -> None:
    stats = tmp_path / "stats.csv"
    stats.write_text(STATS)
    out = tmp_path / "plan.json"
    base = ["plan", "--stats", str(stats), "--destinations", "2", "-o", "json", "--out", str(out)]
    assert runner.invoke(app, [*base, "--budget-tokens", "9000"]).exit_code == 0
    routed = out.read_text()
    assert json.loads(routed)["binaryData"]
    one_line_error([*base, "--budget-tokens", "0"], "--allow-empty", "2 routes")
    assert out.read_text() == routed
    assert runner.invoke(app, [*base, "--budget-tokens", "0", "--allow-empty"]).exit_code == 0
    assert out.read_text() != routed


def test_crds_and_replay_outputs_replace_files_whole(tmp_path: Path) -> None:
    assert runner.invoke(app, ["crds", "--out", str(tmp_path / "crds")]).exit_code == 0
    assert not [p for p in (tmp_path / "crds").iterdir() if p.name.startswith(".")]
    one_line_error(["crds", "--out", str(tmp_path / "crds" / "cacheroute.dev_inferencepools.yaml" / "x")], "--out")


# --- the router's ConfigMap payloads -------------------------------------------------------------


def _ConfigMap(binary_data: Mapping[str, object]) -> dict[str, object]:  # noqa: N802 (reads as the kind)
    """A ConfigMap as the router's watch holds it: its JSON."""
    return {"metadata": {"name": "pool-plan"}, "binaryData": dict(binary_data)}


def test_configmaps_with_bad_base64_are_a_payload_error_not_a_crash() -> None:
    good: dict[str, object] = {"plan.json.gz": base64.b64encode(b"x").decode()}
    assert configmap_files({"a": _ConfigMap(good)}) == {"plan.json.gz": b"x"}
    bad_ones: list[dict[str, object]] = [{"plan.json.gz": "!!!not base64"}, {"plan.json.gz": 7}]
    for bad in bad_ones:
        with pytest.raises(PayloadError, match=r"plan\.json\.gz"):
            configmap_files({"a": _ConfigMap(bad)})


def test_files_saved_with_a_byte_order_mark_read_as_without(tmp_path: Path) -> None:
    stats = tmp_path / "stats.csv"
    stats.write_bytes(b"\xef\xbb\xbf" + STATS.encode())
    base = ["--destinations", "2", "--budget-tokens", "9000", "-o", "json"]
    result = runner.invoke(app, ["plan", "--stats", str(stats), *base])
    assert result.exit_code == 0, result.output
    bom_trace = trace(tmp_path)
    bom_trace.write_bytes(b"\xef\xbb\xbf" + bom_trace.read_bytes())
    result = runner.invoke(app, ["plan", "--trace", str(bom_trace), *base])
    assert result.exit_code == 0, result.output
