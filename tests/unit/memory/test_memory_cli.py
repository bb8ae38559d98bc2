"""`cacheroute memory-plan` as a user runs it."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import typer
from typer.testing import CliRunner

from cacheroute.operator.cli.memory import register
from cacheroute.planner.memory import PRESET_CONFIGS

runner = CliRunner()


def app() -> typer.Typer:
    created = typer.Typer()
    register(created)

    @created.callback()
    def main() -> None:
        """Keep memory-plan a named sub-command."""

    return created


def test_table_shows_the_breakdown_candidates_and_flags() -> None:
    result = runner.invoke(app(), ["memory-plan", "--model", "qwen3-next-80b-a3b", "-q", "fp8", "--tp", "2"])
    assert result.exit_code == 0, result.output
    for text in ("weights", "kv cache", "unprofiled transient", "cuda-graph pool", "safety margin", "16384", "chosen"):
        assert text in result.output
    assert "KV vs vLLM's default mnbt 8192: +" in result.output
    assert "--kv-cache-memory-bytes" in result.output


def test_json_and_args_outputs_agree() -> None:
    base = ["memory-plan", "--model", "llama-3.3-70b", "--quantization", "fp8", "--gpu", "h100-80gb", "--tp", "2"]
    as_json = runner.invoke(app(), [*base, "-o", "json"])
    as_args = runner.invoke(app(), [*base, "-o", "args"])
    assert as_json.exit_code == as_args.exit_code == 0
    document = json.loads(as_json.stdout)
    assert document["flags"] == shlex.split(as_args.stdout)
    assert document["maxModelLen"] == 131072
    assert sum(v for k, v in document["breakdownBytes"].items() if k != "total") == document["breakdownBytes"]["total"]


def test_options_reach_the_plan(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(PRESET_CONFIGS["qwen3-32b"])))
    result = runner.invoke(
        app(),
        [
            "memory-plan",
            "--model",
            str(config),
            "--kv-cache-dtype",
            "fp8",
            "--mnbt",
            "4096",
            "--max-model-len",
            "auto",
            "-o",
            "json",
        ],
    )
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["maxNumBatchedTokens"] == 4096
    assert document["inputs"]["modelSource"] == "config" and document["inputs"]["kvCacheDtype"] == "fp8"
    assert "--kv-cache-dtype" in document["flags"]


def test_plan_errors_are_one_clear_line_without_a_traceback() -> None:
    result = runner.invoke(app(), ["memory-plan", "--model", "llama-3.3-70b", "-q", "fp8", "--tp", "1"])
    assert result.exit_code == 2
    assert "GiB missing per GPU" in result.output and "TP=2 fits" in result.output
    assert "Traceback" not in result.output
    bad_tp = runner.invoke(app(), ["memory-plan", "--model", "llama-3.3-70b", "--tp", "3"])
    assert bad_tp.exit_code == 2 and "does not divide num_attention_heads 64" in bad_tp.output


def test_bad_option_values_name_the_option(tmp_path: Path) -> None:
    for args, option in (
        (["--mnbt", "lots"], "--mnbt"),
        (["--quantization", "int4"], "--quantization"),
        (["-o", "yaml"], "--output"),
    ):
        result = runner.invoke(app(), ["memory-plan", "--model", "llama-3.1-8b", *args])
        assert result.exit_code == 2 and option in result.output
    missing = runner.invoke(app(), ["memory-plan", "--model", str(tmp_path / "nope.json")])
    assert missing.exit_code == 2 and "neither a preset" in missing.output


def test_weights_and_ssm_dtype_overrides() -> None:
    base = ["memory-plan", "--model", "qwen3-next-80b-a3b", "-q", "fp8", "--tp", "2", "-o", "json"]
    plain = json.loads(runner.invoke(app(), base).stdout)
    heavier = json.loads(runner.invoke(app(), [*base, "--weights-gib", "40"]).stdout)
    assert heavier["breakdownBytes"]["weights"] == 40 << 30
    assert heavier["kvCacheMemoryBytes"] < plain["kvCacheMemoryBytes"]
    fp32 = json.loads(runner.invoke(app(), [*base, "--mamba-ssm-dtype", "float32"]).stdout)
    assert fp32["layout"]["blockSize"] == 1056 and "--mamba-ssm-cache-dtype" in fp32["flags"]
    bad = runner.invoke(app(), [*base, "--mamba-ssm-dtype", "int3"])
    assert bad.exit_code == 2 and "int3" in bad.output
    # Only what vLLM's flag takes: bfloat16 would start no engine. Checked for dense models too.
    for value in ("bfloat16", "garbage"):
        refused = runner.invoke(app(), ["memory-plan", "--model", "llama-3.1-8b", "--mamba-ssm-dtype", value])
        assert refused.exit_code == 2 and "float32, float16" in " ".join(refused.output.replace("│", " ").split())


def test_an_mnbt_below_vllms_sequences_says_it_lowered_them() -> None:
    args = ["memory-plan", "--model", "llama-3.1-8b", "--mnbt", "100", "-o", "json"]
    out = json.loads(runner.invoke(app(), args).stdout)
    assert out["maxNumSeqs"] == 100
    assert any("max-num-seqs lowered to 100" in note for note in out["notes"])
    default = json.loads(runner.invoke(app(), ["memory-plan", "--model", "llama-3.1-8b", "-o", "json"]).stdout)
    assert not any("max-num-seqs lowered" in note for note in default["notes"])


def test_a_sliding_window_config_is_refused_naming_the_file(tmp_path: Path) -> None:
    config = {
        "model_type": "mistral", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_hidden_layers": 32, "intermediate_size": 14336, "vocab_size": 32000, "max_position_embeddings": 32768,
    }
    path = tmp_path / "mistral_sw.json"
    for extra, refused in (({"sliding_window": 4096}, True), ({"sliding_window": 4096, "use_sliding_window": True},
                           True), ({"sliding_window": 4096, "use_sliding_window": False}, False),
                           ({"sliding_window": None}, False), ({"sliding_window": 32768}, False)):
        path.write_text(json.dumps({**config, **extra}))
        result = runner.invoke(app(), ["memory-plan", "--model", str(path)])
        assert (result.exit_code == 2) is refused, (extra, result.output)
        if refused:
            assert f"{path}: sliding-window attention" in " ".join(result.output.split())


def test_the_host_tier_is_planned_as_a_pool_would_have_it() -> None:
    base = ["memory-plan", "--model", "llama-3.3-70b", "-q", "fp8", "--tp", "2", "-o", "json"]
    auto = json.loads(runner.invoke(app(), [*base, "--host-kv-gib", "auto", "--node-memory-gib", "2048"]).stdout)
    # docs/memory-plan.md: a 2 TiB node, 8 GPUs, 32 GiB reserve each: 448 GiB per TP=2 replica.
    assert (auto["hostKvCacheBytes"], auto["hostKvSource"]) == (448 << 30, "auto")
    assert auto["flags"][-4:] == ["--kv-offloading-backend", "native", "--kv-offloading-size", "448"]
    unknown = json.loads(runner.invoke(app(), [*base, "--host-kv-gib", "auto"]).stdout)
    assert unknown["hostKvCacheBytes"] == 0 and any("not known" in n for n in unknown["notes"])
    given = json.loads(runner.invoke(app(), [*base, "--host-kv-gib", "100"]).stdout)
    assert given["hostKvCacheBytes"] == 100 << 30 and given["hostKvSource"] == "given"
    off = json.loads(runner.invoke(app(), base).stdout)
    # Without a tier the pod requests the operator's configured memory: the plan claims none, as in status.
    assert (off["hostKvSource"], off["podMemoryBytes"]) == ("off", 0)
    assert auto["podMemoryBytes"] == (448 + 2 * 32) << 30
    bad = runner.invoke(app(), [*base, "--host-kv-gib", "lots"])
    assert bad.exit_code == 2 and "--host-kv-gib" in bad.output
    negative = runner.invoke(app(), [*base, "--host-kv-gib", "-1"])
    assert negative.exit_code == 2 and "between 0 and 65,536" in " ".join(negative.output.split())


def test_a_gpu_given_by_its_memory_is_titled_with_that_memory() -> None:
    result = runner.invoke(app(), ["memory-plan", "--model", "llama-3.1-8b", "--gpu-memory-gib", "40"],
                           env={"COLUMNS": "200"}, terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "on h100-80gb with 40 GiB per GPU, TP=1" in result.output
