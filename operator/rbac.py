"""Every permission the operator uses, in one list: the Helm chart renders it into a ClusterRole.

Kubernetes refuses to let anyone create a Role granting rights it does not hold itself (RBAC
escalation prevention), so the rights given to each pool's router are part of this list too.
`tests/integration/operator` runs the operator under a ServiceAccount bound to exactly these
rules, so a missing one fails the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rule:
    api_groups: tuple[str, ...]
    resources: tuple[str, ...]
    verbs: tuple[str, ...]
    why: str

    def as_policy_rule(self) -> dict[str, Any]:
        return {"apiGroups": list(self.api_groups), "resources": list(self.resources), "verbs": list(self.verbs)}


READ = ("get", "list", "watch")
# Server-side apply creates a missing object: the API server checks both verbs.
APPLY = ("get", "create", "patch")

# What each router's own Role grants (and so what the operator must hold to create that Role).
ROUTER_RULES: tuple[Rule, ...] = (
    Rule(("discovery.k8s.io",), ("endpointslices",), READ, "routers follow destination addresses and readiness"),
)

OPERATOR_RULES: tuple[Rule, ...] = (
    Rule(("cacheroute.dev",), ("inferencepools",), (*READ, "patch"), "watch pools; kopf keeps finalizer and progress"),
    Rule(("cacheroute.dev",), ("inferencepools/status",), ("get", "patch"), "status, conditions, memory plan"),
    Rule(
        ("cacheroute.dev",),
        ("inferencepools/finalizers",),
        ("update",),
        "owner references with blockOwnerDeletion on owned objects",
    ),
    Rule(("cacheroute.dev",), ("affinityplans",), (*READ, "patch"), "AffinityPlans; kopf keeps its daemons' finalizer"),
    Rule(("cacheroute.dev",), ("affinityplans/status",), ("get", "patch"), "plan version, figures, conditions"),
    Rule(("kopf.dev",), ("clusterkopfpeerings", "kopfpeerings"), (*READ, "create", "patch"), "peering of replicas"),
    Rule(("apiextensions.k8s.io",), ("customresourcedefinitions",), READ, "kopf follows CRDs as they appear"),
    Rule(("",), ("namespaces",), READ, "kopf resolves the namespaces it serves"),
    Rule(("", "events.k8s.io"), ("events",), ("create", "patch"), "Events on pools"),
    Rule(("",), ("pods",), READ, "destinations, readiness and unschedulable replicas for status"),
    Rule(("",), ("pods/log",), ("get",), "the profiling Job's vLLM log"),
    Rule(
        ("",),
        ("services",),
        (*READ, "create", "patch"),
        "headless and router Services; a deleted one is recreated at once, so watched",
    ),
    Rule(("",), ("serviceaccounts",), APPLY, "the router's ServiceAccount"),
    Rule(("",), ("configmaps",), (*APPLY, "update"), "plan ConfigMaps, model config.json, profile cache"),
    Rule(("apps",), ("statefulsets", "deployments"), (*READ, "create", "patch"), "engines and routers"),
    Rule(("policy",), ("poddisruptionbudgets",), APPLY, "one replica at a time on node drains"),
    Rule(("rbac.authorization.k8s.io",), ("roles", "rolebindings"), APPLY, "the router's least RBAC"),
    Rule(("batch",), ("jobs",), APPLY, "Profiled memory mode's profiling Job"),
    Rule(
        ("inference.networking.k8s.io",),
        ("inferencepools",),
        (*APPLY, "delete"),
        "the GIE InferencePool pointing at the router",
    ),
    *ROUTER_RULES,
)


def cluster_role(name: str = "cacheroute-operator") -> dict[str, Any]:
    """The ClusterRole holding OPERATOR_RULES."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "cacheroute"}},
        "rules": [rule.as_policy_rule() for rule in OPERATOR_RULES],
    }
