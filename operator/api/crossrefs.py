"""Checks across manifests that no one object's schema can make.

An AffinityPlan's pinned routes name destinations of the InferencePool it refers to
(`<pool>-<ordinal>`). The operator refuses pins naming a destination the pool does not have
(`InvalidPinned`, the plan in effect staying); `cacheroute validate` says so before the commit:
against the pool's replicas when the pool is among the manifests it reads (once), else against
the form of the pool's destination ids, with a note saying why.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cacheroute.operator.api.plan import AffinityPlan
from cacheroute.operator.api.pool import InferencePool


@dataclass(frozen=True)
class Located:
    """A parsed manifest and where it was read (`file` or `file#N`)."""

    where: str
    resource: InferencePool | AffinityPlan


def _same_namespace(a: str | None, b: str | None) -> bool:
    # A manifest without a namespace lands in whichever one `kubectl -n` names.
    return a is None or b is None or a == b


def _pools_for(plan: AffinityPlan, pools: Sequence[tuple[str, InferencePool]]) -> list[tuple[str, InferencePool]]:
    name, namespace = plan.spec.pool_ref.name, plan.metadata.namespace
    return [p for p in pools if p[1].metadata.name == name and _same_namespace(p[1].metadata.namespace, namespace)]


def _replicas_text(pool: InferencePool, name: str) -> str:
    n = pool.spec.replicas
    if n == 0:
        return "0 replicas"
    if n == 1:
        return f"1 replica: {name}-0"
    return f"{n} replicas: {name}-0 to {name}-{n - 1}"


def _destination_check(name: str, pool: InferencePool | None) -> tuple[Callable[[str], bool], str]:
    """Whether a destination id is one of the pool's, and what to say of one that is not: against
    its replicas when its manifest is known, else against the form of its ids."""
    if pool is not None:
        ids = {f"{name}-{i}" for i in range(pool.spec.replicas)}
        return ids.__contains__, f"which InferencePool {name} does not have ({_replicas_text(pool, name)})"
    form = re.compile(rf"{re.escape(name)}-(0|[1-9][0-9]*)")
    return (lambda d: form.fullmatch(d) is not None), (
        f"which is not a destination of InferencePool {name} (its destinations are {name}-0, {name}-1, ...)"
    )


@dataclass(frozen=True)
class PinCheck:
    """`problems`: where each plan whose pins the operator would refuse was read, and why.
    `notes`: what the check could not do (the pool not given, or given twice), plan by plan."""

    problems: dict[str, str]
    notes: dict[str, str]


def check_pins(found: Sequence[Located]) -> PinCheck:
    """Every AffinityPlan's pinned destinations against its InferencePool among `found`."""
    pools = [(x.where, x.resource) for x in found if isinstance(x.resource, InferencePool)]
    problems: dict[str, str] = {}
    notes: dict[str, str] = {}
    for item in found:
        plan = item.resource
        if not isinstance(plan, AffinityPlan) or not plan.spec.pinned:
            continue
        name = plan.spec.pool_ref.name
        candidates = _pools_for(plan, pools)
        pool = candidates[0][1] if len(candidates) == 1 else None
        if len(candidates) > 1:
            notes[item.where] = (
                f"InferencePool {name} is given {len(candidates)} times "
                f"({', '.join(where for where, _ in candidates)}; a manifest without a namespace may be any): "
                "pins checked by the form of its destination ids only"
            )
        elif pool is None:
            notes[item.where] = f"InferencePool {name} is not among the files: pins checked by the form of its ids only"
        fits, why = _destination_check(name, pool)
        bad = [(pin.key, d) for pin in plan.spec.pinned for d in pin.destinations if not fits(d)]
        if not bad:
            continue
        key, destination = bad[0]
        more = f" ({len(bad) - 1} more such destination(s) pinned)" if len(bad) > 1 else ""
        problems[item.where] = (
            f"pinned key {key!r} names {destination}, {why}{more}; "
            "the operator would refuse these pins (InvalidPinned) and keep the plan in effect"
        )
    return PinCheck(problems, notes)
