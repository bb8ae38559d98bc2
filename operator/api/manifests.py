"""Reading custom resources from YAML, with errors that name the field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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


def parse_resource(obj: dict[str, Any], where: str = "") -> InferencePool | AffinityPlan:
    """Validate one decoded object; raises ManifestError naming each bad field."""
    if not isinstance(obj, dict):
        raise ManifestError(f"{where}: expected a mapping, got {type(obj).__name__}")
    kind = obj.get("kind")
    if kind not in KINDS:
        raise ManifestError(f"{where}: kind {kind!r} is not one of {', '.join(KINDS)}")
    if obj.get("apiVersion") != API_VERSION:
        raise ManifestError(f"{where}: apiVersion {obj.get('apiVersion')!r} is not {API_VERSION}")
    try:
        return KINDS[kind].model_validate(obj)
    except ValidationError as exc:
        raise ManifestError(f"{where}: " + "; ".join(field_errors(exc))) from exc


def documents(text: str, source: str = "<input>") -> Iterator[tuple[str, Any]]:
    """Every non-empty document of a YAML stream, with `source#index` to name it."""
    for i, doc in enumerate(yaml.safe_load_all(text)):
        if doc is not None:
            yield f"{source}#{i}", doc


def load_manifests(text: str, source: str = "<input>") -> list[InferencePool | AffinityPlan]:
    """Every document of a YAML stream, validated; the first invalid one raises."""
    return [parse_resource(doc, where) for where, doc in documents(text, source)]
