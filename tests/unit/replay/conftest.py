"""Builders of tiny traces and engine profiles for the replay tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest

from cacheroute.planner.replay.hardware import EngineProfile
from cacheroute.planner.trace import NO_KEY, RequestTrace

TraceBuilder = Callable[..., RequestTrace]


def build_trace(
    requests: Sequence[tuple[float, str | None, int, int, Sequence[int]]],
    block_size: int = 4,
    name: str = "tiny",
) -> RequestTrace:
    """Requests as (arrival_s, key or None, input tokens, output tokens, block ids)."""
    names: list[str] = []
    index: dict[str, int] = {}
    keys = []
    for _, key, *_ in requests:
        if key is None:
            keys.append(NO_KEY)
            continue
        if key not in index:
            index[key] = len(names)
            names.append(key)
        keys.append(index[key])
    lens = [len(r[4]) for r in requests]
    offs = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum(lens, out=offs[1:])
    return RequestTrace(
        arrival_s=np.array([r[0] for r in requests], dtype=np.float64),
        key=np.array(keys, dtype=np.int64),
        input_tokens=np.array([r[2] for r in requests], dtype=np.int64),
        output_tokens=np.array([r[3] for r in requests], dtype=np.int64),
        block_offsets=offs,
        block_ids=np.array([b for r in requests for b in r[4]], dtype=np.int64),
        block_size=block_size,
        key_names=tuple(names),
        name=name,
    )


def flat_profile(step_s: float = 0.01, kv_capacity_tokens: int = 1000, batch_tokens: int = 8,
                 kv_read_s_per_token: float = 0.0, compute_s_per_token: float = 0.0) -> EngineProfile:
    """A profile whose step costs `step_s` plus the KV-read and compute terms given."""
    return EngineProfile(
        name="flat",
        step_overhead_s=0.0,
        weight_read_s=step_s,
        compute_s_per_token=compute_s_per_token,
        attention_s_per_pair=0.0,
        kv_read_s_per_token=kv_read_s_per_token,
        kv_capacity_tokens=kv_capacity_tokens,
        max_num_batched_tokens=batch_tokens,
    )


@pytest.fixture
def make_trace() -> TraceBuilder:
    return build_trace


@pytest.fixture
def make_profile() -> Callable[..., EngineProfile]:
    return flat_profile
