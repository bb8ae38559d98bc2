"""The ext_proc gRPC service: one `Process` stream per HTTP request, handled by an `Exchange`.

This module stays interpreted when the request path is compiled (`native.py`): CPython runs a
coroutine that awaits gRPC's reads and writes in fewer instructions than mypyc's generator object
does (485,335 against 491,791 per stream under callgrind, docs/router.md).
"""

from __future__ import annotations

from typing import Any

import grpc
from grpc.aio import EOF

from cacheroute.router import wire
from cacheroute.router.extproc import RESPONSE_HEADERS_CONTINUE, SERVICE, Exchange, RouterCore, parse_message


class ExternalProcessor:
    """The `Process` method of the ext_proc service: one stream per HTTP request."""

    def __init__(self, core: RouterCore) -> None:
        self.core = core

    async def process(self, request_iterator: object, context: Any) -> None:
        # The reader/writer API: one await per message, without the two async generators the
        # iterator API puts between gRPC and the handler.
        exchange = Exchange(self.core)
        read = context.read
        write = context.write
        try:
            while (data := await read()) is not EOF:
                if data and data[0] == wire.RESPONSE_HEADERS:
                    # The reply to response headers depends on nothing (`Exchange.receive`).
                    await write(RESPONSE_HEADERS_CONTINUE)
                    continue
                try:
                    replies = exchange.receive(data)
                except Exception:
                    # Undecodable bytes raise again here and end the stream with an error status.
                    replies = exchange.recover(parse_message(data))
                for reply in replies:
                    await write(reply)
                if exchange.pending_parse:
                    exchange.after_reply()
        finally:
            exchange.finish()

    def add_to(self, server: grpc.aio.Server) -> None:
        # No serializers: requests are read from their bytes (`Exchange.receive`), replies are
        # serialized already.
        handlers = {"Process": grpc.stream_stream_rpc_method_handler(self.process)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        server.add_registered_method_handlers(SERVICE, handlers)
