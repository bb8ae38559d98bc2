"""vLLM startup logs of old and new builds parse into the same figures; gaps are reported, not guessed."""

# ruff: noqa: E501  (vLLM log lines are quoted verbatim, at their real length)

from __future__ import annotations

import pytest

from cacheroute.planner.memory import MemoryPlanError, MemoryProfile, parse_vllm_log

# A current build, TP=2 hybrid: worker prefixes, the merged KV-size line, the budget line.
NEW_LOG = """\
(EngineCore_DP0 pid=212) INFO 10-06 12:00:01 [scheduler.py:200] Chunked prefill is enabled with max_num_batched_tokens=2048.
(Worker_TP0 pid=301) INFO 10-06 12:00:20 [gpu_model_runner.py:2602] Model loading took 37.4612 GiB memory and 41.322071 seconds
(Worker_TP1 pid=302) INFO 10-06 12:00:20 [gpu_model_runner.py:2602] Model loading took 37.4700 GiB memory and 41.1 seconds
(Worker_TP0 pid=301) INFO 10-06 12:00:21 [interface.py:645] Setting attention block size to 544 tokens to ensure that attention page size is >= mamba page size.
(Worker_TP0 pid=301) INFO 10-06 12:00:21 [interface.py:669] Padding mamba page size by 1.49% to ensure that mamba page size and attention page size are exactly equal.
(Worker_TP0 pid=301) INFO 10-06 12:00:40 [gpu_model_runner.py:6483] Profiling CUDA graph memory: PIECEWISE=51 (largest=512), FULL=35 (largest=256)
(Worker_TP0 pid=301) INFO 10-06 12:00:42 [gpu_model_runner.py:6806] Estimated CUDA graph memory: 0.61 GiB total
(Worker_TP0 pid=301) INFO 10-06 12:00:42 [gpu_worker.py:563] Available KV cache memory: 35.12 GiB
(Worker_TP1 pid=302) INFO 10-06 12:00:42 [gpu_worker.py:563] Available KV cache memory: 35.08 GiB
(Worker_TP0 pid=301) INFO 10-06 12:00:42 [gpu_worker.py:578] CUDA graph memory profiling is enabled (default since v0.21.0). The current --gpu-memory-utilization=0.9000 is equivalent to --gpu-memory-utilization=0.8923 without CUDA graph memory profiling. To maintain the same effective KV cache size as before, increase --gpu-memory-utilization to 0.9077. To disable, set VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0.
(EngineCore_DP0 pid=212) INFO 10-06 12:00:43 [kv_cache_utils.py:1087] GPU KV cache size: 3,174,240 tokens, Maximum concurrency for 262,144 tokens per request: 12.11x
(Worker_TP0 pid=301) INFO 10-06 12:00:57 [gpu_model_runner.py:3480] Graph capturing finished in 14 secs, took 0.48 GiB
(Worker_TP0 pid=301) INFO 10-06 12:00:57 [gpu_worker.py:727] CUDA graph pool memory: 0.48 GiB (actual), 0.61 GiB (estimated), difference: -0.13 GiB (-21.3%).
(Worker_TP0 pid=301) INFO 10-06 12:00:57 [gpu_worker.py:790] Free memory on device (78.52/79.19 GiB) on startup. Desired GPU memory utilization is (0.9, 71.27 GiB). Actual usage is 38.92 GiB for consumed memory (weights + non-torch), 0.71 GiB for peak activation, and 0.48 GiB for CUDAGraph memory. Replace gpu_memory_utilization config with `--kv-cache-memory=33520000000` (31.22 GiB) to fit into requested memory, or `--kv-cache-memory=41000000000` (38.18 GiB) to fully utilize gpu memory. Current kv cache memory in use is 35.12 GiB.
(Worker_TP1 pid=302) INFO 10-06 12:00:57 [gpu_worker.py:790] Free memory on device (78.50/79.19 GiB) on startup. Desired GPU memory utilization is (0.9, 71.27 GiB). Actual usage is 38.95 GiB for consumed memory (weights + non-torch),
0.71 GiB for peak activation, and 0.48 GiB for CUDAGraph memory. Replace gpu_memory_utilization config with `--kv-cache-memory=33490000000` (31.19 GiB) to fit into requested memory, or `--kv-cache-memory=40980000000` (38.17 GiB) to fully utilize gpu memory.
Current kv cache memory in use is 35.08 GiB.
"""

# An older V1 build: no budget line; the V0-style profiling summary; separate KV lines.
V1_OLD_LOG = """\
INFO 03-14 09:12:55 [gpu_model_runner.py:1289] Model loading took 14.9888 GiB and 13.204526 seconds
INFO 03-14 09:13:07 [gpu_worker.py:227] Memory profiling takes 11.85 seconds
INFO 03-14 09:13:07 [gpu_worker.py:227] the current vLLM instance can use total_gpu_memory (79.11GiB) x gpu_memory_utilization (0.90) = 71.20GiB
INFO 03-14 09:13:07 [gpu_worker.py:227] model weights take 14.99GiB; non_torch_memory takes 0.35GiB; PyTorch activation peak memory takes 1.24GiB; the rest of the memory reserved for KV Cache is 54.62GiB.
INFO 03-14 09:13:08 [kv_cache_utils.py:578] GPU KV cache size: 447,440 tokens
INFO 03-14 09:13:08 [kv_cache_utils.py:581] Maximum concurrency for 131,072 tokens per request: 3.41x
INFO 03-14 09:13:20 [gpu_model_runner.py:1604] Graph capturing finished in 10 secs, took 0.53 GiB
"""

# V0: "GB" labels (GiB values), block counts instead of tokens, no graph size.
V0_LOG = """\
INFO 12-22 10:55:30 model_runner.py:1097] Loading model weights took 14.9888 GB
INFO 12-22 10:55:34 worker.py:241] Memory profiling takes 0.69 seconds
INFO 12-22 10:55:34 worker.py:241] the current vLLM instance can use total_gpu_memory (79.25GiB) x gpu_memory_utilization (0.90) = 71.33GiB
INFO 12-22 10:55:34 worker.py:241] model weights take 14.99GiB; non_torch_memory takes 0.26GiB; PyTorch activation peak memory takes 1.19GiB; the rest of the memory reserved for KV Cache is 54.89GiB.
INFO 12-22 10:55:34 distributed_gpu_executor.py:57] # GPU blocks: 28103, # CPU blocks: 2048
INFO 12-22 10:55:34 distributed_gpu_executor.py:61] Maximum concurrency for 131072 tokens per request: 3.43x
INFO 12-22 10:55:47 model_runner.py:1518] Graph capturing finished in 12 secs.
"""


def test_new_format_every_line() -> None:
    p = parse_vllm_log(NEW_LOG, hybrid=True)
    assert p.missing == ()
    assert p.weights_gib == 37.47  # the heaviest rank
    assert p.model_load_seconds == pytest.approx(41.322071)
    assert p.available_kv_gib == 35.08  # the tightest rank, as vLLM sizes the cache
    assert (p.kv_cache_tokens, p.max_concurrency, p.max_concurrency_tokens) == (3_174_240, 12.11, 262_144)
    assert p.cudagraph_captures == (("PIECEWISE", 51, 512), ("FULL", 35, 256))
    assert p.cudagraph_estimate_gib == 0.61
    assert (p.utilization_in_force, p.utilization_equivalent) == (0.9, 0.8923)
    assert (p.graph_capture_seconds, p.graph_capture_gib) == (14, 0.48)
    assert (p.graph_pool_actual_gib, p.graph_pool_estimated_gib) == (0.48, 0.61)
    assert (p.startup_free_gib, p.total_gib) == (78.50, 79.19)
    assert (p.requested_utilization, p.requested_gib) == (0.9, 71.27)
    assert (p.consumed_gib, p.activation_gib, p.cudagraph_gib) == (38.95, 0.71, 0.48)  # wrapped line included
    assert p.non_torch_gib == pytest.approx(38.95 - 37.47)
    assert (p.kv_suggestion_fit_bytes, p.kv_in_use_gib) == (33_490_000_000, 35.08)
    assert (p.attention_block_size, p.mamba_padding_pct) == (544, 1.49)
    assert p.max_num_batched_tokens == 2048
    assert set(p.ranks) >= {"TP0", "TP1"}
    assert not p.failed


def test_old_v1_format_fills_the_same_budget_from_the_profiling_summary() -> None:
    p = parse_vllm_log(V1_OLD_LOG)
    assert p.missing == ()
    assert p.weights_gib == 14.9888
    assert p.model_load_seconds == pytest.approx(13.204526)
    assert (p.total_gib, p.requested_utilization, p.requested_gib) == (79.11, 0.90, 71.20)
    assert (p.non_torch_gib, p.activation_gib, p.available_kv_gib) == (0.35, 1.24, 54.62)
    assert p.consumed_gib == pytest.approx(14.9888 + 0.35)
    assert (p.kv_cache_tokens, p.max_concurrency, p.graph_capture_gib) == (447_440, 3.41, 0.53)
    assert p.startup_free_gib is None  # never printed by this build, so never invented


def test_v0_format_gb_labels_and_block_counts() -> None:
    p = parse_vllm_log(V0_LOG)
    assert p.weights_gib == 14.9888
    assert p.gpu_blocks == 28103 and p.kv_cache_tokens is None
    assert p.max_concurrency_tokens == 131_072
    assert p.graph_capture_seconds == 12 and p.graph_capture_gib is None
    assert p.missing == ()
    assert p.budget_missing() == ("graph_capture",)  # the line is there but carries no size


@pytest.mark.parametrize(
    ("line", "weights", "seconds"),
    [
        ("Loading model weights took 14.9888 GB", 14.9888, None),
        ("Model loading took 3.3414 GB and 0.742108 seconds", 3.3414, 0.742108),
        ("Model loading took 14.9888 GiB and 13.204526 seconds", 14.9888, 13.204526),
        ("Model loading took 4.53 GiB memory and 8.848501 seconds", 4.53, 8.848501),
        ("Model loading took 55.22 GiB memory and 20.3s", 55.22, 20.3),
        ("Model loading took 15.27 GiB", 15.27, None),
    ],
)
def test_every_model_loading_wording(line: str, weights: float, seconds: float | None) -> None:
    p = parse_vllm_log(f"INFO 01-01 00:00:00 [x.py:1] {line}\n")
    assert p.weights_gib == weights
    assert p.model_load_seconds == seconds


@pytest.mark.parametrize(
    "text",
    [
        "GPU KV cache size: 651,859 tokens, Maximum concurrency for 262,144 tokens per request: 2.49x",
        "GPU KV cache size: 651,859 tokens\nMaximum concurrency for 262,144 tokens per request: 2.49x",
    ],
)
def test_kv_size_alone_or_merged_with_concurrency(text: str) -> None:
    p = parse_vllm_log(text)
    assert (p.kv_cache_tokens, p.max_concurrency, p.max_concurrency_tokens) == (651_859, 2.49, 262_144)


def test_other_wordings() -> None:
    p = parse_vllm_log(
        "INFO Profiling CUDA graph memory: PIECEWISE=5 (largest=16)\n"
        "INFO increase --gpu-memory-utilization from 0.9000 to 0.9196 to keep the KV cache size\n"
        "WARNING [kv_cache_utils.py:1208] Add 3 padding layers, may waste at most 6.25% KV cache memory\n"
        "INFO Auto-fit max_model_len: reduced from 262,144 to 180,224 to fit the available KV cache\n"
        "INFO Graph capturing finished in 8 secs.\n"
    )
    assert p.cudagraph_captures == (("PIECEWISE", 5, 16),)
    assert p.utilization_in_force == 0.9
    assert p.padding_layers == 3
    assert p.auto_fit_max_model_len == (262_144, 180_224)
    assert p.graph_capture_seconds == 8


def test_ansi_colours_are_ignored() -> None:
    coloured = (
        "\x1b[32mINFO\x1b[0m 10-06 12:00:42 [gpu_worker.py:563] Available KV cache memory: \x1b[1m35.12\x1b[0m GiB\n"
    )
    assert parse_vllm_log(coloured).available_kv_gib == 35.12


def test_missing_lines_are_reported_not_guessed() -> None:
    text = "\n".join(
        line for line in NEW_LOG.splitlines() if "Graph capturing" not in line and "CUDA graph pool" not in line
    )
    p = parse_vllm_log(text, hybrid=True)
    assert p.missing == ("graph_capture",)
    assert p.graph_capture_gib is None and p.graph_pool_actual_gib is None
    assert p.graph_gib == 0.48  # the budget line still carries the graph figure
    assert parse_vllm_log(text, hybrid=True, cudagraphs=False).missing == ()
    bare = parse_vllm_log("INFO Model loading took 15.27 GiB\n", hybrid=True)
    assert bare.missing == (
        "available_kv_cache",
        "kv_cache_size",
        "max_concurrency",
        "memory_summary",
        "graph_capture",
        "attention_block_size",
    )
    assert bare.budget_missing() == ("memory_summary", "graph_capture")
    assert bare.available_kv_gib is None and bare.activation_gib is None


@pytest.mark.parametrize(
    ("text", "kind", "values"),
    [
        (
            "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`",
            "no_cache_memory",
            (),
        ),
        (
            "ValueError: To serve at least one request with the models's max seq len (131072), (40.00 GiB KV cache is "
            "needed, which is larger than the available KV cache memory (6.01 GiB). Based on the available memory, ...",
            "max_model_len_too_long",
            (131072, 40.0, 6.01),
        ),
        (
            "ValueError: max_num_seqs (1024) exceeds available Mamba cache blocks (512). Each decode sequence requires "
            "one Mamba cache block, so CUDA graph capture cannot proceed.",
            "mamba_blocks",
            (1024, 512),
        ),
        (
            "ValueError: Free memory on device (70.1/79.19 GiB) on startup is less than desired GPU memory utilization "
            "(0.92, 72.85 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.",
            "startup_free_memory",
            (70.1, 79.19, 0.92, 72.85),
        ),
        (
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            "79.19 GiB of which 1.06 GiB is free.",
            "cuda_oom",
            (2.0,),
        ),
    ],
)
def test_failure_strings(text: str, kind: str, values: tuple[float, ...]) -> None:
    p = parse_vllm_log("(Worker_TP0 pid=9) ERROR 10-06 12:00:43 [core.py:1] " + text + "\n")
    assert p.failed
    assert [f.kind for f in p.failures] == [kind]
    assert p.failures[0].values == values
    # A startup-free-memory failure is not mistaken for the budget line.
    assert p.startup_free_gib is None


def test_profile_round_trips_through_a_dict() -> None:
    for text in (NEW_LOG, V1_OLD_LOG, V0_LOG):
        p = parse_vllm_log(text, hybrid=True)
        assert MemoryProfile.from_dict(p.to_dict()) == p
    with pytest.raises(MemoryPlanError, match="schema"):
        MemoryProfile.from_dict({"schema": 99})
