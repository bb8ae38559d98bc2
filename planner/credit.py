"""How firmly the router keeps a planned key on its entry: the plan's `entry_credit`.

An LRU cache keeps a prefix as long as the prefix comes back before the tokens written after it
fill the cache. Over the fleet, the caches (GPU and host tiers) hold `C` tokens and the traffic
writes `W` new tokens per second (each request's prompt past its key's prefix, and its output),
so a prefix lives about `T = C / W` seconds on whichever destination holds it, wherever the
traffic goes. A key arriving `r` times per second then finds its prefix:

- on its entry, when held there (every `1 / r` seconds), if `r T >= 1`;
- wherever it lands, when spread over the fleet's `n` destinations (every `n / r` seconds on
  each), only if `r T >= n`.

A key with `1 <= r T < n` keeps its prefix cached only while it is held to its entry: the plan's
partition of the fleet's KV is what earns its hits, and the entry must hold (credit 1, bounded
affinity up to the spill bound). A key with `r T >= n` (or `< 1`) is cached (or not) however
it is spread, and holding it to one destination only costs balance. The plan holds its entries
when most of the prefill it expects to save (`rate x prefix` over its admitted keys) comes from
keys of the first kind; otherwise it credits them `MIN_ENTRY_CREDIT` and the router scores a
planned request as it scores an unplanned one (`routing.py` step 1), so a busy entry gives the
request to a clearly less loaded destination.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from cacheroute.planner.keystats import KeyStats
from cacheroute.planner.plan import Destination

# The credit of an entry that need not hold: a quarter of the prompt (3/4 of the router's score
# for being the least rather than the most loaded) keeps a key on its entry while loads are close,
# so an idle fleet routes as planned.
MIN_ENTRY_CREDIT: Final = 0.25
# The share of the plan's expected saving that must depend on its entries for them to hold.
HOLD_SHARE: Final = 0.5
# The share of a prompt a remembered prefix must exceed for the router to follow it.
FOLLOWED_SHARE: Final = 0.5


def cache_lifetime_s(stats: KeyStats, destinations: Sequence[Destination]) -> float:
    """`T` of the module docstring: the fleet's KV tokens over the tokens its traffic writes per
    second (inf when nothing is written, 0 when the KV is not known)."""
    capacity = float(sum(d.kv_capacity_tokens + d.host_kv_capacity_tokens for d in destinations))
    new = np.maximum(stats.prompt_tokens - stats.prefix_tokens, 0.0) + stats.output_tokens
    u = stats.unkeyed
    written = float(np.dot(stats.rate, new)) + u.rate * (u.prompt_tokens + u.output_tokens)
    if capacity <= 0:
        return 0.0
    return capacity / written if written > 0 else float("inf")


def held_share(stats: KeyStats, destinations: Sequence[Destination], keys: npt.NDArray[np.bool_]) -> float:
    """The share of the prefill `keys` save (`rate x prefix`) that comes from keys cached only
    while held to one destination (`1 <= r T < n`; module docstring). 1 when the fleet's KV is
    not known: nothing shows the entries may yield."""
    lifetime = cache_lifetime_s(stats, destinations)
    if not lifetime > 0:
        return 1.0
    saving = np.where(keys, stats.rate * stats.prefix_tokens, 0.0)
    total = float(saving.sum())
    if not total > 0:
        return 0.0
    returns = stats.rate * lifetime  # how many times a key comes back within a prefix's lifetime
    # A key whose prefix is most of its prompt is followed to where it went (`routing.py` step 5)
    # with or without its entry.
    followed = stats.prefix_tokens > FOLLOWED_SHARE * stats.prompt_tokens
    needs_entry = (returns >= 1.0) & (returns < len(destinations)) & ~followed
    return float(saving[needs_entry].sum()) / total


def entry_credit(stats: KeyStats, destinations: Sequence[Destination], keys: npt.NDArray[np.bool_]) -> float:
    """1 when most of what the plan's `keys` save depends on holding them to their entries,
    else `MIN_ENTRY_CREDIT` (module docstring)."""
    return 1.0 if held_share(stats, destinations, keys) >= HOLD_SHARE else MIN_ENTRY_CREDIT
