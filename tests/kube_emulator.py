"""A Kubernetes API emulator for the operator's integration tests: kmock, extended.

No kube-apiserver can run on these machines; kmock (by kopf's author) is the closest emulator.
Out of the box it stores objects as plain JSON and merges patches. This subclass adds what the
operator depends on:

- server-set metadata: namespace, uid, resourceVersion, creationTimestamp, generation (bumped on
  spec changes only);
- a status subresource for the kinds that have one (writes to the main resource ignore .status,
  writes to /status touch only .status);
- JSON merge patch (RFC 7386) and an approximation of server-side apply (below);
- admission of custom resources against their CRD: defaults, schema with strict field
  validation, CEL rules (`specgate.admission`), answered with 422 and the field errors;
- label selectors on lists (equality, inequality, existence);
- no-op writes leave the object (and its resourceVersion) alone and send no watch event.

What it still does not emulate, so tests cannot rely on it:
- garbage collection by ownerReferences (the operator deletes its children itself; with a real
  API server the garbage collector would also do it);
- server-side apply's field ownership: an apply replaces the applied object's top-level
  sections (spec, data, rules, ...) and its labels, annotations and ownerReferences; there are
  no managedFields, no conflicts between managers, no list merge keys;
- resourceVersion preconditions and conflicts (409 on stale writes), PUT, watch bookmarks and
  410 Gone, admission webhooks, RBAC, and all controllers (nothing fills a Deployment's status
  unless a test does it).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import json
import uuid
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
import yaml
from kmock._internal import enums, k8s, rendering

from specgate import admission

STATUS_SUBRESOURCE_KINDS = {
    ("specgate.io", "specdecodedeployments"),
    ("apps", "deployments"),
}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


@attrs.define(kw_only=True)
class SpecgateApiEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus the behaviours listed in the module docstring."""

    crd_schemas: dict[tuple[str, str], dict[str, Any]] = attrs.field(factory=dict)
    _rv: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1000), init=False)
    _namespaces: dict[str, dict[str, Any]] = attrs.field(factory=dict, init=False)
    apply_delay_seconds: float = 0.0
    """Each server-side apply waits this long first: a slow API server, so that a test can
    catch the operator with a reconcile under way."""

    def register_crd(self, crd: dict[str, Any]) -> None:
        """Serve a CRD's storage version and admit its objects against its schema."""
        spec = crd["spec"]
        version = next(v for v in spec["versions"] if v.get("storage"))
        key = f"{spec['group']}/{version['name']}/{spec['names']['plural']}"
        self.resources[key] = kmock.ResourceInfo(
            kind=spec["names"]["kind"],
            singular=spec["names"]["singular"],
            namespaced=spec["scope"] == "Namespaced",
            verbs={"get", "list", "watch", "create", "patch", "delete"},
            shortnames=set(spec["names"].get("shortNames", [])),
            subresources=set(version.get("subresources", {})),
        )
        self.crd_schemas[(spec["group"], spec["names"]["plural"])] = admission.crd_schema(crd)

    def serve_builtin(
        self,
        api_version: str,
        plural: str,
        kind: str,
        *,
        status: bool = False,
        namespaced: bool = True,
    ) -> None:
        self.resources[f"{api_version}/{plural}"] = kmock.ResourceInfo(
            kind=kind,
            namespaced=namespaced,
            verbs={"get", "list", "watch", "create", "patch", "delete"},
            subresources={"status"} if status else set(),
        )

    def add_namespace(self, name: str) -> None:
        """kopf lists and watches namespaces before anything else; kmock's URL parser cannot
        parse `/api/v1/namespaces`, so namespaces are served here, ahead of it."""
        self.resources["v1/namespaces"] = kmock.ResourceInfo(
            kind="Namespace", namespaced=False, verbs={"get", "list", "watch"}
        )
        self._namespaces[name] = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "uid": str(uuid.uuid4()), "resourceVersion": "1"},
            "status": {"phase": "Active"},
        }

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if raw_request.path.rstrip("/") != "/api/v1/namespaces":
            return await super().__call__(raw_request)
        items = [copy.deepcopy(ns) for ns in self._namespaces.values()]
        if raw_request.query.get("watch") not in ("true", "1"):
            body = {"kind": "NamespaceList", "metadata": {"resourceVersion": "1"}, "items": items}
            return aiohttp.web.json_response(body)
        response = aiohttp.web.StreamResponse()
        await response.prepare(raw_request)
        for ns in items:
            await response.write(json.dumps({"type": "ADDED", "object": ns}).encode() + b"\n")
        await asyncio.Event().wait()  # namespaces never change here; the client hangs up
        return response

    # ---- helpers ----

    def _next_rv(self) -> str:
        return str(next(self._rv))

    def _has_status(self, resource: Any) -> bool:
        return (resource.group, resource.plural) in STATUS_SUBRESOURCE_KINDS

    def _admit(self, resource: Any, obj: dict[str, Any]) -> dict[str, Any]:
        schema = self.crd_schemas.get((resource.group, resource.plural))
        if schema is None:
            return obj
        try:
            return admission.admit(obj, schema)
        except admission.AdmissionError as exc:
            kind = obj.get("kind", resource.plural)
            name = (obj.get("metadata") or {}).get("name", "")
            raise k8s.KubernetesError(
                status=422,
                reason="Invalid",
                message=f'{kind}.{resource.group} "{name}" is invalid: {exc}',
                details={"causes": [{"field": e.path, "message": e.message} for e in exc.errors]},
            ) from exc

    def _body(self, request: rendering.Request) -> Any:
        data = yaml.safe_load(request.body.decode() or "{}") if request.body else {}
        json_patch = "json-patch" in request.headers.get("Content-Type", "")
        if not isinstance(data, list if json_patch else dict):
            raise k8s.KubernetesError(status=400, reason="BadRequest", message="malformed body")
        return data

    def _stored(self, key: tuple[Any, str | None, str]) -> dict[str, Any] | None:
        if key not in self._objects or self._objects[key].deleted:
            return None
        return copy.deepcopy(self._objects[key].raw)

    async def _store(
        self, key: tuple[Any, str | None, str], obj: dict[str, Any], event: str
    ) -> None:
        if key in self._objects:
            self._objects[key].create(obj)
        else:
            self._objects[key] = obj
        await self._buses[key[0]].put({"type": event, "object": copy.deepcopy(obj)})

    def _new_object(self, request: rendering.Request, body: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if request.namespace:
            meta["namespace"] = request.namespace
        meta.update(
            uid=str(uuid.uuid4()),
            resourceVersion=self._next_rv(),
            creationTimestamp=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            generation=1,
        )
        if self._has_status(request.resource):
            obj.pop("status", None)
        return self._admit(request.resource, obj)

    # ---- request handling ----

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        try:
            if request.resource is not None and request.action == enums.action.CREATE:
                return await self._create(request)
            if request.resource is not None and request.action == enums.action.UPDATE:
                return await self._update(request)
        except k8s.KubernetesError as exc:
            return await self._render_error(exc)
        return await super()._handle(request)

    async def _create(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        body = self._body(request)
        name = (body.get("metadata") or {}).get("name")
        namespace = request.namespace or (body.get("metadata") or {}).get("namespace")
        async with self._lock:
            key = (request.resource, namespace, name)
            if self._stored(key) is not None:
                raise k8s.KubernetesObjectConflictError(message=f'"{name}" already exists')
            obj = self._new_object(request, body)
            await self._store(key, obj, "ADDED")
        return aiohttp.web.json_response(obj, status=201)

    async def _update(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        body = self._body(request)
        content_type = request.headers.get("Content-Type", "")
        key = (request.resource, request.namespace, request.name)
        if "apply-patch" in content_type and self.apply_delay_seconds:
            await asyncio.sleep(self.apply_delay_seconds)
        async with self._lock:
            current = self._stored(key)
            if "apply-patch" in content_type:
                if current is None:
                    obj = self._new_object(request, body)
                    await self._store(key, obj, "ADDED")
                    return aiohttp.web.json_response(obj, status=201)
                new = self._server_side_apply(current, body)
            elif current is None:
                raise k8s.KubernetesObjectNotFoundError()
            elif "json-patch" in content_type:  # RFC 6902, as kopf sends for some writes
                try:
                    new = jsonpatch.apply_patch(current, body)
                except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
                    raise k8s.KubernetesError(
                        status=422, reason="Invalid", message=str(exc)
                    ) from exc
                # A subresource write touches one side only; an object never given a status
                # keeps none (a null one would fail the CRD schema's `type: object`).
                if request.subresource == "status":
                    new = {**current, "status": new.get("status")}
                elif self._has_status(request.resource):
                    new = {k: v for k, v in new.items() if k != "status"}
                    if "status" in current:
                        new["status"] = current["status"]
            elif request.subresource == "status":
                new = merge_patch(current, {"status": body.get("status")})
            else:
                if self._has_status(request.resource):
                    body = {k: v for k, v in body.items() if k != "status"}
                new = merge_patch(current, body)
            new["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            if {k: v for k, v in new.items() if k != "status"} != {
                k: v for k, v in current.items() if k != "status"
            } or new.get("status") != current.get("status"):
                if new.get("spec") != current.get("spec"):
                    new["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
                new = self._admit(request.resource, new)
                new["metadata"]["resourceVersion"] = self._next_rv()
                meta = new["metadata"]
                if meta.get("deletionTimestamp") and not meta.get("finalizers"):
                    self._objects[key].create(new)
                    self._objects[key].delete()
                    await self._buses[key[0]].put({"type": "DELETED", "object": new})
                else:
                    await self._store(key, new, "MODIFIED")
        return aiohttp.web.json_response(new)

    @staticmethod
    def _server_side_apply(current: dict[str, Any], applied: dict[str, Any]) -> dict[str, Any]:
        new = copy.deepcopy(current)
        for section, value in applied.items():
            if section in ("apiVersion", "kind", "status"):
                continue
            if section == "metadata":
                for field in ("labels", "annotations", "ownerReferences"):
                    if field in value:
                        new["metadata"][field] = copy.deepcopy(value[field])
                continue
            new[section] = copy.deepcopy(value)
        return new

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        payload = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        if selector and isinstance(payload, dict):
            payload["items"] = [
                item
                for item in payload["items"]
                if _selector_matches(selector, (item.get("metadata") or {}).get("labels") or {})
            ]
        return payload
