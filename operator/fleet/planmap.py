"""The plan ConfigMap(s): created holding an empty, valid, versioned plan; the AffinityPlan loop fills them.

The router mounts `<pool>-plan` (header and first shard) and the optional shards `<pool>-plan-<i>`.
An empty plan routes every key by key-seeded p2c over the EndpointSlice endpoints, which is what a
pool does until its first plan is applied. The operator only ever creates these objects: it never
overwrites a plan someone else wrote.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from cacheroute.operator.api.pool import InferencePoolSpec
from cacheroute.operator.fleet import names
from cacheroute.planner.plan import KeyExtraction, Plan, PlanSummary, validate_plan
from cacheroute.planner.plan_format import encode_plan


def empty_plan(pool: names.PoolRef, spec: InferencePoolSpec) -> Plan:
    r = spec.router
    return Plan(
        pool=pool.name,
        destinations=(),
        route_keys=np.zeros(0, dtype=np.uint64),
        route_offsets=np.zeros(1, dtype=np.int64),
        route_dests=np.zeros(0, dtype=np.uint16),
        spill_threshold=r.spill_threshold,
        key_extraction=KeyExtraction(
            header=r.key_header.lower(),
            body_field=r.body_field or None,
            session_header=r.session_header.lower() if r.session_header else None,
            prompt_prefix_chars=r.prompt_prefix_chars,
        ),
        summary=PlanSummary(reason="empty plan created with the pool; no keys planned yet"),
    )


def build_plan_configmaps(pool: names.PoolRef, spec: InferencePoolSpec) -> list[dict[str, Any]]:
    """The ConfigMaps of the empty plan (one: an empty plan has a single, empty shard).

    Raises PlanError when the pool's router settings make a plan no router would load.
    """
    plan = empty_plan(pool, spec)
    validate_plan(plan)
    payload = encode_plan(plan)
    out = []
    for name, files in sorted(payload.configmaps.items()):
        out.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    **names.metadata(pool, name, "plan"),
                    "annotations": {"cacheroute.dev/plan-version": payload.version},
                },
                "binaryData": {f: base64.b64encode(payload.files[f]).decode("ascii") for f in files},
            }
        )
    return out
