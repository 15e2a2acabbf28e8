"""A small async Kubernetes API client over httpx, for the operator and the router.

Only what specgate does: server-side apply, create-if-absent, get, list, merge-patch (also of the
status subresource), delete, and API discovery. The operator's credentials come from kopf's
login helpers, so its watch stream and its writes use one identity; the router, which has no
kopf, reads the same sources itself (`Credentials.discover`). Errors become `KubeError` with
the API server's status code, reason and message.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import os
import ssl
import tempfile
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx

FIELD_MANAGER = "specgate-operator"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
TOKEN_FILE_SECONDS = 60.0
"""How long a token read from a file is used before the file is read again (client-go's)."""
EXEC_SECONDS = 30.0
EXEC_OUTPUT_BYTES = 1 << 20
EXEC_EARLY_SECONDS = 30.0
"""An exec plugin's token is renewed this long before its expirationTimestamp."""

# kind -> (API path prefix, plural) for every kind specgate reads or writes.
_KINDS: dict[tuple[str, str], str] = {
    ("v1", "Secret"): "secrets",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Service"): "services",
    ("v1", "Pod"): "pods",
    ("v1", "Event"): "events",
    ("apps/v1", "Deployment"): "deployments",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitors",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproutes",
    ("coordination.k8s.io/v1", "Lease"): "leases",
    ("discovery.k8s.io/v1", "EndpointSlice"): "endpointslices",
    ("specgate.io/v1alpha1", "SpecDecodeDeployment"): "specdecodedeployments",
}


class KubeError(Exception):
    """An API call failed; `status` is the HTTP code (0 when the server was not reached)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        self.status, self.reason, self.message = status, reason, message
        super().__init__(f"{status} {reason}: {message}")

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409


def collection_path(api_version: str, kind: str, namespace: str | None) -> str:
    plural = _KINDS.get((api_version, kind))
    if plural is None:
        raise ValueError(f"specgate does not manage {api_version} {kind}")
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{root}/namespaces/{quote(namespace)}/{plural}" if namespace else f"{root}/{plural}"


def object_path(api_version: str, kind: str, namespace: str | None, name: str) -> str:
    return f"{collection_path(api_version, kind, namespace)}/{quote(name)}"


@dataclass(frozen=True)
class ExecPlugin:
    """A kubeconfig user's `exec` section: a command that prints an ExecCredential."""

    command: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    api_version: str = "client.authentication.k8s.io/v1"


@dataclass(frozen=True)
class Credentials:
    """Where the API server is and how to authenticate."""

    server: str
    token: str | None = None
    token_path: str | None = None
    """A file holding the token, read again every TOKEN_FILE_SECONDS (wins over `token`)."""
    exec_plugin: ExecPlugin | None = None
    ca_path: str | None = None
    ca_data: bytes | None = None
    insecure: bool = False
    certificate_path: str | None = None
    private_key_path: str | None = None
    default_namespace: str | None = None

    @classmethod
    def in_cluster(cls, environ: Mapping[str, str] | None = None) -> Credentials | None:
        """The pod's service account, or None outside a cluster."""
        env = os.environ if environ is None else environ
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
        account = env.get("SPECGATE_SERVICE_ACCOUNT_DIR", SERVICE_ACCOUNT_DIR)
        token_path = os.path.join(account, "token")
        if not (host and port and os.path.exists(token_path)):
            return None
        namespace_file = os.path.join(account, "namespace")
        namespace = None
        if os.path.exists(namespace_file):
            with open(namespace_file) as f:
                namespace = f.read().strip()
        server_host = f"[{host}]" if ":" in host else host
        return cls(
            server=f"https://{server_host}:{port}",
            token_path=token_path,
            ca_path=os.path.join(account, "ca.crt"),
            default_namespace=namespace,
        )

    @classmethod
    def discover(cls, environ: Mapping[str, str] | None = None) -> Credentials:
        """The pod's service account when running in a cluster, else the current context of
        the kubeconfig (`KUBECONFIG`, or ~/.kube/config): what kubectl would use."""
        env = os.environ if environ is None else environ
        found = cls.in_cluster(env)
        if found is not None:
            return found
        path = env.get("KUBECONFIG", "").split(os.pathsep)[0] or os.path.expanduser(
            "~/.kube/config"
        )
        return cls.from_kubeconfig(path)

    @classmethod
    def from_kubeconfig(cls, path: str) -> Credentials:
        """The current context of a kubeconfig file: server, CA, token or client certificate."""
        from specgate import bounded_yaml

        try:
            config = bounded_yaml.load_file(path) or {}
        except (OSError, bounded_yaml.YamlError) as exc:
            why = f"no in-cluster account and no kubeconfig: {exc}"
            raise KubeError(0, "NoCredentials", why) from None
        if not isinstance(config, dict):
            raise KubeError(0, "NoCredentials", f"{path}: a kubeconfig is a mapping")

        def named(section: str, name: str | None) -> dict[str, Any]:
            for entry in config.get(section) or []:
                if isinstance(entry, dict) and entry.get("name") == name:
                    value = entry.get(section.removesuffix("s")) or {}
                    return value if isinstance(value, dict) else {}
            raise KubeError(0, "NoCredentials", f"{path}: no {section[:-1]} named {name!r}")

        context = named("contexts", config.get("current-context"))
        cluster = named("clusters", context.get("cluster"))
        user = named("users", context.get("user")) if context.get("user") else {}
        if not cluster.get("server"):
            raise KubeError(0, "NoCredentials", f"{path}: the current cluster has no server")
        base = os.path.dirname(os.path.abspath(path))

        def file_of(key: str, suffix: str, source: dict[str, Any]) -> str | None:
            if source.get(f"{key}-data"):
                return _to_file(base64.b64decode(source[f"{key}-data"]), suffix)
            value = source.get(key)
            return os.path.join(base, value) if value else None

        return cls(
            server=str(cluster["server"]).rstrip("/"),
            token=user.get("token"),
            token_path=os.path.join(base, user["tokenFile"]) if user.get("tokenFile") else None,
            exec_plugin=_exec_plugin(path, user.get("exec")),
            ca_path=file_of("certificate-authority", "crt", cluster),
            insecure=bool(cluster.get("insecure-skip-tls-verify")),
            certificate_path=file_of("client-certificate", "cert", user),
            private_key_path=file_of("client-key", "key", user),
            default_namespace=context.get("namespace"),
        )

    def ssl_context(self) -> ssl.SSLContext | bool:
        if self.insecure:
            return False
        if self.ca_path or self.ca_data:
            ctx = ssl.create_default_context(
                cafile=self.ca_path,
                cadata=self.ca_data.decode() if self.ca_data else None,
            )
        else:
            ctx = ssl.create_default_context()
        if self.certificate_path and self.private_key_path:
            ctx.load_cert_chain(self.certificate_path, self.private_key_path)
        return ctx


def _exec_plugin(path: str, section: Any) -> ExecPlugin | None:
    if section is None:
        return None
    if not isinstance(section, dict) or not isinstance(section.get("command"), str):
        raise KubeError(0, "NoCredentials", f"{path}: users[].user.exec needs a command")
    args = section.get("args") or []
    env = section.get("env") or []
    if not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
        raise KubeError(0, "NoCredentials", f"{path}: users[].user.exec.args must be strings")
    if not (isinstance(env, list) and all(isinstance(e, dict) for e in env)):
        raise KubeError(0, "NoCredentials", f"{path}: users[].user.exec.env is [{{name, value}}]")
    return ExecPlugin(
        command=section["command"],
        args=tuple(args),
        env=tuple((str(e.get("name", "")), str(e.get("value", ""))) for e in env),
        api_version=str(section.get("apiVersion") or ExecPlugin.api_version),
    )


@dataclass
class TokenAuth(httpx.Auth):
    """The bearer token of `credentials`, current: a file is read again every
    TOKEN_FILE_SECONDS, an exec plugin runs again EXEC_EARLY_SECONDS before its token expires,
    and either is refreshed at once when the server answers 401 (the request is sent again
    once). A fixed token is sent as it is."""

    credentials: Credentials
    clock: Any = time.monotonic
    _token: str | None = None
    _valid_until: float = 0.0
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def refreshable(self) -> bool:
        return bool(self.credentials.token_path or self.credentials.exec_plugin)

    def valid_for(self) -> float:
        """Seconds the current token is used before it is read or fetched again."""
        return max(0.0, self._valid_until - self.clock()) if self.refreshable else float("inf")

    async def token(self, *, force: bool = False) -> str | None:
        if not self.refreshable:
            return self.credentials.token
        async with self._lock:
            if force or self._token is None or self.clock() >= self._valid_until:
                self._token, self._valid_until = await self._fetch()
            return self._token

    async def _fetch(self) -> tuple[str, float]:
        path, plugin = self.credentials.token_path, self.credentials.exec_plugin
        if path:
            try:
                with open(path) as f:
                    return f.read(64 * 1024).strip(), self.clock() + TOKEN_FILE_SECONDS
            except OSError as exc:
                raise KubeError(0, "NoCredentials", f"token file {path}: {exc}") from None
        assert plugin is not None
        return await run_exec_plugin(plugin, self.clock)

    async def async_auth_flow(
        self, request: httpx.Request
    ) -> AsyncGenerator[httpx.Request, httpx.Response]:
        token = await self.token()
        if token:
            request.headers["Authorization"] = f"Bearer {token}"
        response = yield request
        if response.status_code == 401 and self.refreshable:
            token = await self.token(force=True)
            if token:
                request.headers["Authorization"] = f"Bearer {token}"
            yield request

    def sync_auth_flow(self, request: httpx.Request) -> Any:
        raise RuntimeError("KubeClient is asynchronous")


async def run_exec_plugin(plugin: ExecPlugin, clock: Any = time.monotonic) -> tuple[str, float]:
    """(token, monotonic time to renew it) from the plugin's ExecCredential, bounded in time
    and output; a failure is one KubeError naming the command and its last error line."""
    info = {"apiVersion": plugin.api_version, "kind": "ExecCredential",
            "spec": {"interactive": False}}  # fmt: skip
    env = {**os.environ, **dict(plugin.env), "KUBERNETES_EXEC_INFO": json.dumps(info)}
    name = os.path.basename(plugin.command)

    def failed(why: str) -> KubeError:
        return KubeError(0, "ExecCredential", f"exec plugin {name}: {why}")

    try:
        proc = await asyncio.create_subprocess_exec(
            plugin.command, *plugin.args, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
    except OSError as exc:
        raise failed(f"cannot run it ({exc.strerror or exc})") from None
    try:
        async with asyncio.timeout(EXEC_SECONDS):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise failed(f"no answer within {EXEC_SECONDS:.0f}s") from None
    if proc.returncode != 0:
        last = (err.decode(errors="replace").strip().splitlines() or ["no error output"])[-1]
        raise failed(f"exited {proc.returncode}: {last[:300]}")
    if len(out) > EXEC_OUTPUT_BYTES:
        raise failed(f"printed more than {EXEC_OUTPUT_BYTES} bytes")
    try:
        status = json.loads(out)["status"]
        token = status["token"]
    except (ValueError, KeyError, TypeError):
        raise failed("did not print an ExecCredential with status.token (client"
                     " certificates from exec plugins are not supported)") from None  # fmt: skip
    if not isinstance(token, str) or not token:
        raise failed("status.token is empty")
    renew = float("inf")
    expires = status.get("expirationTimestamp")
    if expires:
        try:
            at = datetime.datetime.fromisoformat(str(expires).replace("Z", "+00:00"))
        except ValueError:
            raise failed(f"expirationTimestamp {str(expires)[:40]!r} is not RFC 3339") from None
        left = (at - datetime.datetime.now(datetime.UTC)).total_seconds()
        renew = clock() + max(0.0, left - EXEC_EARLY_SECONDS)
    return token, renew


def _as_bytes(data: str | bytes) -> bytes:
    return data.encode() if isinstance(data, str) else data


def _to_file(data: bytes, suffix: str) -> str:
    fd, path = tempfile.mkstemp(prefix="specgate-", suffix=f".{suffix}")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


class KubeClient:
    """One httpx.AsyncClient bound to one API server; close it with `aclose()`."""

    def __init__(
        self,
        credentials: Credentials,
        *,
        timeout: float = 15.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Accept": "application/json", "User-Agent": "specgate"}
        self.credentials = credentials
        self.auth = TokenAuth(credentials)
        self._http = httpx.AsyncClient(
            base_url=credentials.server,
            headers=headers,
            auth=self.auth,
            timeout=timeout,
            verify=credentials.ssl_context(),
            transport=transport,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        headers = {"Content-Type": content_type} if body is not None else {}
        try:
            resp = await self._http.request(method, path, json=body, headers=headers, params=params)
        except httpx.HTTPError as exc:
            raise KubeError(0, type(exc).__name__, str(exc) or repr(exc)) from exc
        if resp.status_code >= 400:
            try:
                status = resp.json()
                reason, message = status.get("reason", ""), status.get("message", resp.text)
            except ValueError:
                reason, message = resp.reason_phrase, resp.text
            raise KubeError(resp.status_code, str(reason), str(message))
        if not resp.content:
            return {}
        data: dict[str, Any] = resp.json()
        return data

    async def get(
        self, api_version: str, kind: str, namespace: str | None, name: str
    ) -> dict[str, Any]:
        return await self._call("GET", object_path(api_version, kind, namespace, name))

    async def get_or_none(
        self, api_version: str, kind: str, namespace: str | None, name: str
    ) -> dict[str, Any] | None:
        try:
            return await self.get(api_version, kind, namespace, name)
        except KubeError as exc:
            if exc.not_found:
                return None
            raise

    async def list_versioned(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        *,
        label_selector: str | None = None,
    ) -> tuple[list[dict[str, Any]], str]:
        """The items and the list's resourceVersion, where a watch of them starts."""
        params = {"labelSelector": label_selector} if label_selector else None
        data = await self._call("GET", collection_path(api_version, kind, namespace), params=params)
        items: list[dict[str, Any]] = data.get("items", [])
        return items, str((data.get("metadata") or {}).get("resourceVersion") or "")

    async def list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        *,
        label_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        items, _ = await self.list_versioned(
            api_version, kind, namespace, label_selector=label_selector
        )
        return items

    async def watch(self, path: str, params: Mapping[str, str]) -> AsyncIterator[dict[str, Any]]:
        """Watch events (one JSON object per line) until the server ends the stream."""
        try:
            async with self._http.stream(
                "GET", path, params=params, timeout=httpx.Timeout(None, connect=10.0)
            ) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    raise KubeError(resp.status_code, resp.reason_phrase, resp.text[:500])
                async for line in resp.aiter_lines():
                    if line.strip():
                        event: dict[str, Any] = json.loads(line)
                        yield event
        except httpx.HTTPError as exc:
            raise KubeError(0, type(exc).__name__, str(exc)) from exc

    async def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        meta = manifest["metadata"]
        path = collection_path(manifest["apiVersion"], manifest["kind"], meta.get("namespace"))
        return await self._call("POST", path, body=manifest)

    async def create_if_absent(self, manifest: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Create, or return the existing object untouched. Returns (object, created)."""
        try:
            return await self.create(manifest), True
        except KubeError as exc:
            if not exc.conflict:
                raise
        meta = manifest["metadata"]
        existing = await self.get(
            manifest["apiVersion"], manifest["kind"], meta.get("namespace"), meta["name"]
        )
        return existing, False

    async def apply(self, manifest: dict[str, Any], *, force: bool = True) -> dict[str, Any]:
        """Server-side apply: create or converge the fields this manager owns, in one call."""
        meta = manifest["metadata"]
        path = object_path(
            manifest["apiVersion"], manifest["kind"], meta.get("namespace"), meta["name"]
        )
        params = {"fieldManager": FIELD_MANAGER, "force": "true" if force else "false"}
        return await self._call(
            "PATCH", path, body=manifest, content_type="application/apply-patch+yaml", params=params
        )

    async def merge_patch(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        name: str,
        patch: dict[str, Any],
        *,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        path = object_path(api_version, kind, namespace, name)
        if subresource:
            path += f"/{subresource}"
        return await self._call(
            "PATCH", path, body=patch, content_type="application/merge-patch+json"
        )

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        """Delete; False when it was already gone."""
        try:
            await self._call(
                "DELETE",
                object_path(api_version, kind, namespace, name),
                body={"propagationPolicy": "Background"},
            )
        except KubeError as exc:
            if exc.not_found:
                return False
            raise
        return True

    async def serves(self, api_version: str, plural: str) -> bool:
        """Whether the server serves this resource (for optional APIs such as ServiceMonitor)."""
        root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        try:
            data = await self._call("GET", root)
        except KubeError as exc:
            if exc.not_found:
                return False
            raise
        return any(r.get("name") == plural for r in data.get("resources", []))


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    meta = owner["metadata"]
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def adopt(manifest: dict[str, Any], owner: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `manifest` owned by `owner` (garbage-collected with it)."""
    meta = {**manifest["metadata"], "ownerReferences": [owner_reference(owner)]}
    return {**manifest, "metadata": meta}
