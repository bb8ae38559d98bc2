"""The memory of routed prefixes: what each destination is remembered to hold of a prompt."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cacheroute.planner.prefixes import PrefixFollower, PrefixMemory

DESTINATIONS = 5
# Prompts as chains of prefix ids: chain (c, t) is conversation c up to turn t.
chains = st.tuples(st.integers(0, 3), st.integers(0, 6)).map(
    lambda ct: tuple(ct[0] * 100 + b for b in range(ct[1] + 1))
)


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.tuples(chains, st.integers(0, DESTINATIONS - 1)), max_size=20),
    chains,
    st.integers(1, 40),
)
def test_held_depths_are_held_by_for_every_destination(sent: list[tuple[tuple[int, ...], int]],
                                                        asked: tuple[int, ...], capacity: int) -> None:
    # A small capacity makes the memory forget (least recently used first) between the sends.
    memory = PrefixMemory(capacity)
    for chain, destination in sent:
        memory.record(chain, destination)
    one_by_one = {d: memory.held_by(asked, d) for d in range(DESTINATIONS)}
    assert memory.held_depths(asked) == {d: depth for d, depth in one_by_one.items() if depth}


def test_a_destination_holds_the_prompt_up_to_where_its_turns_stopped() -> None:
    follower = PrefixFollower(capacity=100, block_tokens=10, per_token=0.0)
    follower.settle((1, 2), 0, 20)  # turns 1-2 of a conversation on destination 0
    follower.settle((1, 2, 3, 4), 3, 40)  # turns 1-4 on destination 3
    assert follower.held((1, 2, 3, 4, 5), 50) == {0: 20, 3: 40}
    # Only whole blocks of this prompt count: a 35-token prompt with this chain holds at most 30.
    assert follower.held((1, 2, 3, 4, 5), 35) == {0: 20, 3: 30}
    # A prompt shorter than a block holds nothing worth scoring; another conversation holds nothing.
    assert follower.held((1, 2), 9) == {}
    assert follower.held((7, 8), 20) == {}


def test_each_destination_forgets_what_was_sent_to_it_least_recently_end_first() -> None:
    memory = PrefixMemory(capacity=4)
    memory.record((1, 2), 0)
    memory.record((10, 11), 1)
    memory.record((3, 4, 5), 0)  # destination 0 now holds five prefixes: one goes
    # The end of the older prompt went first, as its engine frees a finished request's blocks.
    assert memory.held_by((1, 2), 0) == 1
    assert memory.held_by((3, 4, 5), 0) == 3
    # Destination 1 received nothing since: it keeps all it had.
    assert memory.held_by((10, 11), 1) == 2
    # A prefix two destinations hold, dropped by the last of them, is followed to the other.
    memory.record((1,), 1)
    assert memory.match((1,)) == (1, 1)
    for p in range(100, 104):
        memory.record((p,), 1)
    assert memory.match((1,)) == (1, 0)
    memory.forget(0)
    assert memory.match((1,)) == (0, -1)
    assert len(memory) == 4  # what destination 1 holds


def test_a_prompt_follows_only_a_destination_holding_more_of_it_than_any_other() -> None:
    follower = PrefixFollower(capacity=100, block_tokens=10, per_token=0.5)
    system = (1, 2, 3, 4)  # a 40-token system prompt every conversation starts with
    follower.settle((*system, 100), 0, 50)
    # Only destination 0 holds it, and it is most of the next prompt: followed, shedding 40 tokens.
    assert follower.target((*system, 200), 55) == (0, 20.0)
    follower.settle((*system, 200), 1, 55)  # that one went elsewhere (past the load bound)
    # Now two destinations hold it alike: no reason to send the next new one to the last of them.
    assert follower.target((*system, 300), 55) == (-1, 0.0)
    # A conversation's own history, held on one destination only, is still followed.
    follower.settle((*system, 100, 101, 102), 0, 70)
    assert follower.target((*system, 100, 101, 102, 103), 80) == (0, 35.0)
    # Unless another destination holds as much of it.
    follower.settle((*system, 100, 101, 102), 1, 70)
    assert follower.target((*system, 100, 101, 102, 103), 80) == (-1, 0.0)
