from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from specgate import admission, crd

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
KUBERNETES_VERSION = "1.32.0"  # oldest release we support; kubernetes-validate pins its schemas


@pytest.fixture(scope="session")
def crd_manifest() -> dict[str, Any]:
    return crd.crd()


@pytest.fixture(scope="session")
def schema(crd_manifest: dict[str, Any]) -> dict[str, Any]:
    return admission.crd_schema(crd_manifest)


def minimal_resource(**spec_overrides: Any) -> dict[str, Any]:
    """The smallest valid SpecDecodeDeployment, with top-level spec keys replaced."""
    spec: dict[str, Any] = {
        "model": {"path": "meta-llama/Llama-3.1-8B-Instruct"},
        "speculative": {"draftModel": {"path": "draft/eagle3-8b"}},
    }
    spec.update(copy.deepcopy(spec_overrides))
    return {
        "apiVersion": "specgate.io/v1alpha1",
        "kind": "SpecDecodeDeployment",
        "metadata": {"name": "demo", "namespace": "default"},
        "spec": spec,
    }


def load_example(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    return doc
