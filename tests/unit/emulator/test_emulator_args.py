"""The emulated server is sized and timed from the pod's own `vllm serve` arguments."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cacheroute.operator.cli.main import app
from cacheroute.planner.memory import kv_layout, preset
from cacheroute.planner.replay.hardware import DEFAULT_PROFILE, H100_LLAMA33_70B_FP8_TP2_FP8KV
from cacheroute.sandbox.emulator.args import (
    EmulatorArgsError,
    human_int,
    parse_vllm_args,
    serve_arguments,
)

LLAMA = "meta-llama/Llama-3.3-70B-Instruct"


def test_kv_cache_memory_bytes_sets_the_capacity_through_the_models_kv_geometry() -> None:
    config = parse_vllm_args([LLAMA, "--tensor-parallel-size", "2", "--kv-cache-memory-bytes", "8G",
                              "--max-model-len", "32768"])
    layout = kv_layout(preset("llama-3.3-70b"), 2)
    # 8 GiB over 2.5 MiB blocks of 16 tokens (160 KiB per token per GPU at TP=2, bf16).
    assert layout.bytes_per_block == 16 * 2 * 4 * 128 * 80 * 2
    assert config.kv_capacity_tokens == (8 << 30) // layout.bytes_per_block * 16 == 52_416
    assert config.capacity_source == "--kv-cache-memory-bytes"
    assert config.block_size == 16
    assert config.max_model_len == 32768
    assert config.profile.step_overhead_s == DEFAULT_PROFILE.step_overhead_s


def test_fp8_kv_cache_doubles_the_tokens_and_uses_the_fp8_profile() -> None:
    base = [LLAMA, "-tp", "2", "--kv-cache-memory-bytes", "8G", "--max-model-len", "32768"]
    bf16 = parse_vllm_args(base)
    fp8 = parse_vllm_args([*base, "--kv-cache-dtype", "fp8"])
    # Whole blocks on each side: twice the tokens, give or take the block lost to rounding.
    assert 0 <= fp8.kv_capacity_tokens - 2 * bf16.kv_capacity_tokens <= 16
    assert fp8.profile.kv_read_s_per_token == H100_LLAMA33_70B_FP8_TP2_FP8KV.kv_read_s_per_token


def test_batch_flags_reach_the_engine_profile_and_underscores_are_accepted() -> None:
    config = parse_vllm_args(
        [LLAMA, "--tensor_parallel_size=2", "--max-num-batched-tokens", "2k", "--max_num_seqs=64",
         "--kv-cache-memory-bytes=4G", "--max-model-len=16384", "--disable-log-requests", "--port", "9000",
         "--served-model-name", "llama", "other"]
    )
    assert config.max_num_batched_tokens == 2000
    assert config.max_num_seqs == 64
    assert config.port == 9000
    assert config.served_model_names == ("llama", "other")
    assert "ignored flag --disable-log-requests" in config.notes


def test_without_memory_flags_the_memory_plan_of_an_h100_sizes_the_cache() -> None:
    config = parse_vllm_args(["meta-llama/Llama-3.1-8B-Instruct", "--max-model-len", "32768"])
    assert config.capacity_source.startswith("memory plan")
    assert 300_000 < config.kv_capacity_tokens < 600_000


def test_human_readable_integers_follow_vllm() -> None:
    assert human_int("25.6k", "x") == 25_600
    assert human_int("1K", "x") == 1024
    assert human_int("2G", "x") == 2 << 30
    assert human_int("3g", "x") == 3_000_000_000
    with pytest.raises(EmulatorArgsError, match="not a whole number"):
        human_int("1.5", "--max-num-seqs")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "no model given"),
        (["my-org/custom-model", "--kv-cache-memory-bytes", "1G"], "not a known architecture"),
        ([LLAMA, "-tp", "2", "--kv-cache-memory-bytes", "1G", "--max-model-len", "65536"], "larger than the maximum"),
        ([LLAMA, "extra-positional"], "unexpected argument 'extra-positional'"),
        ([LLAMA, "--kv-cache-dtype", "int3"], "--kv-cache-dtype"),
        ([LLAMA, "-tp", "3"], "does not divide"),
        ([LLAMA, "--port", "99999"], "--port 99999 must be"),
        ([LLAMA, "--gpu-memory-utilization", "nan"], "--gpu-memory-utilization nan must be"),
        ([LLAMA, "--block-size", "0"], "--block-size 0 must be"),
        ([LLAMA, "--kv-offloading-size", "inf"], "--kv-offloading-size inf must be"),
    ],
)
def test_bad_command_lines_are_refused_with_the_reason(argv: list[str], message: str) -> None:
    with pytest.raises(EmulatorArgsError, match=message):
        parse_vllm_args(argv)


def test_an_unknown_model_without_memory_flags_uses_the_profile_capacity() -> None:
    config = parse_vllm_args(["my-org/custom-model", "--max-model-len", "4096"])
    assert config.kv_capacity_tokens == DEFAULT_PROFILE.kv_capacity_tokens
    assert any("not a known architecture" in note for note in config.notes)


def test_emulator_settings_come_from_the_environment() -> None:
    env = {"CACHEROUTE_EMULATOR_LOAD_SECONDS": "2.5", "CACHEROUTE_EMULATOR_ARCHITECTURE": "llama-3.1-8b"}
    config = parse_vllm_args(["/models/weights", "--kv-cache-memory-bytes", "1G", "--max-model-len", "4096"], env)
    assert config.load_delay_s == 2.5
    assert config.kv_capacity_tokens == (1 << 30) // (2 * 8 * 128 * 32 * 2)
    with pytest.raises(EmulatorArgsError, match="CACHEROUTE_EMULATOR_LOAD_SECONDS"):
        parse_vllm_args([LLAMA], {"CACHEROUTE_EMULATOR_LOAD_SECONDS": "soon"})


def test_weights_of_another_name_take_the_architecture_of_the_served_name() -> None:
    # A pool loading a quantized export (or pvc://...) under the canonical served name.
    flags = ["-tp", "2", "--kv-cache-memory-bytes", "8G", "--max-model-len", "32768"]
    config = parse_vllm_args(["RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic", "--served-model-name", LLAMA, *flags])
    assert config.served_model_names == (LLAMA,)
    assert config.kv_capacity_tokens == parse_vllm_args([LLAMA, *flags]).kv_capacity_tokens > 50_000


def test_kv_offloading_gives_the_engine_a_host_tier_sized_over_the_tp_ranks() -> None:
    config = parse_vllm_args([LLAMA, "-tp", "2", "--kv-cache-memory-bytes", "8G", "--max-model-len", "32768",
                              "--kv-offloading-size", "64"])
    per_gpu = 2 * 4 * 128 * 80 * 2
    assert config.host_kv_capacity_tokens == 64 * (1 << 30) // 2 // per_gpu
    assert config.profile.host_kv_capacity_tokens == config.host_kv_capacity_tokens
    # Copy-back cost per token: each GPU's share of the token over its own link.
    assert config.profile.host_copy_s_per_token == pytest.approx(per_gpu / 25e9)
    assert not any("--kv-offloading-size" in note for note in config.notes)
    fp8 = parse_vllm_args([LLAMA, "-tp", "2", "--kv-cache-memory-bytes", "8G", "--max-model-len", "32768",
                           "--kv-offloading-size", "64", "--kv-cache-dtype", "fp8"])
    assert fp8.host_kv_capacity_tokens == 2 * config.host_kv_capacity_tokens


def test_entry_point_overrides_are_understood() -> None:
    assert serve_arguments(None, ["m", "--port", "1"]) == ["m", "--port", "1"]
    assert serve_arguments(["vllm", "serve"], ["m"]) == ["m"]
    assert serve_arguments(["/usr/local/bin/vllm", "serve", "m"], ["--port", "2"]) == ["m", "--port", "2"]
    assert serve_arguments(["python3", "-m", "vllm.entrypoints.openai.api_server"], ["--model", "m"]) == [
        "--model", "m"
    ]
    with pytest.raises(EmulatorArgsError, match="does not start vLLM"):
        serve_arguments(["sleep"], ["10"])


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_names_the_vllm_flags_it_reads_instead_of_starting_a_server(flag: str) -> None:
    result = CliRunner().invoke(app, ["sandbox", "emulator", flag])
    assert result.exit_code == 0, result.output
    assert "Usage: cacheroute sandbox emulator MODEL [VLLM-FLAGS]" in result.output
    assert "--kv-cache-memory-bytes" in result.output and "--kv-offloading-size" in result.output
