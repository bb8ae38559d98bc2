"""kopf logs in as the operator's own API client does (`cacheroute.operator.credentials`)."""

from __future__ import annotations

from typing import Any

import kopf

from cacheroute.operator.context import current
from cacheroute.operator.credentials import connection_info


@kopf.on.login(id="cacheroute-client")
def login(*, settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    return connection_info(current().cluster.api.configuration, trust_env=settings.networking.trust_env)
