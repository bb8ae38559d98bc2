"""A thread pool that takes the most urgent work first.

Reconcile passes block on API calls, so they run in threads; when many pools arrive at once (a
GitOps sync), creating their StatefulSets first lets the scheduler and kubelets start while the
operator is still creating routers, and status-only passes never delay either.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")

ENGINE = 0
ROUTER = 1
STATUS = 2


class PriorityExecutor:
    def __init__(self, workers: int, name: str = "reconcile") -> None:
        self._queue: queue.PriorityQueue[tuple[int, int, Callable[[], None]]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while True:
            _, _, job = self._queue.get()
            job()

    def submit(self, priority: int, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()

        def job() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        self._queue.put((priority, next(self._order), job))
        return future

    async def run(self, priority: int, fn: Callable[[], T]) -> T:
        """Run `fn` in a worker, ahead of anything less urgent queued, and await its result."""
        result: T = await asyncio.wrap_future(self.submit(priority, fn))
        return result

