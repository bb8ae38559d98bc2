"""Plans from a ConfigMap volume: hot reload, atomic swap, last good plan kept."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cacheroute.planner.plan import Destination, Plan, affinity_key_hash, plan_from_routes
from cacheroute.planner.plan_format import encode_plan
from cacheroute.router.endpoints import EndpointPool
from cacheroute.router.metrics import RouterMetrics
from cacheroute.router.picker import Picker
from cacheroute.router.plans import DirectoryPlanSource, PlanStore

ADDRESSES = ["10.0.0.1:8000", "10.0.0.2:8000"]


def plan(alice: int) -> Plan:
    destinations = [Destination(f"pool-{i}", a) for i, a in enumerate(ADDRESSES)]
    return plan_from_routes("pool", destinations, {affinity_key_hash("alice"): [f"pool-{alice}"]})


def kubelet_write(directory: Path, files: dict[str, bytes], generation: int) -> None:
    """What the kubelet does: a new timestamped directory, then an atomic `..data` swap."""
    stamp = directory / f"..2026_01_01_00_00_0{generation}"
    stamp.mkdir()
    for name, data in files.items():
        (stamp / name).write_bytes(data)
    (directory / "..data_tmp").symlink_to(stamp.name)
    os.replace(directory / "..data_tmp", directory / "..data")
    for name in files:
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(Path("..data") / name)


def store() -> tuple[PlanStore, Picker, RouterMetrics]:
    pool = EndpointPool(scraping=False)
    picker = Picker(pool, seed=1)
    metrics = RouterMetrics(pool, sketch_size=8, export_key_names=False)
    return PlanStore(pool, picker, metrics), picker, metrics


def routed(picker: Picker) -> str:
    return picker.pick(affinity_key_hash("alice")).endpoints[0].address


async def test_directory_swaps_are_picked_up_and_bad_payloads_are_rejected(tmp_path: Path) -> None:
    plan_store, picker, metrics = store()
    source = DirectoryPlanSource(tmp_path, plan_store, interval=0.05)
    worker = asyncio.create_task(plan_store.run())
    try:
        first = encode_plan(plan(0))
        kubelet_write(tmp_path, first.files, 1)
        assert source.poll()
        assert not source.poll()  # nothing changed
        await _until(lambda: plan_store.version == first.version)
        assert routed(picker) == ADDRESSES[0]

        second = encode_plan(plan(1))
        kubelet_write(tmp_path, second.files, 2)
        assert source.poll()
        await _until(lambda: plan_store.version == second.version)
        assert routed(picker) == ADDRESSES[1]

        broken = dict(encode_plan(plan(0)).files)
        broken["routes-0000.bin.gz"] = broken["routes-0000.bin.gz"][:-8]
        kubelet_write(tmp_path, broken, 3)
        assert source.poll()
        await _until(lambda: rejected(metrics) == 1)
        assert plan_store.version == second.version
        assert plan_store.last_error is not None and "routes-0000.bin.gz" in plan_store.last_error
        assert routed(picker) == ADDRESSES[1]
    finally:
        worker.cancel()


def rejected(metrics: RouterMetrics) -> float | None:
    return metrics.registry.get_sample_value("cacheroute_router_plan_loads_total", {"result": "rejected"})


async def test_running_sources_apply_a_new_plan_within_a_second(tmp_path: Path) -> None:
    plan_store, picker, _ = store()
    source = DirectoryPlanSource(tmp_path, plan_store, interval=0.05)
    kubelet_write(tmp_path, encode_plan(plan(0)).files, 1)
    tasks = [asyncio.create_task(plan_store.run()), asyncio.create_task(source.run())]
    try:
        await _until(lambda: plan_store.loaded)
        started = time.monotonic()
        kubelet_write(tmp_path, encode_plan(plan(1)).files, 2)
        await _until(lambda: routed(picker) == ADDRESSES[1])
        assert time.monotonic() - started < 1.0
    finally:
        for task in tasks:
            task.cancel()


async def test_half_written_configmaps_get_time_to_settle() -> None:
    plan_store, _picker, metrics = store()
    good = encode_plan(plan(0))
    assert await plan_store.process(good.files, origin="test")
    newer = dict(encode_plan(plan(1)).files)
    shard = newer.pop("routes-0000.bin.gz")
    task = asyncio.create_task(plan_store.run())
    try:
        plan_store.submit(newer, origin="configmaps", settle=0.3)
        # The missing shard arrives before the settle time: nothing is reported as rejected.
        plan_store.submit({**newer, "routes-0000.bin.gz": shard}, origin="configmaps", settle=0.3)
        await _until(lambda: plan_store.version != good.version)
        # A negative check: wait out the settle time of the incomplete payload, then look.
        await asyncio.sleep(0.4)
        assert rejected(metrics) == 0
        broken = {**newer, "routes-0000.bin.gz": b"not gzip"}
        plan_store.submit({**broken, "plan.json.gz": encode_plan(plan(0)).files["plan.json.gz"]},
                          origin="configmaps", settle=0.1)
        await _until(lambda: rejected(metrics) == 1)
    finally:
        task.cancel()


async def test_a_plan_volume_caught_between_shard_and_header_writes_gets_time_to_settle(tmp_path: Path) -> None:
    plan_store, picker, metrics = store()
    source = DirectoryPlanSource(tmp_path, plan_store, interval=0.05, settle=0.3)
    worker = asyncio.create_task(plan_store.run())
    try:
        first = encode_plan(plan(0))
        kubelet_write(tmp_path, first.files, 1)
        assert source.poll()
        await _until(lambda: plan_store.version == first.version)
        second = encode_plan(plan(1))
        # The kubelet projected the new header beside the old shard: a payload that does not match.
        kubelet_write(tmp_path, {**first.files, "plan.json.gz": second.files["plan.json.gz"]}, 2)
        assert source.poll()
        kubelet_write(tmp_path, second.files, 3)
        assert source.poll()
        await _until(lambda: plan_store.version == second.version)
        # A negative check: wait out the settle time of the mixed payload, then look.
        await asyncio.sleep(0.4)
        assert rejected(metrics) == 0
        assert routed(picker) == ADDRESSES[1]
        # A mixed payload that stays is reported once the settle time has passed.
        kubelet_write(tmp_path, {**second.files, "plan.json.gz": first.files["plan.json.gz"]}, 4)
        assert source.poll()
        await _until(lambda: rejected(metrics) == 1)
        assert plan_store.version == second.version
        # A payload that is broken rather than mixed is reported at once, whatever the settle time.
        broken = {**second.files, "plan.json.gz": b"not gzip"}
        assert not await plan_store.process(broken, origin=str(tmp_path), settle=60.0)
        assert rejected(metrics) == 2
    finally:
        worker.cancel()


async def _until(check: Callable[[], bool], within: float = 5.0) -> None:
    """Await `check()` becoming true, polling; fail after `within` seconds."""
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            pytest.fail("condition not met in time")
        await asyncio.sleep(0.01)
