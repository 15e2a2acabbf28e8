"""Malformed resources are rejected on admission with a message that names the field.

Admission is emulated offline (`specgate.admission`): defaults, the structural schema with
strict field validation, then the CEL rules evaluated by a CEL library (cel-python).
"""

from __future__ import annotations

from typing import Any

import pytest

from specgate import admission

from .conftest import minimal_resource

CASES: list[tuple[str, dict[str, Any], str, str]] = [
    # (id, spec overrides, field path in the error, fragment of the message)
    ("replicas-wrong-type", {"replicas": "two"}, "spec.replicas", "is not of type 'integer'"),
    ("replicas-negative", {"replicas": -1}, "spec.replicas", "minimum"),
    ("model-missing", {"model": None}, "spec.model", "Required value"),
    ("model-path-empty", {"model": {"path": ""}}, "spec.model.path", "non-empty"),
    (
        "dtype-unknown",
        {"model": {"path": "m", "dtype": "int3"}},
        "spec.model.dtype",
        "is not one of",
    ),
    (
        "context-length-tiny",
        {"model": {"path": "m", "contextLength": 5}},
        "spec.model.contextLength",
        "minimum",
    ),
    (
        "algorithm-unknown",
        {"speculative": {"algorithm": "MEDUSA", "draftModel": {"path": "d"}}},
        "spec.speculative.algorithm",
        "is not one of",
    ),
    (
        "num-steps-zero",
        {"speculative": {"draftModel": {"path": "d"}, "numSteps": 0, "numDraftTokens": 1}},
        "spec.speculative.numSteps",
        "minimum",
    ),
    (
        "draft-model-missing",
        {"speculative": {"numSteps": 3}},
        "spec.speculative.draftModel",
        "Required value",
    ),
    (
        "mode-unknown",
        {"speculative": {"draftModel": {"path": "d"}, "control": {"mode": "sometimes"}}},
        "spec.speculative.control.mode",
        "is not one of",
    ),
    (
        "cel-dynamic-needs-topk-1",
        {
            "speculative": {
                "draftModel": {"path": "d"},
                "eagleTopk": 4,
                "numDraftTokens": 8,
                "control": {"mode": "dynamic"},
            }
        },
        "spec.speculative",
        "needs eagleTopk: 1",
    ),
    (
        "cel-chain-draft-token-count",
        {"speculative": {"draftModel": {"path": "d"}, "numSteps": 3, "numDraftTokens": 6}},
        "spec.speculative",
        "numDraftTokens must equal numSteps + 1",
    ),
    (
        "off-step-tokens-zero",
        {"speculative": {"draftModel": {"path": "d"}, "offStepTokens": 0}},
        "spec.speculative.offStepTokens",
        "minimum",
    ),
    (
        "cel-off-step-tokens-above-draft-tokens",
        {"speculative": {"draftModel": {"path": "d"}, "offStepTokens": 5}},
        "spec.speculative",
        "offStepTokens cannot exceed numDraftTokens",
    ),
    (
        "cel-tree-too-small",
        {
            "speculative": {
                "draftModel": {"path": "d"},
                "eagleTopk": 2,
                "numSteps": 2,
                "numDraftTokens": 9,
                "control": {"mode": "alwaysOn"},
            }
        },
        "spec.speculative",
        "cannot exceed eagleTopk * numSteps + 1",
    ),
    (
        "cel-threshold-above-max",
        {
            "speculative": {
                "draftModel": {"path": "d"},
                "control": {"threshold": 100, "maxThreshold": 64},
            }
        },
        "spec.speculative.control",
        "threshold must lie within [minThreshold, maxThreshold]",
    ),
    (
        "cel-min-above-threshold",
        {
            "speculative": {
                "draftModel": {"path": "d"},
                "control": {"threshold": 4, "minThreshold": 8},
            }
        },
        "spec.speculative.control",
        "threshold must lie within",
    ),
    (
        "tp-not-power-of-two",
        {"engine": {"tensorParallelSize": 3}},
        "spec.engine.tensorParallelSize",
        "is not one of",
    ),
    (
        "cel-gpus-not-multiple-of-tp",
        {"engine": {"tensorParallelSize": 4, "gpusPerPod": 6}},
        "spec.engine",
        "gpusPerPod must be a multiple of tensorParallelSize",
    ),
    (
        "cel-extra-args-override-api-key",
        {"engine": {"extraArgs": ["--api-key=oops"]}},
        "spec.engine",
        "extraArgs may not set flags the operator renders",
    ),
    (
        "cel-extra-args-trust-remote-code",
        {"engine": {"extraArgs": ["--log-level", "info", "--trust-remote-code"]}},
        "spec.engine",
        "set spec.model.trustRemoteCode",
    ),
    (
        "cel-extra-args-custom-logit-processor",
        {"engine": {"extraArgs": ["--enable-custom-logit-processor"]}},
        "spec.engine",
        "run foreign code",
    ),
    (
        "cel-hub-path-not-a-hub-id",
        {"model": {"path": "/models/llama", "source": {"type": "hub"}}},
        "spec",
        "hub ids: OWNER/NAME",
    ),
    (
        "cel-hub-set-but-type-pvc",
        {"model": {"path": "m", "source": {"type": "image", "hub": {}}}},
        "spec.model.source",
        "set type: hub or remove hub",
    ),
    (
        "cel-hub-pvc-cache-without-claim",
        {"model": {"path": "a/b", "source": {"type": "hub", "hub": {"cache": "pvc"}}}},
        "spec.model.source.hub",
        "cacheClaimName",
    ),
    (
        "cel-extra-args-override-graph-batch",
        {"engine": {"extraArgs": ["--cuda-graph-max-bs-decode=32"]}},
        "spec.engine",
        "use the matching spec field",
    ),
    (
        "cel-extra-args-override-threshold",
        {"engine": {"extraArgs": ["--speculative-disable-batch-threshold", "3"]}},
        "spec.engine",
        "use the matching spec field",
    ),
    (
        "mem-fraction-out-of-range",
        {"engine": {"memFractionStatic": 1.5}},
        "spec.engine.memFractionStatic",
        "maximum",
    ),
    ("shm-size-not-quantity", {"engine": {"shmSize": "lots"}}, "spec.engine.shmSize", "match"),
    (
        "unknown-field-typo",
        {"engine": {"tensorParalelSize": 8}},
        "spec.engine.tensorParalelSize",
        "Unknown field",
    ),
    (
        "cel-pvc-type-without-claim",
        {"model": {"path": "m", "source": {"type": "pvc"}}},
        "spec.model.source",
        "type 'pvc' needs spec.model.source.pvc.claimName",
    ),
    (
        "host-path-relative",
        {"model": {"path": "m", "source": {"type": "hostPath", "hostPath": {"path": "models"}}}},
        "spec.model.source.hostPath.path",
        "match",
    ),
    (
        "router-class-unknown",
        {"router": {"defaultClass": "bulk"}},
        "spec.router.defaultClass",
        "is not one of",
    ),
    (
        "cel-pool-bounds-inverted",
        {"router": {"pools": {"minLatencyFraction": 0.8, "maxLatencyFraction": 0.2}}},
        "spec.router.pools",
        "minLatencyFraction must not exceed maxLatencyFraction",
    ),
    (
        "cel-client-auth-without-credentials",
        {"router": {"clientAuth": {"key": "keys.yaml"}}},
        "spec.router.clientAuth",
        "needs secretName (API keys), oidc (tokens) or both",
    ),
    (
        "oidc-issuer-not-https",
        {"router": {"clientAuth": {"oidc": {"issuer": "http://idp.example", "audience": "a"}}}},
        "spec.router.clientAuth.oidc.issuer",
        "match",
    ),
    (
        "oidc-symmetric-algorithm",
        {
            "router": {
                "clientAuth": {
                    "oidc": {"issuer": "https://i", "audience": "a", "algorithms": ["HS256"]}
                }
            }
        },
        "spec.router.clientAuth.oidc.algorithms[0]",
        "is not one of",
    ),
    (
        "gpu-resource-not-extended-name",
        {"engine": {"gpuResourceName": "gpu"}},
        "spec.engine.gpuResourceName",
        "match",
    ),
    (
        "cel-update-replaces-no-pod",
        {"disruption": {"maxSurge": 0, "maxUnavailable": 0}},
        "spec.disruption",
        "maxSurge and maxUnavailable cannot both be 0",
    ),
    (
        "answer-limit-not-positive",
        {"router": {"timeouts": {"answerSeconds": 0}}},
        "spec.router.timeouts.answerSeconds",
        "minimum",
    ),
    (
        "service-type-unknown",
        {"router": {"serviceType": "Ingress"}},
        "spec.router.serviceType",
        "is not one of",
    ),
]


def test_at_least_fifteen_malformed_cases() -> None:
    assert len(CASES) >= 15


@pytest.mark.parametrize(
    ("case", "overrides", "field", "fragment"), CASES, ids=[c[0] for c in CASES]
)
def test_malformed_resource_is_rejected_naming_the_field(
    case: str, overrides: dict[str, Any], field: str, fragment: str, schema: dict[str, Any]
) -> None:
    resource = minimal_resource(**overrides)
    if overrides.get("model", 0) is None:
        del resource["spec"]["model"]
    with pytest.raises(admission.AdmissionError) as info:
        admission.admit(resource, schema)
    matching = [e for e in info.value.errors if e.path == field]
    assert matching, f"no error at {field}: {info.value}"
    assert any(fragment in e.message for e in matching), str(info.value)


def test_the_minimal_resource_is_valid(schema: dict[str, Any]) -> None:
    admitted = admission.admit(minimal_resource(), schema)
    assert admitted["spec"]["speculative"]["numDraftTokens"] == 4


def test_every_error_is_reported_at_once(schema: dict[str, Any]) -> None:
    resource = minimal_resource(replicas=-3, router={"replicas": 0, "serviceType": "X"})
    with pytest.raises(admission.AdmissionError) as info:
        admission.admit(resource, schema)
    paths = {e.path for e in info.value.errors}
    assert {"spec.replicas", "spec.router.replicas", "spec.router.serviceType"} <= paths


def test_cel_rules_pass_on_valid_combinations(schema: dict[str, Any]) -> None:
    tree = minimal_resource(
        speculative={
            "draftModel": {"path": "d"},
            "eagleTopk": 4,
            "numSteps": 5,
            "numDraftTokens": 8,
            "control": {"mode": "alwaysOn"},
        },
        engine={"tensorParallelSize": 4, "gpusPerPod": 8, "extraArgs": ["--log-level", "info"]},
    )
    admission.admit(tree, schema)


def test_operator_model_rejects_what_the_schema_rejects() -> None:
    """A resource that slipped past an old CRD still fails in the operator, naming the field."""
    from pydantic import ValidationError

    from specgate import api

    with pytest.raises(ValidationError) as info:
        api.SpecDecodeDeployment.model_validate(minimal_resource(replicas=-1))
    assert info.value.errors()[0]["loc"] == ("spec", "replicas")
