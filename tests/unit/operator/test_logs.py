"""Operator logs are JSON lines and never carry object bodies (which may hold business keys)."""

from __future__ import annotations

import json
import logging

from cacheroute.operator.logs import JsonFormatter, QuietRoutine, configure


def record(name: str, level: int, message: str, **extra: object) -> logging.LogRecord:
    rec = logging.LogRecord(name, level, __file__, 1, message, None, None)
    rec.__dict__.update(extra)
    return rec


def test_kopf_bodies_are_cut_from_the_message() -> None:
    body = {"spec": {"pinned": [{"key": "customer-4711", "destinations": ["pool-0"]}]}}
    line = JsonFormatter().format(record("kopf.objects", logging.DEBUG, f"Creation is in progress: {body!r}"))
    out = json.loads(line)
    assert "customer-4711" not in line
    assert out["msg"] == "Creation is in progress: <object omitted>"
    assert out["level"] == "debug" and out["logger"] == "kopf.objects"


def test_object_and_event_fields_travel_as_json() -> None:
    ref = {"kind": "InferencePool", "namespace": "team-a", "name": "llama"}
    line = JsonFormatter().format(record("kopf.objects", logging.INFO, "MemoryPlanned: ok", k8s_ref=ref,
                                         pool="llama", event_reason="MemoryPlanned"))
    out = json.loads(line)
    assert out["object"] == "InferencePool/team-a/llama" and out["event_reason"] == "MemoryPlanned"
    assert out["ts"].endswith("Z")


def test_routine_successes_are_not_logged_but_failures_and_pool_handlers_are() -> None:
    quiet = QuietRoutine()
    assert not quiet.filter(record("kopf.objects", logging.INFO, "Timer 'pool_tick' succeeded."))
    assert not quiet.filter(record("kopf.objects", logging.INFO, "Handler 'pool_object_changed' succeeded."))
    assert quiet.filter(record("kopf.objects", logging.INFO, "Handler 'pool_changed' succeeded."))
    failed = "Handler 'pool_object_changed' failed with an exception."
    assert quiet.filter(record("kopf.objects", logging.ERROR, failed))


def test_prometheus_queries_are_logged_at_debug_level_only() -> None:
    root = logging.getLogger()
    libraries = ("urllib3", "kubernetes", "aiohttp.access", "asyncio", "httpx", "httpcore")
    saved = (list(root.handlers), root.level, {name: logging.getLogger(name).level for name in libraries})
    try:
        configure("info")
        assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
        assert logging.getLogger("httpx").isEnabledFor(logging.WARNING)
        configure("debug")
        assert logging.getLogger("httpx").isEnabledFor(logging.INFO)
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        for name, level in saved[2].items():
            logging.getLogger(name).setLevel(level)
