"""Prometheus' answers read fast give exactly what decoding them as JSON gives."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheroute.operator.control.promjson import AnswerError, pattern_values, values_by_label, vector_values


def answer(items: list[tuple[dict[str, str], str]], *, ensure_ascii: bool = False) -> bytes:
    """An `/api/v1/query` answer as Prometheus writes it (compact, labels in order)."""
    result = [{"metric": metric, "value": [1764547200.123, sample]} for metric, sample in items]
    doc = {"status": "success", "data": {"resultType": "vector", "result": result}}
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=ensure_ascii).encode()


def decoded(body: bytes, label: str) -> dict[str, float]:
    return values_by_label(json.loads(body)["data"]["result"], label)


def test_per_key_counts_are_read_with_non_finite_samples_dropped() -> None:
    body = answer([({"key": "00ff00ff00ff00ff"}, "12.5"), ({"key": "__other__"}, "3"),
                   ({"key": "a"}, "NaN"), ({"key": "b"}, "+Inf"), ({"key": "c"}, "-Inf"), ({"key": "d"}, "1e-3")])
    assert vector_values(body, "key") == {"00ff00ff00ff00ff": 12.5, "__other__": 3.0, "d": 0.001}
    assert pattern_values(body, "key") == vector_values(body, "key")


def test_items_the_pattern_cannot_read_whole_are_decoded_as_json() -> None:
    quoted = answer([({"key": 'say "hi"'}, "1"), ({"key": "plain"}, "2")])
    assert pattern_values(quoted, "key") is None
    assert vector_values(quoted, "key") == {'say "hi"': 1.0, "plain": 2.0}
    unlabelled = answer([({}, "5"), ({"key": "k"}, "2")])
    assert vector_values(unlabelled, "key") == {"k": 2.0}
    escaped = answer([({"pod": "llama-0<x>"}, "1")], ensure_ascii=True).replace(b"<", b"\\u003c")
    assert vector_values(escaped, "pod") == {"llama-0<x>": 1.0}


def test_an_empty_vector_is_empty() -> None:
    assert vector_values(answer([]), "key") == {}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"status":"error","errorType":"bad_data","error":"parse error"}', "parse error"),
        (b'{"status":"success","data":{"resultType":"matrix","result":[]}}', "instant vector"),
        (b"<html>proxy error</html>", "not JSON"),
        (b"[]", "status None"),
    ],
)
def test_answers_that_are_not_an_instant_vector_are_refused_with_what_they_were(body: bytes, message: str) -> None:
    with pytest.raises(AnswerError, match=message):
        vector_values(body, "key")


label_values = st.text(min_size=1, max_size=12)
samples = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.sampled_from(["NaN", "+Inf", "-Inf", "0", "1e+300"]),
)


@settings(max_examples=300)
@given(st.dictionaries(label_values, samples, max_size=20), st.booleans(), st.sampled_from(["key", "pod"]))
def test_any_answer_reads_as_its_json_decoding(series: dict[str, str], ascii_only: bool, label: str) -> None:
    body = answer([({label: name}, sample) for name, sample in series.items()], ensure_ascii=ascii_only)
    got = vector_values(body, label)
    assert got == decoded(body, label)
    assert all(math.isfinite(v) for v in got.values())


def test_another_label_than_the_answer_is_keyed_by_reads_nothing() -> None:
    body: Any = answer([({"pod": "llama-0"}, "1")])
    assert vector_values(body, "key") == {}
