"""The committed CRD is what the model generates, and it is a valid, documented CRD."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from specgate import admission, api, crd

from .conftest import EXAMPLES, KUBERNETES_VERSION, ROOT, load_example

CRD_FILE = ROOT / "crds" / "specdecodedeployments.specgate.io.yaml"


def test_committed_crd_is_generated_from_the_model() -> None:
    assert CRD_FILE.read_text() == crd.crd_yaml(), "run `make crd` and commit the result"


def test_crd_validates_against_kubernetes_schema(crd_manifest: dict[str, Any]) -> None:
    kubernetes_validate.validate(crd_manifest, KUBERNETES_VERSION, strict=True)


def test_crd_identity(crd_manifest: dict[str, Any]) -> None:
    spec = crd_manifest["spec"]
    assert crd_manifest["metadata"]["name"] == "specdecodedeployments.specgate.io"
    assert spec["group"] == "specgate.io" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "SpecDecodeDeployment"
    assert spec["names"]["shortNames"] == ["sdd"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Replicas", "Ready", "Mode", "Threshold", "Age"]


def _walk(node: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for name, child in node.get("properties", {}).items():
        out += _walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        out += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


def test_every_spec_field_is_typed_and_documented(schema: dict[str, Any]) -> None:
    for path, node in _walk(schema["properties"]["spec"], "spec"):
        assert "type" in node, f"{path} has no type"
        if path.endswith(("[]", "{}")) or path == "spec":
            continue
        assert node.get("description"), f"{path} has no description"


def test_every_bounded_scalar_has_bounds_or_enum(schema: dict[str, Any]) -> None:
    for path, node in _walk(schema["properties"]["spec"], "spec"):
        if node.get("type") == "integer":
            assert ("minimum" in node and "maximum" in node) or "enum" in node, path


def test_cross_field_rules_are_present(schema: dict[str, Any]) -> None:
    rules = [
        r["rule"] for _, node in _walk(schema, "") for r in node.get("x-kubernetes-validations", [])
    ]
    assert "self.control.mode != 'dynamic' || self.eagleTopk == 1" in rules
    assert "self.eagleTopk != 1 || self.numDraftTokens == self.numSteps + 1" in rules
    assert "self.gpusPerPod % self.tensorParallelSize == 0" in rules
    assert any("minThreshold <= self.threshold" in r for r in rules)


def test_defaults_match_the_issue(schema: dict[str, Any]) -> None:
    admitted = admission.admit(
        {
            "apiVersion": api.API_VERSION,
            "kind": api.KIND,
            "metadata": {"name": "x"},
            "spec": {"model": {"path": "m"}, "speculative": {"draftModel": {"path": "d"}}},
        },
        schema,
    )
    spec = admitted["spec"]
    assert spec["engine"]["tensorParallelSize"] == 8 and spec["engine"]["gpusPerPod"] == 8
    assert spec["speculative"]["algorithm"] == "EAGLE3"
    assert spec["speculative"]["control"]["mode"] == "dynamic"
    assert spec["placement"]["nodeSelector"] == {}
    assert spec["placement"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    # The defaulted object also parses with the operator's model: one source of truth.
    api.SpecDecodeDeployment.model_validate(admitted)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: Path(p).name)
def test_examples_are_valid_resources(path: Path, schema: dict[str, Any]) -> None:
    admitted = admission.admit(load_example(path), schema)
    api.SpecDecodeDeployment.model_validate(admitted)


def test_there_are_two_examples() -> None:
    assert len(EXAMPLES) >= 2


def test_crd_file_is_one_yaml_document() -> None:
    docs = list(yaml.safe_load_all(CRD_FILE.read_text()))
    assert len(docs) == 1 and docs[0]["kind"] == "CustomResourceDefinition"


def test_committed_reference_docs_are_generated() -> None:
    from specgate import docs

    assert (ROOT / "docs" / "crd-reference.md").read_text() == docs.reference(), (
        "run `make docs` and commit the result"
    )


def test_reference_docs_list_every_field(schema: dict[str, Any]) -> None:
    from specgate import docs

    text = docs.reference()
    for path, _ in _walk(schema["properties"]["spec"], "spec"):
        if path != "spec" and not path.endswith(("[]", "{}")):
            assert f"`{path}`" in text, path


def test_status_conditions_are_a_map_keyed_by_type() -> None:
    """One condition a type, merged by type under server-side apply (the API conventions)."""
    from specgate import crd

    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    conditions = schema["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert "type" in conditions["items"]["required"]
