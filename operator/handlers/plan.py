"""kopf handlers of AffinityPlans: one daemon per AffinityPlan runs its control loop.

A daemon (not a timer) because the period is per object (`spec.controlPeriod`, changeable) and
the rhythm must survive a restart (the next period is due one period after
`status.lastPeriodTime`). kopf runs one daemon per object, so periods of one AffinityPlan never
overlap; it stops the daemon when the object is deleted (the finalizer it holds goes once the
daemon has stopped). The loop itself is `cacheroute.operator.control.loop`.
"""

from __future__ import annotations

from typing import Any, Literal

import kopf

from cacheroute.operator.api.common import GROUP, VERSION
from cacheroute.operator.control.kube import PLAN_PLURAL, ControlApi, default_api_client
from cacheroute.operator.control.loop import PlanLoop
from cacheroute.operator.control.settings import ControlSettings

# The daemon wakes at least this often between periods, to notice spec changes.
_WAKE_S = 1.0

_state: dict[str, Any] = {}


def configure(settings: ControlSettings, api_client: Any | None = None) -> None:
    """Set the loop's operator-wide settings (called by `cacheroute operator run` at start-up)."""
    _state["settings"] = settings
    if api_client is not None:
        _state["api"] = ControlApi(api_client)


def _settings() -> ControlSettings:
    settings = _state.get("settings")
    if settings is None:
        settings = _state["settings"] = ControlSettings.from_env()
    return settings  # type: ignore[no-any-return]


def _api() -> ControlApi:
    api = _state.get("api")
    if api is None:
        api = _state["api"] = ControlApi(default_api_client())
    return api  # type: ignore[no-any-return]


def _events(body: kopf.Body) -> Any:
    def post(kind: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        # Event messages are limited to 1 KiB by kopf's poster; the condition holds the full text.
        (kopf.info if kind == "Normal" else kopf.warn)(body, reason=reason, message=message[:1000])

    return post


@kopf.daemon(GROUP, VERSION, PLAN_PLURAL, id="control-loop", cancellation_timeout=60.0)
async def control_loop(stopped: kopf.DaemonStopped, body: kopf.Body, namespace: str, name: str, **_: Any) -> None:
    loop = PlanLoop(_api(), _settings(), namespace=namespace, name=name, events=_events(body))
    try:
        while not stopped:
            wait = loop.seconds_until_due(body)
            if wait > 0:
                await stopped.wait(min(wait, _WAKE_S))
                continue
            await loop.run_period(body, publish_allowed=lambda: not stopped)
    finally:
        loop.forget()
