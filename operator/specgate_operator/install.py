"""The operator's own install manifests: ServiceAccount, least-privilege ClusterRole, binding and
Deployment. Pure; `specgate install-manifests` prints them and `deploy/operator.yaml` is this
output, checked by a test. The Helm chart carries the same rules."""

from __future__ import annotations

from typing import Any

import yaml

from specgate import api
from specgate_operator import render

NAMESPACE = "specgate-system"
NAME = "specgate-operator"
IMAGE = render.RenderOptions().router_image  # operator and router ship in one image

_CHILD_VERBS = ["get", "create", "patch", "delete"]  # server-side apply creates through PATCH
_WATCHED_CHILD_VERBS = ["get", "list", "watch", "create", "patch", "delete"]  # children.WATCHED


def _rule(group: str, resources: list[str], verbs: list[str]) -> dict[str, list[str]]:
    return {"apiGroups": [group], "resources": resources, "verbs": verbs}


CLUSTER_RULES: list[dict[str, Any]] = [
    # kopf: namespace and CRD observation (cluster-scoped, read-only).
    _rule("", ["namespaces"], ["get", "list", "watch"]),
    _rule("apiextensions.k8s.io", ["customresourcedefinitions"], ["get", "list", "watch"]),
]
"""What the operator needs cluster-wide whatever it watches."""

NAMESPACED_RULES: list[dict[str, Any]] = [
    # The resource itself: kopf watches it, patches finalizers/annotations, writes status.
    _rule(api.GROUP, [api.PLURAL], ["get", "list", "watch", "patch"]),
    _rule(api.GROUP, [f"{api.PLURAL}/status"], ["get", "patch"]),
    # Events about handler outcomes.
    _rule("", ["events"], ["create"]),
    # Children: the watched ones (specgate_operator.children) listed and watched too. Secrets
    # are not: watching them would read every Secret in the namespace.
    _rule("", ["secrets", "serviceaccounts"], _CHILD_VERBS),
    _rule("", ["configmaps", "services"], _WATCHED_CHILD_VERBS),
    _rule("apps", ["deployments"], _WATCHED_CHILD_VERBS),
    _rule("policy", ["poddisruptionbudgets"], _WATCHED_CHILD_VERBS),
    _rule("networking.k8s.io", ["networkpolicies"], _WATCHED_CHILD_VERBS),
    _rule("rbac.authorization.k8s.io", ["roles", "rolebindings"], _CHILD_VERBS),
    _rule("monitoring.coreos.com", ["servicemonitors"], _CHILD_VERBS),
    _rule("gateway.networking.k8s.io", ["httproutes"], _CHILD_VERBS),
    # RBAC forbids granting what one does not hold: the router's Role needs these.
    _rule("discovery.k8s.io", ["endpointslices"], ["get", "list", "watch"]),
    _rule("coordination.k8s.io", ["leases"], ["get", "create", "patch"]),
]
"""What the operator needs in each namespace it watches: granted by a Role in each when the
chart names the namespaces (operator.watchNamespaces), cluster-wide otherwise."""

LEADER_ELECTION_RULES: list[dict[str, Any]] = [
    _rule("coordination.k8s.io", ["leases"], ["get", "create", "patch"]),
]
"""What the operator's replicas need in their own namespace to elect the one that reconciles."""

REPLICAS = 2
"""Operator replicas: one reconciles (the Lease holder), the other takes over when it stops."""
LEASE = "specgate-operator"

OPERATOR_RULES: list[dict[str, Any]] = CLUSTER_RULES + NAMESPACED_RULES
"""Everything, for an operator that watches every namespace."""


def manifests(namespace: str = NAMESPACE, image: str = IMAGE) -> list[dict[str, Any]]:
    labels = {"app.kubernetes.io/name": NAME, "app.kubernetes.io/part-of": "specgate"}
    meta = {"name": NAME, "namespace": namespace, "labels": labels}
    container = {
        "name": "operator",
        "image": image,
        "command": [
            "specgate",
            "operator",
            "--all-namespaces",
            "--metrics-port=8081",
            # Scrapers in the monitoring namespace reach engine /metrics, as with the chart.
            "--metrics-namespace-label=kubernetes.io/metadata.name=monitoring",
            "--leader-election-namespace=$(POD_NAMESPACE)",
            f"--leader-election-lease={LEASE}",
        ],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {
                "name": "POD_NAMESPACE",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
            },
        ],
        "ports": [
            {"name": "health", "containerPort": 8080},
            {"name": "metrics", "containerPort": 8081},
        ],
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "health"},
            "periodSeconds": 20,
            "failureThreshold": 3,
        },
        "resources": {
            "requests": {"cpu": "100m", "memory": "128Mi"},
            "limits": {"memory": "512Mi"},
        },
        "securityContext": render.restricted_container_security(),
    }
    return [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": namespace, "labels": labels},
        },
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": NAME, "labels": labels},
            "rules": OPERATOR_RULES,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": NAME, "labels": labels},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": NAME,
            },
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": namespace}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": f"{NAME}-leader-election", **meta_ns(meta)},
            "rules": LEADER_ELECTION_RULES,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": f"{NAME}-leader-election", **meta_ns(meta)},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": f"{NAME}-leader-election",
            },
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": namespace}],
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                # One reconciles (the Lease holder); a rolling update keeps one running.
                "replicas": REPLICAS,
                "strategy": {
                    "type": "RollingUpdate",
                    "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
                },
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "serviceAccountName": NAME,
                        "containers": [container],
                        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                        "affinity": _spread(labels),
                    },
                },
            },
        },
    ]


def meta_ns(meta: dict[str, Any]) -> dict[str, Any]:
    """The namespace and labels of `meta`, for objects named otherwise."""
    return {"namespace": meta["namespace"], "labels": meta["labels"]}


def _spread(labels: dict[str, str]) -> dict[str, Any]:
    """Replicas on different nodes where there are several: one node's loss leaves one."""
    term = {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": labels}}
    return {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 100, "podAffinityTerm": term}
            ]
        }
    }


HEADER = "# Generated by `specgate install-manifests`. Do not edit; run `make deploy`.\n"


def manifests_yaml() -> str:
    return HEADER + yaml.safe_dump_all(manifests(), sort_keys=False, width=100)
