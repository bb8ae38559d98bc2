"""Reading custom resources from YAML, with errors that name the field.

The rules are the API server's, so that what `cacheroute validate` accepts the cluster accepts:
types are strict (`replicas: "3"` and `replicas: true` are not integers; no number is a string),
integers fit in 64 bits, numbers are finite, and names are what the objects built from them
need (RFC 1123; an InferencePool's name also names a Service and a StatefulSet, hence a DNS-1035
label short enough for the StatefulSet's revision labels).
"""

from __future__ import annotations

import datetime
import json
import math
import re
from collections.abc import Iterator
from typing import Any, TextIO

import yaml
from pydantic import ValidationError

from cacheroute.operator.api.common import API_VERSION
from cacheroute.operator.api.plan import AffinityPlan
from cacheroute.operator.api.pool import InferencePool

KINDS: dict[str, type[InferencePool] | type[AffinityPlan]] = {
    "InferencePool": InferencePool,
    "AffinityPlan": AffinityPlan,
}


class ManifestError(ValueError):
    """A manifest that is not a valid resource; the message names the document and field."""


def field_errors(exc: ValidationError) -> list[str]:
    """`path.to.field: what is wrong` for every error, in wire (camelCase) names."""
    out = []
    for e in exc.errors():
        path = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        out.append(f"{path}: {msg}" if path else msg)
    return out


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# StatefulSet pods carry `controller-revision-hash: <name>-<10 characters>`, a 63-character label.
MAX_POOL_NAME = 52
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


MAX_VALUES = 1_000_000


def _check_values(obj: Any) -> None:
    """Integers within int64 and finite numbers, everywhere in the object (as the API server stores them).

    Walks at most MAX_VALUES values: YAML aliases can make a small file a huge tree.
    """
    stack: list[tuple[str, Any]] = [("", obj)]
    seen = 0
    while stack:
        path, value = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise ValueError(f"more than {MAX_VALUES:,} values (YAML aliases expanding?)")
        if isinstance(value, dict):
            stack.extend((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(f"{path}: {value} does not fit a 64-bit integer")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{path}: {value} is not a finite number")


def _check_name(obj: dict[str, Any], kind: str) -> None:
    meta = obj.get("metadata")
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise ValueError("metadata: expected a mapping")
    name = meta.get("name")
    if name is None and meta.get("generateName"):
        return
    if not isinstance(name, str) or not name:
        raise ValueError("metadata.name: required (a lower-case RFC 1123 name)")
    check_name(name, kind, "metadata.name")


def check_name(name: str, kind: str, what: str) -> None:
    """ValueError, naming `what`, when the API server would refuse `name` for an object of `kind`."""
    if len(name) > 253 or not _SUBDOMAIN.match(name):
        raise ValueError(
            f"{what} {name!r}: not an RFC 1123 name (lower-case letters, digits, '-' and '.', "
            "starting and ending with a letter or digit)"
        )
    if kind == "InferencePool" and (len(name) > MAX_POOL_NAME or not _LABEL_1035.match(name)):
        raise ValueError(
            f"{what} {name!r}: an InferencePool's name names its Service and StatefulSet: "
            f"at most {MAX_POOL_NAME} lower-case letters, digits and '-', starting with a letter"
        )


def _json_value(value: Any) -> Any:
    # YAML reads unquoted timestamps as datetimes; the API server keeps them as RFC 3339 strings.
    if isinstance(value, datetime.datetime | datetime.date):
        return value.isoformat().replace("+00:00", "Z")
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def parse_resource(obj: dict[str, Any], where: str = "") -> InferencePool | AffinityPlan:
    """Validate one decoded object with the API server's rules; raises ManifestError naming each bad field."""
    if not isinstance(obj, dict):
        # YAML reads most text that is not a manifest (a CSV, a log) as one string.
        got = {"str": "a line of text", "list": "a list", "int": "a number", "float": "a number"}.get(
            type(obj).__name__, type(obj).__name__
        )
        raise ManifestError(f"{where}: not a manifest (an object with apiVersion, kind and metadata): {got}")
    kind = obj.get("kind")
    if kind not in KINDS:
        raise ManifestError(f"{where}: kind {kind!r} is not one of {', '.join(KINDS)}")
    if obj.get("apiVersion") != API_VERSION:
        raise ManifestError(f"{where}: apiVersion {obj.get('apiVersion')!r} is not {API_VERSION}")
    try:
        _check_values(obj)
        _check_name(obj, kind)
        text = json.dumps(obj, default=_json_value, allow_nan=False)
    except (ValueError, TypeError) as exc:
        raise ManifestError(f"{where}: {exc}") from None
    except RecursionError:
        raise ManifestError(f"{where}: nested too deeply") from None
    try:
        # Strict JSON validation: the types the API server's schema allows, no coercion.
        return KINDS[kind].model_validate_json(text, strict=True)
    except ValidationError as exc:
        raise ManifestError(f"{where}: " + "; ".join(field_errors(exc))) from exc


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping of a YAML document names one key twice."""

    def __init__(self, key: Any, mark: yaml.Mark) -> None:
        super().__init__(None, None, f"duplicate key {key!r}", mark)
        self.key, self.line = key, mark.line + 1


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: kubectl, like a plain YAML
    load, keeps the last value without a word, and a manifest reviewed in Git says two things."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the base constructor says so
                continue
            if duplicate:
                raise DuplicateKeyError(key, key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def single_document(stream: TextIO) -> Any:
    """The one YAML document of `stream` (a file's name then marks its errors), keys unique."""
    return yaml.load(stream, Loader=_UniqueKeyLoader)


def documents(text: str, source: str = "<input>") -> Iterator[tuple[str, Any]]:
    """Every non-empty document of a YAML stream, with `source#index` to name it."""
    for i, doc in enumerate(yaml.load_all(text, Loader=_UniqueKeyLoader)):
        if doc is not None:
            yield f"{source}#{i}", doc


def load_manifests(text: str, source: str = "<input>") -> list[InferencePool | AffinityPlan]:
    """Every document of a YAML stream, validated; the first invalid one raises."""
    return [parse_resource(doc, where) for where, doc in documents(text, source)]
