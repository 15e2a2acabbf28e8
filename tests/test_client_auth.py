"""Client API keys at the router: hashed at rest, compared in constant time, classes per key,
concurrency and rate limits per key, a keys file read again when it changes."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
import pytest

from specgate_router import client_auth
from specgate_router.client_auth import ClientAuth, KeyRing, Limits
from specgate_router.errors import Forbidden, TooManyRequests, Unauthorized
from specgate_router.settings import ClientAuthSettings, ClientKey

from .router_harness import run_router
from .test_router_http import CHAT, chat, router_settings, sims

ALICE, BOB = "sg-alice-key", "sg-bob-key"


def _key(name: str, key: str, **limits: object) -> ClientKey:
    return ClientKey.model_validate({"name": name, "sha256": client_auth.hash_key(key), **limits})


def test_a_key_is_found_by_its_hash_and_strangers_are_refused() -> None:
    ring = KeyRing([_key("alice", ALICE), _key("bob", BOB, classes=["throughput"])])
    assert ring.identify(ALICE).name == "alice" and ring.identify(BOB).name == "bob"
    for presented in (None, "", "sg-alice", ALICE + " ", client_auth.hash_key(ALICE)):
        with pytest.raises(Unauthorized):
            ring.identify(presented or None)
    assert client_auth.bearer("Bearer  " + ALICE) == ALICE
    assert client_auth.bearer("Basic " + ALICE) is None and client_auth.bearer(None) is None
    with pytest.raises(ValueError, match="unique"):
        KeyRing([_key("alice", ALICE), _key("alice", BOB)])
    fresh = client_auth.new_key()
    assert fresh.startswith(client_auth.KEY_PREFIX) and len(fresh) > 40
    assert fresh != client_auth.new_key()


def test_the_class_header_is_honoured_only_within_the_keys_classes() -> None:
    bob = client_auth.from_key(_key("bob", BOB, classes=["throughput"]))
    assert client_auth.allowed_class(bob, "throughput", "latency") == "throughput"
    assert client_auth.allowed_class(bob, None, "latency") == "throughput"
    with pytest.raises(Forbidden, match="latency"):
        client_auth.allowed_class(bob, "latency", "latency")
    alice = client_auth.from_key(_key("alice", ALICE))
    assert client_auth.allowed_class(alice, None, "latency") == "latency"


def test_concurrency_and_rate_limits_answer_429_with_when_to_retry() -> None:
    limits = Limits()
    one = client_auth.from_key(_key("one", "k1", maxConcurrent=1))
    limits.admit(one, 0.0)
    with pytest.raises(TooManyRequests) as caught:
        limits.admit(one, 0.0)
    assert caught.value.headers() == {"Retry-After": "1"}
    limits.release(one)
    limits.admit(one, 0.0)
    limits.release(one)
    # One every 10 s, bursts of one.
    paced = client_auth.from_key(_key("paced", "k2", requestsPerMinute=6))
    limits.admit(paced, 100.0)
    limits.release(paced)
    with pytest.raises(TooManyRequests) as caught:
        limits.admit(paced, 101.0)
    assert caught.value.retry_after == 9
    limits.admit(paced, 110.5)


def test_usage_is_bounded_by_forgetting_idle_clients_only() -> None:
    """Token subjects are not a closed list: past MAX_TRACKED_CLIENTS entries, clients idle
    for a full burst (buckets refilled, nothing in flight) are dropped; busy ones are kept."""
    limits = Limits()
    paced = {"requests_per_minute": 60, "max_concurrent": 5}
    busy = client_auth.Client("oidc:busy", "token subject 'busy'", ("latency",), False, **paced)
    limits.admit(busy, 0.0)
    for i in range(client_auth.MAX_TRACKED_CLIENTS - 1):
        limits.release(client_auth.Client(f"oidc:{i}", "", ("latency",), False))
        limits.admit(client_auth.Client(f"oidc:{i}", "", ("latency",), False), 0.0)
        limits.release(client_auth.Client(f"oidc:{i}", "", ("latency",), False))
    assert len(limits.usage) == client_auth.MAX_TRACKED_CLIENTS
    newcomer = client_auth.Client("oidc:new", "", ("latency",), False)
    limits.admit(newcomer, 5.0)  # the others idle only 5 s: kept
    assert len(limits.usage) == client_auth.MAX_TRACKED_CLIENTS + 1
    limits.admit(client_auth.Client("oidc:later", "", ("latency",), False), 20.0)
    assert set(limits.usage) == {"oidc:busy", "oidc:new", "oidc:later"}
    assert limits.usage["oidc:busy"].in_flight == 1


def test_a_keys_file_is_read_again_when_it_changes_and_a_broken_one_keeps_the_last(
    tmp_path: Path,
) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(json.dumps([_key("alice", ALICE).model_dump(by_alias=True)]))
    auth = ClientAuth(ClientAuthSettings(keys_file=str(path)))
    assert auth.ring.identify(ALICE).name == "alice"
    path.write_text(json.dumps([_key("bob", BOB).model_dump(by_alias=True)]))

    os.utime(path, (1, 1))
    auth.refresh(1000.0)
    assert auth.ring.identify(BOB).name == "bob"
    with pytest.raises(Unauthorized):
        auth.ring.identify(ALICE)
    path.write_text("- {name: x, sha256: nothex}\n")
    os.utime(path, (2, 2))
    auth.refresh(2000.0)
    assert auth.ring.identify(BOB).name == "bob" and "sha256" in (auth.error or "")
    with pytest.raises(ValueError, match=r"entry 0\.sha256"):
        client_auth.read_keys_file(str(path))


async def test_the_router_requires_a_key_and_applies_its_class_and_limits() -> None:
    keys = [
        _key("alice", ALICE).model_dump(by_alias=True),
        _key("bob", BOB, classes=["throughput"], maxConcurrent=1).model_dump(by_alias=True),
    ]
    async with sims(2) as cluster:
        settings = router_settings(cluster.urls, clientAuth={"keys": keys})
        async with run_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
            url = router.url + CHAT
            anonymous = await client.post(url, json=chat())
            assert anonymous.status_code == 401
            assert anonymous.headers["www-authenticate"].startswith("Bearer")
            assert anonymous.json()["error"]["type"] == "authentication_error"
            wrong = await client.post(url, json=chat(), headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
            ok = await client.post(url, json=chat(), headers={"Authorization": f"Bearer {ALICE}"})
            assert ok.status_code == 200, ok.text
            bob = {"Authorization": f"Bearer {BOB}"}
            refused = await client.post(url, json=chat(), headers={**bob, "x-specgate-class":
                                                                   "latency"})  # fmt: skip
            assert refused.status_code == 403 and "throughput" in refused.text
            # Bob's one slot is held by a stream until its last chunk has gone.
            async with client.stream("POST", url, json=chat(200, stream=True), headers=bob) as s:
                assert s.status_code == 200
                second = await client.post(url, json=chat(), headers=bob)
                assert second.status_code == 429 and second.headers["retry-after"] == "1"
                async for _ in s.aiter_bytes():
                    pass
            await asyncio.sleep(0.05)
            third = await client.post(url, json=chat(), headers=bob)
            assert third.status_code == 200, third.text
            # Health and metrics stay open: probes and Prometheus carry no client key.
            assert (await client.get(router.url + "/healthz")).status_code == 200


@pytest.mark.parametrize(
    ("path", "admin"),
    [
        ("/specgate/pods", True),
        ("/specgate/samples", True),
        ("/specgate", True),
        ("/docs", True),
        ("/redoc", True),
        ("/openapi.json", True),
        ("/docs/oauth2-redirect", True),
        ("/specgatex", False),
        ("/documents", False),
        ("/v1/models", False),
        ("/metrics", False),
    ],
)
def test_admin_paths_are_the_routers_own_endpoints_and_its_docs(path: str, admin: bool) -> None:
    assert client_auth.is_admin_path(path) is admin


async def test_with_client_keys_the_routers_own_endpoints_and_docs_need_an_admin_key() -> None:
    """/specgate/* shows every pod's load and the docs list every route: once the router
    requires keys, they need a key marked admin (401 without a key, 403 with another);
    /metrics and the probes stay open."""
    root = "sg-root-key"
    keys = [
        _key("alice", ALICE).model_dump(by_alias=True),
        _key("root", root, admin=True).model_dump(by_alias=True),
    ]
    async with sims(1) as cluster:
        settings = router_settings(cluster.urls, clientAuth={"keys": keys})
        async with run_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
            for path in ("/specgate/pods", "/specgate/samples", "/docs", "/openapi.json"):
                anonymous = await client.get(router.url + path)
                assert anonymous.status_code == 401, (path, anonymous.text)
                alice = await client.get(
                    router.url + path, headers={"Authorization": f"Bearer {ALICE}"}
                )
                assert alice.status_code == 403 and "--admin" in alice.text, path
                ok = await client.get(
                    router.url + path, headers={"Authorization": f"Bearer {root}"}
                )
                assert ok.status_code == 200, (path, ok.text)
            for path in ("/metrics", "/healthz"):
                assert (await client.get(router.url + path)).status_code == 200
            # Alice's API calls are not affected; the model list needs a key like them.
            models = await client.get(
                router.url + "/v1/models", headers={"Authorization": f"Bearer {ALICE}"}
            )
            assert models.status_code == 200
            anonymous = await client.get(router.url + "/v1/models")
            assert anonymous.status_code == 401 and "data" not in anonymous.json()
            wrong = await client.get(
                router.url + "/v1/models", headers={"Authorization": "Bearer sg-not-a-key"}
            )
            assert wrong.status_code == 401


async def test_without_client_keys_the_admin_endpoints_stay_open() -> None:
    async with (
        sims(1) as cluster,
        run_router(router_settings(cluster.urls)) as router,
        httpx.AsyncClient(timeout=30) as client,
    ):
        assert (await client.get(router.url + "/specgate/pods")).status_code == 200
        assert (await client.get(router.url + "/openapi.json")).status_code == 200
