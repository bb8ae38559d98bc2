"""What the router reads of an ext_proc message straight from its wire bytes.

Envoy sends each request's stream a `request_headers` message, and with the gateway's processing
mode a `response_headers` one. Walking the decoded header list in Python costs more than the
routing decision (docs/router.md, "The gap to the constant servicer"), so the router looks for the
few headers it wants in the serialized bytes instead:

- `message_kind` names a message by the tag byte of its `request` oneof (fields 2-7), found as
  its first field or right after a protocol configuration: encoders write fields in field-number
  order (Envoy's C++ encoder, which puts the oneof first) or the oneof last (Go's, which puts the
  protocol configuration first). Anything else is told apart by the full decoder only.
- `read_request_headers` returns the raw values of the wanted headers of a request_headers
  message, its end-of-stream flag and the protocol configuration's body modes, or None when it
  cannot be sure of them, and the caller decodes the message as before: anything after the
  header map but the encodings of those two fields that encoders produce (a metadata context,
  whose subset hint needs the full message, attributes, a mode this table does not hold), a
  header map it cannot delimit, a wanted header carried as `value` or with an empty value, a
  length it does not expect.

A wanted header is found by its key field, the bytes `0x0a <name length> <name>` followed by the
`raw_value` tag, searched within the message's header map only. No other bytes of a header map
can match: header names are tokens and values cannot hold a line feed (0x0a; RFC 9110 section
5.5, and Envoy's codecs reject one), and each match is checked against the length of the entry
that holds it. The last occurrence wins, as when the decoded list is walked.
"""

from __future__ import annotations

from collections.abc import Collection
from itertools import product
from typing import Final

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

# ProcessingRequest fields (envoy/service/ext_proc/v3/external_processor.proto) as tag bytes:
# field number << 3 | wire type 2 (length-delimited).
REQUEST_HEADERS: Final = 2 << 3 | 2
RESPONSE_HEADERS: Final = 3 << 3 | 2
# HttpHeaders.headers, HeaderMap.headers and HeaderValue.key are all field 1; raw_value is 3.
_FIELD_1: Final = 1 << 3 | 2
_RAW_VALUE: Final = 3 << 3 | 2
PROTOCOL_CONFIG: Final = 11 << 3 | 2

# Per wanted header name: its key field and that field's length.
Patterns = tuple[tuple[str, bytes, int], ...]


def _protocol_tails() -> dict[bytes, tuple[int, int] | None]:
    """What may follow the request_headers field: nothing, or a protocol configuration, as
    encoders write them; the (request, response) body modes each says."""
    modes = processing_mode_pb2.ProcessingMode.BodySendMode.values()
    tails: dict[bytes, tuple[int, int] | None] = {b"": None}
    for request, response, flag in product(modes, modes, (False, True)):
        config = pb.ProtocolConfiguration(request_body_mode=request, response_body_mode=response,
                                          send_body_without_waiting_for_header_response=flag)
        tails[pb.ProcessingRequest(protocol_config=config).SerializeToString()] = (request, response)
    return tails


_TAILS: Final = _protocol_tails()
_UNKNOWN: Final = (-1, -1)  # a tail the table does not hold
# What may follow the header map inside HttpHeaders: the end_of_stream flag, or nothing.
_END_OF_STREAM: Final = {b"": False, pb.HttpHeaders(end_of_stream=True).SerializeToString(): True}


# What `read_request_headers` finds: the end-of-stream flag, the (request, response) body modes
# when the message carries a protocol configuration, and the raw value of each wanted header
# present. A plain tuple: a named one costs a Python-level call to build, once per request.
WireHeaders = tuple[bool, tuple[int, int] | None, dict[str, bytes]]


def header_patterns(names: Collection[str]) -> Patterns | None:
    """What `read_request_headers` searches for; None when a name cannot be searched this way (empty,
    128 bytes or longer, or holding anything but printable ASCII)."""
    out = []
    for name in sorted(names):
        if not (name and len(name) < 128 and name.isascii() and name.isprintable()):
            return None
        key_field = bytes((_FIELD_1, len(name))) + name.encode("ascii")
        out.append((name, key_field, len(key_field)))
    return tuple(out)


def message_kind(data: bytes) -> tuple[int, int]:
    """(the tag byte of the `request` oneof, where that field starts) when it is the first field
    or follows a short protocol configuration; (0, 0) otherwise."""
    if not data:
        return 0, 0
    kind = data[0]
    if kind != PROTOCOL_CONFIG:
        return kind, 0
    if len(data) < 3 or data[1] >= 0x80:
        return 0, 0
    at = data[1] + 2
    return (data[at], at) if at < len(data) else (0, 0)


def read_request_headers(data: bytes, at: int, patterns: Patterns) -> WireHeaders | None:
    """What the router decides on in a serialized request_headers message whose request_headers
    field starts at `at` (`message_kind`; module docstring); None when the message must be
    decoded instead."""
    # One function with the varints read inline: this runs once per request. Lengths of one or
    # two varint bytes (under 16 kB) are read here; anything longer goes to the decoder.
    try:
        if data[at] != REQUEST_HEADERS:
            return None
        b = data[at + 1]
        if b < 0x80:
            size, i = b, at + 2
        elif data[at + 2] < 0x80:
            size, i = (b & 0x7F) | data[at + 2] << 7, at + 3
        else:
            return None
        headers_end = i + size
        if headers_end > len(data):
            return None
        if at:
            # The protocol configuration came first; nothing may follow the headers.
            modes = _TAILS.get(data[:at], _UNKNOWN) if headers_end == len(data) else _UNKNOWN
        else:
            modes = _TAILS.get(data[headers_end:], _UNKNOWN)
        if modes == _UNKNOWN:
            return None
        if size == 0 or data[i] != _FIELD_1:
            start = end = i  # no header map: no headers
        else:
            b = data[i + 1]
            if b < 0x80:
                size, start = b, i + 2
            elif data[i + 2] < 0x80:
                size, start = (b & 0x7F) | data[i + 2] << 7, i + 3
            else:
                return None
            end = start + size
            if end > headers_end:
                return None
        eos = _END_OF_STREAM.get(data[end:headers_end])
        if eos is None:
            return None
        values: dict[str, bytes] = {}
        for name, key_field, key_length in patterns:
            key = data.rfind(key_field, start, end)
            if key < 0:
                continue
            tag = key + key_length
            size = data[tag + 1]
            value = tag + 2
            # The last occurrence must be a raw value of under 128 bytes, and the entry holding
            # it exactly this key and value (a one-byte length just before the key field).
            if (data[tag] != _RAW_VALUE or size >= 0x80 or value + size > end or key - 2 < start
                    or data[key - 2] != _FIELD_1 or data[key - 1] != value + size - key):
                return None
            values[name] = data[value : value + size]
        return eos, modes, values
    except IndexError:
        return None
