"""The Envoy ext_proc service: one `Process` stream per HTTP request.

Endpoint-picker protocol (Gateway API Inference Extension): the chosen endpoint(s) go into the
`x-gateway-destination-endpoint` request header and into dynamic metadata
`envoy.lb/x-gateway-destination-endpoint` (same value, `ip:port[,ip:port...]`), with
`clear_route_cache` so the proxy routes on the new header; no ready endpoint gives a 503
immediate response. The subset hint (`envoy.lb.subset_hint` filter metadata) restricts the choice.

When the decision is made depends on where the key is and how Envoy sends the body:

- the key header is present (and prefixes are not followed), or no body follows, or the body
  mode is NONE/STREAMED: decide on the request headers;
- BUFFERED (and BUFFERED_PARTIAL): decide on the body message and set the header in its reply;
- FULL_DUPLEX_STREAMED: hold the header reply and the body chunks until the body ends (or passes
  `max_body_bytes`), then send the header reply followed by the held chunks; later chunks are
  passed back as they come.

A body over `max_body_bytes` is not parsed (and not held beyond the limit): p2c decides. When the
picker follows prefixes, a parsed body also gives the prompt's prefix chain (`prompts.py`). The
stream lives from the request's start to the response's end (or a reset), which is what the
endpoint's in-flight count measures: a stream holds at most one endpoint at a time and gives it
back exactly once when it ends, whatever order its messages come in (a second `request_headers`
is answered without a new decision) and however it ends.

Whatever a message holds, the stream gets an answer: a message whose handling raises (a bug, or
input nothing anticipated) is answered with the p2c fallback if no decision was made yet, else
passed through, counted in `cacheroute_router_stream_errors_total`, and logged with its traceback
at most once a minute.

Replies are serialized once and kept (constants at import, routing replies per endpoint list),
and go out through a method handler without a response serializer: per stream, gRPC costs the
process several hundred microseconds of CPU and the routing itself a few tens, so nothing on
the request path builds or serializes a protobuf message twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, Final

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from cacheroute.planner.tokenload import TokenEstimator
from cacheroute.router import keys as keymod
from cacheroute.router import wire
from cacheroute.router.endpoints import Endpoint
from cacheroute.router.picker import NONE
from cacheroute.router.prompts import prefix_chain, prompt_text

if TYPE_CHECKING:
    from cacheroute.router.endpoints import EndpointPool
    from cacheroute.router.metrics import RouterMetrics
    from cacheroute.router.picker import Picker

log = logging.getLogger(__name__)

SERVICE: Final = "envoy.service.ext_proc.v3.ExternalProcessor"
DESTINATION_HEADER: Final = "x-gateway-destination-endpoint"
METADATA_NAMESPACE: Final = "envoy.lb"
SUBSET_NAMESPACE: Final = "envoy.lb.subset_hint"
SUBSET_KEY: Final = "x-gateway-destination-endpoint-subset"

_Mode = processing_mode_pb2.ProcessingMode
BODY_MODE_BY_NAME = {
    "none": _Mode.NONE,
    "streamed": _Mode.STREAMED,
    "buffered": _Mode.BUFFERED,
    "buffered-partial": _Mode.BUFFERED_PARTIAL,
    "full-duplex": _Mode.FULL_DUPLEX_STREAMED,
}
_BUFFERED_MODES: Final = frozenset((_Mode.BUFFERED, _Mode.BUFFERED_PARTIAL))
_FULL_DUPLEX: Final = _Mode.FULL_DUPLEX_STREAMED
# A content-length past this is not believed (no prompt is a gigabyte): the size counts as unknown.
MAX_CONTENT_LENGTH: Final = 1 << 30
_MAX_CONTENT_LENGTH_DIGITS: Final = len(str(MAX_CONTENT_LENGTH))
# The decision clock, held here rather than looked up on the module for every request.
_clock: Final = time.perf_counter
# Seconds between two logged tracebacks of failed messages (the rest are counted only).
ERROR_LOG_INTERVAL: Final = 60.0

# A serialized ProcessingResponse.
Reply = bytes

parse_message: Final = pb.ProcessingRequest.FromString

_HEADERS_CONTINUE: Final[Reply] = pb.ProcessingResponse(request_headers=pb.HeadersResponse()).SerializeToString()
_BODY_CONTINUE: Final[Reply] = pb.ProcessingResponse(request_body=pb.BodyResponse()).SerializeToString()
_TRAILERS_CONTINUE: Final[Reply] = pb.ProcessingResponse(request_trailers=pb.TrailersResponse()).SerializeToString()
RESPONSE_HEADERS_CONTINUE: Final[Reply] = pb.ProcessingResponse(
    response_headers=pb.HeadersResponse()
).SerializeToString()
_RESPONSE_BODY_CONTINUE: Final[Reply] = pb.ProcessingResponse(response_body=pb.BodyResponse()).SerializeToString()
_RESPONSE_TRAILERS_CONTINUE: Final[Reply] = pb.ProcessingResponse(
    response_trailers=pb.TrailersResponse()
).SerializeToString()
_NO_ENDPOINT: Final[Reply] = pb.ProcessingResponse(
    immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=http_status_pb2.ServiceUnavailable),
        body=b"no ready endpoint\n",
        details="cacheroute_no_ready_endpoint",
    )
).SerializeToString()


def _route_response(phase: str, value: str) -> Reply:
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
        reply = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata)
    else:
        reply = pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)
    data: Reply = reply.SerializeToString()
    return data


def _echo(chunk: bytes, end_of_stream: bool, *, response: bool = False) -> Reply:
    body = pb.BodyResponse(
        response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(
                streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream)
            )
        )
    )
    reply = pb.ProcessingResponse(response_body=body) if response else pb.ProcessingResponse(request_body=body)
    data: Reply = reply.SerializeToString()
    return data


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
        # Prompt tokens from body bytes, the ratio learned from responses' usage (token-aware load).
        self.estimator = TokenEstimator()
        # Routing replies by (phase, endpoint list): built once each (`route_response`).
        self.replies: dict[tuple[str, str], Reply] = {}
        self._error_logged_at = -ERROR_LOG_INTERVAL
        self._errors_unlogged = 0
        self.header_keys = keymod.HeaderKeys()

    def report_error(self, kind: str | None) -> None:
        """Count a message whose handling raised; log its traceback at most once a minute."""
        self.metrics.stream_errors["handled"] += 1
        now = time.monotonic()
        if now - self._error_logged_at < ERROR_LOG_INTERVAL:
            self._errors_unlogged += 1
            return
        more = f" ({self._errors_unlogged} more since the last report)" if self._errors_unlogged else ""
        self._error_logged_at = now
        self._errors_unlogged = 0
        log.exception("handling an ext_proc %s message failed; answered with the fallback%s", kind, more)

    def route_response(self, phase: str, value: str) -> Reply:
        # Replies are identical for every request sent to the same endpoint list; build each once.
        cache_key = (phase, value)
        response = self.replies.get(cache_key)
        if response is None:
            if len(self.replies) > 4096:
                self.replies.clear()
            response = self.replies[cache_key] = _route_response(phase, value)
        return response


class Exchange:
    """The state of one request's ext_proc stream."""

    __slots__ = (
        "allowed",
        "body_bytes",
        "chain",
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
        "ticket",
        "usage_tokens",
    )

    def __init__(self, core: RouterCore) -> None:
        self.core = core
        self.decided = False
        self.endpoint: Endpoint | None = None
        # What `endpoint`'s pool gave for this request: handed back when it ends (token-aware load).
        self.ticket = 0
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
        # The prompt's prefix ids, when the picker follows prefixes and the body was parsed.
        self.chain: Sequence[int] = ()
        self.pending_parse = False
        self.prefix_tokens = 0
        self.usage_tokens: int | None = None

    # --- messages ---------------------------------------------------------------------------------

    def handle(self, req: pb.ProcessingRequest) -> list[Reply]:
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            return self._on_request_headers(req)
        if kind == "response_headers":
            return [RESPONSE_HEADERS_CONTINUE]
        if kind == "request_body":
            return self._on_request_body(req.request_body)
        if kind == "request_trailers":
            return self._on_request_trailers()
        if kind == "response_body":
            return self._on_response_body(req.response_body)
        if kind == "response_trailers":
            return [_RESPONSE_TRAILERS_CONTINUE]
        return []

    def receive(self, data: bytes) -> list[Reply]:
        """Handle one message as it came off the wire. The reply to response headers does not
        depend on them, so they are not decoded; request headers are read from their bytes
        where they can be (`wire.py`); every other message is decoded and handled by `handle`."""
        # `wire.message_kind`, called only when a protocol configuration comes first.
        kind = data[0] if data else 0
        at = 0
        if kind == wire.PROTOCOL_CONFIG:
            kind, at = wire.message_kind(data)
        if kind == wire.RESPONSE_HEADERS:
            return [RESPONSE_HEADERS_CONTINUE]
        if kind == wire.REQUEST_HEADERS and not self.decided:
            started = _clock()
            patterns = self.core.picker.header_patterns
            found = wire.read_request_headers(data, at, patterns) if patterns is not None else None
            if found is not None:
                end_of_stream, modes, values = found
                if modes is not None:
                    self.request_mode, self.response_mode = modes
                headers = self.headers
                for name, raw in values.items():
                    headers[name] = raw.decode("utf-8", "replace")
                return self._headers_seen(started, not end_of_stream)
        return self.handle(parse_message(data))

    def _on_request_headers(self, req: pb.ProcessingRequest) -> list[Reply]:
        if self.decided:
            # A second request_headers (or headers after the body): one request, one decision.
            return [_HEADERS_CONTINUE]
        started = _clock()
        if req.HasField("protocol_config"):
            self.request_mode = req.protocol_config.request_body_mode
            self.response_mode = req.protocol_config.response_body_mode
        if req.HasField("metadata_context"):
            self.allowed = _subset_hint(req.metadata_context)
        wanted = self.core.picker.wanted_headers
        headers = self.headers
        message = req.request_headers
        for h in message.headers.headers:
            name = h.key
            if name in wanted:
                raw: bytes = h.raw_value
                headers[name] = raw.decode("utf-8", "replace") if raw else h.value
        return self._headers_seen(started, not message.end_of_stream)

    def _headers_seen(self, started: float, body_follows: bool) -> list[Reply]:
        """Decide on the request headers now, or wait for the body (module docstring)."""
        picker = self.core.picker
        extraction = picker.key_extraction
        headers = self.headers
        length = headers.get("content-length", "")
        if length.isdigit() and len(length) <= _MAX_CONTENT_LENGTH_DIGITS and length.isascii():
            size = int(length)
            self.content_length = size if size <= MAX_CONTENT_LENGTH else 0
        # `key_from_headers`, with the key's hash remembered (`HeaderKeys`).
        name = extraction.header
        value = headers.get(name) if name else None
        key = None
        if value:
            header_keys = self.core.header_keys
            key = header_keys.get(value) or header_keys.add(value)
        self.key = key
        follows = picker.follows_prefixes
        if (
            (self.key is not None and not follows)
            or not body_follows
            or not (follows or keymod.wants_body(extraction))
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

    def _on_request_body(self, body: pb.HttpBody) -> list[Reply]:
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

    def _release_held(self, reply: Reply, eos: bool) -> list[Reply]:
        held = self.held
        self.held = []
        if reply is _NO_ENDPOINT:
            return [reply]
        last = len(held) - 1
        return [reply, *(_echo(c, eos and i == last) for i, c in enumerate(held))]

    def _on_request_trailers(self) -> list[Reply]:
        if self.decided:
            return [_TRAILERS_CONTINUE]
        replies = self._release_held(self._decide_from_body("headers"), False)
        if replies[0] is not _NO_ENDPOINT:
            replies.append(_TRAILERS_CONTINUE)
        return replies

    def _on_response_body(self, body: pb.HttpBody) -> list[Reply]:
        tokens = keymod.usage_prompt_tokens(body.body)
        if tokens is not None:
            self.usage_tokens = tokens
        if self.response_mode == _FULL_DUPLEX:
            return [_echo(body.body, body.end_of_stream, response=True)]
        return [_RESPONSE_BODY_CONTINUE]

    # --- deciding ---------------------------------------------------------------------------------

    def _decide_from_body(self, phase: str) -> Reply:
        started = _clock()
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
                if self.core.picker.follows_prefixes:
                    self.chain = prefix_chain(prompt_text(self.doc))
        self.chunks = []
        self.key = keymod.request_key(self.headers, self.doc, self.core.picker.key_extraction)
        return self._decide(phase, started)

    def _decide(self, phase: str, started: float) -> Reply:
        """Pick, count and reply; `started` is when work on the deciding message began."""
        core = self.core
        # What the body says the prompt weighs: its bytes so far, or the declared content-length
        # when the decision comes from the headers alone.
        tokens = int((self.body_bytes or self.content_length) * core.estimator.ratio + 0.5)  # `estimate`, inline
        key = self.key
        decision = core.picker.pick(key.hash if key is not None else None, self.allowed, tokens, self.chain)
        if self.endpoint is not None:
            # Only a fallback after a failed message decides twice; the first endpoint goes back.
            core.pool.release(self.endpoint, self.ticket)
            self.endpoint = None
        self.outcome = decision.outcome
        metrics = core.metrics
        metrics.decisions[decision.outcome] += 1
        if decision.outcome == NONE:
            metrics.decision_seconds.observe(_clock() - started)
            self.decided = True
            return _NO_ENDPOINT
        endpoints = decision.endpoints
        primary = endpoints[0]
        self.ticket = core.pool.acquire(primary, decision.charge)
        self.endpoint = primary
        value = primary.address if len(endpoints) == 1 else ",".join(e.address for e in endpoints)
        response = core.replies.get((phase, value)) or core.route_response(phase, value)
        metrics.decision_seconds.observe(_clock() - started)
        # Decided once the reply exists: a failure before this point is answered by `recover` with
        # the fallback decision (this endpoint goes back), not passed through without a destination.
        self.decided = True
        return response

    def recover(self, req: pb.ProcessingRequest) -> list[Reply]:
        """The answer to a message whose handling raised: p2c if undecided, else pass it through."""
        kind = req.WhichOneof("request")
        self.core.report_error(kind)
        self.chunks = []
        self.pending_parse = False
        if kind in ("request_headers", "request_body", "request_trailers") and not self.decided:
            self.key = None
            self.chain = ()
            buffered_body = kind == "request_body" and self.request_mode != _FULL_DUPLEX
            reply = self._decide("body" if buffered_body else "headers", _clock())
            if self.request_mode == _FULL_DUPLEX and kind != "request_headers":
                eos = kind == "request_body" and req.request_body.end_of_stream
                replies = self._release_held(reply, eos)
                if kind == "request_trailers" and replies[0] is not _NO_ENDPOINT:
                    replies.append(_TRAILERS_CONTINUE)
                return replies
            return [reply]
        if kind == "request_body" and self.request_mode == _FULL_DUPLEX:
            return [_echo(req.request_body.body, req.request_body.end_of_stream)]
        if kind == "response_body" and self.response_mode == _FULL_DUPLEX:
            return [_echo(req.response_body.body, req.response_body.end_of_stream, response=True)]
        return [_PASS_THROUGH.get(kind or "", _HEADERS_CONTINUE)]

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
            self.core.pool.release(self.endpoint, self.ticket)
            self.endpoint = None
        if not self.decided or self.outcome == NONE:
            return
        if self.usage_tokens is not None:
            self.core.estimator.learn(self.body_bytes or self.content_length, self.usage_tokens)
        try:
            metrics = self.core.metrics
            if self.usage_tokens is not None:
                prompt_tokens = self.usage_tokens
                metrics.token_sources["usage"] += 1
            else:
                prompt_tokens = keymod.estimate_prompt_tokens(self.body_bytes or self.content_length)
                metrics.token_sources["estimate"] += 1
            key = self.key
            metrics.record_request(key, prompt_tokens, self.prefix_tokens)
        except Exception:
            self.core.report_error("stream end")


_PASS_THROUGH: Final = {
    "request_headers": _HEADERS_CONTINUE,
    "request_body": _BODY_CONTINUE,
    "request_trailers": _TRAILERS_CONTINUE,
    "response_headers": RESPONSE_HEADERS_CONTINUE,
    "response_body": _RESPONSE_BODY_CONTINUE,
    "response_trailers": _RESPONSE_TRAILERS_CONTINUE,
}


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
