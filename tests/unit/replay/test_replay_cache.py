"""The per-destination prefix KV cache: hits, pinning, capacity and LRU eviction order."""

from __future__ import annotations

from cacheroute.planner.replay.cache import PrefixCache


def test_hit_counts_only_the_contiguous_prefix() -> None:
    c = PrefixCache(capacity_tokens=100, block_size=4)
    assert c.admit([1, 2, 3], 0) == 0
    c.release([1, 2, 3], 0)
    # Block 9 is new, so block 3 behind it is not a hit even though it is cached.
    assert c.admit([1, 2, 9, 3], 0) == 2


def test_shared_blocks_are_pinned_once_and_freed_when_the_last_user_ends() -> None:
    c = PrefixCache(capacity_tokens=100, block_size=4)
    assert c.admit([1, 2], 3) == 0
    assert c.admit([1, 2, 5], 3) == 2
    assert c.pinned_tokens == 3 * 4 + 3 + 3
    c.release([1, 2], 3)
    assert c.pinned_tokens == 3 * 4 + 3  # blocks 1 and 2 are still used by the second request
    assert c.free_order() == []
    c.release([1, 2, 5], 3)
    assert c.pinned_tokens == 0
    assert c.free_order() == [5, 2, 1]  # tail first: the head of the prompt is evicted last


def test_admission_is_refused_without_room_and_changes_nothing() -> None:
    c = PrefixCache(capacity_tokens=20, block_size=4)
    assert c.admit([1, 2, 3], 4) == 0  # 12 + 4 = 16 tokens pinned
    assert c.admit([7, 8], 0) == -1  # needs 8 more, only 4 left
    assert c.pinned_tokens == 16
    assert c.lookup([7]) == 0
    # Already pinned blocks cost nothing, so a request sharing them still fits.
    assert c.admit([1, 2, 3], 4) == 3


def test_lru_evicts_least_recently_freed_blocks_first() -> None:
    c = PrefixCache(capacity_tokens=16, block_size=4)  # room for 4 blocks
    for blocks in ([1, 2], [3, 4]):
        c.admit(blocks, 0)
        c.release(blocks, 0)
    assert c.free_order() == [2, 1, 4, 3]
    # Reusing 1, 2 makes them the most recently freed.
    assert c.admit([1, 2], 0) == 2
    c.release([1, 2], 0)
    assert c.free_order() == [4, 3, 2, 1]
    # Two new blocks need room: 4 then 3 go, 1 and 2 stay.
    assert c.admit([5, 6], 0) == 0
    assert c.lookup([1, 2]) == 2
    assert c.lookup([3]) == 0 and c.lookup([4]) == 0
    assert c.cached_tokens() == 16


def test_eviction_never_touches_pinned_blocks() -> None:
    c = PrefixCache(capacity_tokens=12, block_size=4)
    c.admit([1, 2], 0)  # pinned
    c.admit([3], 0)
    c.release([3], 0)  # free
    assert c.admit([4], 0) == 0  # evicts 3, not 1 or 2
    assert c.lookup([1, 2]) == 2
    assert c.lookup([3]) == 0
    assert c.usage() == 12 / 12


def test_blocks_evicted_from_the_gpu_are_hits_from_the_host_tier_until_it_evicts_them() -> None:
    """With a host tier, a prompt whose head was evicted from the GPU still hits, and `loaded`
    says how many blocks must be copied back; without one the same prompt misses."""
    for host_tokens, hit, loaded in ((0, 0, 0), (8, 2, 2)):
        c = PrefixCache(capacity_tokens=16, block_size=4, host_capacity_tokens=host_tokens)
        assert c.admit([1, 2], 0) == 0
        c.release([1, 2], 0)
        assert c.admit([3, 4, 5, 6], 0) == 0  # fills the GPU: blocks 1 and 2 are evicted
        c.release([3, 4, 5, 6], 0)
        assert c.lookup([1, 2]) == 0
        assert c.admit([1, 2], 0) == hit
        assert c.loaded == loaded
    # The host tier is LRU too: two more evictions push the oldest blocks out of it.
    c = PrefixCache(capacity_tokens=8, block_size=4, host_capacity_tokens=8)
    for prompt in ([1, 2], [3, 4], [5, 6]):
        c.admit(prompt, 0)
        c.release(prompt, 0)
    assert c.host_tokens() == 8
    assert c.admit([1, 2], 0) == 0
