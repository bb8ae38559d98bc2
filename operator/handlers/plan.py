"""kopf handlers of AffinityPlans: one daemon per AffinityPlan runs its control loop.

A daemon (not a timer) because the period is per object (`spec.controlPeriod`, changeable) and
the rhythm must survive a restart (the next period is due one period after
`status.lastPeriodTime`). kopf runs one daemon per object, so periods of one AffinityPlan never
overlap; it stops the daemon when the object is deleted (the finalizer it holds goes once the
daemon has stopped). The loop itself is `cacheroute.operator.control.loop`.
"""

from __future__ import annotations

from typing import Any

import kopf

from cacheroute.operator import context
from cacheroute.operator.api.common import GROUP, VERSION
from cacheroute.operator.control.kube import PLAN_PLURAL, ControlApi, default_api_client
from cacheroute.operator.control.loop import PlanLoop
from cacheroute.operator.control.settings import ControlSettings
from cacheroute.operator.handlers import events

# The daemon wakes at least this often between periods, to notice spec changes.
_WAKE_S = 1.0


class _Setup:
    """Built on first use: kopf imports this module before the operator has logged in."""

    settings: ControlSettings | None = None
    api: ControlApi | None = None


def _settings() -> ControlSettings:
    if _Setup.settings is None:
        try:
            # `cacheroute operator run` sets the context (its --prometheus-url) before importing us.
            _Setup.settings = ControlSettings(prometheus_url=context.current().prometheus_url)
        except RuntimeError:  # run by `kopf run` directly: the environment
            _Setup.settings = ControlSettings.from_env()
    return _Setup.settings


def _api() -> ControlApi:
    if _Setup.api is None:
        try:
            # The client `cacheroute operator run` built from its --kubeconfig (or in-cluster):
            # the library's default kubeconfig is fixed at its import, before that flag is read.
            _Setup.api = ControlApi(context.current().cluster.api)
        except RuntimeError:  # run by `kopf run` directly: the environment
            _Setup.api = ControlApi(default_api_client())
    return _Setup.api


def _events(body: kopf.Body) -> Any:
    # Through the API at once (`events.py`): the loop writes the status that records a period's
    # Events only once they are posted.
    return events.poster(_api(), body)


# Stopped, a daemon has `_STOP_GRACE_S` to end its period (without publishing) and release its
# pool before kopf cancels it; without a backoff kopf cancels at once.
_STOP_GRACE_S = 15.0


@kopf.daemon(
    GROUP, VERSION, PLAN_PLURAL, id="control-loop", cancellation_backoff=_STOP_GRACE_S, cancellation_timeout=60.0
)
async def control_loop(
    stopped: kopf.DaemonStopped, body: kopf.Body, namespace: str | None, name: str, **_: Any
) -> None:
    loop = PlanLoop(_api(), _settings(), namespace=namespace or "", name=name, events=_events(body))
    try:
        while not stopped:
            wait = loop.seconds_until_due(body)
            if wait > 0 and not await loop.pool_changed(body):
                await stopped.wait(min(wait, _WAKE_S))
                continue
            await loop.run_period(body, publish_allowed=lambda: not stopped)
    finally:
        if stopped.reason is not None and stopped.reason & kopf.DaemonStoppingReason.RESOURCE_DELETED:
            await loop.release(body)
        loop.forget()
