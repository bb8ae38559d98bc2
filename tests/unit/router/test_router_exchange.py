"""One ext_proc stream, message by message, in each body mode Envoy may use."""

from __future__ import annotations

import json

import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from cacheroute.planner.plan import Destination, affinity_key_hash, plan_from_routes
from cacheroute.router.endpoints import EndpointPool
from cacheroute.router.extproc import Exchange, RouterCore
from cacheroute.router.metrics import RouterMetrics
from cacheroute.router.picker import Picker
from cacheroute.router.table import build_table
from tests.support.extproc import body, handle, headers, routed_to, sample

Mode = processing_mode_pb2.ProcessingMode
ADDRESSES = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]


def make_core(max_body_bytes: int = 1 << 20, ready: bool = True) -> RouterCore:
    pool = EndpointPool(scraping=not ready)
    picker = Picker(pool, seed=1)
    destinations = [Destination(f"pool-{i}", a) for i, a in enumerate(ADDRESSES)]
    plan = plan_from_routes("pool", destinations, {affinity_key_hash("alice"): ["pool-2"]})
    pool.set_plan_destinations(plan.destinations)
    picker.install(build_table(plan, "v1"))
    metrics = RouterMetrics(pool, sketch_size=16, export_key_names=False)
    return RouterCore(picker, metrics, max_body_bytes=max_body_bytes)


def echoed(response: pb.ProcessingResponse) -> tuple[bytes, bool]:
    streamed = response.request_body.response.body_mutation.streamed_response
    return streamed.body, streamed.end_of_stream


BODY = json.dumps({"model": "m", "user": "alice", "messages": [{"role": "user", "content": "hi"}]}).encode()


def test_full_duplex_holds_headers_and_chunks_until_the_body_ends() -> None:
    core = make_core()
    ex = Exchange(core)
    assert handle(ex, headers(Mode.FULL_DUPLEX_STREAMED)) == []
    assert handle(ex, body(BODY[:10], False)) == []
    replies = handle(ex, body(BODY[10:], True))
    assert replies[0].WhichOneof("response") == "request_headers"
    assert routed_to(replies[0]) == ADDRESSES[2]
    assert [echoed(r) for r in replies[1:]] == [(BODY[:10], False), (BODY[10:], True)]
    assert core.pool.by_address[ADDRESSES[2]].in_flight == 1
    ex.finish()
    assert core.pool.by_address[ADDRESSES[2]].in_flight == 0


def test_full_duplex_past_the_limit_decides_by_p2c_and_streams_the_rest() -> None:
    core = make_core(max_body_bytes=16)
    ex = Exchange(core)
    handle(ex, headers(Mode.FULL_DUPLEX_STREAMED))
    assert handle(ex, body(BODY[:12], False)) == []
    replies = handle(ex, body(BODY[12:24], False))
    assert ex.outcome == "p2c"
    assert [echoed(r) for r in replies[1:]] == [(BODY[:12], False), (BODY[12:24], False)]
    assert ex.chunks == [] and ex.held == []
    (last,) = handle(ex, body(BODY[24:], True))
    assert echoed(last) == (BODY[24:], True)
    assert sample(core, "cacheroute_router_body_key_fallbacks_total", reason="too_large") == 1


def test_full_duplex_with_trailers_decides_on_the_trailers() -> None:
    ex = Exchange(make_core())
    handle(ex, headers(Mode.FULL_DUPLEX_STREAMED))
    handle(ex, body(BODY, False))
    replies = handle(ex, pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    assert routed_to(replies[0]) == ADDRESSES[2]
    assert echoed(replies[1]) == (BODY, False)
    assert replies[2].WhichOneof("response") == "request_trailers"


def test_buffered_decides_on_the_body_message() -> None:
    ex = Exchange(make_core())
    (first,) = handle(ex, headers(Mode.BUFFERED))
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.response.HasField("header_mutation")
    (reply,) = handle(ex, body(BODY, True))
    assert reply.WhichOneof("response") == "request_body"
    assert routed_to(reply) == ADDRESSES[2]
    assert ex.key is not None and ex.key.name == "alice"


def test_key_header_decides_on_the_headers_and_the_body_only_feeds_estimates() -> None:
    core = make_core()
    ex = Exchange(core)
    (reply,) = handle(ex, headers(Mode.BUFFERED, key="alice"))
    assert routed_to(reply) == ADDRESSES[2]
    conversation = json.dumps({"model": "m", "messages": [
        {"role": "system", "content": "s" * 400}, {"role": "user", "content": "next"}
    ]}).encode()
    (passed,) = handle(ex, body(conversation, True))
    assert passed.WhichOneof("response") == "request_body"
    assert not passed.request_body.response.HasField("header_mutation")
    assert ex.prefix_tokens == 0  # measured only after the reply went out
    ex.after_reply()
    assert ex.prefix_tokens >= 100
    ex.finish()
    snap = core.metrics.sketch.snapshot()
    assert snap.keys[0].key == affinity_key_hash("alice")
    assert snap.keys[0].prompt_tokens == -(-len(conversation) // 4)
    assert snap.keys[0].prefix_tokens == ex.prefix_tokens


@pytest.mark.parametrize("mode", [Mode.NONE, Mode.STREAMED])
def test_modes_without_a_held_body_decide_on_the_headers(mode: int) -> None:
    ex = Exchange(make_core())
    (reply,) = handle(ex, headers(mode))
    assert reply.WhichOneof("response") == "request_headers"
    assert ex.outcome == "p2c"


def test_no_ready_endpoint_is_an_immediate_503() -> None:
    core = make_core(ready=False)
    ex = Exchange(core)
    assert handle(ex, headers(Mode.FULL_DUPLEX_STREAMED)) == []
    (reply,) = handle(ex, body(BODY, True))
    assert reply.immediate_response.status.code == 503
    ex.finish()
    assert core.metrics.sketch.snapshot().total_requests == 0


def test_response_usage_replaces_the_estimate() -> None:
    core = make_core()
    ex = Exchange(core)
    handle(ex, headers(Mode.BUFFERED, key="alice"))
    handle(ex, body(BODY, True))
    handle(ex, pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
    usage = b'{"usage": {"prompt_tokens": 321, "completion_tokens": 2}}'
    (reply,) = handle(ex, pb.ProcessingRequest(response_body=pb.HttpBody(body=usage, end_of_stream=True)))
    assert reply.WhichOneof("response") == "response_body"
    ex.finish()
    assert core.metrics.sketch.snapshot().keys[0].prompt_tokens == 321
    assert sample(core, "cacheroute_router_prompt_token_counts_total", source="usage") == 1


def test_the_request_charges_its_estimated_prompt_tokens_until_it_ends_and_usage_teaches_the_ratio() -> None:
    """Token-aware load: the endpoint carries the prompt tokens the body's size implies while the
    request is in flight; a response's usage.prompt_tokens moves the bytes-to-tokens ratio."""
    core = make_core()
    ex = Exchange(core)
    handle(ex, headers(Mode.FULL_DUPLEX_STREAMED))
    handle(ex, body(BODY, True))
    endpoint = core.pool.by_address[ADDRESSES[2]]
    assert endpoint.in_flight_tokens == round(len(BODY) / 4) > 0
    assert core.pool.tokens_ready == endpoint.in_flight_tokens
    usage = json.dumps({"usage": {"prompt_tokens": len(BODY) // 2}}).encode()
    handle(ex, pb.ProcessingRequest(response_body=pb.HttpBody(body=usage, end_of_stream=True)))
    ex.finish()
    assert endpoint.in_flight_tokens == 0 and core.pool.tokens_ready == 0
    # One response: the plain mean of what was seen, half a token per byte.
    assert core.estimator.ratio == pytest.approx(0.5, abs=0.01)
