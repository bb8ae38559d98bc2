"""What the operator process was started with, for the kopf handler modules to read.

The runtime sets it before it imports the handler modules: kopf registers handlers (and their
intervals) at import time.
"""

from __future__ import annotations

from dataclasses import dataclass

from cacheroute.operator.config import OperatorConfig
from cacheroute.operator.fleet.cluster import Cluster
from cacheroute.operator.work import PriorityExecutor


@dataclass(frozen=True)
class OperatorContext:
    config: OperatorConfig
    cluster: Cluster
    # Blocking API work of handlers runs here, off kopf's event loop, most urgent first.
    work: PriorityExecutor
    # Full re-apply of every owned object (repairs drift); the status is refreshed more often.
    resync_seconds: float = 60.0
    status_seconds: float = 5.0
    # Default Prometheus of AffinityPlans that name none.
    prometheus_url: str | None = None


_current: list[OperatorContext] = []


def set_context(ctx: OperatorContext) -> None:
    _current[:] = [ctx]


def current() -> OperatorContext:
    if not _current:
        raise RuntimeError("the operator context is not set: run through `cacheroute operator run`")
    return _current[0]
