"""The router decides as the replay measured: the same state and seed give the same decisions.

For generated states (destinations, in-flight and queued requests on each, a plan, the spill
settings, how unplanned keys are routed, a random seed), the router's `Picker` and the replay's
`Planned` policy take the same sequence of requests (planned keys, unplanned keys, keyless) and
must send every one to the same destination with the same outcome.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheroute.planner.keyring import UNPLANNED_MODES
from cacheroute.planner.plan import Destination, Plan, affinity_key_hash, plan_from_routes
from cacheroute.planner.replay.engine import Engine, RequestTable
from cacheroute.planner.replay.hardware import EngineProfile
from cacheroute.planner.replay.planned import Planned
from cacheroute.planner.replay.policy import RouterView
from cacheroute.planner.replay.run import destination_ids
from cacheroute.planner.routing import P2C, PLANNED, SPILLED
from cacheroute.planner.trace import NO_KEY, RequestTrace
from cacheroute.router.endpoints import EndpointPool
from cacheroute.router.picker import Picker
from cacheroute.router.table import build_table

KEYS = [f"user-{i}" for i in range(12)]
PROFILE = EngineProfile(name="parity", step_overhead_s=0.0, weight_read_s=0.01, compute_s_per_token=0.0,
                        attention_s_per_pair=0.0, kv_read_s_per_token=0.0, kv_capacity_tokens=1000)


@dataclass(frozen=True)
class State:
    in_flight: list[int]
    waiting: list[int]
    routes: dict[str, list[int]]  # planned keys -> destination indexes, preference order
    spill_threshold: float
    spill_slack: float
    unplanned: str
    seed: int
    requests: list[str | None]  # key names (planned or not) or None for keyless requests


@st.composite
def states(draw: st.DrawFn) -> State:
    n = draw(st.integers(1, 9))
    loads = st.lists(st.integers(0, 30), min_size=n, max_size=n)
    # Every planned key gets 1-3 distinct destinations in some order.
    entry = st.lists(st.integers(0, n - 1), min_size=1, max_size=min(n, 3), unique=True)
    planned_keys = draw(st.lists(st.sampled_from(KEYS), max_size=8, unique=True))
    return State(
        in_flight=draw(loads),
        waiting=draw(loads),
        routes={k: draw(entry) for k in planned_keys},
        spill_threshold=draw(st.sampled_from([1.0, 1.2, 1.5, 2.0, 3.0])),
        spill_slack=draw(st.sampled_from([0.0, 0.5, 2.0, 4.0])),
        unplanned=draw(st.sampled_from(UNPLANNED_MODES)),
        seed=draw(st.integers(0, 2**32 - 1)),
        requests=draw(st.lists(st.one_of(st.none(), st.sampled_from(KEYS)), min_size=1, max_size=6)),
    )


def plan_of(state: State) -> Plan:
    n = len(state.in_flight)
    ids = destination_ids(n)
    destinations = [Destination(ids[i], f"10.1.0.{i + 1}:8000") for i in range(n)]
    return plan_from_routes(
        "pool",
        destinations,
        {affinity_key_hash(k): [ids[d] for d in v] for k, v in state.routes.items()},
        spill_threshold=state.spill_threshold,
    )


def router_decisions(state: State, plan: Plan) -> list[tuple[str, int]]:
    pool = EndpointPool(scraping=False)
    picker = Picker(pool, spill_slack=state.spill_slack, seed=state.seed, unplanned=state.unplanned)
    pool.set_plan_destinations(plan.destinations)
    picker.install(build_table(plan, "v1"))
    index = {d.address: i for i, d in enumerate(plan.destinations)}
    for d, flying, queued in zip(plan.destinations, state.in_flight, state.waiting, strict=True):
        endpoint = pool.by_address[d.address]
        for _ in range(flying):
            pool.acquire(endpoint)
        pool.record_scrape(endpoint, ok=True, waiting=queued)
    out = []
    for key in state.requests:
        decision = picker.pick(affinity_key_hash(key) if key is not None else None)
        out.append((decision.outcome, index[decision.endpoints[0].address]))
    return out


def trace_of(requests: Sequence[str | None]) -> RequestTrace:
    names = sorted({k for k in requests if k is not None})
    n = len(requests)
    return RequestTrace(
        arrival_s=np.zeros(n, dtype=np.float64),
        key=np.array([names.index(k) if k is not None else NO_KEY for k in requests], dtype=np.int64),
        input_tokens=np.full(n, 4, dtype=np.int64),
        output_tokens=np.ones(n, dtype=np.int64),
        block_offsets=np.arange(n + 1, dtype=np.int64),
        block_ids=np.arange(n, dtype=np.int64),
        block_size=4,
        key_names=tuple(names),
    )


def replay_decisions(state: State, plan: Plan) -> list[tuple[str, int]]:
    trace = trace_of(state.requests)
    req = RequestTable(trace.arrival_s.tolist(), trace.input_tokens.tolist(), trace.output_tokens.tolist())

    def blocks(i: int) -> list[int]:
        return [i]

    n = len(state.in_flight)
    engines = [Engine(d, PROFILE, trace.block_size, req, blocks) for d in range(n)]
    for engine, queued in zip(engines, state.waiting, strict=True):
        engine.waiting.extend(range(queued))
    view = RouterView(trace, engines, req, destination_ids=destination_ids(n), profile=PROFILE, get_blocks=blocks)
    policy = Planned(plan, spill_slack=state.spill_slack, unplanned=state.unplanned)
    policy.bind(view, state.seed)
    view.inflight[:] = state.in_flight
    view.total_inflight = sum(state.in_flight)
    out = []
    for i in range(len(state.requests)):
        planned, spilled = policy.planned_requests, policy.spilled_requests
        d = policy.route(i, 0.0)
        if policy.planned_requests > planned:
            outcome = PLANNED
        elif policy.spilled_requests > spilled:
            outcome = SPILLED
        else:
            outcome = P2C
        out.append((outcome, d))
    return out


@settings(max_examples=2000, deadline=None)
@given(states())
def test_router_and_replay_make_the_same_decisions(state: State) -> None:
    plan = plan_of(state)
    assert router_decisions(state, plan) == replay_decisions(state, plan)


def test_the_generated_states_reach_every_outcome() -> None:
    """The parity test above is only as good as its cases: they must plan, spill and p2c."""
    state = State(in_flight=[9, 0, 0], waiting=[3, 0, 0], routes={"user-0": [0], "user-1": [1, 2]},
                  spill_threshold=1.5, spill_slack=2.0, unplanned="key-p2c", seed=7,
                  requests=["user-0", "user-1", "user-2", None])
    plan = plan_of(state)
    decisions = router_decisions(state, plan)
    assert [outcome for outcome, _ in decisions] == [SPILLED, PLANNED, P2C, P2C]
    assert decisions[0][1] != 0
    assert decisions == replay_decisions(state, plan)
