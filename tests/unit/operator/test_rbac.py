"""The operator's one permission list: least privilege, and enough to grant routers theirs."""

from __future__ import annotations

from cacheroute.operator.fleet.cluster import KINDS
from cacheroute.operator.rbac import OPERATOR_RULES, ROUTER_RULES, cluster_role


def allowed(group: str, resource: str, verb: str) -> bool:
    return any(group in r.api_groups and resource in r.resources and verb in r.verbs for r in OPERATOR_RULES)


def test_no_wildcards_and_every_rule_says_why() -> None:
    for rule in OPERATOR_RULES:
        assert "*" not in rule.api_groups + rule.resources + rule.verbs
        assert rule.why
    assert not any("delete" in r.verbs and r.api_groups != ("inference.networking.k8s.io",) for r in OPERATOR_RULES)


def test_every_kind_the_operator_applies_can_be_created_and_patched() -> None:
    for kind in KINDS.values():
        group = kind.api_version.rpartition("/")[0]
        if kind.plural == "pods":
            assert allowed(group, "pods", "list") and allowed(group, "pods/log", "get")
            continue
        assert allowed(group, kind.plural, "get"), kind
        assert allowed(group, kind.plural, "patch"), kind


def test_the_operator_holds_everything_it_grants_a_router() -> None:
    for rule in ROUTER_RULES:
        for group in rule.api_groups:
            for resource in rule.resources:
                for verb in rule.verbs:
                    assert allowed(group, resource, verb), (group, resource, verb)


def test_cluster_role_renders_the_list() -> None:
    role = cluster_role()
    assert role["kind"] == "ClusterRole" and len(role["rules"]) == len(OPERATOR_RULES)
    assert {"apiGroups": ["cacheroute.dev"], "resources": ["inferencepools/status"], "verbs": ["get", "patch"]} in (
        role["rules"]
    )
