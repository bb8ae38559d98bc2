"""Bad input is refused with a message naming the field; durations and rules behave."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cacheroute.operator.api.common import parse_duration
from cacheroute.operator.api.manifests import ManifestError, field_errors, load_manifests, parse_resource
from cacheroute.operator.api.plan import AffinityPlan
from cacheroute.operator.api.pool import InferencePool

POOL = {
    "apiVersion": "cacheroute.dev/v1alpha1",
    "kind": "InferencePool",
    "metadata": {"name": "llama"},
    "spec": {
        "model": {"name": "meta-llama/Llama-3.3-70B-Instruct", "quantization": "fp8"},
        "replicas": 30,
        "tensorParallelSize": 2,
    },
}


def plan(**spec: object) -> dict[str, object]:
    return {
        "apiVersion": "cacheroute.dev/v1alpha1",
        "kind": "AffinityPlan",
        "metadata": {"name": "p"},
        "spec": {"poolRef": {"name": "llama"}, **spec},
    }


def test_valid_pool_gets_defaults() -> None:
    pool = InferencePool.model_validate(POOL)
    assert pool.spec.gpu.product == "NVIDIA-H100-80GB-HBM3"
    assert pool.spec.memory.max_num_batched_tokens == "auto"
    assert pool.spec.router.key_header == "x-affinity-key"


def test_negative_replicas_names_the_field() -> None:
    bad = {**POOL, "spec": {**POOL["spec"], "replicas": -1}}  # type: ignore[dict-item]
    with pytest.raises(ValidationError) as exc:
        InferencePool.model_validate(bad)
    assert any(e.startswith("spec.replicas:") for e in field_errors(exc.value))


def test_unknown_mode_names_the_field() -> None:
    with pytest.raises(ValidationError) as exc:
        AffinityPlan.model_validate(plan(mode="Sometimes"))
    errors = field_errors(exc.value)
    assert any(e.startswith("spec.mode:") and "Auto" in e for e in errors)


def test_unknown_field_is_refused() -> None:
    with pytest.raises(ManifestError, match=r"spec\.replicaCount"):
        parse_resource({**POOL, "spec": {**POOL["spec"], "replicaCount": 3}}, "x")  # type: ignore[dict-item]


@pytest.mark.parametrize("tp", [3, 5, 16])
def test_tensor_parallel_must_divide_node_gpus(tp: int) -> None:
    with pytest.raises(ManifestError, match="tensorParallelSize must divide"):
        parse_resource({**POOL, "spec": {**POOL["spec"], "tensorParallelSize": tp}}, "x")  # type: ignore[dict-item]


def test_manual_memory_needs_bytes() -> None:
    spec = {**POOL["spec"], "memory": {"mode": "Manual"}}  # type: ignore[dict-item]
    with pytest.raises(ManifestError, match="kvCacheMemoryBytes"):
        parse_resource({**POOL, "spec": spec}, "x")


def test_max_num_batched_tokens_is_auto_or_bounded() -> None:
    for ok in ("auto", 2048):
        InferencePool.model_validate({**POOL, "spec": {**POOL["spec"], "memory": {"maxNumBatchedTokens": ok}}})  # type: ignore[dict-item]
    for bad in ("lots", 100):
        with pytest.raises(ValidationError, match="maxNumBatchedTokens"):
            InferencePool.model_validate({**POOL, "spec": {**POOL["spec"], "memory": {"maxNumBatchedTokens": bad}}})  # type: ignore[dict-item]


def test_manual_plan_requires_pinned_and_respects_max_destinations() -> None:
    with pytest.raises(ValidationError, match="Manual requires at least one pinned"):
        AffinityPlan.model_validate(plan(mode="Manual"))
    too_many = [{"key": "a", "destinations": ["d0", "d1", "d2"]}]
    with pytest.raises(ValidationError, match="maxDestinationsPerKey"):
        AffinityPlan.model_validate(plan(mode="Manual", pinned=too_many, budget={"maxDestinationsPerKey": 2}))
    ok = AffinityPlan.model_validate(plan(mode="Manual", pinned=too_many))
    assert ok.spec.pinned[0].destinations == ["d0", "d1", "d2"]


@pytest.mark.parametrize(("period", "accepted"), [("500ms", False), ("0s", False), ("1s", True), ("1h30m", True)])
def test_a_control_period_under_a_second_is_refused(period: str, accepted: bool) -> None:
    if accepted:
        assert AffinityPlan.model_validate(plan(controlPeriod=period)).spec.control_period == period
        return
    with pytest.raises(ValidationError, match="controlPeriod must be at least 1s"):
        AffinityPlan.model_validate(plan(controlPeriod=period))


def test_duplicate_pinned_keys_are_refused() -> None:
    twice = [{"key": "a", "destinations": ["d0"]}, {"key": "a", "destinations": ["d1"]}]
    with pytest.raises(ValidationError, match="pinned lists the key 'a' twice"):
        AffinityPlan.model_validate(plan(pinned=twice))
    with pytest.raises(ValidationError, match="pinned key 'a' lists d0 twice"):
        AffinityPlan.model_validate(plan(pinned=[{"key": "a", "destinations": ["d0", "d1", "d0"]}]))


@pytest.mark.parametrize(("text", "seconds"), [("5m", 300), ("1h30m", 5400), ("250ms", 0.25), ("3.5s", 3.5)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["5", "five minutes", "-5m", "5d", ""])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)
    with pytest.raises(ValidationError, match="controlPeriod"):
        AffinityPlan.model_validate(plan(controlPeriod=text))


def test_wrong_kind_and_api_version() -> None:
    with pytest.raises(ManifestError, match="kind 'Deployment'"):
        parse_resource({"apiVersion": "apps/v1", "kind": "Deployment"}, "x")
    with pytest.raises(ManifestError, match="apiVersion"):
        parse_resource({**POOL, "apiVersion": "cacheroute.dev/v1"}, "x")


def test_multi_document_yaml() -> None:
    import yaml

    text = yaml.safe_dump_all([POOL, plan()])
    kinds = [o.kind for o in load_manifests(text)]
    assert kinds == ["InferencePool", "AffinityPlan"]


@pytest.mark.parametrize("field", ["keyHeader", "sessionHeader"])
@pytest.mark.parametrize("value", ["x key", "x-key:", "", "ключ"])
def test_router_headers_must_be_http_header_names(field: str, value: str) -> None:
    # Every router would refuse a plan carrying such a header: the pool must refuse it first.
    bad = {**POOL, "spec": {**POOL["spec"], "router": {field: value}}}  # type: ignore[dict-item]
    with pytest.raises(ManifestError, match=f"router.{field}"):
        parse_resource(bad, "pool.yaml")


def test_the_empty_plan_of_a_valid_pool_passes_plan_validation() -> None:
    from cacheroute.operator.fleet import names, planmap

    pool = InferencePool.model_validate(
        {**POOL, "spec": {**POOL["spec"], "router": {"keyHeader": "X-Tenant", "sessionHeader": "x-session-id"}}}  # type: ignore[dict-item]
    )
    maps = planmap.build_plan_configmaps(names.PoolRef(name="llama", namespace="ns", uid="uid-1"), pool.spec)
    assert [m["metadata"]["name"] for m in maps] == ["llama-plan"]
