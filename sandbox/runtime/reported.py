"""Whether a pod's status, as the API server holds it, still says what the runtime reported.

The runtime cannot assume that what it once patched stays: kwok may play a pod stage a second
time from a stale copy of the pod (its pod watch and the sync of a node it has just begun to
manage can both queue the same pod), and that stage writes "containers creating, not ready"
over the runtime's report. So the runtime compares what it would report with the pod it
observes at every change, and reports again when they differ, as the kubelet's status manager
does. Timestamps are left out of the comparison: the observed ones are the runtime's own or
kwok's, and neither changes what the pod means.
"""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]


def _conditions(status: Obj) -> dict[str, str]:
    return {str(c.get("type")): str(c.get("status")) for c in status.get("conditions") or []}


def _containers(status: Obj) -> dict[str, tuple[bool, int, tuple[str, ...]]]:
    return {
        str(c.get("name")): (bool(c.get("ready")), int(c.get("restartCount") or 0), tuple(sorted(c.get("state") or {})))
        for c in status.get("containerStatuses") or []
    }


def status_shows(observed: Obj, reported: Obj) -> bool:
    """True when `observed` carries every condition, container state and phase of `reported`."""
    if "phase" in reported and observed.get("phase") != reported["phase"]:
        return False
    seen = _conditions(observed)
    if any(seen.get(kind) != value for kind, value in _conditions(reported).items()):
        return False
    containers = _containers(observed)
    return all(containers.get(name) == facts for name, facts in _containers(reported).items())
