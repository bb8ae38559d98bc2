"""In-flight accounting: one release per acquire, whatever the messages and however streams end.

Streams are driven message by message with random kinds, orders, body modes, sizes, encodings
and failures, interleaved with endpoint readiness changes and plan swaps; after every step the
pool's totals match its endpoints, a stream holds at most one endpoint, and once every stream
has ended nothing is in flight.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheroute.planner.plan import Destination, KeyExtraction, affinity_key_hash, plan_from_routes
from cacheroute.router.endpoints import EndpointPool
from cacheroute.router.extproc import Exchange, RouterCore
from cacheroute.router.metrics import RouterMetrics
from cacheroute.router.picker import Picker
from cacheroute.router.table import build_table

Mode = processing_mode_pb2.ProcessingMode
MODES = [Mode.NONE, Mode.STREAMED, Mode.BUFFERED, Mode.BUFFERED_PARTIAL, Mode.FULL_DUPLEX_STREAMED]
ADDRESSES = [f"10.0.0.{i}:8000" for i in range(1, 5)]
KEYS = ["alice", "bob", "carol", None]


class InjectedError(RuntimeError):
    """A failure the test injects into the request path."""


def make_core(max_body_bytes: int = 256) -> RouterCore:
    pool = EndpointPool(scraping=True)
    picker = Picker(pool, seed=3)
    install(picker, ADDRESSES[:3])
    for endpoint in pool.by_address.values():
        pool.record_scrape(endpoint, ok=True)
    metrics = RouterMetrics(pool, sketch_size=8, export_key_names=False)
    return RouterCore(picker, metrics, max_body_bytes=max_body_bytes, default_body_mode="buffered")


def install(picker: Picker, addresses: list[str]) -> None:
    destinations = [Destination(f"pool-{a.split('.')[-1].split(':')[0]}", a) for a in addresses]
    ids = [d.id for d in destinations]
    planned = ["alice", "bob", "carol"]
    routes = {affinity_key_hash(k): [ids[i % len(ids)], ids[(i + 1) % len(ids)]] for i, k in enumerate(planned)}
    plan = plan_from_routes("pool", destinations, routes, key_extraction=KeyExtraction(prompt_prefix_chars=8))
    picker.pool.set_plan_destinations(plan.destinations)
    picker.install(build_table(plan, "v"))


def body_bytes(kind: str, size: int, key: str | None) -> bytes:
    if kind == "json":
        doc: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x" * size}]}
        if key is not None:
            doc["user"] = key
        return json.dumps(doc).encode()
    if kind == "deep":
        return b"[" * (size * 100 + 5000) + b"]" * (size * 100 + 5000)
    if kind == "huge-int":
        return b'{"user": ' + b"9" * 5000 + b"}"
    if kind == "not-utf8":
        return b"\xff\xfe" * (size + 1)
    return b"x" * size


def message(step: tuple[Any, ...]) -> pb.ProcessingRequest:
    kind = step[0]
    if kind == "headers":
        _, key, eos, mode, length = step
        values = [base_pb2.HeaderValue(key=":method", raw_value=b"POST")]
        if key is not None:
            values.append(base_pb2.HeaderValue(key="x-affinity-key", raw_value=key.encode()))
        if length is not None:
            values.append(base_pb2.HeaderValue(key="content-length", raw_value=length.encode()))
        request = pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=values), end_of_stream=eos)
        )
        if mode is not None:
            request.protocol_config.request_body_mode = mode
            request.protocol_config.response_body_mode = mode
        return request
    if kind == "body":
        _, encoding, size, eos, key = step
        return pb.ProcessingRequest(request_body=pb.HttpBody(body=body_bytes(encoding, size, key), end_of_stream=eos))
    if kind == "trailers":
        return pb.ProcessingRequest(request_trailers=pb.HttpTrailers())
    if kind == "response_headers":
        return pb.ProcessingRequest(response_headers=pb.HttpHeaders())
    if kind == "response_body":
        _, tokens, eos = step
        chunk = b'{"usage": {"prompt_tokens": ' + tokens.encode() + b"}}"
        return pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=eos))
    return pb.ProcessingRequest()


stream_steps = st.one_of(
    st.tuples(
        st.just("headers"),
        st.sampled_from(KEYS),
        st.booleans(),
        st.sampled_from([None, *MODES]),
        st.sampled_from([None, "120", "99999999999999999999999999", "-5", "²", "1" * 5000]),
    ),
    st.tuples(
        st.just("body"),
        st.sampled_from(["json", "deep", "huge-int", "not-utf8", "raw"]),
        st.integers(0, 400),
        st.booleans(),
        st.sampled_from(KEYS),
    ),
    st.tuples(st.just("trailers")),
    st.tuples(st.just("response_headers")),
    st.tuples(st.just("response_body"), st.sampled_from(["7", "99999999999999", "1" * 5000, "-1"]), st.booleans()),
    st.tuples(st.just("empty")),
)
# (stream index, what happens): a message, the stream's end, or a change of the world between messages.
events = st.lists(
    st.one_of(
        st.tuples(st.integers(0, 3), stream_steps),
        st.tuples(st.integers(0, 3), st.just(("end",))),
        st.tuples(st.just(-1), st.sampled_from([("flap", 0), ("flap", 1), ("flap", 2), ("swap",), ("fail",),
                                                ("fail-late",)])),
    ),
    max_size=40,
)


def check_totals(core: RouterCore, exchanges: dict[int, Exchange]) -> None:
    pool = core.pool
    ready = [e for e in pool.by_address.values() if e.ready]
    assert pool.in_flight_ready == sum(e.in_flight for e in ready)
    held = [x.endpoint for x in exchanges.values() if x.endpoint is not None]
    live = sum(e.in_flight for e in pool.by_address.values())
    # Every acquired endpoint is held by exactly one open stream (removed endpoints included).
    assert live <= len(held)
    for endpoint in {id(e): e for e in held}.values():
        assert endpoint.in_flight == sum(1 for e in held if e is endpoint)


class _Armed:
    """Failures the test injects: "fail" strikes while a decision is counted (after the pick,
    before the endpoint is acquired), "fail-late" while its reply is kept (after the acquire).
    Each strikes once. They go through the core's collaborators (its counters and reply cache),
    so every line of the exchange's own code runs as in production."""

    def __init__(self) -> None:
        self.early = False
        self.late = False


class _CountsThatFail(dict[str, int]):
    def __init__(self, counts: dict[str, int], armed: _Armed) -> None:
        super().__init__(counts)
        self.armed = armed

    def __setitem__(self, key: str, value: int) -> None:
        if self.armed.early:
            self.armed.early = False
            raise InjectedError("counting the decision")
        super().__setitem__(key, value)


class _RepliesThatFail(dict[tuple[str, str], bytes]):
    """A reply cache that keeps nothing (every decision builds its reply, so a late failure can
    strike any of them) and fails when armed."""

    def __init__(self, armed: _Armed) -> None:
        super().__init__()
        self.armed = armed

    def __setitem__(self, key: tuple[str, str], value: bytes) -> None:
        if self.armed.late:
            self.armed.late = False
            raise InjectedError("keeping the reply")


def drive(core: RouterCore, script: list[tuple[int, tuple[Any, ...]]]) -> _Armed:
    exchanges: dict[int, Exchange] = {}
    picker = core.picker
    armed = _Armed()
    core.metrics.decisions = _CountsThatFail(core.metrics.decisions, armed)
    core.replies = _RepliesThatFail(armed)
    swapped = False
    everything: list[Any] = []
    for target, step in script:
        if target < 0:
            if step[0] == "flap":
                endpoint = list(core.pool.by_address.values())[step[1] % len(core.pool.by_address)]
                core.pool.record_scrape(endpoint, ok=not endpoint.ready)
            elif step[0] == "swap":
                swapped = not swapped
                install(picker, ADDRESSES[1:] if swapped else ADDRESSES[:3])
                for endpoint in core.pool.by_address.values():
                    if not endpoint.scraped:
                        core.pool.record_scrape(endpoint, ok=True)
            elif step[0] == "fail":
                armed.early = True
            else:
                armed.late = True
        elif step[0] == "end":
            exchange = exchanges.pop(target, None)
            if exchange is not None:
                exchange.finish()
        else:
            exchange = exchanges.setdefault(target, Exchange(core))
            request = message(step)
            try:
                replies = exchange.handle(request)
            except Exception:
                try:
                    replies = exchange.recover(request)
                except InjectedError:
                    # The fallback failed too: the stream ends with an error status, and its end
                    # gives back what it holds (`ExternalProcessor.process`).
                    exchanges.pop(target).finish()
                    check_totals(core, exchanges)
                    continue
            everything.extend(replies)
            exchange.after_reply()
        check_totals(core, exchanges)
    for exchange in exchanges.values():
        exchange.finish()
    exchanges.clear()
    check_totals(core, exchanges)
    assert all(e.in_flight == 0 for e in core.pool.by_address.values())
    assert core.pool.in_flight_ready == 0
    for reply in everything:
        pb.ProcessingResponse.FromString(reply)
    return armed


@settings(max_examples=200, deadline=None)
@given(script=events)
def test_in_flight_returns_to_zero_whatever_the_messages(script: list[tuple[int, tuple[Any, ...]]]) -> None:
    drive(make_core(), script)


def headers(key: str | None = "alice", eos: bool = False, mode: int = Mode.BUFFERED) -> tuple[Any, ...]:
    return ("headers", key, eos, mode, None)


@pytest.mark.parametrize(
    "script",
    [
        [(0, headers(eos=True)), (0, headers(eos=True)), (0, headers(eos=True))],
        [(0, ("body", "json", 10, True, "bob")), (0, headers(eos=True))],
        [(0, headers()), (0, ("body", "json", 10, True, "bob")), (0, headers(eos=True)), (0, ("trailers",))],
        [(0, headers(mode=Mode.FULL_DUPLEX_STREAMED)), (0, ("body", "raw", 300, False, None)), (0, headers())],
        [(-1, ("fail",)), (0, headers(eos=True)), (-1, ("fail",)), (1, headers(eos=True))],
        [(-1, ("fail-late",)), (0, headers(eos=True)), (-1, ("fail-late",)), (1, headers(key=None, eos=True))],
        [(0, headers(key=None)), (-1, ("fail-late",)), (0, ("body", "json", 10, True, "carol"))],
    ],
    ids=["three request_headers", "body before headers", "headers body headers", "full duplex then headers",
         "failed decisions", "failures after acquire", "failure after acquire, on the body"],
)
def test_known_orders_release_exactly_once(script: list[tuple[int, tuple[Any, ...]]]) -> None:
    armed = drive(make_core(), script)
    assert not armed.early and not armed.late, "every injected failure struck a decision"


def test_a_second_request_headers_does_not_decide_again() -> None:
    core = make_core()
    exchange = Exchange(core)
    first = exchange.handle(message(headers(eos=True)))
    endpoint = exchange.endpoint
    assert endpoint is not None and endpoint.in_flight == 1
    again = pb.ProcessingResponse.FromString(exchange.handle(message(headers("bob", eos=True)))[0])
    assert again.WhichOneof("response") == "request_headers"
    assert not again.request_headers.response.header_mutation.set_headers
    assert exchange.endpoint is endpoint and endpoint.in_flight == 1
    assert core.metrics.decisions["planned"] + core.metrics.decisions["p2c"] == 1
    exchange.finish()
    assert endpoint.in_flight == 0 and first


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"[" * 200_000 + b"]" * 200_000, "malformed"),
        (b'{"user": ' + b"9" * 5000 + b"}", "malformed"),
        (b"\xff\xfe\x00", "malformed"),
    ],
    ids=["deep nesting", "integer of 5000 digits", "not UTF-8"],
)
def test_bodies_that_raise_in_the_parser_take_the_p2c_fallback(body: bytes, reason: str) -> None:
    core = make_core(max_body_bytes=1 << 20)
    exchange = Exchange(core)
    exchange.handle(message(headers(key=None)))
    reply = pb.ProcessingResponse.FromString(exchange.handle(pb.ProcessingRequest(
        request_body=pb.HttpBody(body=body, end_of_stream=True)))[0])
    assert reply.request_body.response.header_mutation.set_headers  # routed
    assert core.metrics.decisions["p2c"] == 1
    assert core.metrics.body_fallbacks[reason] == 1
    assert core.metrics.stream_errors["handled"] == 0
    exchange.finish()


def test_absurd_sizes_and_usage_are_not_believed() -> None:
    core = make_core()
    exchange = Exchange(core)
    exchange.handle(message(("headers", "alice", True, Mode.NONE, "9" * 30)))
    assert exchange.content_length == 0
    exchange.handle(message(("response_body", "9" * 30, True)))
    exchange.handle(message(("response_body", "123456789012", True)))
    assert exchange.usage_tokens is None
    exchange.handle(message(("response_body", "77", True)))
    assert exchange.usage_tokens == 77
    exchange.finish()
    assert core.metrics.token_sources["usage"] == 1


def test_a_message_that_raises_gets_the_fallback_and_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    core = make_core()
    exchange = Exchange(core)

    def broken(*_args: Any) -> Any:
        raise InjectedError("key extraction")

    monkeypatch.setattr("cacheroute.router.keys.HeaderKeys.add", broken)
    request = message(headers(eos=True))
    with pytest.raises(InjectedError):
        exchange.handle(request)
    reply = pb.ProcessingResponse.FromString(exchange.recover(request)[0])
    assert reply.request_headers.response.header_mutation.set_headers[0].header.raw_value
    assert core.metrics.stream_errors["handled"] == 1
    assert core.metrics.decisions["p2c"] == 1
    exchange.finish()
    assert all(e.in_flight == 0 for e in core.pool.by_address.values())


def test_a_failure_after_the_endpoint_is_taken_still_routes_the_request() -> None:
    """The reply fails to build once the endpoint is acquired: the request is still sent somewhere
    (the fallback decision, with its destination header), and only that endpoint stays taken."""
    core = make_core()
    armed = _Armed()
    core.replies = _RepliesThatFail(armed)
    armed.late = True
    exchange = Exchange(core)
    request = message(headers(eos=True))
    with pytest.raises(InjectedError):
        exchange.handle(request)
    [raw] = exchange.recover(request)
    reply = pb.ProcessingResponse.FromString(raw)
    [header] = reply.request_headers.response.header_mutation.set_headers
    assert header.header.key == "x-gateway-destination-endpoint"
    assert exchange.endpoint is not None
    assert header.header.raw_value.decode() == exchange.endpoint.address
    assert sum(e.in_flight for e in core.pool.by_address.values()) == 1
    exchange.finish()
    assert all(e.in_flight == 0 for e in core.pool.by_address.values())
