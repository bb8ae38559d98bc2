"""validate_plan and decode_plan: whatever the bytes, a plan error naming the problem, within bounded memory."""

from __future__ import annotations

import dataclasses
import gzip
import json
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cacheroute.planner import plan as plan_module
from cacheroute.planner.plan import (
    MAX_DESTINATIONS_PER_ROUTE,
    Destination,
    KeyExtraction,
    Plan,
    PlanError,
    affinity_key_hash,
    parse_destination_address,
    plan_from_routes,
    validate_plan,
)
from cacheroute.planner.plan_format import (
    HEADER_FILE,
    MAX_HEADER_BYTES,
    MAX_INFLATED_BYTES,
    decode_plan,
    encode_plan,
    max_shard_bytes,
)
from tests.support.plan_payloads import bad_payloads, bomb, forge

DESTINATIONS = [Destination("pool-0", "10.0.0.1:8000"), Destination("pool-1", "llama-1.llama.ns.svc:8000")]


def good_plan(**changes: object) -> Plan:
    routes = {affinity_key_hash(f"k{i}"): ["pool-0" if i % 2 else "pool-1"] for i in range(50)}
    plan = plan_from_routes("pool", DESTINATIONS, routes, generated_at="2026-01-01T00:00:00Z")
    return dataclasses.replace(plan, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "address", ["10.0.0.1:8000", "[::1]:9000", "[fd00::2]:80", "llama-0.llama.default.svc:8000", "localhost:1"]
)
def test_addresses_that_route(address: str) -> None:
    host, port = parse_destination_address(address)
    assert f"{host}:{port}" in (address, address.replace("[", "").replace("]", ""))


@pytest.mark.parametrize(
    ("address", "problem"),
    [
        ("not-an-address", "not host:port"),
        ("10.0.0.1", "not host:port"),
        ("10.0.0.1:0", "port '0'"),
        ("10.0.0.1:65536", "port '65536'"),
        ("10.0.0.1:08000", "port '08000'"),
        ("10.0.0.1:80a", "port '80a'"),
        (":8000", "not host:port"),
        ("::1:8000", "needs brackets"),
        ("[::1:8000", "unbalanced"),
        ("[::0:1]:80", "write it as [::1]:80"),
        ("Llama.svc:80", "lower-case DNS name"),
        ("under_score:80", "lower-case DNS name"),
        ("-lead:80", "lower-case DNS name"),
        ("10.0.0.999:80", "lower-case DNS name"),
        (7, "not a string"),
    ],
)
def test_addresses_that_do_not(address: object, problem: str) -> None:
    with pytest.raises(PlanError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        parse_destination_address(address)


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"pool": ""}, "pool must not be empty"),
        ({"pool": 5}, "pool must be a string"),
        ({"spill_threshold": float("nan")}, "spillThreshold is nan"),
        ({"spill_threshold": float("inf")}, "spillThreshold is inf"),
        ({"spill_threshold": 0.5}, "spillThreshold is 0.5"),
        ({"spill_threshold": "1.5"}, "spillThreshold must be a number"),
        ({"spill_threshold": True}, "spillThreshold must be a number"),
        ({"generated_at": None}, "generatedAt must be a string"),
        ({"key_extraction": KeyExtraction(header="")}, "keyExtraction.header must not be empty"),
        ({"key_extraction": KeyExtraction(header="x key")}, "not an HTTP header name"),
        ({"key_extraction": KeyExtraction(body_field=5)}, "bodyField must be a string"),  # type: ignore[arg-type]
        ({"key_extraction": KeyExtraction(prompt_prefix_chars=-1)}, "promptPrefixChars is -1"),
        ({"key_extraction": KeyExtraction(prompt_prefix_chars=10**9)}, "promptPrefixChars is 1000000000"),
        ({"destinations": (Destination("pool-0", "nowhere"), DESTINATIONS[1])}, "nowhere"),
        ({"destinations": (Destination("pool-0", "10.0.0.1:80", float("nan")), DESTINATIONS[1])}, "weight is nan"),
        ({"destinations": (Destination("pool-0", "10.0.0.1:80", 0.0), DESTINATIONS[1])}, "weight is 0.0"),
        ({"destinations": (Destination("pool-0", "10.0.0.1:80", 1.0, -1), DESTINATIONS[1])}, "kvCapacityTokens"),
        # One past the bound, which a float comparison would take for the bound itself.
        (
            {"destinations": (Destination("pool-0", "10.0.0.1:80", 1.0, 2**53 + 1), DESTINATIONS[1])},
            "kvCapacityTokens is 9007199254740993",
        ),
        ({"destinations": (Destination("pool 0", "10.0.0.1:80"), DESTINATIONS[1])}, "white space"),
        (
            {"destinations": (Destination("pool-0", "10.0.0.1:80"), Destination("pool-1", "10.0.0.1:80"))},
            "is also pool-0's",
        ),
    ],
)
def test_validate_plan_names_the_field(changes: dict[str, object], problem: str) -> None:
    with pytest.raises(PlanError, match=problem):
        validate_plan(good_plan(**changes))


def test_validate_plan_accepts_what_the_planner_writes() -> None:
    validate_plan(good_plan())
    validate_plan(good_plan(destinations=(Destination("pool-0"), Destination("pool-1"))))  # addresses from slices


def test_route_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_module, "MAX_ROUTES", 10)
    with pytest.raises(PlanError, match="50 routes: a plan holds at most 10"):
        validate_plan(good_plan())
    many = [Destination(f"pool-{i}", f"10.0.1.{i}:80") for i in range(MAX_DESTINATIONS_PER_ROUTE + 1)]
    wide = plan_from_routes("pool", many, {1: [d.id for d in many]})
    with pytest.raises(PlanError, match=f"has {MAX_DESTINATIONS_PER_ROUTE + 1} destinations"):
        validate_plan(wide)


def test_decode_runs_the_validation() -> None:
    payload = encode_plan(good_plan(destinations=(Destination("pool-0", "not-an-address"), DESTINATIONS[1])))
    with pytest.raises(PlanError, match="not-an-address"):
        decode_plan(payload.files)


BAD = bad_payloads(good_plan())


@pytest.mark.parametrize("case", sorted(BAD))
def test_every_class_of_bad_payload_is_a_plan_error(case: str) -> None:
    files = BAD[case]
    with pytest.raises(PlanError) as caught:
        decode_plan(files)
    assert "\n" not in str(caught.value)


def test_inflating_stops_at_the_limit_without_producing_the_rest() -> None:
    """A gzip bomb costs about the limit in memory, not its inflated size."""
    files = dict(encode_plan(good_plan()).files)
    files[HEADER_FILE] = bomb(64 * 1024 * 1024)
    assert len(files[HEADER_FILE]) < (1 << 20)  # under a megabyte that inflates to 64 MiB
    tracemalloc.start()
    try:
        with pytest.raises(PlanError, match="inflates past the limit"):
            decode_plan(files)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * MAX_HEADER_BYTES + (1 << 20)


def test_limits_follow_from_the_route_cap() -> None:
    assert max_shard_bytes(0) == 12
    assert max_shard_bytes(plan_module.MAX_ROUTES) <= MAX_INFLATED_BYTES
    # The largest legitimate plan still decodes: MAX_DESTINATIONS_PER_ROUTE destinations on every key.
    many = [Destination(f"pool-{i}", f"10.0.1.{i}:80") for i in range(MAX_DESTINATIONS_PER_ROUTE)]
    routes = {affinity_key_hash(f"k{i}"): [d.id for d in many] for i in range(2000)}
    wide = plan_from_routes("pool", many, routes)
    assert len(decode_plan(encode_plan(wide).files)) == 2000


def test_a_forged_but_valid_header_still_decodes() -> None:
    """The forging helper itself signs correctly, so the rejections above are about content."""
    files = forge(dict(encode_plan(good_plan()).files), lambda h: h.update(spillThreshold=2.0))
    assert decode_plan(files).spill_threshold == 2.0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    header=st.one_of(json_values, st.fixed_dictionaries({"schema": st.just("cacheroute.dev/plan/v1")}, optional={
        "version": st.text(max_size=20), "pool": json_values, "destinations": json_values, "shards": json_values,
        "spillThreshold": json_values, "keyExtraction": json_values, "summary": json_values,
        "routeCount": json_values,
    })),
    shard=st.binary(max_size=64),
    sign_it=st.booleans(),
)
def test_random_headers_and_shards_only_ever_raise_plan_errors(header: object, shard: bytes, sign_it: bool) -> None:
    from tests.support.plan_payloads import sign

    if sign_it and isinstance(header, dict):
        header = sign(header)
    files = {HEADER_FILE: gzip.compress(json.dumps(header).encode(), mtime=0), "routes-0000.bin.gz": shard}
    try:
        plan = decode_plan(files)
    except PlanError:
        return
    validate_plan(plan)  # anything that decodes is a valid plan


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=512))
def test_random_bytes_only_ever_raise_plan_errors(data: bytes) -> None:
    for files in ({HEADER_FILE: data}, {HEADER_FILE: gzip.compress(data, mtime=0)}):
        with pytest.raises(PlanError):
            decode_plan(files)


def test_numpy_arrays_of_the_wrong_type_are_refused() -> None:
    plan = good_plan()
    with pytest.raises(PlanError, match="route_dests must be"):
        validate_plan(dataclasses.replace(plan, route_dests=plan.route_dests.astype(np.int64)))


def test_the_entry_credit_travels_in_the_header_and_is_checked() -> None:
    soft = good_plan(entry_credit=0.4)
    assert decode_plan(encode_plan(soft).files).entry_credit == 0.4
    # A plan that keeps keys on their entries writes no credit: its version is what it always was.
    files = encode_plan(good_plan()).files
    assert "entryCredit" not in json.loads(gzip.decompress(files[HEADER_FILE]))
    assert decode_plan(files).entry_credit == 1.0
    assert encode_plan(soft).version != encode_plan(good_plan()).version
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(PlanError, match="entryCredit"):
            validate_plan(good_plan(entry_credit=bad))
    forged = forge(dict(files), lambda h: h.update(entryCredit=3.0))
    with pytest.raises(PlanError, match="entryCredit"):
        decode_plan(forged)
