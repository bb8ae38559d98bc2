"""Building ext_proc messages and reading the router's replies, for tests of one stream."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from cacheroute.router.extproc import Exchange, RouterCore

Mode = processing_mode_pb2.ProcessingMode


def handle(ex: Exchange, request: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
    """The exchange's replies to one message, parsed (they leave it serialized)."""
    return [pb.ProcessingResponse.FromString(reply) for reply in ex.handle(request)]


def sample(core: RouterCore, name: str, **labels: str) -> float | None:
    return core.metrics.registry.get_sample_value(name, labels)


def headers(mode: int, *, key: str | None = None, eos: bool = False) -> pb.ProcessingRequest:
    values = [base_pb2.HeaderValue(key=":method", raw_value=b"POST")]
    if key is not None:
        values.append(base_pb2.HeaderValue(key="x-affinity-key", raw_value=key.encode()))
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=values), end_of_stream=eos),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=mode, response_body_mode=Mode.NONE),
    )


def body(chunk: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=eos))


def routed_to(response: pb.ProcessingResponse) -> str:
    phase = response.WhichOneof("response")
    common = getattr(response, phase).response
    assert common.clear_route_cache
    value: str = common.header_mutation.set_headers[0].header.raw_value.decode()
    assert response.dynamic_metadata.fields["envoy.lb"].struct_value.fields[
        "x-gateway-destination-endpoint"
    ].string_value == value
    return value
