"""vLLM's Prometheus metrics, with vLLM's names, labels and histogram buckets (v1 engine, 0.11).

Token counters follow vLLM's accounting: a request's prompt tokens count as prefix-cache queries
when it is scheduled, its tokens found in the cache as hits; prompt and generation tokens count
what was processed. `vllm:kv_cache_usage_perc` is a fraction (1 means full), as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cacheroute.sandbox.emulator.args import EmulatorConfig

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineMetrics:
    """The metrics of one emulated server (its own registry: one pod, one /metrics)."""

    def __init__(
        self,
        config: EmulatorConfig,
        *,
        running: Callable[[], float],
        waiting: Callable[[], float],
        kv_usage: Callable[[], float],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        names = ["model_name", "engine"]
        values = (config.served_name, "0")
        reg = self.registry

        def gauge(name: str, doc: str, read: Callable[[], float]) -> None:
            Gauge(name, doc, names, registry=reg).labels(*values).set_function(read)

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.", running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_usage)
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", names,
            registry=reg,
        ).labels(*values)
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", names, registry=reg
        ).labels(*values)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", names, registry=reg
        ).labels(*values)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", names, registry=reg
        ).labels(*values)
        self._success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", [*names, "finished_reason"],
            registry=reg,
        )
        Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", names, registry=reg).labels(
            *values
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", names,
            buckets=TTFT_BUCKETS, registry=reg,
        ).labels(*values)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", names,
            buckets=LATENCY_BUCKETS, registry=reg,
        ).labels(*values)
        self.queue = Histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", names,
            buckets=LATENCY_BUCKETS, registry=reg,
        ).labels(*values)
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks"],
            registry=reg,
        )
        info.labels(
            str(config.block_size),
            config.kv_cache_dtype,
            str(config.prefix_caching),
            str(config.kv_capacity_tokens // config.block_size),
        ).set(1)
        self._values = values

    def scheduled(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(cached_tokens)
        self.prompt_tokens.inc(prompt_tokens)

    def finished(self, *, generated: int, ttft_s: float, e2e_s: float, queue_s: float, reason: str) -> None:
        self.generation_tokens.inc(generated)
        self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        self.queue.observe(queue_s)
        self._success.labels(*self._values, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
