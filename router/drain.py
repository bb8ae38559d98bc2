"""`cacheroute router drain`: the router pod's preStop hook, so that stopping a router cuts no request.

Kubernetes runs it in both containers of a router pod being deleted, before their SIGTERM:

1. wait `settle` seconds: the pod has left its EndpointSlices, and clients (a Service, a gateway,
   a client that lists the endpoints) stop choosing it; what still arrives is served;
2. ask Envoy, through its admin socket (an emptyDir both containers mount), to drain its
   listeners: every connection is told to close after its request in flight (HTTP/1.1
   `Connection: close`, HTTP/2 GOAWAY);
3. wait until Envoy has no request in flight (its client listener's `downstream_rq_active`), or
   until `timeout`, whichever comes first.

The picker's hook waits the same way, so the picker answers Envoy until the last request is
through. A hook that cannot reach Envoy (it is not running) returns at once: nothing to drain.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import httpx
import typer

from cacheroute.router.envoyadmin import EnvoyAdmin

POLL_S = 0.2


@dataclass(frozen=True)
class DrainOutcome:
    drained: bool  # no request left in flight (or no Envoy to drain)
    waited_s: float
    in_flight: int  # at the last look


def drain(
    admin: EnvoyAdmin,
    *,
    settle_s: float,
    timeout_s: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    wait_only: bool = False,
) -> DrainOutcome:
    """Settle, drain Envoy's listeners (unless `wait_only`: the picker's hook leaves that to
    Envoy's), and wait for its requests in flight (module docstring)."""
    started = clock()
    sleep(min(settle_s, timeout_s))
    try:
        if not wait_only:
            # Refused (already draining, say): the wait below is what matters.
            with contextlib.suppress(httpx.HTTPStatusError):
                admin.drain_listeners()
        left = admin.in_flight()
        while left > 0 and clock() - started < timeout_s:
            sleep(POLL_S)
            left = admin.in_flight()
    except httpx.HTTPError:
        # Envoy is gone (or never started): nothing is in flight through it.
        return DrainOutcome(True, clock() - started, 0)
    return DrainOutcome(left == 0, clock() - started, left)


def drain_command(
    admin_socket: Annotated[
        Path, typer.Option(dir_okay=False, help="Envoy's admin socket (router envoy --admin-socket).")
    ],
    settle: Annotated[
        float, typer.Option(min=0.0, max=600.0, help="Seconds for clients to stop choosing this pod first.")
    ] = 5.0,
    timeout: Annotated[
        float, typer.Option(min=0.0, max=3600.0, help="Most seconds to wait in all (below the pod's grace period).")
    ] = 25.0,
    wait_only: Annotated[
        bool, typer.Option("--wait-only", help="Only wait for Envoy's requests in flight (the picker's hook).")
    ] = False,
) -> None:
    """Drain this router pod's Envoy and wait for its requests in flight (a preStop hook)."""
    if not admin_socket.exists():
        typer.echo(f"no Envoy admin socket at {admin_socket}: nothing to drain")
        return
    admin = EnvoyAdmin(admin_socket)
    try:
        outcome = drain(admin, settle_s=settle, timeout_s=timeout, wait_only=wait_only)
    finally:
        admin.close()
    if outcome.drained:
        typer.echo(f"drained in {outcome.waited_s:.1f} s")
    else:
        typer.echo(f"{outcome.in_flight} request(s) still in flight after {outcome.waited_s:.1f} s")


def register(app: typer.Typer) -> None:
    app.command("drain")(drain_command)
