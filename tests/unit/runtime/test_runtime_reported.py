"""The runtime reports a pod's status again when what the API server holds no longer says it."""

from __future__ import annotations

from typing import Any

from cacheroute.sandbox.runtime.reported import status_shows


def container(name: str, *, ready: bool, state: str, restarts: int = 0) -> dict[str, Any]:
    return {"name": name, "ready": ready, "restartCount": restarts, "state": {state: {"startedAt": "t"}}}


REPORTED = {
    "phase": "Running",
    "conditions": [{"type": "ContainersReady", "status": "True"}, {"type": "Ready", "status": "True"}],
    "containerStatuses": [container("vllm", ready=True, state="running")],
}

# What kwok's stage for the runtime's pods writes: an address, nothing ready, containers creating.
KWOK_ASSIGNED = {
    "phase": "Running",
    "podIP": "10.0.0.5",
    "conditions": [
        {"type": "PodReadyToStartContainers", "status": "True"},
        {"type": "Initialized", "status": "True"},
        {"type": "Ready", "status": "False", "reason": "ContainersNotReady"},
        {"type": "ContainersReady", "status": "False", "reason": "ContainersNotReady"},
    ],
    "containerStatuses": [{"name": "vllm", "ready": False, "restartCount": 0, "state": {"waiting": {}}}],
}


def test_a_report_written_over_by_a_stale_kwok_stage_no_longer_shows() -> None:
    assert not status_shows(KWOK_ASSIGNED, REPORTED)


def test_a_report_that_landed_shows_whatever_else_the_pod_carries_and_whenever_it_was_written() -> None:
    observed = {
        **KWOK_ASSIGNED,
        "conditions": [
            {"type": "Initialized", "status": "True"},
            {"type": "Ready", "status": "True", "lastTransitionTime": "later"},
            {"type": "ContainersReady", "status": "True", "lastTransitionTime": "later"},
        ],
        "containerStatuses": [container("vllm", ready=True, state="running") | {"containerID": "x"}],
    }
    assert status_shows(observed, REPORTED)


def test_a_restart_a_state_or_a_phase_that_differs_is_a_difference() -> None:
    landed = {**REPORTED, "podIP": "10.0.0.5"}
    assert status_shows(landed, REPORTED)
    restarted = container("vllm", ready=True, state="running", restarts=1)
    assert not status_shows({**landed, "containerStatuses": [restarted]}, REPORTED)
    exited = container("vllm", ready=True, state="terminated")
    assert not status_shows({**landed, "containerStatuses": [exited]}, REPORTED)
    assert not status_shows({**landed, "phase": "Pending"}, REPORTED)
    assert not status_shows({**landed, "containerStatuses": []}, REPORTED)
    assert not status_shows({}, REPORTED)
