"""The vLLM emulator as a client sees it: OpenAI API, vLLM's counters, the replay's timing."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from cacheroute.planner.replay.policies import RoundRobin
from cacheroute.planner.replay.run import ReplayConfig, replay_trace
from cacheroute.planner.trace import NO_KEY, RequestTrace
from cacheroute.sandbox.emulator.args import parse_vllm_args
from tests.support.emulator import LLAMA_70B, emulator_process
from tests.support.sandbox import wait_for

pytestmark = pytest.mark.integration

# Llama-3.1-8B at TP=1: 128 KiB of KV per token, so 128 MiB hold 64 blocks of 16 tokens.
SMALL = ["meta-llama/Llama-3.1-8B-Instruct", "--kv-cache-memory-bytes", "128M", "--max-model-len", "1024"]
# The replay's calibrated profile: Llama-3.3-70B FP8 on two H100s.
LARGE = [LLAMA_70B, "--tensor-parallel-size", "2", "--kv-cache-memory-bytes", "16G", "--max-model-len", "16384"]


def prompt(tag: str, tokens: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(tokens))


def sse(text: str) -> list[Any]:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completions_and_chat_streaming_and_not(tmp_path: Path) -> None:
    with emulator_process([*SMALL, "--served-model-name", "llama"], tmp_path) as emulator:
        url = emulator.url
        models = emulator.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["llama"]
        assert models["data"][0]["max_model_len"] == 1024

        plain = httpx.post(f"{url}/v1/completions", json={"model": "llama", "prompt": prompt("p", 40), "max_tokens": 7})
        body = plain.json()
        assert plain.status_code == 200
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert body["choices"][0]["finish_reason"] == "length"
        assert len(body["choices"][0]["text"].split()) == 7
        assert body["usage"] == {
            "prompt_tokens": 40, "completion_tokens": 7, "total_tokens": 47,
            "prompt_tokens_details": {"cached_tokens": 0},
        }

        streamed = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": prompt("p", 40), "max_tokens": 7, "stream": True,
                  "stream_options": {"include_usage": True}},
        )
        assert streamed.headers["content-type"].startswith("text/event-stream")
        chunks = sse(streamed.text)
        assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == body["choices"][0]["text"]
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == []
        # The same prompt again: its two full blocks of 16 come from the cache.
        assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32

        chat = httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}],
                  "max_tokens": 5},
        ).json()
        assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
        assert chat["choices"][0]["message"]["role"] == "assistant"
        assert len(chat["choices"][0]["message"]["content"].split()) == 5
        # Role markers count as tokens: <|system|> be brief <|user|> hi there <|assistant|>.
        assert chat["usage"]["prompt_tokens"] == 7

        chat_stream = httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4, "stream": True},
        )
        chunks = sse(chat_stream.text)
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks).split() == (
            chat["choices"][0]["message"]["content"].split()[:4]
        )
        assert all("usage" not in c for c in chunks)

        too_long = httpx.post(f"{url}/v1/completions", json={"prompt": prompt("x", 1000), "max_tokens": 100})
        assert too_long.status_code == 400
        assert "maximum context length is 1024 tokens" in too_long.json()["error"]["message"]
        unknown = httpx.post(f"{url}/v1/completions", json={"model": "gpt-5", "prompt": "a", "max_tokens": 1})
        assert unknown.status_code == 404


def test_prefix_cache_hits_and_evicts_like_vllm(tmp_path: Path) -> None:
    """64 blocks of 16 tokens; prompts of 20 whole blocks, one output token each.

    After A, B, C (in that order) the cache holds 60 free blocks. D (10 blocks) needs room for
    7 more: they come from the least recently freed prompt, A, tail first, so A keeps its first
    13 blocks. C then hits in full (all but its last token is reused, as in vLLM), A hits its 13
    surviving blocks and, to refill its tail, evicts the tail of the next least recently freed
    prompt, B, which then hits 13 blocks too.
    """
    with emulator_process(SMALL, tmp_path) as emulator:
        cached = []
        for tag, tokens in [("A", 320), ("B", 320), ("C", 320), ("D", 160), ("C", 320), ("A", 320), ("B", 320)]:
            reply = httpx.post(f"{emulator.url}/v1/completions", json={"prompt": prompt(tag, tokens), "max_tokens": 1})
            cached.append(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached == [0, 0, 0, 0, 319, 208, 208]
        assert emulator.metric("vllm:prefix_cache_queries_total") == 6 * 320 + 160
        assert emulator.metric("vllm:prefix_cache_hits_total") == 319 + 208 + 208
        assert emulator.metric("vllm:prompt_tokens_total") == 6 * 320 + 160
        assert emulator.metric("vllm:generation_tokens_total") == 7
        assert emulator.metric("vllm:e2e_request_latency_seconds_count") == 7
        assert emulator.metric("vllm:num_requests_running") == 0
        assert emulator.metric("vllm:kv_cache_usage_perc") == 0


def replay_of(config_args: list[str], requests: list[tuple[float, int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(TTFT, e2e) the replay predicts for (arrival, prompt tokens, output tokens), unique prompts."""
    config = parse_vllm_args(config_args)
    bs = config.block_size
    counts = [math.ceil(n / bs) for _, n, _ in requests]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    trace = RequestTrace(
        arrival_s=np.array([a for a, _, _ in requests]),
        key=np.full(len(requests), NO_KEY, dtype=np.int64),
        input_tokens=np.array([n for _, n, _ in requests], dtype=np.int64),
        output_tokens=np.array([o for _, _, o in requests], dtype=np.int64),
        block_offsets=offsets,
        block_ids=np.arange(int(offsets[-1]), dtype=np.int64),
        block_size=bs,
        key_names=(),
    )
    replay_config = ReplayConfig(destinations=1, profile=config.profile, warmup_fraction=0.0)
    result = replay_trace(trace, RoundRobin(), replay_config)
    return result.ttft_s, result.e2e_s


async def measure(url: str, requests: list[tuple[float, int, int]], tag: str) -> list[tuple[float, float, float]]:
    """Send (delay, prompt tokens, output tokens) requests, streaming; (sent, TTFT, e2e) for each.

    Prompts are unique (`tag` and the request's index): nothing comes from the cache.
    """
    loop = asyncio.get_running_loop()
    origin = 0.0

    async def one(client: httpx.AsyncClient, i: int, delay: float, n_in: int, n_out: int) -> tuple[float, float, float]:
        await asyncio.sleep(max(0.0, origin + delay - loop.time()))
        body = {"prompt": prompt(f"{tag}{i}-", n_in), "max_tokens": n_out, "stream": True}
        sent = loop.time()
        first = math.nan
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if math.isnan(first) and line.startswith("data: {"):
                    first = loop.time() - sent
        return sent - origin, first, loop.time() - sent

    limits = httpx.Limits(max_keepalive_connections=len(requests))
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        # Open the connections first: what is measured is the server, not TCP handshakes.
        await asyncio.gather(*(client.get(f"{url}/health") for _ in requests))
        origin = loop.time()
        return await asyncio.gather(*(one(client, i, *r) for i, r in enumerate(requests)))


def deviations(url: str, requests: list[tuple[float, int, int]], tag: str) -> list[str]:
    """Requests whose client-side TTFT or latency is off the replay's by more than 10 % (all, described)."""
    measured = asyncio.run(measure(url, requests, tag))
    arrivals = [(sent, n_in, n_out) for (sent, _, _), (_, n_in, n_out) in zip(measured, requests, strict=True)]
    ttft, e2e = replay_of(LARGE, arrivals)
    off = []
    for (sent, got_t, got_e), want_t, want_e in zip(measured, ttft, e2e, strict=True):
        if abs(got_t - want_t) > 0.10 * want_t or abs(got_e - want_e) > 0.10 * want_e:
            off.append(f"{tag} sent {sent:.3f}: TTFT {got_t:.3f} vs {want_t:.3f}, e2e {got_e:.3f} vs {want_e:.3f}")
    return off


def test_timing_follows_the_replay_engine_for_one_request_and_for_a_batch(tmp_path: Path) -> None:
    single = [(0.0, 4000, 50)]
    batch = [
        (0.0, 8000, 40),
        # These arrive while the first is in its (0.6 s) prefill step, and join at its end:
        # chunked prefill over several steps, mixed with the first request's decodes.
        (0.15, 3000, 30), (0.2, 6000, 60), (0.25, 1200, 20), (0.3, 2500, 80), (0.35, 500, 10),
    ]
    with emulator_process(LARGE, tmp_path) as emulator:
        for name, requests in (("single", single), ("batch", batch)):
            # A loaded machine may stall either process for a moment; one clean run of three must
            # match in every request, which a systematic difference never would.
            failures = []
            for attempt in range(3):
                off = deviations(emulator.url, requests, f"{name}{attempt}-")
                if not off:
                    break
                failures += off
            else:
                pytest.fail("timing differs from the replay's by more than 10 %: " + "; ".join(failures))


def test_the_server_listens_only_after_the_model_load_delay(tmp_path: Path) -> None:
    env = {"CACHEROUTE_EMULATOR_LOAD_SECONDS": "1.5"}
    with emulator_process(SMALL, tmp_path, env=env, wait=False) as emulator:
        log = tmp_path / "emulator.log"
        wait_for(lambda: "Loading model weights" in log.read_text(), timeout=60, what="the emulator to start loading")
        loading = time.monotonic()
        with pytest.raises(httpx.ConnectError):
            emulator.get("/health")
        wait_for(lambda: emulator.get("/health").status_code == 200, timeout=30, what="the emulator to be ready")
        assert time.monotonic() - loading >= 1.0
        assert emulator.get("/v1/models").status_code == 200
