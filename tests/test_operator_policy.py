"""The operator's policy (operator/specgate_operator/policy.py): what a resource may do beyond
its schema, decided on typed data; and the operator refusing a resource that breaks it, with a
condition naming the field, before it renders anything."""

from __future__ import annotations

from typing import Any

import pytest

from specgate import api
from specgate_operator.policy import Policy, host_path_allowed, image_allowed, violations

from .conftest import minimal_resource


def _sdd(**spec: Any) -> api.SpecDecodeDeployment:
    return api.SpecDecodeDeployment.model_validate(minimal_resource(**spec))


@pytest.mark.parametrize(
    ("image", "allowed"),
    [
        ("registry.io/team/worker:1", True),
        ("registry.io/team", True),
        ("registry.io/team@sha256:abc", True),
        ("registry.io/team-other/worker:1", False),
        ("registry.io/teamworker", False),
        ("docker.io/evil/worker", False),
    ],
)
def test_images_are_matched_at_a_boundary(image: str, allowed: bool) -> None:
    assert image_allowed(image, ("registry.io/team",)) is allowed
    assert image_allowed(image, ()) is True  # no list: any image


@pytest.mark.parametrize(
    ("path", "allowed"),
    [
        ("/mnt/models", True),
        ("/mnt/models/llama", True),
        ("/mnt/models/./llama/", True),
        ("/mnt/models2", False),
        ("/mnt/models/../../etc", False),
        ("/", False),
        ("mnt/models", False),
    ],
)
def test_host_paths_are_matched_by_component(path: str, allowed: bool) -> None:
    assert host_path_allowed(path, ("/mnt/models/",)) is allowed


def test_a_resource_gets_one_line_per_refused_field_naming_the_fix() -> None:
    policy = Policy(allowed_image_prefixes=("registry.io/llm/",))
    sdd = _sdd(
        engine={"image": "docker.io/someone/sglang:latest"},
        router={"image": "registry.io/llm/router:1"},
        model={"path": "m", "source": {"type": "hostPath", "hostPath": {"path": "/"}}},
    )
    refused = violations(sdd, policy)
    assert len(refused) == 2
    assert refused[0].startswith("spec.engine.image: 'docker.io/someone/sglang:latest'")
    assert "registry.io/llm/" in refused[0]
    assert refused[1].startswith("spec.model.source.hostPath.path: this operator allows no")
    assert "--allowed-host-path-prefix" in refused[1] and "pvc" in refused[1]
    under = Policy(allowed_host_path_prefixes=("/mnt/models",))
    assert violations(sdd, under)[0].startswith("spec.model.source.hostPath.path: '/'")
    inside = _sdd(
        model={"path": "m", "source": {"type": "hostPath", "hostPath": {"path": "/mnt/models"}}}
    )
    assert violations(inside, under) == []
    # The operator's own default images pass whatever the list says.
    default = _sdd(engine={"image": "ghcr.io/specgate/worker:1"})
    assert violations(default, policy, ("ghcr.io/specgate/worker:1",)) == []


@pytest.mark.parametrize(
    "bad",
    [
        {"allowed_host_path_prefixes": ("mnt",)},
        {"allowed_host_path_prefixes": ("/a/..",)},
        {"allowed_image_prefixes": ("",)},
    ],
)
def test_a_malformed_policy_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Policy(**bad)


def test_engine_env_reads_only_the_secrets_the_resource_names_unless_allowed() -> None:
    env = [
        {"name": "PLAIN", "value": "1"},
        {"name": "DB", "valueFrom": {"secretKeyRef": {"name": "other-team-db", "key": "pw"}}},
        {"name": "CM", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "k"}}},
    ]
    sdd = _sdd(engine={"env": env})
    (refused,) = violations(sdd, Policy())
    assert refused.startswith("spec.engine.env[1].valueFrom.secretKeyRef:")
    assert "--allow-env-secrets" in refused and "tokenSecretRef" in refused
    assert violations(sdd, Policy(allow_env_secrets=True)) == []
