"""What the API server does to a custom resource on admission, done offline.

Three steps, in the API server's order: apply the schema's defaults, validate against the
structural schema (with strict field validation, as `kubectl apply` asks for since 1.27, so an
unknown or misspelt field is an error, not silently pruned), then evaluate every CEL rule
(`x-kubernetes-validations`) with `self` bound to the value it is attached to.

Used by the tests, by `specgate render` (so a bad file fails before it reaches a cluster) and by
the Kubernetes API emulator in the integration tests. Not covered: CEL cost limits, transition
rules (`oldSelf`), `messageExpression`, and formats beyond what jsonschema checks.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jsonschema


@dataclass(frozen=True)
class FieldError:
    """One rejected field, worded like the API server's `field.Error`."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class AdmissionError(ValueError):
    """The resource would be rejected; `errors` names every offending field."""

    def __init__(self, errors: list[FieldError]) -> None:
        self.errors = errors
        super().__init__("; ".join(str(e) for e in errors))


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Structural defaulting: fill absent properties that have a default, recursively."""
    if isinstance(value, dict) and schema.get("type") == "object":
        out = dict(value)
        for name, prop in schema.get("properties", {}).items():
            if name not in out and "default" in prop:
                out[name] = copy.deepcopy(prop["default"])
            if name in out and out[name] is not None:
                out[name] = apply_defaults(out[name], prop)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            known = set(schema.get("properties", {}))
            for key in out:
                if key not in known:
                    out[key] = apply_defaults(out[key], extra)
        return out
    if isinstance(value, list) and schema.get("type") == "array" and "items" in schema:
        return [apply_defaults(item, schema["items"]) for item in value]
    return value


def _to_json_schema(schema: dict[str, Any], *, strict: bool) -> dict[str, Any]:
    """OpenAPI v3 structural schema -> JSON Schema (nullable, preserve-unknown, strict fields)."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("properties", "items", "additionalProperties", "nullable") or key.startswith(
            "x-"
        ):
            continue
        if key in ("exclusiveMinimum", "exclusiveMaximum"):
            continue
        out[key] = value
    if schema.get("exclusiveMinimum"):
        out["exclusiveMinimum"] = out.pop("minimum")
    if schema.get("exclusiveMaximum"):
        out["exclusiveMaximum"] = out.pop("maximum")
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    if "properties" in schema:
        out["properties"] = {
            k: _to_json_schema(v, strict=strict) for k, v in schema["properties"].items()
        }
        if strict and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = _to_json_schema(schema["additionalProperties"], strict=strict)
    if "items" in schema:
        out["items"] = _to_json_schema(schema["items"], strict=strict)
    return out


def _dotted(path: Iterator[Any] | list[Any]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _schema_errors(obj: dict[str, Any], schema: dict[str, Any]) -> list[FieldError]:
    validator = jsonschema.Draft7Validator(_to_json_schema(schema, strict=True))
    errors: list[FieldError] = []
    for err in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path)):
        path = _dotted(list(err.absolute_path)) or "<root>"
        if err.validator == "additionalProperties":
            known = sorted(err.schema.get("properties", {}))
            extra = sorted(set(err.instance) - set(known))
            for name in extra:
                prefix = f"{path}." if path != "<root>" else ""
                errors.append(
                    FieldError(
                        f"{prefix}{name}",
                        f"Unknown field: not in the schema (known fields here: {', '.join(known)})",
                    )
                )
            continue
        if err.validator == "required":
            missing = err.message.split("'")[1] if "'" in err.message else err.message
            prefix = f"{path}." if path != "<root>" else ""
            errors.append(FieldError(f"{prefix}{missing}", "Required value"))
            continue
        shown = json.dumps(err.instance)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        errors.append(FieldError(path, f"Invalid value: {shown}: {err.message}"))
    return errors


def _cel_rules(
    value: Any, schema: dict[str, Any], path: list[Any]
) -> Iterator[tuple[list[Any], Any, dict[str, str]]]:
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, value, rule
    if isinstance(value, dict):
        for name, prop in schema.get("properties", {}).items():
            if name in value and value[name] is not None:
                yield from _cel_rules(value[name], prop, [*path, name])
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            yield from _cel_rules(item, schema["items"], [*path, i])


def _cel_errors(obj: dict[str, Any], schema: dict[str, Any]) -> list[FieldError]:
    # A dev/test dependency, imported lazily so the operator image carries no CEL library.
    import celpy
    from celpy.adapter import json_to_cel
    from celpy.evaluation import CELEvalError

    env = celpy.Environment()
    errors: list[FieldError] = []
    for path, value, rule in _cel_rules(obj, schema, []):
        program = env.program(env.compile(rule["rule"]))
        try:
            result = program.evaluate({"self": json_to_cel(value)})
        except CELEvalError as exc:  # the API server reports evaluation errors as invalid
            errors.append(FieldError(_dotted(path), f"Invalid value: rule {rule['rule']!r}: {exc}"))
            continue
        if not bool(result):
            where = _dotted(path) + rule.get("fieldPath", "")
            errors.append(FieldError(where, f"Invalid value: {rule['message']}"))
    return errors


API_VERSION = "specgate.io/v1alpha1"
KIND = "SpecDecodeDeployment"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
CHILD_SUFFIXES = ("-engine", "-router", "-engine-key", "-router-leader")
"""What the operator appends to a resource's name for its children (render.names)."""
MAX_NAME = 63 - max(len(s) for s in CHILD_SUFFIXES)
"""Longest resource name whose children (Services among them: DNS labels) stay within 63."""


def identity_errors(obj: Any) -> list[FieldError]:
    """What the API server checks before the schema: the type, and a name it accepts. Names
    are DNS labels here, and short enough that every child the operator creates is one too."""
    if not isinstance(obj, dict):
        return [FieldError("<root>", f"Invalid value: a mapping, got {type(obj).__name__}")]
    errors = []
    if obj.get("apiVersion") != API_VERSION:
        errors.append(
            FieldError("apiVersion", f"Invalid value: {obj.get('apiVersion')!r}: use {API_VERSION}")
        )
    if obj.get("kind") != KIND:
        errors.append(FieldError("kind", f"Invalid value: {obj.get('kind')!r}: use {KIND}"))
    meta = obj.get("metadata")
    if not isinstance(meta, dict) or "name" not in meta:
        errors.append(FieldError("metadata.name", "Required value: name the resource"))
        return errors
    name = meta["name"]
    if not isinstance(name, str) or not DNS_LABEL.match(name):
        errors.append(
            FieldError(
                "metadata.name",
                f"Invalid value: {name!r}: lowercase letters, digits and '-', starting and"
                " ending with a letter or digit",
            )
        )
    elif len(name) > MAX_NAME:
        longest = name + max(CHILD_SUFFIXES, key=len)
        errors.append(
            FieldError(
                "metadata.name",
                f"Invalid value: {name!r}: its child {longest!r} would be {len(longest)}"
                f" characters, over 63: use at most {MAX_NAME}",
            )
        )
    namespace = meta.get("namespace")
    if namespace is not None and (not isinstance(namespace, str) or not DNS_LABEL.match(namespace)):
        errors.append(
            FieldError("metadata.namespace", f"Invalid value: {namespace!r}: a DNS label")
        )
    return errors


def admit(obj: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """Default and validate `obj` against a CRD's openAPIV3Schema.

    Returns the defaulted object, or raises AdmissionError naming every bad field. CEL rules run
    only when the schema checks pass, as in the API server (rules assume well-typed input).
    """
    errors = identity_errors(obj)
    if errors:
        raise AdmissionError(errors)
    defaulted: dict[str, Any] = apply_defaults(obj, schema)
    errors = _schema_errors(defaulted, schema)
    if not errors:
        errors = _cel_errors(defaulted, schema)
    if errors:
        raise AdmissionError(errors)
    return defaulted


def crd_schema(crd: dict[str, Any], version: str | None = None) -> dict[str, Any]:
    """The openAPIV3Schema of a CRD's served version (the storage one by default)."""
    for ver in crd["spec"]["versions"]:
        if (version is None and ver.get("storage")) or ver["name"] == version:
            schema: dict[str, Any] = dict(ver["schema"]["openAPIV3Schema"])
            return schema
    raise KeyError(f"version {version!r} not in CRD {crd['metadata']['name']}")
