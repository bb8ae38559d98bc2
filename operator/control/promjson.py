"""Prometheus' instant-vector answers, as `label value -> sample value`.

Every query of a period aggregates `by` one label, so every item of an answer has the same shape,
`{"metric":{"<label>":"<value>"},"value":[<time>,"<sample>"]}`. At the report's scale a per-key
answer holds 128,826 such items (about 10 MB), and building a dictionary, a list and two strings
per item (`json.loads`) costs three times what one pass of a pattern over the bytes does (0.27 s
against 0.09 s an answer, one core); the period's three per-key answers are decoded under one
interpreter lock. The pattern reads an answer only when it accounts for every item; anything else
(a label value with an escape, an item without the label, an error) is decoded by `json`.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

_VECTOR = b'{"status":"success","data":{"resultType":"vector","result":['
_ITEM_START = b'{"metric":'


class AnswerError(ValueError):
    """Prometheus answered, but not with an instant vector."""


@functools.cache
def _item(label: str) -> re.Pattern[bytes]:
    name = re.escape(label.encode("ascii"))
    return re.compile(rb'\{"metric":\{"' + name + rb'":"([^"\\]*)"\},"value":\[[^,\]]*,"([^"\\]*)"\]\}')


def values_by_label(result: Sequence[Mapping[str, Any]], label: str) -> dict[str, float]:
    """`label` value -> sample value of a decoded instant vector; items without the label and
    non-finite samples are dropped."""
    out: dict[str, float] = {}
    for item in result:
        name = item.get("metric", {}).get(label)
        if name is None:
            continue
        value = float(item["value"][1])
        if math.isfinite(value):
            out[name] = value
    return out


def _decoded(body: bytes) -> list[dict[str, Any]]:
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise AnswerError(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("status") != "success":
        error = doc.get("error") if isinstance(doc, dict) else None
        raise AnswerError(f"status {doc.get('status') if isinstance(doc, dict) else None!r}: {error}")
    data = doc.get("data") or {}
    if data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
        raise AnswerError(f"expected an instant vector, got {data.get('resultType')!r}")
    result: list[dict[str, Any]] = data["result"]
    return result


def pattern_values(body: bytes, label: str) -> dict[str, float] | None:
    """The answer read by the pattern; None unless it is an instant vector whose every item the
    pattern reads."""
    if not body.startswith(_VECTOR):
        return None
    items = _item(label).findall(body)
    if len(items) != body.count(_ITEM_START):
        return None
    out: dict[str, float] = {}
    for name, sample in items:
        value = float(sample)
        if math.isfinite(value):
            out[name.decode("utf-8")] = value
    return out


def vector_values(body: bytes, label: str) -> dict[str, float]:
    """`label` value -> sample value of the instant vector in a `/api/v1/query` answer."""
    fast = pattern_values(body, label)
    return fast if fast is not None else values_by_label(_decoded(body), label)
