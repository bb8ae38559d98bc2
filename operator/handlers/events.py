"""Events of the handlers, posted through the API at once rather than queued with `kopf.event`.

A pass records in its object's status what it has told (a pool's conditions and memory plan, an
AffinityPlan's period), and the next pass, of this replica or of the one that takes over, compares
with that status. An Event still in kopf's queue when the operator dies, or when the status write
after it fails, would never be told: posted from the pass before its status, it is told once, or
again after such a failure, never lost.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from cacheroute.operator.control.kube import ControlApi

EventKind = Literal["Normal", "Warning"]
# What the API server's Event message holds comfortably; the object's conditions hold the whole text.
MESSAGE_LIMIT = 1024


def poster(api: ControlApi, body: Mapping[str, Any]) -> Callable[[EventKind, str, str], None]:
    """A function that posts an Event about `body` (a pool or plan) and returns once the API
    server holds it (a refusal is logged, not raised). Blocking: call it from a worker thread."""
    meta = body.get("metadata") or {}
    # A plain copy: the handler's body view is not read from the worker threads.
    involved = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                "metadata": {key: meta.get(key) for key in ("name", "namespace", "uid")}}

    def post(kind: EventKind, reason: str, message: str) -> None:
        api.post_event(involved, kind, reason, message[:MESSAGE_LIMIT])

    return post
