"""What a routing policy may see, and the policy interface.

A policy sees what a real router sees: the request (its affinity key, prompt blocks, length), its
own in-flight counters (incremented when it dispatches, decremented when the response ends; also
in prompt tokens, for the policies that charge them),
metrics a gateway scrapes from vLLM (waiting queue depth, KV usage), time, and its own history.
It never sees the engines' true cache contents.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from cacheroute.planner.plan import affinity_key_hash
from cacheroute.planner.replay.engine import Engine, RequestTable
from cacheroute.planner.replay.hardware import EngineProfile
from cacheroute.planner.trace import RequestTrace


class RouterView:
    __slots__ = (
        "_key_hashes", "block_size", "charging", "destination_ids", "engines", "get_blocks", "inflight",
        "input_tokens", "key", "pending", "profile", "req", "total_inflight", "trace",
    )

    def __init__(self, trace: RequestTrace, engines: Sequence[Engine], req: RequestTable, *,
                 destination_ids: Sequence[str], profile: EngineProfile,
                 get_blocks: Callable[[int], list[int]]) -> None:
        self.trace = trace
        self.engines = list(engines)
        self.req = req
        self.destination_ids = tuple(destination_ids)
        self.profile = profile
        self.block_size = trace.block_size
        self.inflight = [0] * len(self.engines)
        self.total_inflight = 0
        self.key: list[int] = trace.key.tolist()
        self.input_tokens = req.inp
        self.get_blocks = get_blocks
        self._key_hashes: npt.NDArray[np.uint64] | None = None
        # Token-aware load (`tokenload.py`): whether the policy charges prompt tokens, and per
        # destination the charges of its requests in flight, request -> tokens in dispatch order;
        # the replay loop drops a request's charge when it finishes.
        self.charging = False
        self.pending: list[dict[int, int]] = [{} for _ in self.engines]

    @property
    def n(self) -> int:
        return len(self.engines)

    def blocks(self, i: int) -> list[int]:
        """Prompt block ids of request i (shared with the engine, which reuses the list)."""
        blocks_of = self.req.blocks_of
        b = blocks_of.get(i)
        if b is None:
            b = self.get_blocks(i)
            blocks_of[i] = b
        return b

    def queue_depths(self) -> list[int]:
        """Scraped `vllm:num_requests_waiting` of every destination."""
        return [len(e.waiting) for e in self.engines]

    def key_hashes(self) -> npt.NDArray[np.uint64]:
        """64-bit hash of every key name (what the router computes from the key it extracts)."""
        if self._key_hashes is None and self.trace.key_hashes is not None:
            self._key_hashes = self.trace.key_hashes
        if self._key_hashes is None:
            names = self.trace.key_names
            self._key_hashes = np.fromiter(
                (affinity_key_hash(k) for k in names), dtype=np.uint64, count=len(names)
            )
        return self._key_hashes


class Policy(ABC):
    """A routing policy. `bind` is called once per replay before the first `route`."""

    name: ClassVar[str] = "policy"
    # Whether the replay loop must call `on_finish` (kept off for policies that ignore it: speed).
    wants_finish: ClassVar[bool] = False

    view: RouterView
    rng: random.Random

    def bind(self, view: RouterView, seed: int) -> None:
        self.view = view
        self.rng = random.Random(seed)

    @abstractmethod
    def route(self, i: int, now: float) -> int:
        """Destination index for request i arriving at `now`."""

    def on_finish(self, i: int, dest: int, now: float) -> None:  # noqa: B027 (optional hook)
        """Request i finished on `dest` (the router saw its response end)."""

    def describe(self) -> dict[str, object]:
        """Settings that identify this policy in reports."""
        return {"name": self.name}
