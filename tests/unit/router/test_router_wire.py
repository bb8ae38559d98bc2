"""Reading request headers from their wire bytes gives what decoding the message gives.

Messages are built with random header lists (wanted and other names, duplicates, empty values,
values of every length), random end-of-stream flags, protocol configurations and other
top-level fields, serialized in both field orders encoders use (Envoy's: by field number; Go's:
the protocol configuration first). Whenever the reader answers, its answer equals the decoded
message's; and it does answer for the messages Envoy sends, so the router takes the fast path.
"""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheroute.planner.plan import Destination, plan_from_routes
from cacheroute.router.endpoints import EndpointPool
from cacheroute.router.extproc import SUBSET_KEY, SUBSET_NAMESPACE, Exchange, RouterCore, parse_message
from cacheroute.router.metrics import RouterMetrics
from cacheroute.router.picker import Picker
from cacheroute.router.table import build_table
from cacheroute.router.wire import (
    REQUEST_HEADERS,
    RESPONSE_HEADERS,
    header_patterns,
    message_kind,
    read_request_headers,
)

WANTED = ("content-length", "x-affinity-key", "x-session-id")
_patterns = header_patterns(WANTED)
assert _patterns is not None
PATTERNS = _patterns
MODES = list(processing_mode_pb2.ProcessingMode.BodySendMode.values())
# Header values as HTTP allows them: no line feed, carriage return or NUL (RFC 9110 section 5.5).
VALUE_BYTES = st.binary(max_size=300).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b"").replace(b"\0", b""))
NAMES = st.sampled_from([*WANTED, ":path", ":authority", "x-request-id", "user-agent", "x-affinity-key2", "x-n"])


def envoy_headers(values: list[tuple[str, bytes]]) -> list[base_pb2.HeaderValue]:
    return [base_pb2.HeaderValue(key=k, raw_value=v) for k, v in values]


def decoded(data: bytes) -> tuple[bool, tuple[int, int] | None, dict[str, bytes]]:
    """What the router reads from the decoded message: end of stream, body modes, the last raw
    value of each wanted header present (as `Exchange._on_request_headers` walks the list)."""
    message = parse_message(data)
    modes = None
    if message.HasField("protocol_config"):
        modes = (message.protocol_config.request_body_mode, message.protocol_config.response_body_mode)
    values = {}
    for h in message.request_headers.headers.headers:
        if h.key in WANTED:
            values[h.key] = h.raw_value if h.raw_value else h.value.encode()
    return message.request_headers.end_of_stream, modes, values


@st.composite
def messages(draw: st.DrawFn) -> tuple[bytes, bool]:
    """A serialized request_headers message, and whether it carries a metadata context."""
    values = draw(st.lists(st.tuples(NAMES, VALUE_BYTES), max_size=12))
    headers = envoy_headers(values)
    rarely = st.integers(0, 3).map(lambda n: n == 0)
    if draw(rarely):
        # Some encoders set the deprecated string `value` instead.
        name = draw(st.sampled_from(WANTED))
        headers.insert(draw(st.integers(0, len(headers))), base_pb2.HeaderValue(key=name, value="v"))
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=headers), end_of_stream=draw(st.booleans()))
    )
    config = None
    if draw(st.booleans()):
        config = pb.ProtocolConfiguration(
            request_body_mode=draw(st.sampled_from(MODES)),
            response_body_mode=draw(st.sampled_from(MODES)),
            send_body_without_waiting_for_header_response=draw(st.booleans()),
        )
    with_metadata = draw(rarely)
    if with_metadata:
        metadata = base_pb2.Metadata()
        metadata.filter_metadata[SUBSET_NAMESPACE].update({SUBSET_KEY: "10.0.0.1:8000"})
        message.metadata_context.CopyFrom(metadata)
    if draw(rarely):
        message.observability_mode = True
    if draw(rarely):
        message.attributes["envoy.filters.http.ext_proc"].CopyFrom(struct_pb2.Struct())
    body = message.SerializeToString()
    if config is None:
        return body, with_metadata
    if draw(st.booleans()):
        # Go's order: the protocol configuration first, the request oneof after it.
        return pb.ProcessingRequest(protocol_config=config).SerializeToString() + body, with_metadata
    message.protocol_config.CopyFrom(config)
    return message.SerializeToString(), with_metadata


@settings(max_examples=1500, deadline=None)
@given(messages())
def test_what_the_wire_reader_answers_is_what_the_decoder_reads(case: tuple[bytes, bool]) -> None:
    data, with_metadata = case
    kind, at = message_kind(data)
    assert kind == REQUEST_HEADERS
    found = read_request_headers(data, at, PATTERNS)
    if found is None:
        return
    assert not with_metadata, "a subset hint must send the message to the decoder"
    assert found == decoded(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_arbitrary_bytes_never_raise(data: bytes) -> None:
    kind, at = message_kind(data)
    if kind == REQUEST_HEADERS:
        read_request_headers(data, at, PATTERNS)


def loadgen_like(key: str, *, config_first: bool) -> bytes:
    """The request headers Envoy (or the bench's Go load generator) sends for a chat request."""
    headers = envoy_headers([
        (":authority", b"gateway"), (":path", b"/v1/chat/completions"), (":method", b"POST"),
        ("content-type", b"application/json"), ("content-length", b"96"),
        ("x-request-id", b"00000000-0000-4000-8000-000000000001"), ("x-affinity-key", key.encode()),
    ])
    config = pb.ProtocolConfiguration(request_body_mode=MODES[0], response_body_mode=MODES[0])
    rest = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=headers)))
    if config_first:
        head: bytes = pb.ProcessingRequest(protocol_config=config).SerializeToString()
        tail: bytes = rest.SerializeToString()
        return head + tail
    rest.protocol_config.CopyFrom(config)
    whole: bytes = rest.SerializeToString()
    return whole


def test_envoys_request_headers_take_the_fast_path_in_either_field_order() -> None:
    for config_first in (False, True):
        data = loadgen_like("tenant-7", config_first=config_first)
        kind, at = message_kind(data)
        assert (kind, at != 0) == (REQUEST_HEADERS, config_first)
        assert read_request_headers(data, at, PATTERNS) == (
            False, (0, 0), {"content-length": b"96", "x-affinity-key": b"tenant-7"}
        )


def test_response_headers_are_told_apart_without_decoding() -> None:
    message = pb.ProcessingRequest(response_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=envoy_headers([(":status", b"200")]))))
    assert message_kind(message.SerializeToString()) == (RESPONSE_HEADERS, 0)


def test_header_names_that_cannot_be_searched_are_decoded_instead() -> None:
    assert header_patterns(["x-" + "k" * 130]) is None
    assert header_patterns(["x-k\u00e9y"]) is None
    assert header_patterns(["x-affinity-key"]) is not None


def make_core() -> RouterCore:
    pool = EndpointPool(scraping=False)
    picker = Picker(pool, seed=5)
    destinations = [Destination(f"pool-{i}", f"10.0.0.{i}:8000") for i in range(1, 4)]
    plan = plan_from_routes("pool", destinations, {})
    pool.set_plan_destinations(plan.destinations)
    picker.install(build_table(plan, "v"))
    return RouterCore(picker, RouterMetrics(pool, sketch_size=8, export_key_names=False), max_body_bytes=1024)


@settings(max_examples=300, deadline=None)
@given(messages())
def test_a_stream_fed_bytes_decides_as_a_stream_fed_messages(case: tuple[bytes, bool]) -> None:
    data, _ = case
    # Two routers in the same state and with the same seed: one reads the bytes, one the message.
    wire_core, decoded_core = make_core(), make_core()
    by_wire, by_message = Exchange(wire_core), Exchange(decoded_core)
    assert by_wire.receive(data) == by_message.handle(parse_message(data))
    assert (by_wire.key, by_wire.content_length, by_wire.request_mode, by_wire.allowed) == (
        by_message.key, by_message.content_length, by_message.request_mode, by_message.allowed)
    by_wire.finish()
    by_message.finish()
