"""The Envoy ext_proc service: one `Process` stream per HTTP request.

Endpoint-picker protocol (Gateway API Inference Extension): the chosen endpoint(s) go into the
`x-gateway-destination-endpoint` request header and into dynamic metadata
`envoy.lb/x-gateway-destination-endpoint` (same value, `ip:port[,ip:port...]`), with
`clear_route_cache` so the proxy routes on the new header; no ready endpoint gives a 503
immediate response. The subset hint (`envoy.lb.subset_hint` filter metadata) restricts the choice.

When the decision is made depends on where the key is and how Envoy sends the body:

- the key header is present, or no body follows, or the body mode is NONE/STREAMED: decide on the
  request headers;
- BUFFERED (and BUFFERED_PARTIAL): decide on the body message and set the header in its reply;
- FULL_DUPLEX_STREAMED: hold the header reply and the body chunks until the body ends (or passes
  `max_body_bytes`), then send the header reply followed by the held chunks; later chunks are
  passed back as they come.

A body over `max_body_bytes` is not parsed (and not held beyond the limit): p2c decides. The
stream lives from the request's start to the response's end (or a reset), which is what the
endpoint's in-flight count measures.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Collection
from typing import TYPE_CHECKING, Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from cacheroute.router import keys as keymod
from cacheroute.router.endpoints import Endpoint
from cacheroute.router.picker import NONE

if TYPE_CHECKING:
    from cacheroute.router.endpoints import EndpointPool
    from cacheroute.router.metrics import RouterMetrics
    from cacheroute.router.picker import Picker

DESTINATION_HEADER = "x-gateway-destination-endpoint"
METADATA_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"

_Mode = processing_mode_pb2.ProcessingMode
BODY_MODE_BY_NAME = {
    "none": _Mode.NONE,
    "streamed": _Mode.STREAMED,
    "buffered": _Mode.BUFFERED,
    "buffered-partial": _Mode.BUFFERED_PARTIAL,
    "full-duplex": _Mode.FULL_DUPLEX_STREAMED,
}
_BUFFERED_MODES = frozenset((_Mode.BUFFERED, _Mode.BUFFERED_PARTIAL))
_FULL_DUPLEX = _Mode.FULL_DUPLEX_STREAMED

_HEADERS_CONTINUE = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_BODY_CONTINUE = pb.ProcessingResponse(request_body=pb.BodyResponse())
_TRAILERS_CONTINUE = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
_RESPONSE_HEADERS_CONTINUE = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_RESPONSE_BODY_CONTINUE = pb.ProcessingResponse(response_body=pb.BodyResponse())
_RESPONSE_TRAILERS_CONTINUE = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
_NO_ENDPOINT = pb.ProcessingResponse(
    immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=http_status_pb2.ServiceUnavailable),
        body=b"no ready endpoint\n",
        details="cacheroute_no_ready_endpoint",
    )
)


def _route_response(phase: str, value: str) -> pb.ProcessingResponse:
    common = pb.CommonResponse(
        header_mutation=pb.HeaderMutation(
            set_headers=[
                base_pb2.HeaderValueOption(
                    header=base_pb2.HeaderValue(key=DESTINATION_HEADER, raw_value=value.encode()),
                    append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                )
            ]
        ),
        clear_route_cache=True,
    )
    metadata = struct_pb2.Struct()
    metadata.update({METADATA_NAMESPACE: {DESTINATION_HEADER: value}})
    if phase == "headers":
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata)
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)


def _echo(chunk: bytes, end_of_stream: bool, *, response: bool = False) -> pb.ProcessingResponse:
    body = pb.BodyResponse(
        response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(
                streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream)
            )
        )
    )
    return pb.ProcessingResponse(response_body=body) if response else pb.ProcessingResponse(request_body=body)


def _header_text(h: Any) -> str:
    raw: bytes = h.raw_value
    return raw.decode("utf-8", "replace") if raw else str(h.value)


class RouterCore:
    """What every stream shares: the picker, the endpoints, metrics and limits."""

    def __init__(
        self,
        picker: Picker,
        metrics: RouterMetrics,
        *,
        max_body_bytes: int,
        default_body_mode: str = "none",
    ) -> None:
        self.picker = picker
        self.pool: EndpointPool = picker.pool
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.default_body_mode = BODY_MODE_BY_NAME[default_body_mode]
        self._routes: dict[tuple[str, str], pb.ProcessingResponse] = {}

    def route_response(self, phase: str, value: str) -> pb.ProcessingResponse:
        # Replies are identical for every request sent to the same endpoint list; build each once.
        cache_key = (phase, value)
        response = self._routes.get(cache_key)
        if response is None:
            if len(self._routes) > 4096:
                self._routes.clear()
            response = self._routes[cache_key] = _route_response(phase, value)
        return response


class Exchange:
    """The state of one request's ext_proc stream."""

    __slots__ = (
        "allowed",
        "body_bytes",
        "chunks",
        "content_length",
        "core",
        "decided",
        "doc",
        "endpoint",
        "headers",
        "held",
        "key",
        "outcome",
        "overflow",
        "pending_parse",
        "prefix_tokens",
        "request_mode",
        "response_mode",
        "usage_tokens",
    )

    def __init__(self, core: RouterCore) -> None:
        self.core = core
        self.decided = False
        self.endpoint: Endpoint | None = None
        self.key: keymod.Key | None = None
        self.outcome = ""
        self.headers: dict[str, str] = {}
        self.allowed: Collection[str] | None = None
        self.request_mode = core.default_body_mode
        self.response_mode = core.default_body_mode
        # Body bytes kept for parsing (at most max_body_bytes) and, in full-duplex mode, the
        # chunks held back until the decision.
        self.chunks: list[bytes] = []
        self.held: list[bytes] = []
        self.body_bytes = 0
        self.content_length = 0
        self.overflow = False
        self.doc: dict[str, Any] | None = None
        self.pending_parse = False
        self.prefix_tokens = 0
        self.usage_tokens: int | None = None

    # --- messages ---------------------------------------------------------------------------------

    def handle(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            return self._on_request_headers(req)
        if kind == "request_body":
            return self._on_request_body(req.request_body)
        if kind == "request_trailers":
            return self._on_request_trailers()
        if kind == "response_headers":
            return [_RESPONSE_HEADERS_CONTINUE]
        if kind == "response_body":
            return self._on_response_body(req.response_body)
        if kind == "response_trailers":
            return [_RESPONSE_TRAILERS_CONTINUE]
        return []

    def _on_request_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        started = time.perf_counter()
        if req.HasField("protocol_config"):
            self.request_mode = req.protocol_config.request_body_mode
            self.response_mode = req.protocol_config.response_body_mode
        if req.HasField("metadata_context"):
            self.allowed = _subset_hint(req.metadata_context)
        picker = self.core.picker
        extraction = picker.key_extraction
        wanted = picker.wanted_headers
        headers = self.headers
        message = req.request_headers
        for h in message.headers.headers:
            name = h.key
            if name in wanted:
                headers[name] = _header_text(h)
        length = headers.get("content-length", "")
        self.content_length = int(length) if length.isdigit() else 0
        body_follows = not message.end_of_stream
        self.key = keymod.key_from_headers(headers, extraction)
        if (
            self.key is not None
            or not body_follows
            or not keymod.wants_body(extraction)
            or (self.request_mode not in _BUFFERED_MODES and self.request_mode != _FULL_DUPLEX)
        ):
            if self.key is None:
                self.key = keymod.session_key(headers, extraction)
            return [self._decide("headers", started)]
        if self.request_mode == _FULL_DUPLEX:
            return []
        return [_HEADERS_CONTINUE]

    def _keep(self, chunk: bytes) -> None:
        """Keep body bytes for parsing, up to the limit; past it the body is dropped, not held."""
        self.body_bytes += len(chunk)
        if self.overflow:
            return
        if self.body_bytes > self.core.max_body_bytes:
            self.overflow = True
            self.chunks = []
        else:
            self.chunks.append(chunk)

    def _on_request_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        chunk = body.body
        eos = body.end_of_stream
        self._keep(chunk)
        if self.decided:
            # Measured after the reply is sent, for the prefix-token estimate only.
            self.pending_parse = eos and not self.overflow
            if self.request_mode == _FULL_DUPLEX:
                return [_echo(chunk, eos)]
            return [_BODY_CONTINUE]
        if self.request_mode == _FULL_DUPLEX:
            # Held until the decision (bounded: the limit forces the decision).
            self.held.append(chunk)
            if not eos and not self.overflow:
                return []
            return self._release_held(self._decide_from_body("headers"), eos)
        # BUFFERED: the whole body (or, for BUFFERED_PARTIAL, its first part) in one message.
        if not eos:
            self.overflow = True
            self.chunks = []
        return [self._decide_from_body("body")]

    def _release_held(self, reply: pb.ProcessingResponse, eos: bool) -> list[pb.ProcessingResponse]:
        held = self.held
        self.held = []
        if reply is _NO_ENDPOINT:
            return [reply]
        last = len(held) - 1
        return [reply, *(_echo(c, eos and i == last) for i, c in enumerate(held))]

    def _on_request_trailers(self) -> list[pb.ProcessingResponse]:
        if self.decided:
            return [_TRAILERS_CONTINUE]
        replies = self._release_held(self._decide_from_body("headers"), False)
        if replies[0] is not _NO_ENDPOINT:
            replies.append(_TRAILERS_CONTINUE)
        return replies

    def _on_response_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        tokens = keymod.usage_prompt_tokens(body.body)
        if tokens is not None:
            self.usage_tokens = tokens
        if self.response_mode == _FULL_DUPLEX:
            return [_echo(body.body, body.end_of_stream, response=True)]
        return [_RESPONSE_BODY_CONTINUE]

    # --- deciding ---------------------------------------------------------------------------------

    def _decide_from_body(self, phase: str) -> pb.ProcessingResponse:
        started = time.perf_counter()
        metrics = self.core.metrics
        if self.overflow:
            metrics.body_fallbacks["too_large"] += 1
        elif self.chunks:
            raw = b"".join(self.chunks)
            self.doc = keymod.parse_body(raw)
            if self.doc is None:
                metrics.body_fallbacks["malformed"] += 1
            else:
                self.prefix_tokens = keymod.estimate_prefix_tokens(raw)
        self.chunks = []
        self.key = keymod.request_key(self.headers, self.doc, self.core.picker.key_extraction)
        return self._decide(phase, started)

    def _decide(self, phase: str, started: float) -> pb.ProcessingResponse:
        """Pick, count and reply; `started` is when work on the deciding message began."""
        core = self.core
        decision = core.picker.pick(self.key.hash if self.key is not None else None, self.allowed)
        self.decided = True
        self.outcome = decision.outcome
        metrics = core.metrics
        metrics.decisions[decision.outcome] += 1
        if decision.outcome == NONE:
            metrics.decision_seconds.observe(time.perf_counter() - started)
            return _NO_ENDPOINT
        endpoints = decision.endpoints
        primary = endpoints[0]
        core.pool.acquire(primary)
        self.endpoint = primary
        value = primary.address if len(endpoints) == 1 else ",".join(e.address for e in endpoints)
        response = core.route_response(phase, value)
        metrics.decision_seconds.observe(time.perf_counter() - started)
        return response

    # --- after the replies ------------------------------------------------------------------------

    def after_reply(self) -> None:
        """Work that must not delay the reply: measure a fully seen body for the token estimates."""
        if self.pending_parse:
            self.pending_parse = False
            self.prefix_tokens = keymod.estimate_prefix_tokens(b"".join(self.chunks))
            self.chunks = []

    def finish(self) -> None:
        """The stream ended (response complete or reset): release the endpoint, count the request."""
        if self.endpoint is not None:
            self.core.pool.release(self.endpoint)
            self.endpoint = None
        if not self.decided or self.outcome == NONE:
            return
        metrics = self.core.metrics
        if self.usage_tokens is not None:
            prompt_tokens = self.usage_tokens
            metrics.token_sources["usage"] += 1
        else:
            prompt_tokens = keymod.estimate_prompt_tokens(self.body_bytes or self.content_length)
            metrics.token_sources["estimate"] += 1
        key = self.key
        metrics.record_request(
            key.hash if key is not None else None,
            key.name if key is not None else None,
            prompt_tokens,
            self.prefix_tokens,
        )


def _subset_hint(metadata: base_pb2.Metadata) -> Collection[str] | None:
    if SUBSET_NAMESPACE not in metadata.filter_metadata:
        return None
    field = metadata.filter_metadata[SUBSET_NAMESPACE].fields.get(SUBSET_KEY)
    if field is None:
        return None
    if field.HasField("list_value"):
        return frozenset(v.string_value for v in field.list_value.values)
    if field.HasField("string_value"):
        return frozenset(s.strip() for s in field.string_value.split(",") if s.strip())
    return frozenset()


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, core: RouterCore) -> None:
        self.core = core

    async def Process(  # noqa: N802 - the gRPC method name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = Exchange(self.core)
        try:
            async for request in request_iterator:
                for response in exchange.handle(request):
                    yield response
                exchange.after_reply()
        finally:
            exchange.finish()
