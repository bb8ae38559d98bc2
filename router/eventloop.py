"""The asyncio event loop the router runs on.

Per ext_proc stream, grpc.aio spends most of the router's CPU in event-loop callbacks (one per
completed gRPC operation, several per stream). uvloop runs them for less: on the 2-vCPU
development VM the router used about 15 % less CPU per stream on it than on the standard loop
(docs/router.md, "Performance"). `auto` takes uvloop when it is installed and the standard loop
otherwise; uvloop is optional, so the router runs anywhere asyncio does.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Coroutine
from typing import Any

EVENT_LOOPS = ("auto", "asyncio", "uvloop")


class EventLoopError(RuntimeError):
    """The requested event loop cannot be used here."""


def uvloop_available() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def resolve(choice: str) -> str:
    """The loop `choice` stands for here: `asyncio` or `uvloop`."""
    if choice not in EVENT_LOOPS:
        raise EventLoopError(f"event loop {choice!r} is not one of {', '.join(EVENT_LOOPS)}")
    if choice == "auto":
        return "uvloop" if uvloop_available() else "asyncio"
    if choice == "uvloop" and not uvloop_available():
        raise EventLoopError("event loop 'uvloop' asked for, but uvloop is not installed (pip install uvloop)")
    return choice


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if resolve(choice) == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def run(main: Coroutine[Any, Any, None], choice: str) -> None:
    """Run `main` to completion on a new loop of the kind `choice` resolves to."""
    try:
        factory = loop_factory(choice)
    except EventLoopError:
        main.close()
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main)
