"""A request trace held as columns: the common input of planning, statistics and replay."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

NO_KEY = -1


@dataclass(frozen=True, eq=False)
class RequestTrace:
    """Requests in arrival order.

    `key[i]` is a dense affinity-key id (`NO_KEY` when the request carries none);
    `key_names[key[i]]` is the key as a client would send it, so plans built from a trace hash
    the same strings the router will see. The prompt of request i is the block sequence
    `block_ids[block_offsets[i]:block_offsets[i + 1]]`; blocks are prefix-chained (equal id at
    equal position means an equal prefix up to there), each `block_size` tokens, the last one
    usually partial.
    """

    arrival_s: npt.NDArray[np.float64]
    key: npt.NDArray[np.int64]
    input_tokens: npt.NDArray[np.int64]
    output_tokens: npt.NDArray[np.int64]
    block_offsets: npt.NDArray[np.int64]
    block_ids: npt.NDArray[np.int64]
    block_size: int
    key_names: tuple[str, ...]
    name: str = "trace"
    # The keys' affinity hashes when known without their clear names (see `KeyStats.key_hashes`).
    key_hashes: npt.NDArray[np.uint64] | None = None

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        for col in ("key", "input_tokens", "output_tokens"):
            if len(getattr(self, col)) != n:
                raise ValueError(f"trace column {col} has {len(getattr(self, col))} rows, expected {n}")
        if len(self.block_offsets) != n + 1 or (n and int(self.block_offsets[-1]) != len(self.block_ids)):
            raise ValueError("block_offsets must have n + 1 entries ending at len(block_ids)")
        if n > 1 and bool(np.any(np.diff(self.arrival_s) < 0)):
            raise ValueError("arrival_s must be sorted")
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if n and int(self.key.max(initial=NO_KEY)) >= len(self.key_names):
            raise ValueError("a key id has no entry in key_names")
        if self.key_hashes is not None and len(self.key_hashes) != len(self.key_names):
            raise ValueError("key_hashes must have one entry per key name")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) > 1 else 0.0

    def blocks(self, i: int) -> npt.NDArray[np.int64]:
        return self.block_ids[self.block_offsets[i] : self.block_offsets[i + 1]]

    def time_scaled(self, factor: float) -> RequestTrace:
        """The same requests arriving `factor` times faster (factor > 1 raises the QPS)."""
        if not factor > 0:
            raise ValueError("time scale factor must be positive")
        start = self.arrival_s[0] if len(self) else 0.0
        return RequestTrace(
            arrival_s=start + (self.arrival_s - start) / factor,
            key=self.key,
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            block_offsets=self.block_offsets,
            block_ids=self.block_ids,
            block_size=self.block_size,
            key_names=self.key_names,
            name=self.name,
            key_hashes=self.key_hashes,
        )

    def window(self, start_s: float, end_s: float) -> RequestTrace:
        """Requests arriving in [start_s, end_s)."""
        lo, hi = np.searchsorted(self.arrival_s, [start_s, end_s], side="left")
        offs = self.block_offsets[lo : hi + 1]
        return RequestTrace(
            arrival_s=self.arrival_s[lo:hi],
            key=self.key[lo:hi],
            input_tokens=self.input_tokens[lo:hi],
            output_tokens=self.output_tokens[lo:hi],
            block_offsets=offs - offs[0],
            block_ids=self.block_ids[int(offs[0]) : int(offs[-1])],
            block_size=self.block_size,
            key_names=self.key_names,
            name=self.name,
            key_hashes=self.key_hashes,
        )

    def select(self, mask: npt.NDArray[np.bool_]) -> RequestTrace:
        """The requests where `mask` is True, in their order, with their blocks."""
        if len(mask) != len(self):
            raise ValueError(f"mask has {len(mask)} entries, the trace {len(self)} requests")
        per_request = np.diff(self.block_offsets)
        offs = np.zeros(int(np.count_nonzero(mask)) + 1, dtype=np.int64)
        np.cumsum(per_request[mask], out=offs[1:])
        return RequestTrace(
            arrival_s=self.arrival_s[mask],
            key=self.key[mask],
            input_tokens=self.input_tokens[mask],
            output_tokens=self.output_tokens[mask],
            block_offsets=offs,
            block_ids=self.block_ids[np.repeat(mask, per_request)],
            block_size=self.block_size,
            key_names=self.key_names,
            name=self.name,
            key_hashes=self.key_hashes,
        )
