"""The generated CRDs are structural, complete, and agree with the Python models."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from cacheroute.operator.api.crdgen import MODELS, crd, crd_file_name, render
from cacheroute.operator.api.manifests import field_errors
from cacheroute.operator.api.plan import AffinityPlan
from cacheroute.operator.api.pool import InferencePool

REPO = Path(__file__).resolve().parents[3]
FORBIDDEN = {
    "$ref",
    "$defs",
    "definitions",
    "id",
    "additionalItems",
    "patternProperties",
    "dependencies",
    "const",
    "prefixItems",
    "title",
}
ROOT_ALLOWED = {
    "type",
    "description",
    "required",
    "properties",
    "x-kubernetes-validations",
    "x-kubernetes-preserve-unknown-fields",
}
JUNCTORS = ("anyOf", "oneOf", "allOf", "not")


def walk(node: dict[str, Any], path: str = "$") -> list[str]:
    """Every violation of the structural-schema rules below `node`."""
    problems: list[str] = []
    for key in FORBIDDEN & node.keys():
        problems.append(f"{path}: forbidden keyword {key}")
    if node.get("type") == "null":
        problems.append(f"{path}: type null")
    if node.get("uniqueItems") is True:
        problems.append(f"{path}: uniqueItems true")
    if "additionalProperties" in node and "properties" in node:
        problems.append(f"{path}: additionalProperties beside properties")
    typed = "type" in node or node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
    if not typed:
        problems.append(f"{path}: no type")
    if node.get("nullable") and "type" not in node:
        problems.append(f"{path}: nullable without type")
    for j in JUNCTORS:
        for i, sub in enumerate(node.get(j, [])):
            bad = {"type", "default", "nullable", "description"} & sub.keys()
            if bad:
                problems.append(f"{path}.{j}[{i}]: junctor carries {sorted(bad)}")
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if key in node and not isinstance(node[key], bool):
            problems.append(f"{path}: {key} must be a boolean")
    items = node.get("items")
    if isinstance(items, list):
        problems.append(f"{path}: array-form items")
    elif isinstance(items, dict):
        problems += walk(items, f"{path}[]")
    elif node.get("type") == "array":
        problems.append(f"{path}: array without items")
    for name, sub in node.get("properties", {}).items():
        problems += walk(sub, f"{path}.{name}")
    if isinstance(node.get("additionalProperties"), dict):
        problems += walk(node["additionalProperties"], f"{path}{{*}}")
    return problems


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_schema_is_structural(model: type[InferencePool] | type[AffinityPlan]) -> None:
    schema = crd(model)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert set(schema) <= ROOT_ALLOWED, set(schema) - ROOT_ALLOWED
    assert walk(schema) == []


def test_walker_catches_violations() -> None:
    bad = {
        "type": "object",
        "properties": {
            "a": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "b": {"type": "object", "properties": {"x": {"type": "string"}}, "additionalProperties": False},
            "c": {"$ref": "#/$defs/C"},
            "d": {"type": "number", "exclusiveMinimum": 0},
        },
    }
    found = "\n".join(walk(bad))
    for needle in (
        "$.a: no type",
        "$.b: additionalProperties beside properties",
        "forbidden keyword $ref",
        "$.d: exclusiveMinimum must be a boolean",
    ):
        assert needle in found


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_committed_crds_match_the_models(model: type[InferencePool] | type[AffinityPlan]) -> None:
    committed = (REPO / "crds" / crd_file_name(model)).read_text("utf-8")
    assert committed == render(model), "crds/ is stale: run `cacheroute crds --out crds`"


def test_crd_metadata() -> None:
    pool, plan = crd(InferencePool), crd(AffinityPlan)
    assert pool["metadata"]["name"] == "inferencepools.cacheroute.dev"
    for obj, columns in (
        (pool, ["Ready", "Reason", "Degraded", "Available", "Replicas", "TP", "GPU", "Age"]),
        (plan, ["Pool", "Mode", "Ready", "Degraded", "Plan", "Keys", "KV hit", "Age"]),
    ):
        version = obj["spec"]["versions"][0]
        assert version["subresources"] == {"status": {}}
        names = [c["name"] for c in version["additionalPrinterColumns"]]
        assert all(c in names for c in columns)
        assert obj["spec"]["names"]["shortNames"]
        conditions = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["conditions"]
        assert conditions["x-kubernetes-list-type"] == "map"
        assert conditions["x-kubernetes-list-map-keys"] == ["type"]


def test_cross_field_rules_are_cel_with_messages() -> None:
    spec = crd(AffinityPlan)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = {r["message"]: r["rule"] for r in spec["x-kubernetes-validations"]}
    assert any("Manual" in m for m in rules)
    assert any("maxDestinationsPerKey" in r for r in rules.values())
    pool_spec = crd(InferencePool)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert any("tensorParallelSize" in r["rule"] for r in pool_spec["x-kubernetes-validations"])


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """What the API server's structural defaulting does to an object."""
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for name, sub in schema["properties"].items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = apply_defaults(sub, out[name])
        return out
    if isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], v) for v in value]
    return value


@pytest.mark.parametrize(
    ("model", "minimal"),
    [
        (InferencePool, {"model": {"name": "meta-llama/Llama-3.3-70B-Instruct"}}),
        (AffinityPlan, {"poolRef": {"name": "llama"}, "pinned": [{"key": "tenant-a", "destinations": ["llama-0"]}]}),
    ],
    ids=["InferencePool", "AffinityPlan"],
)
def test_api_server_defaults_equal_python_defaults(model: Any, minimal: dict[str, Any]) -> None:
    schema = crd(model)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    defaulted = apply_defaults(schema, minimal)
    python = model.model_validate({"spec": minimal}).spec.wire()
    assert defaulted == python


def int_or_word_fields(node: dict[str, Any], path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """(path under spec, schema node) of every int-or-string field."""
    if node.get("x-kubernetes-int-or-string"):
        return [(path, node)]
    children = node.get("properties", {}).items()
    return [hit for name, child in children for hit in int_or_word_fields(child, (*path, name))]


MINIMAL: dict[str, dict[str, Any]] = {
    "InferencePool": {"model": {"name": "meta-llama/Llama-3.3-70B-Instruct"}},
    "AffinityPlan": {"poolRef": {"name": "llama"}},
}


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_a_wrong_int_or_word_value_is_one_error_in_the_api_servers_words(model: Any) -> None:
    schema = crd(model)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    fields = int_or_word_fields(schema)
    assert fields, "the models have integer-or-auto fields"
    for path, node in fields:
        (rule,) = node["x-kubernetes-validations"]
        lowest = re.search(r"self >= (\d+)", rule["rule"])
        assert lowest is not None, rule
        below = int(lowest.group(1)) - 1
        for value, shown in (("lots", '"lots"'), ("300", '"300"'), (below, str(below))):
            spec = copy.deepcopy(MINIMAL[model.__name__])
            leaf = spec
            for name in path[:-1]:
                leaf = leaf.setdefault(name, {})
            leaf[path[-1]] = value
            with pytest.raises(ValidationError) as exc:
                model.model_validate({"spec": spec})
            # The offline check and the API server's CEL rule give the same sentence.
            assert field_errors(exc.value) == [f"spec.{'.'.join(path)}: {rule['message']}, not {shown}"]
            assert rule["messageExpression"].startswith(f"'{rule['message']}, not '")


def test_generated_yaml_is_loadable() -> None:
    for model in MODELS:
        doc = yaml.safe_load(render(model))
        assert doc["kind"] == "CustomResourceDefinition"
