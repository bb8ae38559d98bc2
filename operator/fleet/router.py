"""The pool's router: endpoint picker and Envoy in one pod, its ServiceAccount and least RBAC.

Both containers run the cacheroute image. `cacheroute router serve` follows the plan mounted from
the plan ConfigMaps and the destinations' addresses and readiness from the headless Service's
EndpointSlices (so a pod IP change needs no new plan). `cacheroute router envoy` renders the
Envoy bootstrap for the pod IP and execs Envoy: HTTP on 8080, ext_proc to the picker on
`$(POD_IP):9002`, ORIGINAL_DST to the picked endpoint.
"""

from __future__ import annotations

from typing import Any

from cacheroute.operator.api.pool import InferencePoolSpec
from cacheroute.operator.config import OperatorConfig
from cacheroute.operator.fleet import names
from cacheroute.operator.rbac import ROUTER_RULES
from cacheroute.planner.memory import MemoryPlan

PLAN_MOUNT = "/etc/cacheroute/plan"
# An emptyDir both containers mount: Envoy's admin socket, which both preStop hooks and the
# picker's /metrics reach.
RUN_MOUNT = "/run/cacheroute"
ADMIN_SOCKET = f"{RUN_MOUNT}/envoy-admin.sock"
POD_IP = "$(POD_IP)"
DOWNWARD_ENV = [
    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
]
# The image's compiled copy of the request path (`cacheroute router build-native`, router/native.py):
# first on the picker's path, it runs each stream in about half the instructions. An image without
# it runs the same code interpreted.
NATIVE_PATH = "/opt/cacheroute/native"
PICKER_ENV = [*DOWNWARD_ENV, {"name": "PYTHONPATH", "value": NATIVE_PATH}]


def build_service_account(pool: names.PoolRef) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": names.metadata(pool, pool.router, "router"),
    }


def build_role(pool: names.PoolRef) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": names.metadata(pool, pool.router, "router"),
        "rules": [rule.as_policy_rule() for rule in ROUTER_RULES],
    }


def build_role_binding(pool: names.PoolRef) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": names.metadata(pool, pool.router, "router"),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": pool.router},
        "subjects": [{"kind": "ServiceAccount", "name": pool.router, "namespace": pool.namespace}],
    }


def plan_volume(pool: names.PoolRef) -> dict[str, Any]:
    """Header ConfigMap plus optional shard ConfigMaps, projected into one directory."""
    sources: list[dict[str, Any]] = [{"configMap": {"name": pool.plan_configmap(0)}}]
    sources += [
        {"configMap": {"name": pool.plan_configmap(i), "optional": True}} for i in range(1, names.MAX_PLAN_SHARDS)
    ]
    return {"name": "plan", "projected": {"sources": sources}}


def _grpc_probe(service: str, period: int, failures: int) -> dict[str, Any]:
    return {"grpc": {"port": names.ROUTER_GRPC_PORT, "service": service}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": 2}


def _http_probe(period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": "/ready", "port": "health"}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": 2}


def endpoint_kv_tokens(plan: MemoryPlan) -> int:
    """KV tokens one replica holds under `plan`: GPU and host tiers."""
    return plan.kv_capacity_tokens + plan.host_kv_capacity_tokens


def picker_args(
    pool: names.PoolRef, spec: InferencePoolSpec, config: OperatorConfig, memory_plan: MemoryPlan | None = None
) -> list[str]:
    r = spec.router
    args = [
        "router", "serve",
        "--grpc-host", POD_IP,
        "--grpc-port", str(names.ROUTER_GRPC_PORT),
        "--metrics-host", POD_IP,
        "--metrics-port", str(names.ROUTER_METRICS_PORT),
        # Envoy's statistics (its 413s and 503s) served with the picker's: one scrape sees both.
        "--envoy-admin-socket", ADMIN_SOCKET,
        "--plan-dir", PLAN_MOUNT,
        "--namespace", pool.namespace,
        "--service", pool.headless_service,
        "--target-port", str(spec.engine.port),
        "--key-header", r.key_header,
        "--body-field", r.body_field or "",
        "--session-header", r.session_header or "",
        "--prompt-prefix-chars", str(r.prompt_prefix_chars),
        "--spill-threshold", f"{r.spill_threshold:g}",
        "--follow-prefixes" if r.follow_prefixes else "--no-follow-prefixes",
        "--prefix-memory-blocks", str(r.prefix_memory_blocks),
        # Envoy's ORIGINAL_DST cluster takes a single address.
        "--fallbacks", "0",
        "--scrape-interval", f"{config.router.scrape_interval_seconds:g}",
        "--log-level", config.router.log_level,
    ]
    if memory_plan is not None:
        # Without a plan yet (or in Shadow mode) the router sizes its prefix memory from this.
        args += ["--endpoint-kv-tokens", str(endpoint_kv_tokens(memory_plan))]
    return args


def envoy_args(pool: names.PoolRef, spec: InferencePoolSpec, config: OperatorConfig) -> list[str]:
    envoy = config.router.envoy
    fallback = f"{pool.headless_service}.{pool.namespace}.svc.{config.cluster_domain}:{spec.engine.port}"
    return [
        "router", "envoy",
        "--pod-ip", POD_IP,
        "--listen-port", str(names.ROUTER_HTTP_PORT),
        "--health-port", str(names.ROUTER_HEALTH_PORT),
        "--ext-proc-port", str(names.ROUTER_GRPC_PORT),
        "--failure-mode-allow" if envoy.failure_mode_allow else "--no-failure-mode-allow",
        "--fallback", fallback,
        "--message-timeout", envoy.message_timeout,
        "--route-timeout", envoy.route_timeout,
        "--request-body-mode", envoy.request_body_mode,
        "--max-request-bytes", str(envoy.max_request_bytes),
        "--concurrency", str(envoy.concurrency),
        "--log-level", envoy.log_level,
        "--admin-socket", ADMIN_SOCKET,
    ]


def drain_hook(config: OperatorConfig, *, wait_only: bool) -> dict[str, Any]:
    """preStop of a router container: serve while clients stop choosing the pod, then drain Envoy
    and wait for its requests in flight, within the grace period (`cacheroute router drain`)."""
    r = config.router
    command = [
        "cacheroute", "router", "drain", "--admin-socket", ADMIN_SOCKET,
        "--settle", str(r.drain_seconds),
        # A margin for the containers' own stop once the hook returns.
        "--timeout", str(max(r.termination_grace_period_seconds - 2, 0)),
    ]
    return {"preStop": {"exec": {"command": command + (["--wait-only"] if wait_only else [])}}}


def build_deployment(
    pool: names.PoolRef,
    spec: InferencePoolSpec,
    config: OperatorConfig,
    memory_plan: MemoryPlan | None = None,
    *,
    idle: bool = False,
) -> dict[str, Any]:
    """The router Deployment; `memory_plan` is the replicas' (None while it is not decided).
    `idle`: the pool has no engine to route to and will have none until it is fixed (no replica)."""
    r = config.router
    image = spec.router.image or r.image
    picker = {
        "name": "picker",
        "image": image,
        "imagePullPolicy": r.image_pull_policy,
        "args": picker_args(pool, spec, config, memory_plan),
        "env": PICKER_ENV,
        "ports": [
            {"name": "grpc", "containerPort": names.ROUTER_GRPC_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": names.ROUTER_METRICS_PORT, "protocol": "TCP"},
        ],
        "readinessProbe": _grpc_probe("readiness", 2, 3),
        "livenessProbe": _grpc_probe("liveness", 10, 3),
        "resources": r.resources,
        "volumeMounts": [
            {"name": "plan", "mountPath": PLAN_MOUNT, "readOnly": True},
            {"name": "run", "mountPath": RUN_MOUNT},
        ],
        "lifecycle": drain_hook(config, wait_only=True),
    }
    envoy = {
        "name": "envoy",
        "image": image,
        "imagePullPolicy": r.image_pull_policy,
        "args": envoy_args(pool, spec, config),
        "env": DOWNWARD_ENV,
        "ports": [
            {"name": "http", "containerPort": names.ROUTER_HTTP_PORT, "protocol": "TCP"},
            {"name": "health", "containerPort": names.ROUTER_HEALTH_PORT, "protocol": "TCP"},
        ],
        "readinessProbe": _http_probe(2, 3),
        "livenessProbe": _http_probe(10, 3),
        "resources": r.envoy.resources,
        "volumeMounts": [{"name": "run", "mountPath": RUN_MOUNT}],
        "lifecycle": drain_hook(config, wait_only=False),
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": pool.router,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": r.termination_grace_period_seconds,
        "containers": [picker, envoy],
        "volumes": [plan_volume(pool), {"name": "run", "emptyDir": {}}],
    }
    if r.node_selector:
        pod_spec["nodeSelector"] = dict(r.node_selector)
    if r.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in r.tolerations]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": names.metadata(pool, pool.router, "router"),
        "spec": {
            "replicas": 0 if idle else spec.router.replicas,
            "revisionHistoryLimit": 5,
            "selector": {"matchLabels": names.selector(pool, "router")},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {
                    "labels": names.labels(pool, "router"),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(names.ROUTER_METRICS_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": pod_spec,
            },
        },
    }
