"""The objects a pool owns, as the operator builds them: what a cluster operator would check."""

from __future__ import annotations

import base64
import math
from pathlib import Path
from typing import Any

import pytest
import typer

from cacheroute.operator.api.common import parse_duration
from cacheroute.operator.api.pool import InferencePoolSpec
from cacheroute.operator.config import OperatorConfig
from cacheroute.operator.fleet import gie, names, pdb, planmap, router, services, statefulset
from cacheroute.operator.fleet.memory import MemoryOutcome
from cacheroute.operator.fleet.profiling_job import plan_for_pool, resolve_architecture
from cacheroute.operator.fleet.reconcile import desired_objects
from cacheroute.operator.rbac import OPERATOR_RULES, ROUTER_RULES
from cacheroute.planner.plan_format import decode_plan
from cacheroute.router.cli import app as router_app

POOL = names.PoolRef("llama", "team-a", "1234-uid")
SPEC = InferencePoolSpec.model_validate(
    {
        "model": {"name": "meta-llama/Llama-3.3-70B-Instruct", "quantization": "fp8"},
        "tensorParallelSize": 2,
        "replicas": 4,
        "engine": {"startupTimeout": "45m", "env": [{"name": "HF_HOME", "value": "/models"}]},
        "router": {"replicas": 3, "sessionHeader": "X-Session", "promptPrefixChars": 256},
    }
)
PLAN = plan_for_pool(SPEC, resolve_architecture(SPEC))
CONFIG = OperatorConfig()


def pod_spec(sts: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = sts["spec"]["template"]["spec"]
    return out


def test_engine_pods_land_on_the_gpu_product_with_tp_gpus_and_the_pod_settings_vllm_needs() -> None:
    sts = statefulset.build_statefulset(POOL, SPEC, PLAN, CONFIG.engine)
    spec = pod_spec(sts)
    container = spec["containers"][0]
    assert sts["spec"]["serviceName"] == "llama" and sts["spec"]["replicas"] == 4
    assert sts["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert spec["enableServiceLinks"] is False
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": CONFIG.engine.shm_size_limit}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true", "prometheus.io/port": "8000", "prometheus.io/path": "/metrics"
    }
    assert {"name": "HF_HOME", "value": "/models"} in container["env"]
    assert container["env"][0] == {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert container["args"][:5] == ["meta-llama/Llama-3.3-70B-Instruct", "--served-model-name",
                                     "meta-llama/Llama-3.3-70B-Instruct", "--host", "$(POD_IP)"]


def test_probes_wait_for_the_startup_timeout_and_readiness_means_the_model_is_served() -> None:
    container = pod_spec(statefulset.build_statefulset(POOL, SPEC, PLAN, CONFIG.engine))["containers"][0]
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= parse_duration("45m")
    assert startup["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/v1/models"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    drain = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = pod_spec(statefulset.build_statefulset(POOL, SPEC, PLAN, CONFIG.engine))["terminationGracePeriodSeconds"]
    assert 0 < drain < grace
    # Readiness every 5 s at most, and as often as the other probes when they are faster.
    assert (container["readinessProbe"]["periodSeconds"], container["livenessProbe"]["periodSeconds"]) == (5, 10)
    fast = CONFIG.engine.model_copy(update={"probe_period_seconds": 1})
    fast_container = pod_spec(statefulset.build_statefulset(POOL, SPEC, PLAN, fast))["containers"][0]
    assert {fast_container[p]["periodSeconds"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {1}


def test_startup_failures_round_up() -> None:
    assert statefulset.startup_failures("30m", 10) == 180
    assert statefulset.startup_failures("95s", 10) == math.ceil(9.5)


def test_every_owned_object_is_labelled_and_owned_by_the_pool() -> None:
    objects = desired_objects(POOL, SPEC, MemoryOutcome("Planned", "", plan=PLAN), CONFIG)
    everything = [*objects.engine, *objects.apply, *objects.create_only]
    assert sorted(o["kind"] for o in everything) == sorted(
        ["StatefulSet", "Service", "Service", "PodDisruptionBudget", "PodDisruptionBudget", "ServiceAccount", "Role",
         "RoleBinding", "Deployment", "ConfigMap"]
    )
    for obj in everything:
        meta = obj["metadata"]
        assert meta["namespace"] == "team-a"
        assert meta["ownerReferences"] == [POOL.owner_reference()]
        assert meta["ownerReferences"][0]["controller"] is True
        labels = meta["labels"]
        assert labels[names.MANAGED_BY] == "cacheroute" and labels[names.INSTANCE] == "llama"
        assert labels[names.POOL] == "llama" and labels[names.COMPONENT] in ("engine", "router", "plan")
    assert {o["metadata"]["name"] for o in everything} == {"llama", "llama-router", "llama-plan"}


def test_no_statefulset_without_a_memory_plan() -> None:
    objects = desired_objects(POOL, SPEC, MemoryOutcome("DoesNotFit", "too big"), CONFIG)
    assert [o["kind"] for o in objects.engine] == ["Service"]


def router_replicas(objects: Any) -> int:
    deployment = next(o for o in objects.apply if o["kind"] == "Deployment")
    return int(deployment["spec"]["replicas"])


@pytest.mark.parametrize("state", ["DoesNotFit", "ProfilingFailed", "InvalidModel"])
def test_a_pool_that_cannot_start_runs_no_router_unless_replicas_of_an_earlier_spec_serve(state: str) -> None:
    stopped = MemoryOutcome(state, "cannot start")  # type: ignore[arg-type]
    assert router_replicas(desired_objects(POOL, SPEC, stopped, CONFIG, engine_exists=False)) == 0
    assert router_replicas(desired_objects(POOL, SPEC, stopped, CONFIG, engine_exists=True)) == SPEC.router.replicas


def test_routers_run_while_the_replicas_are_planned_or_profiled() -> None:
    assert SPEC.router.replicas > 0
    for outcome in (MemoryOutcome("Planned", "", plan=PLAN), MemoryOutcome("Profiling", "measuring")):
        objects = desired_objects(POOL, SPEC, outcome, CONFIG, engine_exists=False)
        assert router_replicas(objects) == SPEC.router.replicas
    # With no engine to route to, a pool scaled to zero runs no router pod.
    zero = SPEC.model_copy(update={"replicas": 0})
    assert router_replicas(desired_objects(POOL, zero, MemoryOutcome("Planned", "", plan=PLAN), CONFIG)) == 0


def test_services_select_engines_and_routers() -> None:
    headless = services.build_headless_service(POOL, SPEC)
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == {"cacheroute.dev/pool": "llama", "app.kubernetes.io/component": "engine"}
    front = services.build_router_service(POOL)
    assert {(p["port"], p["name"]) for p in front["spec"]["ports"]} == {(8080, "http"), (9002, "grpc-ext-proc")}
    assert front["spec"]["selector"]["app.kubernetes.io/component"] == "router"
    budget = pdb.build_pdb(POOL)
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"] == headless["spec"]["selector"]
    # A node drain takes the routers one at a time too.
    routers = pdb.build_router_pdb(POOL)
    assert routers["spec"]["maxUnavailable"] == 1
    assert routers["spec"]["selector"]["matchLabels"] == front["spec"]["selector"]


def test_router_pod_has_picker_and_envoy_on_the_pod_ip_with_the_plan_mounted() -> None:
    deployment = router.build_deployment(POOL, SPEC, CONFIG)
    assert deployment["spec"]["replicas"] == 3
    spec = pod_spec(deployment)
    picker, envoy = spec["containers"]
    assert picker["image"] == envoy["image"] == CONFIG.router.image
    assert picker["args"][:2] == ["router", "serve"] and envoy["args"][:2] == ["router", "envoy"]
    for container in (picker, envoy):
        assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
    # The picker runs the image's compiled request path; Envoy has no Python to speed up.
    assert {"name": "PYTHONPATH", "value": router.NATIVE_PATH} in picker["env"]
    assert all(e["name"] != "PYTHONPATH" for e in envoy["env"])
    assert picker["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
    assert envoy["readinessProbe"]["httpGet"]["path"] == "/ready"
    volume = spec["volumes"][0]["projected"]["sources"]
    assert volume[0] == {"configMap": {"name": "llama-plan"}}
    assert [s["configMap"]["name"] for s in volume[1:]] == [f"llama-plan-{i}" for i in range(1, names.MAX_PLAN_SHARDS)]
    assert all(s["configMap"]["optional"] for s in volume[1:])
    assert spec["serviceAccountName"] == "llama-router"


def as_in_pod(args: list[str], plan_mount: Path) -> list[str]:
    """A router container's args as its process sees them: $(POD_IP) expanded by the kubelet,
    the plan's ConfigMap mounted (at `plan_mount`, a directory of the test's)."""
    return [a.replace("$(POD_IP)", "10.1.2.3").replace(router.PLAN_MOUNT, str(plan_mount)) for a in args]


def test_router_arguments_parse_with_the_router_commands_as_they_are(tmp_path: Path) -> None:
    """The args are what `cacheroute router serve|envoy` accept (the kubelet expands $(POD_IP),
    and the plan's ConfigMap is mounted where the args say: here a directory of the test's)."""
    deployment = router.build_deployment(POOL, SPEC, CONFIG)
    command = typer.main.get_command(router_app)

    def in_pod(args: list[str]) -> list[str]:
        return as_in_pod(args, tmp_path)

    for container in pod_spec(deployment)["containers"]:
        args = in_pod(container["args"])
        sub = command.commands[args[1]]  # type: ignore[attr-defined]
        ctx = sub.make_context(args[1], args[2:])
        assert ctx.params
    serve = command.commands["serve"].make_context("serve", in_pod(router.picker_args(POOL, SPEC, CONFIG))[2:])  # type: ignore[attr-defined]
    assert serve.params["plan_dir"] is not None and serve.params["service"] == "llama"
    assert serve.params["session_header"] == "X-Session" and serve.params["prompt_prefix_chars"] == 256
    assert serve.params["fallbacks"] == 0
    assert serve.params["follow_prefixes"] is True and serve.params["prefix_memory_blocks"] == 262_144
    off = SPEC.model_copy(update={"router": SPEC.router.model_copy(update={"follow_prefixes": False,
                                                                          "prefix_memory_blocks": 1000})})
    serve = command.commands["serve"].make_context("serve", in_pod(router.picker_args(POOL, off, CONFIG))[2:])  # type: ignore[attr-defined]
    assert serve.params["follow_prefixes"] is False and serve.params["prefix_memory_blocks"] == 1000


def test_a_stopping_router_pod_drains_envoy_and_keeps_its_picker_until_the_requests_are_through() -> None:
    command = typer.main.get_command(router_app)
    spec = pod_spec(router.build_deployment(POOL, SPEC, CONFIG))
    picker, envoy = spec["containers"]
    grace = spec["terminationGracePeriodSeconds"]
    assert grace == CONFIG.router.termination_grace_period_seconds >= 120  # a long stream fits
    # Envoy's admin socket lies on a volume both containers mount, where both hooks look for it.
    [shared] = [v for v in spec["volumes"] if "emptyDir" in v]
    envoy_args = command.commands["envoy"].make_context("envoy", envoy["args"][2:]).params  # type: ignore[attr-defined]
    hooks = {}
    for container in (picker, envoy):
        assert {"name": shared["name"], "mountPath": router.RUN_MOUNT} in container["volumeMounts"]
        argv = container["lifecycle"]["preStop"]["exec"]["command"]
        assert argv[:3] == ["cacheroute", "router", "drain"]
        hooks[container["name"]] = command.commands["drain"].make_context("drain", argv[3:]).params  # type: ignore[attr-defined]
    for params in hooks.values():
        assert params["admin_socket"] == envoy_args["admin_socket"]
        assert params["settle"] == CONFIG.router.drain_seconds and params["settle"] < params["timeout"] < grace
    # Envoy's hook drains it; the picker's only waits, answering Envoy meanwhile.
    assert (hooks["envoy"]["wait_only"], hooks["picker"]["wait_only"]) == (False, True)


def test_the_router_pods_envoy_holds_the_configured_request_body_within_the_routers_bounds() -> None:
    """Envoy's buffer of the router pod is what the operator's configuration says (16 MiB unless
    told): Envoy's own 1 MiB default would answer 413 to long prompts; the operator's bounds are
    the router's own, so every configuration it accepts renders an Envoy the picker can serve."""
    from cacheroute.operator.config import EnvoySettings
    from cacheroute.router.envoy import DEFAULT_MAX_REQUEST_BYTES, MAX_REQUEST_BYTES

    field = EnvoySettings.model_fields["max_request_bytes"]
    bounds = {type(m).__name__: getattr(m, "ge", getattr(m, "le", None)) for m in field.metadata}
    assert (field.default, bounds["Le"]) == (DEFAULT_MAX_REQUEST_BYTES, MAX_REQUEST_BYTES)
    command = typer.main.get_command(router_app)
    for size in (16 << 20, 40 << 20):
        config = CONFIG.model_copy(deep=True)
        config.router.envoy.max_request_bytes = size
        envoy = pod_spec(router.build_deployment(POOL, SPEC, config))["containers"][1]
        params = command.commands["envoy"].make_context("envoy", [*envoy["args"][2:], "--print"]).params  # type: ignore[attr-defined]
        assert params["max_request_bytes"] == size
    with pytest.raises(ValueError, match="less than or equal"):
        EnvoySettings(max_request_bytes=MAX_REQUEST_BYTES + 1)


def test_the_router_is_told_what_one_replica_holds_once_the_memory_plan_is_decided(tmp_path: Path) -> None:
    """Without a plan (Shadow mode, before the first period) the router sizes its prefix memory from
    the replicas' KV, GPU and host tiers; while the memory plan is not decided it is not told."""
    command = typer.main.get_command(router_app)

    def served(objects: Any) -> dict[str, Any]:
        deployment = next(o for o in objects.apply if o["kind"] == "Deployment")
        args = as_in_pod(pod_spec(deployment)["containers"][0]["args"], tmp_path)
        params: dict[str, Any] = command.commands["serve"].make_context("serve", args[2:]).params  # type: ignore[attr-defined]
        return params

    planned = served(desired_objects(POOL, SPEC, MemoryOutcome("Planned", "", plan=PLAN), CONFIG))
    assert planned["endpoint_kv_tokens"] == PLAN.kv_capacity_tokens + PLAN.host_kv_capacity_tokens > 0
    undecided = served(desired_objects(POOL, SPEC, MemoryOutcome("DoesNotFit", "too big"), CONFIG))
    assert undecided["endpoint_kv_tokens"] == 0


def test_router_role_grants_only_endpointslice_reads_and_the_operator_holds_it() -> None:
    role = router.build_role(POOL)
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    assert all(rule in OPERATOR_RULES for rule in ROUTER_RULES)


def test_plan_configmap_holds_an_empty_valid_versioned_plan_with_the_router_settings() -> None:
    [cm] = planmap.build_plan_configmaps(POOL, SPEC)
    files = {k: base64.b64decode(v) for k, v in cm["binaryData"].items()}
    plan = decode_plan(files)
    assert plan.pool == "llama" and len(plan) == 0 and plan.destinations == ()
    assert plan.key_extraction.session_header == "x-session" and plan.key_extraction.prompt_prefix_chars == 256
    assert cm["metadata"]["annotations"]["cacheroute.dev/plan-version"]
    assert cm["metadata"]["name"] == "llama-plan"
    assert planmap.build_plan_configmaps(POOL, SPEC) == [cm]  # deterministic


@pytest.mark.parametrize("mode", ["FailOpen", "FailClose"])
def test_gie_pool_points_at_the_router_picker(mode: str) -> None:
    spec = SPEC.model_copy(update={"gie": SPEC.gie.model_copy(update={"enabled": True, "failure_mode": mode})})
    obj = gie.build_gie_pool(POOL, spec)
    assert obj["apiVersion"] == "inference.networking.k8s.io/v1"
    ref = obj["spec"]["endpointPickerRef"]
    expected = ("Service", "llama-router", {"number": 9002}, mode)
    assert (ref["kind"], ref["name"], ref["port"], ref["failureMode"]) == expected
    assert obj["spec"]["targetPorts"] == [{"number": 8000}]


def test_a_host_kv_tier_reaches_the_engine_flags_and_the_pod_memory_request() -> None:
    """hostKvCacheGib auto on a 2 TiB node: vLLM's native offloading with the replica's share of
    the node less the reserve, and a memory request the scheduler must find for it; 0 turns it off."""
    base = SPEC.model_dump(by_alias=True, exclude_none=True)
    spec = InferencePoolSpec.model_validate(
        base | {"gpu": base["gpu"] | {"nodeMemoryGib": 2048}, "memory": base["memory"] | {"kvCacheDtype": "fp8"}}
    )
    plan = plan_for_pool(spec, resolve_architecture(spec))
    container = pod_spec(statefulset.build_statefulset(POOL, spec, plan, CONFIG.engine))["containers"][0]
    args = container["args"]
    # A TP=2 replica's quarter of 2 TiB is 512 GiB, less 32 GiB per GPU.
    assert args[args.index("--kv-offloading-size") + 1] == "448"
    assert args[args.index("--kv-offloading-backend") + 1] == "native"
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"
    assert container["resources"]["requests"]["memory"] == "512Gi"
    assert plan.host_kv_capacity_tokens == 448 * 2**30 // (2 * 80 * 8 * 128)
    off = InferencePoolSpec.model_validate(base | {"memory": base["memory"] | {"hostKvCacheGib": 0}})
    plan_off = plan_for_pool(off, resolve_architecture(off))
    container = pod_spec(statefulset.build_statefulset(POOL, off, plan_off, CONFIG.engine))["containers"][0]
    assert "--kv-offloading-size" not in container["args"]
    assert container["resources"]["requests"]["memory"] == CONFIG.engine.memory_request
