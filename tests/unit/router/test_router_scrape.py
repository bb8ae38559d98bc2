"""Queue depth from engine metrics, under current and older metric names, over real sockets."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cacheroute.router.endpoints import EndpointPool
from cacheroute.router.scrape import MetricsConnection, Scraper, parse_queue
from cacheroute.sandbox.process import free_port

CURRENT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 3.0
vllm:num_requests_running{engine="1",model_name="llama"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 7.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 99.0
vllm:num_requests_running_total 1000
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="llama"} 0.5
"""

LEGACY = """\
vllm:num_requests_running{model_name="llama"} 4
vllm:num_requests_swapped{model_name="llama"} 2
vllm:num_requests_waiting{model_name="llama"} 1
"""


def test_current_names_are_summed_over_label_sets() -> None:
    assert parse_queue(CURRENT) == (5, 7)


def test_v0_names_count_swapped_as_waiting() -> None:
    assert parse_queue(LEGACY) == (4, 3)


def test_underscore_and_sglang_names() -> None:
    text = "vllm_num_requests_running 2\nvllm_num_requests_waiting 6\nsglang:num_queue_reqs 1\n"
    assert parse_queue(text) == (2, 7)
    assert parse_queue("sglang:num_running_reqs{tp_rank=\"0\"} 9\n") == (9, 0)


def test_missing_or_broken_values_count_as_zero() -> None:
    assert parse_queue("") == (0, 0)
    assert parse_queue("vllm:num_requests_waiting NaN\nvllm:num_requests_running oops\n") == (0, 0)


class _Metrics(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    mode = "length"
    served = 0

    def do_GET(self) -> None:
        type(self).served += 1
        body = LEGACY.encode()
        if self.mode == "slow":
            time.sleep(0.5)
        self.send_response(503 if self.mode == "down" else 200)
        if self.mode == "chunked":
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for part in (body[:10], body[10:]):
                self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
            return
        self.send_header("content-length", str(len(body)))
        if self.mode == "close":
            self.send_header("connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def metrics_server() -> Iterator[tuple[ThreadingHTTPServer, type[_Metrics]]]:
    handler = type("Handler", (_Metrics,), {"mode": "length", "served": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, handler
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("mode", ["length", "chunked", "close"])
async def test_connection_reads_every_response_framing(
    metrics_server: tuple[ThreadingHTTPServer, type[_Metrics]], mode: str
) -> None:
    server, handler = metrics_server
    handler.mode = mode
    connection = MetricsConnection(f"127.0.0.1:{server.server_address[1]}", deadline=2)
    for _ in range(3):
        status, body = await connection.get()
        assert status == 200
        assert parse_queue(body) == (4, 3)
    assert handler.served == 3
    connection.close()


async def test_connection_reports_status_and_timeouts(
    metrics_server: tuple[ThreadingHTTPServer, type[_Metrics]],
) -> None:
    server, handler = metrics_server
    connection = MetricsConnection(f"127.0.0.1:{server.server_address[1]}", deadline=0.2)
    handler.mode = "down"
    assert (await connection.get())[0] == 503
    handler.mode = "slow"
    with pytest.raises(TimeoutError):
        await connection.get()
    refused = MetricsConnection(f"127.0.0.1:{free_port()}", deadline=0.5)
    with pytest.raises(OSError):
        await refused.get()


async def test_scraper_marks_endpoints_by_their_metrics(
    metrics_server: tuple[ThreadingHTTPServer, type[_Metrics]],
) -> None:
    server, handler = metrics_server
    live = f"127.0.0.1:{server.server_address[1]}"
    dead = f"127.0.0.1:{free_port()}"
    pool = EndpointPool(scraping=True)
    pool.set_static([live, dead])
    failures: list[str] = []
    scraper = Scraper(pool, interval=10, timeout=0.5, on_failure=lambda e: failures.append(e.address))
    await scraper.scrape_all()
    assert [e.address for e in pool.ready] == [live]
    assert pool.by_address[live].waiting == 3 and pool.by_address[live].running == 4
    assert failures == [dead]
    handler.mode = "down"
    await scraper.scrape_all()
    assert pool.ready == ()
