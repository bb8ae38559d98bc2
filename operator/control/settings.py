"""Operator-wide settings of the control loop (from `cacheroute operator run` flags or env)."""

from __future__ import annotations

import os
from dataclasses import dataclass

PROMETHEUS_URL_ENV = "CACHEROUTE_OPERATOR_PROMETHEUS_URL"


@dataclass(frozen=True)
class ControlSettings:
    # Prometheus of AffinityPlans that do not name one in spec.prometheus.url.
    prometheus_url: str | None = None

    @classmethod
    def from_env(cls) -> ControlSettings:
        return cls(prometheus_url=os.environ.get(PROMETHEUS_URL_ENV) or None)
