"""Per-key traffic statistics over a window: the input of planning.

Held as columns because a pool sees up to a million keys per window. `prefix_tokens` is the
*stable prefix*: the prompt tokens a later request of the same key can reuse from a destination
that holds the key warm. From a trace it is the longest common block prefix of all the key's
requests in the window, capped per request at that request's prompt length, averaged over the
requests (a key seen once has nothing to reuse: 0). Traces carry prefix-chained block ids (see
`RequestTrace`), which lets the common prefix be found by bisection.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from operator import itemgetter

import numpy as np
import numpy.typing as npt

from cacheroute.planner.errors import PlanInputError
from cacheroute.planner.trace import NO_KEY, RequestTrace

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]

# Relative slack when checking prefix <= prompt, for means computed in floating point.
_PREFIX_SLACK = 1e-9


def affinity_key_hashes(names: Sequence[str]) -> U64:
    """`affinity_key_hash` of many keys at once (same 64-bit values, as a uint64 array)."""
    # Copying a fresh 8-byte blake2b state is cheaper than constructing one per key.
    fresh = hashlib.blake2b(digest_size=8)
    out: list[bytes] = []
    add = out.append
    for k in names:
        h = fresh.copy()
        h.update(k.encode("utf-8"))
        add(h.digest())
    return np.frombuffer(b"".join(out), dtype="<u8").astype(np.uint64)


def _check_column(name: str, values: F64, keys: Sequence[str] | None) -> None:
    bad = ~np.isfinite(values) | (values < 0)
    if bool(bad.any()):
        i = int(np.flatnonzero(bad)[0])
        who = f" (key {keys[i]!r})" if keys is not None else ""
        raise PlanInputError(f"{name}[{i}]{who} is {float(values[i])!r}: must be finite and >= 0")


def _as_column(name: str, values: object, n: int | None) -> F64:
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise PlanInputError(f"{name} is not numeric: {exc}") from exc
    if arr.ndim != 1:
        raise PlanInputError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if n is not None and len(arr) != n:
        raise PlanInputError(f"{name} has {len(arr)} entries, expected {n} (one per key)")
    return arr


@dataclass(frozen=True)
class UnkeyedTraffic:
    """Requests that carry no affinity key: always routed by power-of-two choices."""

    rate: float = 0.0
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0

    def __post_init__(self) -> None:
        for name in ("rate", "prompt_tokens", "output_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise PlanInputError(f"unkeyed.{name} is {v!r}: must be finite and >= 0")


@dataclass(frozen=True, eq=False)
class KeyStats:
    """Per-key means over a window, one row per distinct key.

    `rate` is in requests per second; token columns are means per request. Keys are the strings
    clients send (the plan stores only their 64-bit `affinity_key_hash`).

    `key_hashes`, when given, are the keys' hashes as already known to the caller, and `names`
    only label the rows: the router's metrics name most keys by their hash alone (the clear key
    never leaves it), so statistics read from them cannot be hashed again.
    """

    names: tuple[str, ...]
    rate: F64
    prompt_tokens: F64
    prefix_tokens: F64
    output_tokens: F64
    unkeyed: UnkeyedTraffic = field(default_factory=UnkeyedTraffic)
    window_s: float | None = None
    key_hashes: U64 | None = None

    def __post_init__(self) -> None:
        names = tuple(self.names)
        object.__setattr__(self, "names", names)
        n = len(names)
        if self.key_hashes is not None:
            self._set_known_hashes(self.key_hashes, n)
        for col in ("rate", "prompt_tokens", "prefix_tokens", "output_tokens"):
            arr = _as_column(f"stats.{col}", getattr(self, col), n)
            _check_column(f"stats.{col}", arr, names)
            object.__setattr__(self, col, arr)
        over = self.prefix_tokens > self.prompt_tokens * (1 + _PREFIX_SLACK)
        if bool(over.any()):
            i = int(np.flatnonzero(over)[0])
            raise PlanInputError(
                f"stats.prefix_tokens[{i}] (key {names[i]!r}) is {float(self.prefix_tokens[i])!r}, more than its "
                f"prompt_tokens {float(self.prompt_tokens[i])!r}"
            )
        distinct = set(names)
        if set(map(type, distinct)) - {str} or "" in distinct:
            i = next(i for i, k in enumerate(names) if not (isinstance(k, str) and k))
            raise PlanInputError(f"stats.names[{i}] is {names[i]!r}: a key must be a non-empty string")
        if len(distinct) != n:
            seen: set[str] = set()
            dup = next(k for k in names if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise PlanInputError(f"stats.names lists key {dup!r} more than once")
        if self.window_s is not None and not (math.isfinite(self.window_s) and self.window_s > 0):
            raise PlanInputError(f"stats.window_s is {self.window_s!r}: must be a positive number of seconds")

    def _set_known_hashes(self, given: object, n: int) -> None:
        try:
            hashes = np.asarray(given)
        except (TypeError, ValueError) as exc:
            raise PlanInputError(f"stats.key_hashes is not an array of 64-bit hashes: {exc}") from exc
        if hashes.ndim != 1 or len(hashes) != n:
            raise PlanInputError(f"stats.key_hashes has shape {hashes.shape}, expected ({n},) (one per key)")
        if n and hashes.dtype != np.uint64:
            raise PlanInputError(f"stats.key_hashes has dtype {hashes.dtype}, expected uint64")
        hashes = hashes.astype(np.uint64, copy=False)
        if len(np.unique(hashes)) != n:
            raise PlanInputError("stats.key_hashes lists a hash more than once")
        object.__setattr__(self, "key_hashes", hashes)
        # Primes the cached property below, so nothing hashes the row names.
        self.__dict__["hashes"] = hashes

    def __len__(self) -> int:
        return len(self.names)

    @cached_property
    def hashes(self) -> U64:
        """`affinity_key_hash` of every key (computed once, on first use), or `key_hashes`."""
        return affinity_key_hashes(self.names)

    def hashes_of(self, index: I64) -> U64:
        """Hashes of some keys; reuses the full column when it was already computed."""
        if "hashes" in self.__dict__:
            return self.hashes[index]
        idx = index.tolist()
        if len(idx) < 2:
            return affinity_key_hashes([self.names[i] for i in idx])
        return affinity_key_hashes(itemgetter(*idx)(self.names))

    @property
    def total_rate(self) -> float:
        return float(self.rate.sum()) + self.unkeyed.rate

    @property
    def total_prompt_token_rate(self) -> float:
        """Prompt tokens a second, keyed and keyless (an inner product without BLAS, as `load.dot`)."""
        keyed = float(np.einsum("i,i->", self.rate, self.prompt_tokens, dtype=np.float64))
        return keyed + self.unkeyed.rate * self.unkeyed.prompt_tokens


def _common_prefix_blocks(trace: RequestTrace, req: I64, key_of: I64, n_keys: int) -> I64:
    """Longest common block prefix of each key's requests (`req`, their keys in `key_of`).

    Block ids are prefix-chained (`RequestTrace`): two prompts that agree at position p agree on
    every position before it. So the common prefix of two prompts is found by bisection on the
    position, and a key's is the least over its requests against its first one.
    """
    counts = np.bincount(key_of, minlength=n_keys)
    multi = counts >= 2
    if not bool(multi.any()):
        return np.zeros(n_keys, dtype=np.int64)
    lens = np.diff(trace.block_offsets)[req]
    order = np.argsort(key_of, kind="stable")
    starts = np.cumsum(counts) - counts
    # Every key here has at least one request, so the group starts are strictly increasing.
    shortest = np.minimum.reduceat(lens[order], starts)
    first = order[starts]
    is_first = np.zeros(len(req), dtype=bool)
    is_first[first] = True
    others = np.flatnonzero(~is_first & multi[key_of])
    k = key_of[others]
    offs = trace.block_offsets
    ids = trace.block_ids
    mine = offs[req[others]]
    theirs = offs[req[first[k]]]
    # Invariant: the prompts agree on [0, lo) and differ somewhere in [lo, hi) unless lo == hi.
    lo = np.zeros(len(others), dtype=np.int64)
    hi = shortest[k].astype(np.int64)
    open_ = np.flatnonzero(lo < hi)
    while len(open_):
        low, high = lo[open_], hi[open_]
        mid = (low + high) // 2
        same = ids[mine[open_] + mid] == ids[theirs[open_] + mid]
        lo[open_] = np.where(same, mid + 1, low)
        hi[open_] = np.where(same, high, mid)
        open_ = open_[lo[open_] < hi[open_]]
    lcp = np.where(multi, shortest, 0).astype(np.int64)
    np.minimum.at(lcp, k, lo)
    return lcp


def _names_of(key_names: tuple[str, ...], ids: I64) -> tuple[str, ...]:
    idx = ids.tolist()
    if len(idx) < 2:
        return tuple(key_names[i] for i in idx)
    return tuple(itemgetter(*idx)(key_names))


def key_stats_from_trace(trace: RequestTrace, start_s: float | None = None, end_s: float | None = None) -> KeyStats:
    """Per-key statistics of the requests arriving in `[start_s, end_s)`.

    Without `start_s` the window opens at the first arrival; without `end_s` it closes just after
    the last one (rates then use the span between the first and last arrival in the window).
    """
    if len(trace) == 0:
        raise PlanInputError(f"trace {trace.name!r} has no requests")
    lo = float(trace.arrival_s[0]) if start_s is None else float(start_s)
    last = float(trace.arrival_s[-1])
    hi = float(np.nextafter(last, np.inf)) if end_s is None else float(end_s)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise PlanInputError(f"window [{start_s!r}, {end_s!r}) must have finite bounds")
    if start_s is not None and lo > last:
        raise PlanInputError(
            f"window start {lo:g} s is after the last request of trace {trace.name!r} ({last:g} s)"
        )
    win = trace.window(lo, hi)
    duration = (min(hi, last) if end_s is None else hi) - lo
    if not duration > 0:
        raise PlanInputError(
            f"window [{lo!r}, {hi!r}) of trace {trace.name!r} spans {duration!r} s: rates need a positive duration"
        )
    if len(win) == 0:
        raise PlanInputError(f"window [{lo!r}, {hi!r}) of trace {trace.name!r} holds no request")
    keyed = win.key != NO_KEY
    req = np.flatnonzero(keyed)
    ids, key_of, counts = np.unique(win.key[req], return_inverse=True, return_counts=True)
    key_of = key_of.astype(np.int64).reshape(-1)
    n_keys = len(ids)
    prompt = win.input_tokens.astype(np.float64)
    output = win.output_tokens.astype(np.float64)
    lcp = _common_prefix_blocks(win, req, key_of, n_keys)
    reusable = np.minimum(lcp[key_of] * float(win.block_size), prompt[req])
    fc = counts.astype(np.float64)
    mean_prompt = np.bincount(key_of, weights=prompt[req], minlength=n_keys) / fc
    unkeyed_n = len(win) - len(req)
    unkeyed = UnkeyedTraffic(
        rate=unkeyed_n / duration,
        prompt_tokens=float(prompt[~keyed].mean()) if unkeyed_n else 0.0,
        output_tokens=float(output[~keyed].mean()) if unkeyed_n else 0.0,
    )
    return KeyStats(
        names=_names_of(win.key_names, ids),
        rate=fc / duration,
        prompt_tokens=mean_prompt,
        prefix_tokens=np.minimum(np.bincount(key_of, weights=reusable, minlength=n_keys) / fc, mean_prompt),
        output_tokens=np.bincount(key_of, weights=output[req], minlength=n_keys) / fc,
        unkeyed=unkeyed,
        window_s=duration,
        key_hashes=None if win.key_hashes is None else win.key_hashes[ids],
    )
