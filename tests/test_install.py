"""The operator's install manifests: generated, valid, and least-privilege."""

from __future__ import annotations

import kubernetes_validate

from specgate_operator import install, render

from .conftest import KUBERNETES_VERSION, ROOT


def test_committed_install_manifests_are_generated() -> None:
    assert (ROOT / "deploy" / "operator.yaml").read_text() == install.manifests_yaml(), (
        "run `make deploy` and commit the result"
    )


def test_install_manifests_are_valid_kubernetes() -> None:
    for manifest in install.manifests():
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def granted(rules: list[dict[str, list[str]]]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_no_wildcards() -> None:
    for group, resource, verb in granted(install.OPERATOR_RULES):
        assert "*" not in (group, resource, verb)


def test_operator_may_apply_every_child_it_renders() -> None:
    grants = granted(install.OPERATOR_RULES)
    opts = render.RenderOptions(service_monitor=True)
    from specgate import api

    from .conftest import minimal_resource

    sdd = api.SpecDecodeDeployment.model_validate(minimal_resource())
    plural = {
        "Secret": "secrets",
        "ServiceAccount": "serviceaccounts",
        "ConfigMap": "configmaps",
        "Service": "services",
        "Deployment": "deployments",
        "PodDisruptionBudget": "poddisruptionbudgets",
        "NetworkPolicy": "networkpolicies",
        "Role": "roles",
        "RoleBinding": "rolebindings",
        "ServiceMonitor": "servicemonitors",
    }
    for m in render.render(sdd, opts, api_key="k"):
        group = m["apiVersion"].rpartition("/")[0]
        for verb in ("get", "create", "patch", "delete"):
            assert (group, plural[m["kind"]], verb) in grants, (m["kind"], verb)


def test_operator_holds_everything_it_grants_the_router() -> None:
    """RBAC refuses to let a subject grant permissions it does not hold itself."""
    assert granted(render.ROUTER_RULES) <= granted(install.OPERATOR_RULES)
