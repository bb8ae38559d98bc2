"""Whatever an endpoint answers on /metrics, only that endpoint fails: the scraper carries on.

Each case is a real socket serving crafted bytes: responses cut short, malformed framing,
absurd values, and an address that cannot be connected to at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from cacheroute.router.endpoints import EndpointPool
from cacheroute.router.scrape import MAX_QUEUE, Scraper, parse_queue

GOOD = b"vllm:num_requests_running 2\nvllm:num_requests_waiting 5\n"


def head(extra: str) -> bytes:
    return f"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n{extra}\r\n".encode()


ANSWERS: dict[str, bytes] = {
    "length longer than the body": head("content-length: 1000\r\n") + GOOD,
    "chunk cut short": head("transfer-encoding: chunked\r\n") + b"400\r\n" + GOOD,
    "chunk size not hex": head("transfer-encoding: chunked\r\n") + b"zz\r\n" + GOOD,
    "no end of the chunks": head("transfer-encoding: chunked\r\n") + b"5\r\nvllm:\r\n",
    "head cut short": b"HTTP/1.1 200 OK\r\ncontent-le",
    "not HTTP": b"SSH-2.0-OpenSSH\r\n\r\n",
    "status not a number": b"HTTP/1.1 2OO OK\r\n\r\n",
    "nothing at all": b"",
    "a head line past the reader's limit": b"HTTP/1.1 200 OK\r\nx: " + b"a" * 200_000 + b"\r\n\r\n",
}


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[bytes], asyncio.Future[str]]]:
    servers: list[asyncio.Server] = []

    async def start(answer: bytes) -> str:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(answer)
                await writer.drain()
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        return f"127.0.0.1:{server.sockets[0].getsockname()[1]}"

    def schedule(answer: bytes) -> asyncio.Future[str]:
        return asyncio.ensure_future(start(answer))

    yield schedule
    for server in servers:
        server.close()


@pytest.mark.parametrize("case", sorted(ANSWERS))
async def test_a_bad_answer_takes_only_that_endpoint_out(
    case: str, serve: Callable[[bytes], asyncio.Future[str]]
) -> None:
    good = await serve(head(f"content-length: {len(GOOD)}\r\n") + GOOD)
    bad = await serve(ANSWERS[case])
    pool = EndpointPool(scraping=True)
    pool.set_static([good, bad])
    failures: list[str] = []
    scraper = Scraper(pool, interval=1.0, timeout=2.0, on_failure=lambda e: failures.append(e.address))
    await scraper.scrape_all()
    assert pool.by_address[good].ready and pool.by_address[good].waiting == 5
    assert not pool.by_address[bad].ready
    assert failures == [bad]
    # The endpoint was ready once and went bad: it leaves the ready set.
    pool.record_scrape(pool.by_address[bad], ok=True)
    assert pool.by_address[bad].ready
    await scraper.scrape_all()
    assert not pool.by_address[bad].ready


async def test_addresses_that_do_not_parse_or_resolve_fail_alone(serve: Callable[[bytes], asyncio.Future[str]]) -> None:
    good = await serve(head(f"content-length: {len(GOOD)}\r\n") + GOOD)
    pool = EndpointPool(scraping=True)
    pool.set_static([good, "not-an-address", "10.0.0.1:99999", "no-such-host.invalid:80", ":80"])
    scraper = Scraper(pool, interval=0.05, timeout=2.0)
    second_round = asyncio.Event()

    def after_round() -> None:
        if scraper.rounds >= 2:
            second_round.set()

    scraper.on_round(after_round)
    task = asyncio.create_task(scraper.run())
    try:
        await asyncio.wait([task, asyncio.create_task(second_round.wait())], timeout=20,
                           return_when=asyncio.FIRST_COMPLETED)
        assert second_round.is_set() and not task.done(), task.exception() if task.done() else "no second round"
    finally:
        task.cancel()
    assert [e.address for e in pool.ready] == [good]


async def test_a_body_without_length_is_read_to_the_end(serve: Callable[[bytes], asyncio.Future[str]]) -> None:
    padding = b"# " + b"p" * 100_000 + b"\n"
    address = await serve(b"HTTP/1.0 200 OK\r\n\r\n" + padding + GOOD)
    pool = EndpointPool(scraping=True)
    pool.set_static([address])
    await Scraper(pool, interval=1.0, timeout=2.0).scrape_all()
    endpoint = pool.by_address[address]
    assert endpoint.ready and (endpoint.running, endpoint.waiting) == (2, 5)


def test_absurd_values_are_bounded() -> None:
    text = "vllm:num_requests_waiting +Inf\nvllm:num_requests_running 1e308\nvllm:num_requests_waiting -5\n"
    assert parse_queue(text) == (MAX_QUEUE, 0)
    assert parse_queue("vllm:num_requests_waiting 1e999\n") == (0, 0)
