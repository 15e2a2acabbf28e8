"""Generate the SpecDecodeDeployment CRD from the pydantic models in `specgate.api`.

Pydantic emits JSON Schema 2020-12; the API server wants a *structural* OpenAPI v3 schema:
every node typed, `$ref`s inlined, `nullable` instead of `anyOf [..., null]`, no `title`,
`x-kubernetes-preserve-unknown-fields` for pass-through core types. This module does that
translation and nothing else, so the committed CRD is a pure function of the models.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema, to_jsonable_python

from specgate import api


class _WithFactoryDefaults(GenerateJsonSchema):
    """Pydantic leaves `default_factory` defaults out of schemas; the CRD needs them so the API
    server applies them. A model-valued default is the model with its own defaults filled in:
    the API server checks a default against the object's CEL rules, and `{}` would fail every
    rule that reads a field ("no such key")."""

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        factory = schema.get("default_factory")
        if factory is None or schema.get("default_factory_takes_data"):
            return super().default_schema(schema)
        inner = self.generate_inner(schema["schema"])
        value = factory()  # type: ignore[call-arg]
        inner["default"] = (
            value.model_dump(by_alias=True, mode="json", exclude_none=True)
            if isinstance(value, BaseModel)
            else to_jsonable_python(value)
        )
        return inner


_KEEP = {
    "type",
    "description",
    "default",
    "enum",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "format",
    "required",
    "nullable",
}


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**copy.deepcopy(target), **{k: v for k, v in node.items() if k != "$ref"}}
        return _resolve(merged, defs)
    return node


def _structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    node = _resolve(node, defs)
    nullable = False
    if "anyOf" in node:
        variants = [v for v in node["anyOf"] if v.get("type") != "null"]
        nullable = len(variants) < len(node["anyOf"])
        if len(variants) != 1:
            raise ValueError(f"cannot express a union of {len(variants)} types: {node}")
        outer = {k: v for k, v in node.items() if k != "anyOf"}
        node = {**_resolve(variants[0], defs), **outer}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _KEEP or key.startswith("x-kubernetes-"):
            out[key] = copy.deepcopy(value)
    if "description" in out:
        out["description"] = " ".join(out["description"].split())
    if "const" in node:
        out["enum"] = [node["const"]]
    if "exclusiveMinimum" in node:
        out["minimum"], out["exclusiveMinimum"] = node["exclusiveMinimum"], True
    if "exclusiveMaximum" in node:
        out["maximum"], out["exclusiveMaximum"] = node["exclusiveMaximum"], True
    if nullable:
        out["nullable"] = True
        if out.get("default", 0) is None:
            del out["default"]
    if out.get("type") == "object" or "properties" in node:
        out["type"] = "object"
        if "properties" in node:
            out["properties"] = {
                name: _structural(prop, defs) for name, prop in node["properties"].items()
            }
        if out.get("x-kubernetes-preserve-unknown-fields"):
            out.pop("additionalProperties", None)
        elif isinstance(node.get("additionalProperties"), dict):
            out["additionalProperties"] = _structural(node["additionalProperties"], defs)
        elif node.get("additionalProperties") is True:
            out["x-kubernetes-preserve-unknown-fields"] = True
    if out.get("type") == "array" or "items" in node:
        out["type"] = "array"
        out["items"] = _structural(node.get("items", {}), defs)
    if "type" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        raise ValueError(f"untyped schema node: {node}")
    if out.get("x-kubernetes-preserve-unknown-fields") and out.get("type") == "array":
        out.pop("x-kubernetes-preserve-unknown-fields")
    return out


def openapi_schema(model: type[Any]) -> dict[str, Any]:
    """The structural schema of one pydantic model."""
    raw = model.model_json_schema(
        by_alias=True, mode="validation", schema_generator=_WithFactoryDefaults
    )
    return _structural(raw, raw.get("$defs", {}))


def resource_schema() -> dict[str, Any]:
    """openAPIV3Schema of the whole resource."""
    return {
        "type": "object",
        "description": "SpecDecodeDeployment runs a model on SGLang EAGLE pods behind specgate's"
        " speculation-aware router.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "specgate.io/v1alpha1"},
            "kind": {"type": "string", "description": "SpecDecodeDeployment"},
            "metadata": {"type": "object"},
            "spec": openapi_schema(api.SpecDecodeDeploymentSpec),
            "status": openapi_schema(api.SpecDecodeDeploymentStatus),
        },
    }


PRINTER_COLUMNS = [
    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Mode", "type": "string", "jsonPath": ".spec.speculative.control.mode"},
    {"name": "Threshold", "type": "string", "jsonPath": ".status.threshold"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition manifest."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{api.PLURAL}.{api.GROUP}",
            "labels": {"app.kubernetes.io/part-of": "specgate"},
        },
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
                "categories": ["specgate"],
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": resource_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


HEADER = "# Generated by `specgate crd` from specgate/api.py. Do not edit; run `make crd`.\n"


def crd_yaml() -> str:
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=100)
