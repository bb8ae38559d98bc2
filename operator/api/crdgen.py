"""CustomResourceDefinitions generated from the pydantic models.

pydantic emits JSON Schema 2020-12; the API server wants a *structural* OpenAPI v3 subset. The
rewrite below inlines references and turns each construct the API server refuses into its
Kubernetes spelling (nullable, int-or-string, boolean exclusive bounds, ...).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from cacheroute.operator.api.common import GROUP, VERSION, int_or_words_message
from cacheroute.operator.api.plan import AffinityPlan
from cacheroute.operator.api.pool import InferencePool
from cacheroute.operator.files import write_atomically

MODELS: tuple[type[InferencePool] | type[AffinityPlan], ...] = (InferencePool, AffinityPlan)
_DROP_KEYS = {"title", "additionalProperties", "examples", "$defs", "uniqueItems"}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_resolve(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].split("/")[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        return _resolve({**target, **extra}, defs)
    return {k: _resolve(v, defs) for k, v in node.items()}


def _rewrite(node: Any) -> Any:
    if isinstance(node, list):
        return [_rewrite(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    for junctor in ("anyOf", "oneOf"):
        if junctor in node:
            node = _collapse_union(node, [_rewrite(o) for o in node.pop(junctor)])
    if "allOf" in node and len(node["allOf"]) == 1:
        node = {**node.pop("allOf")[0], **node}
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "exclusiveMinimum" in node and not isinstance(node["exclusiveMinimum"], bool):
        node["minimum"] = node.pop("exclusiveMinimum")
        node["exclusiveMinimum"] = True
    if "exclusiveMaximum" in node and not isinstance(node["exclusiveMaximum"], bool):
        node["maximum"] = node.pop("exclusiveMaximum")
        node["exclusiveMaximum"] = True
    if "prefixItems" in node:
        node["items"] = node.pop("prefixItems")[0]
    # A map (dict[str, X]) keeps additionalProperties; it is only forbidden beside properties.
    keep_map = (
        "additionalProperties" in node and "properties" not in node and isinstance(node["additionalProperties"], dict)
    )
    out = {k: _rewrite(v) for k, v in node.items() if k not in _DROP_KEYS or (k == "additionalProperties" and keep_map)}
    if out.get("default", 0) is None:
        del out["default"]
    _default_nested_objects(out)
    return out


def _default_nested_objects(node: dict[str, Any]) -> None:
    """Give optional sub-objects `default: {}` so the API server applies their own defaults.

    pydantic leaves `default_factory` fields without a default; without one, an omitted `gpu`
    would stay absent and CEL rules reading `self.gpu.countPerNode` would fail.
    """
    required = set(node.get("required", ()))
    for name, prop in node.get("properties", {}).items():
        if (
            name not in required
            and prop.get("type") == "object"
            and "properties" in prop
            and not prop.get("nullable")
            and "default" not in prop
        ):
            prop["default"] = {}


def _collapse_union(node: dict[str, Any], options: list[dict[str, Any]]) -> dict[str, Any]:
    non_null = [o for o in options if o.get("type") != "null"]
    nullable = len(non_null) < len(options)
    types = {o.get("type") for o in non_null}
    if len(non_null) == 1:
        merged = {**non_null[0], **node}
    elif types == {"integer", "string"}:
        # `int | Literal["auto"]`: Kubernetes' int-or-string, the string part checked by CEL.
        ints = next(o for o in non_null if o.get("type") == "integer")
        strs = next(o for o in non_null if o.get("type") == "string")
        merged = {**node, "x-kubernetes-int-or-string": True}
        words = strs.get("enum", [])
        if words:
            merged["x-kubernetes-validations"] = [_int_or_word_rule(ints, words)]
    else:
        raise ValueError(f"union {options!r} has no structural form; restrict the model field")
    if nullable:
        merged["nullable"] = True
    return merged


def _int_or_word_rule(ints: dict[str, Any], words: list[str]) -> dict[str, str]:
    bounds = []
    if "minimum" in ints:
        bounds.append(f"self >= {ints['minimum']}")
    if "maximum" in ints:
        bounds.append(f"self <= {ints['maximum']}")
    message = int_or_words_message(ints.get("minimum"), ints.get("maximum"), words)
    number_rule = " && ".join(bounds) or "true"
    word_rule = " || ".join(f"self == '{w}'" for w in words)
    return {
        "rule": f"type(self) == int ? ({number_rule}) : ({word_rule})",
        "message": message,
        # The API server quotes an int-or-string field's value as "" in its error, so the message
        # names the value given, as `IntOrWords` does offline.
        "messageExpression": f"'{message}, not ' + (type(self) == int ? string(self) : '\"' + self + '\"')",
    }


def structural_schema(model: type[InferencePool] | type[AffinityPlan]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    resolved = _resolve(raw, raw.get("$defs", {}))
    schema: dict[str, Any] = _rewrite(resolved)
    props = schema["properties"]
    # The API server owns these; a schema for them would be pruned or refused.
    props["apiVersion"] = {"type": "string"}
    props["kind"] = {"type": "string"}
    props["metadata"] = {"type": "object"}
    spec_model = model.model_fields["spec"].annotation
    rules = getattr(spec_model, "rules", ())
    if rules:
        props["spec"]["x-kubernetes-validations"] = [r.as_schema() for r in rules]
    props["spec"].pop("default", None)
    props["status"].pop("default", None)
    props["status"].pop("nullable", None)
    schema["required"] = ["spec"]
    schema.pop("description", None)
    schema["description"] = (model.__doc__ or "").strip().splitlines()[0]
    return schema


def crd(model: type[InferencePool] | type[AffinityPlan]) -> dict[str, Any]:
    kind = model.model_fields["kind"].default
    plural = model.crd_plural
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "cacheroute", "app.kubernetes.io/part-of": "cacheroute"},
        },
        "spec": {
            "group": GROUP,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": list(model.crd_short_names),
                "categories": list(model.crd_categories),
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [dict(c) for c in model.crd_printer_columns],
                    "schema": {"openAPIV3Schema": structural_schema(model)},
                }
            ],
        },
    }


def crd_file_name(model: type[InferencePool] | type[AffinityPlan]) -> str:
    return f"{GROUP}_{model.crd_plural}.yaml"


def render(model: type[InferencePool] | type[AffinityPlan]) -> str:
    header = "# Generated by `cacheroute crds` from the pydantic models in operator/api_*.py. Do not edit.\n"
    return header + yaml.safe_dump(crd(model), sort_keys=False, width=120, allow_unicode=True)


def rendered_files() -> dict[str, str]:
    """Every file of crds/: the models' CRDs and kopf's peering CRDs."""
    from cacheroute.operator.api.peering import PEERING_FILE, render_peering

    files = {crd_file_name(model): render(model) for model in MODELS}
    files[PEERING_FILE] = render_peering()
    return files


def write_crds(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in rendered_files().items():
        path = out_dir / name
        write_atomically(path, text)
        written.append(path)
    return written
