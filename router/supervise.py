"""Background tasks that cannot die silently.

Every long-running task of the router (plan store, plan sources, scraper, Kubernetes watches)
runs under a `Supervisor`: when one raises, or returns although it should run forever, the
failure is logged with its traceback, the task counts as down (the router reports NOT_SERVING
while any task is down, and `cacheroute_router_task_up{task}` is 0), and it is started again
after a backoff that doubles from `initial_backoff` up to `max_backoff`. A task that ran for
`stable_after` seconds before failing starts again from the initial backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)

TaskFactory = Callable[[], Coroutine[Any, Any, None]]


class TaskReturnedError(RuntimeError):
    """A background task returned, which none of them should do while the router runs."""


class Supervisor:
    def __init__(
        self,
        *,
        on_change: Callable[[], None] = lambda: None,
        on_state: Callable[[str, bool], None] = lambda _name, _up: None,
        on_restart: Callable[[str], None] = lambda _name: None,
        initial_backoff: float = 0.1,
        max_backoff: float = 10.0,
        stable_after: float = 60.0,
    ) -> None:
        self._on_change = on_change
        self._on_state = on_state
        self._on_restart = on_restart
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff
        self.stable_after = stable_after
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._down: set[str] = set()
        self.restarts: dict[str, int] = {}

    @property
    def down(self) -> frozenset[str]:
        """Names of the tasks that failed and wait for their restart."""
        return frozenset(self._down)

    def spawn(self, name: str, factory: TaskFactory) -> None:
        """Run `factory()` as task `name`, again after every failure."""
        if name in self._tasks:
            raise ValueError(f"a task named {name!r} already runs")
        self.restarts[name] = 0
        self._on_state(name, True)
        self._tasks[name] = asyncio.get_running_loop().create_task(self._keep(name, factory), name=name)

    async def _keep(self, name: str, factory: TaskFactory) -> None:
        backoff = self.initial_backoff
        while True:
            started = time.monotonic()
            try:
                await factory()
                raise TaskReturnedError(f"background task {name} returned")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if time.monotonic() - started >= self.stable_after:
                    backoff = self.initial_backoff
                log.error("background task %s failed (%s); restarting in %.1f s", name, _describe(exc), backoff,
                          exc_info=exc)
            self._set_down(name, True)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff)
            self.restarts[name] += 1
            self._on_restart(name)
            log.info("background task %s restarted", name)
            self._set_down(name, False)

    def _set_down(self, name: str, down: bool) -> None:
        if down:
            self._down.add(name)
        else:
            self._down.discard(name)
        self._on_state(name, not down)
        try:
            self._on_change()
        except Exception:
            log.exception("readiness update after task %s changed state failed", name)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
