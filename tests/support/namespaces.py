"""A namespace held in Terminating, for tests of what the operator does while one is deleted."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tests.support.sandbox import wait_for


@contextmanager
def terminating_namespace(kube_api: Any, name: str) -> Iterator[str]:
    """Create `name` and delete it, holding it in Terminating until the block ends (a ConfigMap's
    finalizer that nobody else removes)."""
    from kubernetes import client

    core = client.CoreV1Api(kube_api)
    core.create_namespace({"metadata": {"name": name}})
    core.create_namespaced_config_map(name, {"metadata": {"name": "held", "finalizers": ["cacheroute.dev/test"]}})
    core.delete_namespace(name)
    try:
        yield name
    finally:
        core.patch_namespaced_config_map("held", name, {"metadata": {"finalizers": None}})


def first_refusal(attempt: Callable[[], object], error: type[BaseException], *, undo: Callable[[], object]) -> Any:
    """The exception `attempt` raises once the API server refuses it; `undo` after each success.

    The API server's admission sees a namespace's phase once its cache has it: a write made just
    after the deletion may still pass.
    """
    refusals: list[BaseException] = []

    def refused() -> bool:
        try:
            attempt()
        except error as exc:
            refusals.append(exc)
            return True
        undo()
        return False

    wait_for(refused, timeout=30, what="writes refused in the terminating namespace", interval=0.2)
    return refusals[-1]
