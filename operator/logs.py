"""Structured logs: one JSON object per line, never a prompt, a request body or an affinity key.

The operator never sees prompts, but object bodies can hold business keys (an AffinityPlan's
pinned routes): kopf prints whole bodies and patches at debug level, so those records keep their
text up to the object and drop the object itself.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_OMITTED = "<object omitted>"
_BODY_MARKERS = ("{'", '{"', "[{", "Body(", "Patch(")


def _redact(logger: str, message: str) -> str:
    if not logger.startswith("kopf"):
        return message
    cut = min((i for i in (message.find(m) for m in _BODY_MARKERS) if i >= 0), default=-1)
    return message if cut < 0 else message[:cut] + _OMITTED


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", "msg", "object"?, "exc"?}` per record."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": _redact(record.name, record.getMessage()),
        }
        ref = getattr(record, "k8s_ref", None)
        if isinstance(ref, dict) and ref.get("name"):
            out["object"] = "/".join(str(p) for p in (ref.get("kind"), ref.get("namespace"), ref.get("name")) if p)
        for key in ("pool", "event_reason"):
            if hasattr(record, key):
                out[key] = getattr(record, key)
        if record.exc_info:
            out["exc"] = _redact(record.name, self.formatException(record.exc_info))
        return json.dumps(out, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record = logging.makeLogRecord(record.__dict__)
        record.msg, record.args = _redact(record.name, record.getMessage()), None
        return super().format(record)


# Handlers that run on every watch event of pods and the like: their successes are not news.
ROUTINE_HANDLERS = ("pool_object_changed",)


class QuietRoutine(logging.Filter):
    """kopf reports every successful run at info level: drop timers' and per-event handlers' successes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO or not record.name.startswith("kopf"):
            return True
        message = record.getMessage()
        if not message.endswith("succeeded."):
            return True
        routine = message.startswith("Timer '") or any(message == f"Handler '{h}' succeeded." for h in ROUTINE_HANDLERS)
        return not routine


def configure(level: str = "info", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(QuietRoutine())
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    # The client libraries log request bodies at debug level.
    for noisy in ("urllib3", "kubernetes", "aiohttp.access", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.INFO, root.level))
    # httpx logs every Prometheus query at info level: dozens a minute with a few plans.
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(root.level if root.level <= logging.DEBUG else logging.WARNING)
