"""The heavy-hitter sketch keeps its error bound and its exported series add up."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheroute.router.sketch import HeavyKeys


def zipf_stream(n: int, keys: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, keys + 1) ** 1.1
    drawn: list[int] = rng.choice(keys, size=n, p=weights / weights.sum()).tolist()
    return drawn


def check_bounds(sketch: HeavyKeys, truth: Counter[int]) -> None:
    snap = sketch.snapshot()
    n = sum(truth.values())
    bound = n / sketch.capacity
    assert snap.total_requests == n
    assert snap.error_bound == pytest.approx(bound)
    tracked = {k.key: k for k in snap.keys}
    assert len(tracked) <= sketch.capacity
    for k in snap.keys:
        true = truth[k.key]
        # The estimate never undercounts and overcounts by at most N / capacity ...
        assert true <= k.estimate <= true + bound
        assert k.estimate - k.error <= true
        # ... and what is exported (counted since the key entered) never exceeds the truth.
        assert k.requests == k.estimate - k.error
    # Every key heavier than N / capacity is tracked.
    for key, count in truth.items():
        if count > bound:
            assert key in tracked
    assert snap.other_requests == n - sum(k.requests for k in snap.keys)
    assert snap.other_requests >= 0


@pytest.mark.parametrize(("capacity", "keys"), [(16, 1000), (64, 20_000), (4096, 100_000)])
def test_error_bound_on_a_skewed_stream(capacity: int, keys: int) -> None:
    stream = zipf_stream(60_000, keys, seed=capacity)
    sketch = HeavyKeys(capacity)
    truth: Counter[int] = Counter()
    for i, key in enumerate(stream):
        sketch.add(key, prompt_tokens=10, prefix_tokens=3)
        truth[key] += 1
        if i % 20_000 == 0:
            check_bounds(sketch, truth)
    check_bounds(sketch, truth)
    snap = sketch.snapshot()
    assert snap.total_prompt_tokens == 10 * len(stream)
    assert snap.other_prompt_tokens + sum(k.prompt_tokens for k in snap.keys) == snap.total_prompt_tokens
    assert all(k.prompt_tokens == 10 * k.requests and k.prefix_tokens == 3 * k.requests for k in snap.keys)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=400), st.integers(1, 12))
def test_error_bound_on_any_stream(stream: list[int], capacity: int) -> None:
    sketch = HeavyKeys(capacity)
    truth: Counter[int] = Counter()
    others = []
    for key in stream:
        sketch.add(key)
        truth[key] += 1
        others.append(sketch.snapshot().other_requests)
    check_bounds(sketch, truth)
    # __other__ is a counter: it never decreases.
    assert all(b >= a for a, b in itertools.pairwise(others))


def test_heaviest_keys_survive_a_flood_of_one_off_keys() -> None:
    sketch = HeavyKeys(8)
    for round_ in range(200):
        for heavy in range(4):
            sketch.add(heavy)
        sketch.add(10_000 + round_)
    tracked = {k.key: k for k in sketch.snapshot().keys}
    assert all(h in tracked and tracked[h].requests == 200 for h in range(4))


def test_names_are_kept_only_when_asked() -> None:
    named = HeavyKeys(4, keep_names=True)
    named.add(1, name="alice")
    assert named.snapshot().keys[0].name == "alice"
    anonymous = HeavyKeys(4)
    anonymous.add(1, name="alice")
    assert anonymous.snapshot().keys[0].name is None


def test_a_key_carries_the_time_it_entered_and_a_readmitted_key_a_new_one() -> None:
    now = [100.0]
    sketch = HeavyKeys(1, clock=lambda: now[0])
    assert sketch.snapshot().started == 100.0
    now[0] = 105.0
    sketch.add(1)
    now[0] = 110.0
    sketch.add(1)  # a later request does not move the key's start
    [entry] = sketch.snapshot().keys
    assert (entry.key, entry.created) == (1, 105.0)
    now[0] = 120.0
    sketch.add(2)  # evicts key 1 (capacity 1)
    now[0] = 130.0
    sketch.add(1)  # key 1 back, counting from zero again
    [entry] = sketch.snapshot().keys
    assert (entry.key, entry.requests, entry.created) == (1, 1, 130.0)
