"""The router decides as the replay measured: the same state and seed give the same decisions.

For generated states (destinations, in-flight and queued requests and prompt tokens in flight on
each, a plan, the spill settings, how unplanned keys are routed, how many prompt tokens weigh one
request, a random seed), the router's `Picker` and the replay's `Planned` policy take the same
sequence of requests (planned keys, unplanned keys, keyless; each of some prompt size, charged to
the destination it goes to) and must send every one to the same destination with the same outcome.
With prefix following on, each request also carries its prompt's chain of prefix ids (turns of a
few conversations, so later turns extend earlier ones): both sides remember where every chain went
and follow it under the same load bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheroute.planner.keyring import UNPLANNED_MODES
from cacheroute.planner.plan import Destination, Plan, affinity_key_hash, plan_from_routes
from cacheroute.planner.replay.engine import Engine, RequestTable
from cacheroute.planner.replay.hardware import EngineProfile
from cacheroute.planner.replay.planned import EngineLoads, Planned, RoutingSettings
from cacheroute.planner.replay.policy import RouterView
from cacheroute.planner.replay.run import destination_ids
from cacheroute.planner.routing import FOLLOWED, KEY_P2C, P2C, PLANNED, SCORED, SPILLED
from cacheroute.planner.tokenload import BYTES_PER_TOKEN, TokenEstimator
from cacheroute.planner.trace import NO_KEY, RequestTrace
from cacheroute.router.endpoints import EndpointPool
from cacheroute.router.picker import Picker
from cacheroute.router.prompts import BLOCK_TOKENS
from cacheroute.router.table import build_table

KEYS = [f"user-{i}" for i in range(12)]
PROFILE = EngineProfile(name="parity", step_overhead_s=0.0, weight_read_s=0.01, compute_s_per_token=0.0,
                        attention_s_per_pair=0.0, kv_read_s_per_token=0.0, kv_capacity_tokens=1000)


@dataclass(frozen=True)
class State:
    in_flight: list[int]
    waiting: list[int]
    in_flight_tokens: list[int]
    routes: dict[str, list[int]]  # planned keys -> destination indexes, preference order
    spill_threshold: float
    spill_slack: float
    unplanned: str
    seed: int
    requests: list[str | None]  # key names (planned or not) or None for keyless requests
    sizes: list[int]  # prompt tokens of each request
    tokens_per_unit: float = 0.0
    in_flight_weight: float = 1.0  # what a request in flight weighs against a queued one
    pinned: tuple[str, ...] = ()  # planned keys kept to their entry
    widen_planned: bool = False
    follow: bool = False
    chains: tuple[tuple[int, ...], ...] = ()  # each request's prefix ids (empty: none known)
    entry_credit: float = 1.0  # below 1, planned requests are scored (the plan's `entry_credit`)


@st.composite
def states(draw: st.DrawFn) -> State:
    n = draw(st.integers(1, 9))
    loads = st.lists(st.integers(0, 30), min_size=n, max_size=n)
    # Every planned key gets 1-3 distinct destinations in some order.
    entry = st.lists(st.integers(0, n - 1), min_size=1, max_size=min(n, 3), unique=True)
    planned_keys = draw(st.lists(st.sampled_from(KEYS), max_size=8, unique=True))
    requests = draw(st.lists(st.one_of(st.none(), st.sampled_from(KEYS)), min_size=1, max_size=6))
    # Turns of three conversations: turn t of conversation c has the prefix ids (c, 0) .. (c, t).
    turns = st.tuples(st.integers(0, 2), st.integers(0, 5))
    chains = tuple(
        tuple(c * 100 + b for b in range(t + 1))
        for c, t in draw(st.lists(turns, min_size=len(requests), max_size=len(requests)))
    )
    small = st.integers(1, 3 * BLOCK_TOKENS)
    return State(
        in_flight=draw(loads),
        waiting=draw(loads),
        in_flight_tokens=draw(st.lists(st.integers(0, 200_000), min_size=n, max_size=n)),
        routes={k: draw(entry) for k in planned_keys},
        spill_threshold=draw(st.sampled_from([1.0, 1.2, 1.5, 2.0, 3.0])),
        spill_slack=draw(st.sampled_from([0.0, 0.5, 2.0, 4.0])),
        unplanned=draw(st.sampled_from(UNPLANNED_MODES)),
        seed=draw(st.integers(0, 2**32 - 1)),
        requests=requests,
        sizes=draw(st.lists(st.one_of(small, st.integers(1, 100_000)), min_size=len(requests),
                            max_size=len(requests))),
        tokens_per_unit=draw(st.sampled_from([0.0, 512.0, 4096.0])),
        in_flight_weight=draw(st.sampled_from([1.0, 0.25, 0.0])),
        pinned=tuple(k for k in planned_keys if draw(st.booleans())),
        widen_planned=draw(st.booleans()),
        follow=draw(st.booleans()),
        chains=chains,
        entry_credit=draw(st.sampled_from([1.0, 0.66, 0.25, 0.0])),
    )


def plan_of(state: State) -> Plan:
    n = len(state.in_flight)
    ids = destination_ids(n)
    # The plan carries the engines' KV capacity, as the operator's does: both sides size their
    # memory of routed prefixes from it.
    destinations = [Destination(ids[i], f"10.1.0.{i + 1}:8000", 1.0, PROFILE.kv_capacity_tokens) for i in range(n)]
    plan = plan_from_routes(
        "pool",
        destinations,
        {affinity_key_hash(k): [ids[d] for d in v] for k, v in state.routes.items()},
        spill_threshold=state.spill_threshold,
    )
    pinned = np.array(sorted(affinity_key_hash(k) for k in state.pinned), dtype=np.uint64)
    return replace(plan, pinned_keys=pinned, entry_credit=state.entry_credit)


def router_decisions(state: State, plan: Plan) -> list[tuple[str, int]]:
    pool = EndpointPool(scraping=False)
    picker = Picker(pool, spill_slack=state.spill_slack, seed=state.seed, unplanned=state.unplanned,
                    tokens_per_unit=state.tokens_per_unit, in_flight_weight=state.in_flight_weight,
                    widen_planned=state.widen_planned, follow_prefixes=state.follow)
    pool.set_plan_destinations(plan.destinations)
    picker.install(build_table(plan, "v1"))
    index = {d.address: i for i, d in enumerate(plan.destinations)}
    for d, flying, queued, tokens in zip(plan.destinations, state.in_flight, state.waiting, state.in_flight_tokens,
                                         strict=True):
        endpoint = pool.by_address[d.address]
        for _ in range(flying):
            pool.acquire(endpoint)
        # The newest charge holds the tokens still to prefill; the request it came with is not counted.
        pool.acquire(endpoint, tokens)
        pool.release(endpoint)
        pool.record_scrape(endpoint, ok=True, waiting=queued)
    queues = list(state.waiting)
    estimator = TokenEstimator()
    out = []
    for i, (key, size) in enumerate(zip(state.requests, state.sizes, strict=True)):
        # What the exchange passes: the prompt tokens estimated from a body of that size, the chain.
        decision = picker.pick(affinity_key_hash(key) if key is not None else None,
                               prompt_tokens=estimator.estimate(size * BYTES_PER_TOKEN), chain=chain_of(state, i))
        endpoint = decision.endpoints[0]
        pool.acquire(endpoint, decision.charge)
        # The request joins the queue, and the next scrape says so.
        queues[index[endpoint.address]] += 1
        pool.record_scrape(endpoint, ok=True, waiting=queues[index[endpoint.address]])
        out.append((decision.outcome, index[endpoint.address]))
    return out


def chain_of(state: State, i: int) -> tuple[int, ...]:
    return state.chains[i] if i < len(state.chains) else ()


def trace_of(requests: Sequence[str | None], sizes: Sequence[int]) -> RequestTrace:
    names = sorted({k for k in requests if k is not None})
    n = len(requests)
    return RequestTrace(
        arrival_s=np.zeros(n, dtype=np.float64),
        key=np.array([names.index(k) if k is not None else NO_KEY for k in requests], dtype=np.int64),
        input_tokens=np.array(sizes, dtype=np.int64),
        output_tokens=np.ones(n, dtype=np.int64),
        block_offsets=np.arange(n + 1, dtype=np.int64),
        block_ids=np.arange(n, dtype=np.int64),
        block_size=BLOCK_TOKENS,
        key_names=tuple(names),
    )


def replay_decisions(state: State, plan: Plan) -> list[tuple[str, int]]:
    trace = trace_of(state.requests, state.sizes)
    req = RequestTable(trace.arrival_s.tolist(), trace.input_tokens.tolist(), trace.output_tokens.tolist())

    def blocks(i: int) -> list[int]:
        return list(chain_of(state, i))

    n = len(state.in_flight)
    engines = [Engine(d, PROFILE, trace.block_size, req, blocks) for d in range(n)]
    for engine, queued in zip(engines, state.waiting, strict=True):
        engine.waiting.extend(range(queued))
    view = RouterView(trace, engines, req, destination_ids=destination_ids(n), profile=PROFILE, get_blocks=blocks)
    policy = Planned(plan, spill_slack=state.spill_slack, unplanned=state.unplanned,
                     routing=RoutingSettings(tokens_per_unit=state.tokens_per_unit,
                                             in_flight_weight=state.in_flight_weight,
                                             widen_planned=state.widen_planned, follow_prefixes=state.follow))
    policy.bind(view, state.seed)
    view.inflight[:] = state.in_flight
    view.total_inflight = sum(state.in_flight)
    # Ids below 0 are the requests in flight before: the newest charge holds the tokens.
    for d, (flying, tokens) in enumerate(zip(state.in_flight, state.in_flight_tokens, strict=True)):
        charges = view.pending[d]
        for j in range(flying):
            charges[-1 - j] = 0
        charges[-1 - flying] = tokens
    out = []
    for i in range(len(state.requests)):
        d = policy.route(i, 0.0)
        # What the replay's loop does after a decision: the request joins the engine's queue.
        view.inflight[d] += 1
        view.total_inflight += 1
        engines[d].waiting.append(i)
        # The router counts key-seeded p2c as p2c.
        out.append((P2C if policy.last_outcome == KEY_P2C else policy.last_outcome, d))
    return out


@settings(max_examples=2000, deadline=None)
@given(states())
def test_router_and_replay_make_the_same_decisions(state: State) -> None:
    plan = plan_of(state)
    assert router_decisions(state, plan) == replay_decisions(state, plan)


def test_the_generated_states_reach_every_outcome() -> None:
    """The parity test above is only as good as its cases: they must plan, spill and p2c."""
    # Planned keys keep to their entry when unplanned keys go to plain p2c.
    state = State(in_flight=[9, 0, 0], waiting=[3, 0, 0], in_flight_tokens=[0, 0, 0],
                  routes={"user-0": [0], "user-1": [1, 2]},
                  spill_threshold=1.5, spill_slack=2.0, unplanned="p2c", seed=7,
                  requests=["user-0", "user-1", "user-2", None], sizes=[10, 10, 10, 10])
    plan = plan_of(state)
    decisions = router_decisions(state, plan)
    assert [outcome for outcome, _ in decisions] == [SPILLED, PLANNED, P2C, P2C]
    assert decisions[0][1] != 0
    assert decisions == replay_decisions(state, plan)
    seeded = State(**{**state.__dict__, "unplanned": "key-p2c"})
    decisions = router_decisions(seeded, plan)
    assert [outcome for outcome, _ in decisions][2:] == [P2C, P2C]
    assert decisions == replay_decisions(seeded, plan)


def test_prompt_tokens_in_flight_turn_the_same_decision_in_both() -> None:
    """Token-aware load is part of what both sides agree on: with equal request counts, the
    destination prefilling long prompts loses the p2c draw in the router and in the replay."""
    base = State(in_flight=[2, 2], waiting=[0, 0], in_flight_tokens=[0, 0], routes={},
                 spill_threshold=1.5, spill_slack=2.0, unplanned="p2c", seed=3,
                 requests=[None] * 4, sizes=[100] * 4, tokens_per_unit=4096.0)
    heavy = [200_000, 0]
    counted = router_decisions(State(**{**base.__dict__, "in_flight_tokens": heavy}), plan_of(base))
    assert all(d == 1 for _, d in counted)
    blind = State(**{**base.__dict__, "in_flight_tokens": heavy, "tokens_per_unit": 0.0})
    assert any(d == 0 for _, d in router_decisions(blind, plan_of(blind)))
    for state in (State(**{**base.__dict__, "in_flight_tokens": heavy}), blind):
        assert router_decisions(state, plan_of(state)) == replay_decisions(state, plan_of(state))


def test_a_later_turn_follows_its_conversation_in_both() -> None:
    """The memory of routed prefixes is part of the parity: a conversation's next turn goes where its
    first turn went, though p2c would draw elsewhere, in the router and in the replay."""
    state = State(in_flight=[0, 0, 0, 0], waiting=[0, 0, 0, 0], in_flight_tokens=[0] * 4, routes={},
                  spill_threshold=1.5, spill_slack=2.0, unplanned="p2c", seed=11,
                  requests=[None] * 6, sizes=[600, 100, 100, 100, 100, 900], tokens_per_unit=4096.0,
                  follow=True, chains=((7, 8), (1,), (2,), (3,), (4,), (7, 8, 9, 10)))
    decisions = router_decisions(state, plan_of(state))
    assert decisions[-1] == (FOLLOWED, decisions[0][1])
    assert decisions == replay_decisions(state, plan_of(state))
    forgetful = State(**{**state.__dict__, "follow": False})
    assert router_decisions(forgetful, plan_of(forgetful))[-1][0] == P2C


def test_an_unplanned_request_is_scored_alike_in_both() -> None:
    """With key-seeded p2c and prefix memory, unplanned requests with no prefix worth following
    are scored by what each destination holds of them and by load, on both sides alike."""
    state = State(in_flight=[3, 0, 1, 2], waiting=[0, 1, 0, 0], in_flight_tokens=[0, 40_000, 0, 9_000],
                  routes={"user-0": [2]}, spill_threshold=1.5, spill_slack=2.0, unplanned="key-p2c", seed=2,
                  requests=["user-1", "user-2", None, "user-3", "user-0"],
                  sizes=[512, 1536, 1280, 768, 512], tokens_per_unit=4096.0, follow=True,
                  chains=((7, 8), (7, 8, 9, 10, 11, 12), (7, 8, 20, 21, 22), (30, 31, 32), (7, 8)))
    decisions = router_decisions(state, plan_of(state))
    assert [outcome for outcome, _ in decisions] == [SCORED, SCORED, SCORED, SCORED, PLANNED]
    assert decisions == replay_decisions(state, plan_of(state))


def test_a_planned_request_is_scored_alike_in_both_when_its_entry_is_credited() -> None:
    """A plan crediting its entries below 1 has planned requests scored: a busy entry loses its
    request to an idle destination, in the router and in the replay; at 1 the entry keeps it."""
    state = State(in_flight=[6, 0, 0, 0], waiting=[0, 0, 0, 0], in_flight_tokens=[0, 0, 0, 0],
                  routes={"user-0": [0]}, spill_threshold=3.0, spill_slack=4.0, unplanned="key-p2c", seed=5,
                  requests=["user-0", "user-0"], sizes=[512, 512], follow=True, chains=((1, 2), (3, 4)),
                  entry_credit=0.25)
    decisions = router_decisions(state, plan_of(state))
    assert [outcome for outcome, _ in decisions] == [SCORED, SCORED]
    assert all(d != 0 for _, d in decisions)
    assert decisions == replay_decisions(state, plan_of(state))
    pinned = State(**{**state.__dict__, "entry_credit": 1.0})
    assert router_decisions(pinned, plan_of(pinned)) == [(PLANNED, 0), (PLANNED, 0)]
    assert router_decisions(pinned, plan_of(pinned)) == replay_decisions(pinned, plan_of(pinned))


def test_a_queue_outweighs_requests_in_flight_in_both() -> None:
    """A request queued on a destination holds a newcomer back more than one running there: with
    requests in flight weighing a quarter, p2c sends the request to the destination busy decoding
    six rather than the one with two queued, in the router and in the replay; weighing them whole
    (the load before) sends it to the queue."""
    base = State(in_flight=[6, 1], waiting=[0, 2], in_flight_tokens=[0, 0], routes={},
                 spill_threshold=1.5, spill_slack=2.0, unplanned="p2c", seed=3,
                 requests=[None], sizes=[100], in_flight_weight=0.25)
    whole = State(**{**base.__dict__, "in_flight_weight": 1.0})
    assert router_decisions(base, plan_of(base)) == [(P2C, 0)]
    assert router_decisions(whole, plan_of(whole)) == [(P2C, 1)]
    for state in (base, whole):
        assert router_decisions(state, plan_of(state)) == replay_decisions(state, plan_of(state))


def test_a_prompt_counts_until_the_queue_says_it_is_prefilled_in_both() -> None:
    """Of three long prompts sent to one destination, the tokens still to prefill are those of the
    newest `waiting + 1`: all three while two wait, the newest alone once the queue is empty, and
    a request ending after it was prefilled takes nothing more off; the router (at its scrapes) and
    the replay count alike."""
    pool = EndpointPool(scraping=False)
    pool.per_token = 1 / 4096
    pool.set_static(["10.1.0.1:8000"])
    endpoint = pool.by_address["10.1.0.1:8000"]
    tickets = [pool.acquire(endpoint, tokens) for tokens in (30_000, 20_000, 10_000)]
    trace = trace_of([None] * 3, [30_000, 20_000, 10_000])
    req = RequestTable(trace.arrival_s.tolist(), trace.input_tokens.tolist(), trace.output_tokens.tolist())
    engines = [Engine(0, PROFILE, trace.block_size, req, lambda i: [])]
    view = RouterView(trace, engines, req, destination_ids=destination_ids(1), profile=PROFILE,
                      get_blocks=lambda i: [])
    view.pending[0].update({0: 30_000, 1: 20_000, 2: 10_000})
    view.inflight[0] = view.total_inflight = 3
    loads = EngineLoads(view, tokens_per_unit=4096.0)

    def replay_tokens(waiting: int) -> int:
        engines[0].waiting.clear()
        engines[0].waiting.extend(range(waiting))
        return loads.tokens(0)

    assert endpoint.in_flight_tokens == pool.tokens_ready == 60_000
    pool.record_scrape(endpoint, ok=True, waiting=2)
    assert endpoint.in_flight_tokens == replay_tokens(2) == 60_000
    pool.record_scrape(endpoint, ok=True, waiting=0)
    assert endpoint.in_flight_tokens == replay_tokens(0) == pool.tokens_ready == 10_000
    assert pool.mean_load() == 3 + 10_000 / 4096 == loads.mean()
    pool.release(endpoint, tickets[0])
    del view.pending[0][0]
    assert endpoint.in_flight_tokens == replay_tokens(0) == 10_000
    pool.release(endpoint, tickets[2])
    del view.pending[0][2]
    assert endpoint.in_flight_tokens == pool.tokens_ready == 0
    assert replay_tokens(0) == 20_000  # the replay recounts at once: the router does at its next scrape
    pool.record_scrape(endpoint, ok=True, waiting=0)
    assert endpoint.in_flight_tokens == 20_000
