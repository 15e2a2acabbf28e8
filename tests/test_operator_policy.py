"""The operator's policy (operator/specgate_operator/policy.py): what a resource may do beyond
its schema, decided on typed data; and the operator refusing a resource that breaks it, with a
condition naming the field, before it renders anything."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from specgate import admission, api, crd
from specgate_operator.policy import (
    REFERABLE_LABEL,
    Policy,
    add_arguments,
    from_arguments,
    host_path_allowed,
    hub_endpoint_problem,
    image_allowed,
    quantity_bytes,
    reserved_engine_arg,
    secret_references,
    secret_violations,
    service_account_violation,
    violations,
)

from .conftest import minimal_resource

SCHEMA = admission.crd_schema(crd.crd())


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


@pytest.mark.parametrize(
    "arg",
    [
        "--trust-remote",
        "--trust-remote-code",
        "--enable-custom-logit",
        "--api-ke=x",
        "--api-key",
        "--config",
        "--conf=/etc/x.yaml",
        "--tp=2",
        "--spec",
        "--speculative-num-steps=5",
        "--speculative-anything-new",
        "--mem-frac=0.5",
        "--model=/x",
        "--context-len",
        "-tp",
        "--enable-trace",
        "--otlp-traces-endpoint=collector.evil:4317",
    ],
)
def test_reserved_flags_are_refused_in_every_spelling_sglang_parses(arg: str) -> None:
    """SGLang's argparse takes unique prefixes and the =VALUE form: each of these sets a flag
    the operator renders or refuses, so the policy and the CRD's rule refuse it."""
    assert reserved_engine_arg(arg)
    (refused,) = violations(_sdd(engine={"extraArgs": ["--log-level=info", arg]}), Policy())
    assert refused.startswith("spec.engine.extraArgs[1]:")
    with pytest.raises(admission.AdmissionError, match="extraArgs may not set"):
        admission.admit(minimal_resource(engine={"extraArgs": [arg]}), SCHEMA)


@pytest.mark.parametrize(
    "arg",
    [
        "--disable-radix-cache",
        "--chunked-prefill-size=512",
        "--enable-metrics-for-all-schedulers",
        "--kv-cache-dtype=fp8_e5m2",
        "--model-impl=sglang",
        "--attention-backend",
        "fa3",
        "--log-level=info",
        "--trace-modules=request",
    ],
)
def test_other_engine_flags_pass(arg: str) -> None:
    assert not reserved_engine_arg(arg)
    assert violations(_sdd(engine={"extraArgs": [arg]}), Policy()) == []
    admission.admit(minimal_resource(engine={"extraArgs": [arg]}), SCHEMA)


@pytest.mark.parametrize(
    ("name", "refused"),
    [
        ("LD_PRELOAD", True),
        ("LD_LIBRARY_PATH", True),
        ("PYTHONPATH", True),
        ("PYTHONSTARTUP", True),
        ("SGLANG_API_KEY", True),
        ("HF_HUB_OFFLINE", False),
        ("NCCL_DEBUG", False),
    ],
)
def test_engine_env_may_not_load_code_or_set_the_engine_key(name: str, refused: bool) -> None:
    found = violations(_sdd(engine={"env": [{"name": name, "value": "x"}]}), Policy())
    assert bool(found) is refused
    if refused:
        assert found[0].startswith("spec.engine.env[0].name:") and name in found[0]


def test_scheduling_privileges_are_refused_unless_the_policy_grants_them() -> None:
    sdd = _sdd(
        placement={
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                {"operator": "Exists"},
                {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"},
            ],
            "runtimeClassName": "kata",
            "priorityClassName": "system-node-critical",
        },
    )
    refused = violations(sdd, Policy())
    assert [line.split(":")[0] for line in refused] == [
        "spec.placement.tolerations[1]",
        "spec.placement.tolerations[2]",
        "spec.placement.runtimeClassName",
        "spec.placement.priorityClassName",
    ]
    assert "every taint" in refused[0] and "--allowed-toleration-key" in refused[0]
    generous = Policy(
        allowed_toleration_keys=("*",),
        allowed_runtime_classes=("kata",),
        allowed_priority_classes=("system-node-critical",),
    )
    assert violations(sdd, generous) == []
    # Router pods' tolerations are held to the same keys.
    router = _sdd(router={"tolerations": [{"operator": "Exists"}], "nodeSelector": {"a": "b"}})
    (line,) = violations(router, Policy())
    assert line.startswith("spec.router.tolerations[0]: tolerating every taint")
    assert violations(router, generous) == []
    # A non-system class passes when no list is set; with a list, only the list does.
    ordinary = _sdd(placement={"priorityClassName": "llm-high"})
    assert violations(ordinary, Policy()) == []
    assert violations(ordinary, Policy(allowed_priority_classes=("llm-low",)))


def test_sizes_are_bounded_by_the_policy() -> None:
    sdd = _sdd(
        engine={"shmSize": "999Ei"},
        model={"path": "o/m", "source": {"type": "hub", "hub": {"cacheSize": "5Ti"}}},
        speculative={"draftModel": {"path": "o/d"}},
    )
    refused = violations(sdd, Policy())
    assert [line.split(":")[0] for line in refused] == [
        "spec.engine.shmSize",
        "spec.model.source.hub.cacheSize",
    ]
    assert violations(sdd, Policy(max_shm_size="1000Ei", max_cache_size="5Ti")) == []
    assert quantity_bytes("16Gi") == 16 * 2**30 and quantity_bytes("1.5k") == 1500
    with pytest.raises(ValueError):
        quantity_bytes("12Q")


@pytest.mark.parametrize(
    ("endpoint", "allowed"),
    [
        ("https://huggingface.co", True),
        ("https://HuggingFace.co/", True),
        ("https://huggingface.co:443/api", False),  # another origin than the one allowed
        ("http://huggingface.co", False),
        ("https://evil.example.com", False),
        ("http://169.254.169.254/latest/meta-data", False),
        ("http://[fe80::1]", False),
        ("http://127.0.0.1:8080", False),
        ("http://localhost", False),
        ("http://[::1]", False),
        ("http://0.0.0.0", False),
        ("http://metadata.google.internal", False),
        ("https://huggingface.co@evil.example.com", False),  # the host is evil.example.com
        ("https://evil.example.com#@huggingface.co", False),
    ],
)
def test_hub_endpoints_come_from_the_allow_list_never_internal_addresses(
    endpoint: str, allowed: bool
) -> None:
    assert (hub_endpoint_problem(endpoint, Policy().allowed_hub_endpoints) is None) is allowed
    # Loopback and link-local stay refused even where an administrator lists them.
    if "169.254" in endpoint or "127.0.0.1" in endpoint:
        assert hub_endpoint_problem(endpoint, (endpoint,)) is not None


def test_a_hub_source_sends_its_token_only_to_an_allowed_hub() -> None:
    sdd = _sdd(
        model={
            "path": "o/m",
            "source": {
                "type": "hub",
                "hub": {"endpoint": "http://169.254.169.254", "tokenSecretRef": {"name": "t"}},
            },
        },
        speculative={"draftModel": {"path": "o/d"}},
    )
    (refused,) = violations(sdd, Policy())
    assert refused.startswith("spec.model.source.hub.endpoint:") and "link-local" in refused
    mirror = Policy(allowed_hub_endpoints=("https://hf-mirror.internal",))
    ok = _sdd(
        model={
            "path": "o/m",
            "source": {"type": "hub", "hub": {"endpoint": "https://hf-mirror.internal/"}},
        },
        speculative={"draftModel": {"path": "o/d"}},
    )
    assert violations(ok, mirror) == [] and violations(ok, Policy())


def test_a_resource_may_name_only_secrets_labelled_for_it() -> None:
    sdd = _sdd(
        apiKeySecretRef={"name": "engine-key"},
        router={"clientAuth": {"secretName": "client-keys"}},
        model={
            "path": "o/m",
            "source": {"type": "hub", "hub": {"tokenSecretRef": {"name": "other-team"}}},
        },
        speculative={"draftModel": {"path": "o/d"}},
    )
    assert secret_references(sdd) == [
        ("spec.apiKeySecretRef", "engine-key"),
        ("spec.model.source.hub.tokenSecretRef", "other-team"),
        ("spec.router.clientAuth.secretName", "client-keys"),
    ]
    labels = {
        "engine-key": {REFERABLE_LABEL: "true"},
        "client-keys": {REFERABLE_LABEL: "yes"},  # only "true" lets it
        "other-team": {},
    }
    refused = secret_violations(sdd, Policy(), labels)
    assert [line.split(":")[0] for line in refused] == [
        "spec.model.source.hub.tokenSecretRef",
        "spec.router.clientAuth.secretName",
    ]
    assert "kubectl label secret other-team specgate.io/referable=true" in refused[0]
    assert secret_violations(sdd, Policy(allow_unlabelled_secrets=True), labels) == []


def test_engines_run_only_as_a_service_account_labelled_for_it() -> None:
    sdd = _sdd(engine={"serviceAccountName": "s3-reader"})
    assert service_account_violation(sdd, {REFERABLE_LABEL: "true"}) is None
    refused = service_account_violation(sdd, {"team": "llm"})
    assert refused is not None and refused.startswith("spec.engine.serviceAccountName: ")
    assert "kubectl label serviceaccount s3-reader specgate.io/referable=true" in refused
    assert service_account_violation(_sdd(), {}) is None  # none named: the namespace's default


def test_the_command_line_gives_the_default_policy_and_refuses_a_bad_one() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert from_arguments(parser.parse_args([])) == Policy()
    custom = from_arguments(
        parser.parse_args(["--allowed-hub-endpoint=https://m.internal", "--max-shm-size=8Gi"])
    )
    assert custom.allowed_hub_endpoints == ("https://m.internal",)
    assert custom.max_shm_size == "8Gi"
    for bad in (["--max-shm-size=lots"], ["--allowed-hub-endpoint=ftp://x"]):
        with pytest.raises(ValueError):
            from_arguments(parser.parse_args(bad))
