"""specgate/kube.py's credentials: the service account found as client-go finds it, tokens that
rotate (a projected token file, an exec plugin), and the EndpointSlice watch's resume point."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from specgate import kube
from specgate.kube import Credentials, KubeClient, KubeError, TokenAuth
from specgate_router.cluster import follow_slices


def _account(tmp_path: Path, token: str = "first") -> dict[str, str]:
    (tmp_path / "token").write_text(token)
    (tmp_path / "namespace").write_text("team-a")
    (tmp_path / "ca.crt").write_text("")
    return {
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "KUBERNETES_SERVICE_PORT": "443",
        "SPECGATE_SERVICE_ACCOUNT_DIR": str(tmp_path),
    }


def test_the_service_account_is_found_by_address_not_by_a_dns_name(tmp_path: Path) -> None:
    found = Credentials.discover(_account(tmp_path))
    assert found.server == "https://10.96.0.1:443"  # kubernetes.default.svc needs cluster DNS
    assert found.token_path == str(tmp_path / "token") and found.default_namespace == "team-a"
    v6 = Credentials.in_cluster({**_account(tmp_path), "KUBERNETES_SERVICE_HOST": "fd00::1"})
    assert v6 is not None and v6.server == "https://[fd00::1]:443"
    assert Credentials.in_cluster({"KUBERNETES_SERVICE_HOST": "10.96.0.1"}) is None


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _server(accepted: set[str], seen: list[str]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        seen.append(token)
        if token in accepted:
            return httpx.Response(200, json={"kind": "Namespace", "metadata": {"name": "x"}})
        return httpx.Response(401, json={"reason": "Unauthorized", "message": "expired"})

    return httpx.MockTransport(handle)


async def test_a_rotated_token_file_is_read_again_each_minute_and_after_a_401(
    tmp_path: Path,
) -> None:
    # (no CA: the transport is in process)
    credentials = dataclasses.replace(Credentials.discover(_account(tmp_path)), ca_path=None)
    seen: list[str] = []
    client = KubeClient(credentials, transport=_server({"first", "second"}, seen))
    clock = client.auth.clock = Clock()
    await client._call("GET", "/api/v1/namespaces/x")
    (tmp_path / "token").write_text("second")  # the kubelet rotated it
    await client._call("GET", "/api/v1/namespaces/x")
    assert seen == ["first", "first"]  # within the minute: the token read before
    clock.now += kube.TOKEN_FILE_SECONDS
    await client._call("GET", "/api/v1/namespaces/x")
    assert seen[-1] == "second"
    # Revoked early: the 401 makes the client read the file at once and send it again.
    (tmp_path / "token").write_text("first")
    seen.clear()
    client.auth = client._http.auth = TokenAuth(credentials, clock=clock)
    client.auth._token, client.auth._valid_until = "stale", clock.now + 50
    await client._call("GET", "/api/v1/namespaces/x")
    assert seen == ["stale", "first"]
    await client.aclose()


def _plugin(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "plugin.py"
    script.write_text(f"#!{sys.executable}\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def _kubeconfig(tmp_path: Path, user: dict[str, Any]) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://api.example:6443"}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
    }))  # fmt: skip
    return str(path)


async def test_an_exec_plugin_token_is_used_until_it_nearly_expires(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    expires = (datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=10)).isoformat()
    plugin = _plugin(tmp_path, (
        "import json, os\n"
        f"open({str(calls)!r}, 'a').write('x')\n"
        "info = json.loads(os.environ['KUBERNETES_EXEC_INFO'])\n"
        "assert info['kind'] == 'ExecCredential', info\n"
        f"count = len(open({str(calls)!r}).read())\n"
        "print(json.dumps({'apiVersion': info['apiVersion'], 'kind': 'ExecCredential',\n"
        f"  'status': {{'token': f'token-{{count}}-' + os.environ['REGION'],"
        f" 'expirationTimestamp': {expires!r}}}}}))\n"
    ))  # fmt: skip
    path = _kubeconfig(tmp_path, {"exec": {
        "apiVersion": "client.authentication.k8s.io/v1", "command": str(plugin),
        "args": [], "env": [{"name": "REGION", "value": "eu"}],
    }})  # fmt: skip
    credentials = Credentials.from_kubeconfig(path)
    assert credentials.exec_plugin is not None and credentials.exec_plugin.command == str(plugin)
    clock = Clock()
    auth = TokenAuth(credentials, clock=clock)
    assert await auth.token() == "token-1-eu"
    assert await auth.token() == "token-1-eu"  # not run again while valid
    assert 9 * 60 - kube.EXEC_EARLY_SECONDS < auth.valid_for() <= 10 * 60
    clock.now += auth.valid_for()
    assert await auth.token() == "token-2-eu"
    assert await auth.token(force=True) == "token-3-eu"  # after a 401


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("import sys; print('denied by the cloud', file=sys.stderr); sys.exit(3)",
         "exited 3: denied by the cloud"),
        ("print('not json')", "did not print an ExecCredential"),
        ("import json; print(json.dumps({'status': {'token': 't',"
         " 'expirationTimestamp': 'tomorrow'}}))", "is not RFC 3339"),
        ("print('x' * (2 << 20))", "printed more than"),
    ],
)  # fmt: skip
async def test_a_failing_exec_plugin_is_one_error_naming_it(
    tmp_path: Path, body: str, says: str
) -> None:
    plugin = _plugin(tmp_path, body)
    credentials = Credentials.from_kubeconfig(_kubeconfig(tmp_path, {"exec": {
        "command": str(plugin)}}))  # fmt: skip
    with pytest.raises(KubeError) as caught:
        await TokenAuth(credentials).token()
    assert caught.value.reason == "ExecCredential"
    assert f"exec plugin {plugin.name}: " in caught.value.message and says in caught.value.message


async def test_a_missing_or_hanging_exec_plugin_is_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = Credentials.from_kubeconfig(
        _kubeconfig(tmp_path, {"exec": {"command": str(tmp_path / "nope")}})
    )
    with pytest.raises(KubeError, match="cannot run it"):
        await TokenAuth(missing).token()
    monkeypatch.setattr(kube, "EXEC_SECONDS", 0.5)
    hanging = _plugin(tmp_path, "import time; time.sleep(30)")
    slow = Credentials.from_kubeconfig(_kubeconfig(tmp_path, {"exec": {"command": str(hanging)}}))
    with pytest.raises(KubeError, match="no answer within"):
        await TokenAuth(slow).token()


def test_a_malformed_exec_section_names_the_field(tmp_path: Path) -> None:
    malformed = (
        ({"exec": {"args": []}}, "needs a command"),
        ({"exec": {"command": "x", "args": [1]}}, "args must be strings"),
    )
    for user, field in malformed:
        with pytest.raises(KubeError, match=field):
            Credentials.from_kubeconfig(_kubeconfig(tmp_path, user))


def test_a_watch_resumes_from_the_last_version_and_lists_again_only_when_it_is_gone() -> None:
    slices: dict[str, dict[str, Any]] = {}
    added = {"type": "ADDED", "object": {"metadata": {"name": "a", "resourceVersion": "11"}}}
    assert follow_slices(slices, added, "10") == "11" and set(slices) == {"a"}
    bookmark = {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "15"}}}
    assert follow_slices(slices, bookmark, "11") == "15" and set(slices) == {"a"}
    gone = {"type": "DELETED", "object": {"metadata": {"name": "a", "resourceVersion": "16"}}}
    assert follow_slices(slices, gone, "15") == "16" and slices == {}
    expired = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}
    assert follow_slices(slices, expired, "16") == ""
    other = {"type": "ERROR", "object": {"kind": "Status", "code": 500}}
    assert follow_slices(slices, other, "16") == "16"


async def test_the_endpoint_watch_resumes_without_listing_again_until_its_version_is_gone() -> None:
    import asyncio

    from specgate_router.cluster import watch_endpoints
    from specgate_router.settings import KubernetesDiscovery

    calls: list[tuple[str, str]] = []
    backends: list[dict[str, str]] = []
    slice_a = {
        "metadata": {"name": "a", "resourceVersion": "12"},
        "endpoints": [
            {"addresses": ["10.0.0.1"], "conditions": {"ready": True}, "targetRef": {"name": "p1"}}
        ],
    }

    class Kube:
        async def list_versioned(self, *_: Any, **__: Any) -> tuple[list[Any], str]:
            calls.append(("list", ""))
            return [], "10"

        async def watch(self, path: str, params: dict[str, str]) -> Any:
            calls.append(("watch", params["resourceVersion"]))
            watches = sum(1 for c in calls if c[0] == "watch")
            if watches == 1:
                yield {"type": "ADDED", "object": slice_a}  # then the server ends the stream
            elif watches == 2:
                raise KubeError(0, "ReadError", "connection reset")
            elif watches == 3:
                raise KubeError(410, "Gone", "too old resource version")
            else:
                await asyncio.sleep(3600)

    class State:
        kube = Kube()

        def sync_backends(self, urls: dict[str, str]) -> None:
            backends.append(urls)

    real_sleep = asyncio.sleep

    async def no_wait(seconds: float) -> None:
        await real_sleep(0)

    k8s = KubernetesDiscovery.model_validate({"namespace": "d", "service": "e", "port": 30000})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("specgate_router.cluster.asyncio.sleep", no_wait)
        task = asyncio.create_task(watch_endpoints(State(), k8s))  # type: ignore[arg-type]
        while len(calls) < 6:
            await real_sleep(0.01)
        task.cancel()
    assert calls[:6] == [("list", ""), ("watch", "10"), ("watch", "12"), ("watch", "12"),
                         ("list", ""), ("watch", "10")]  # fmt: skip
    assert {"p1": "http://10.0.0.1:30000"} in backends


def test_no_credential_file_is_left_readable_by_others(tmp_path: Path) -> None:
    path = _kubeconfig(tmp_path, {"client-certificate-data": "Y2VydA==",
                                  "client-key-data": "a2V5"})  # fmt: skip
    found = Credentials.from_kubeconfig(path)
    assert found.private_key_path is not None
    assert os.stat(found.private_key_path).st_mode & 0o077 == 0


async def test_kopf_logs_in_with_the_same_credentials_and_renews_an_exec_token(
    tmp_path: Path,
) -> None:
    from specgate_operator.handlers import kopf_login

    in_pod = await kopf_login(Credentials.discover(_account(tmp_path, "pod-token")))
    assert (in_pod.server, in_pod.token) == ("https://10.96.0.1:443", "pod-token")
    assert in_pod.expiration is None  # a 401 makes kopf log in again, reading the file anew
    expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=15)
    plugin = _plugin(tmp_path, (
        "import json\nprint(json.dumps({'status': {'token': 'cloud',"
        f" 'expirationTimestamp': {expires.isoformat()!r}}}}}))"
    ))  # fmt: skip
    outside = Credentials.from_kubeconfig(_kubeconfig(tmp_path, {"exec": {"command": str(plugin)}}))
    info = await kopf_login(outside)
    assert info.token == "cloud" and info.expiration is not None
    early = expires - info.expiration
    assert datetime.timedelta(seconds=kube.EXEC_EARLY_SECONDS - 5) < early
    assert early < datetime.timedelta(seconds=kube.EXEC_EARLY_SECONDS + 5)
