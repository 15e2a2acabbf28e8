"""OpenID Connect tokens at the router: signatures checked against the provider's published
keys (asymmetric algorithms only), issuer, audience and lifetime checked, classes and admin
right from the claims; keys fetched over verified TLS, bounded, refetched on rotation but not
for every made-up key id. The provider in these tests is a real HTTPS server (a CA made here
signs its certificate)."""

from __future__ import annotations

import asyncio
import base64
import datetime
import ipaddress
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
import uvicorn
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from specgate_router import client_auth, oidc
from specgate_router.errors import Forbidden, Unauthorized
from specgate_router.settings import OidcSettings

from .conftest import free_port_base
from .router_harness import run_router, serving
from .test_router_http import CHAT, chat, router_settings, sims

AUDIENCE = "specgate-api"
NOW = 1_800_000_000.0


def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def public_jwk(key: Any, kid: str | None, **extra: Any) -> dict[str, Any]:
    algorithm = jwt.algorithms.RSAAlgorithm if isinstance(key, rsa.RSAPrivateKey) else None
    if algorithm is None:
        out = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(key.public_key()))
    else:
        out = json.loads(algorithm.to_jwk(key.public_key()))
    if kid is not None:
        out["kid"] = kid
    return {**out, **extra}


def mint(key: Any, issuer: str, kid: str | None = "k1", alg: str = "RS256", **claims: Any) -> str:
    body = {"iss": issuer, "aud": AUDIENCE, "sub": "user-1", "exp": NOW + 300, **claims}
    body = {k: v for k, v in body.items() if v is not None}
    headers = {"kid": kid} if kid is not None else {}
    return jwt.encode(body, key, algorithm=alg, headers=headers)


def settings(issuer: str = "https://idp.example", **overrides: Any) -> OidcSettings:
    return OidcSettings.model_validate({"issuer": issuer, "audience": AUDIENCE, **overrides})


SIGNER = rsa_key()
ISSUER = "https://idp.example"
KEYS = oidc.parse_jwks({"keys": [public_jwk(SIGNER, "k1")]})


def test_a_valid_token_becomes_a_client_with_its_classes_and_admin_right() -> None:
    config = settings(adminGroups=["ops"], maxConcurrent=3)
    client = oidc.verify(mint(SIGNER, ISSUER), KEYS, config, NOW)
    assert client.name == "oidc:user-1" and client.classes == ("latency", "throughput")
    assert client.admin is False and client.max_concurrent == 3
    admin = oidc.verify(mint(SIGNER, ISSUER, groups=["dev", "ops"]), KEYS, config, NOW)
    assert admin.admin is True
    narrow = oidc.verify(mint(SIGNER, ISSUER, specgate_classes="throughput"), KEYS, config, NOW)
    assert narrow.classes == ("throughput",)
    with pytest.raises(Forbidden, match="latency"):
        client_auth.allowed_class(narrow, "latency", "latency")
    # Keycloak puts roles under realm_access: a dotted claim name reaches them.
    nested = settings(groupsClaim="realm_access.roles", adminGroups=["ops"])
    token = mint(SIGNER, ISSUER, realm_access={"roles": ["ops"]})
    assert oidc.verify(token, KEYS, nested, NOW).admin is True


@pytest.mark.parametrize(
    ("claims", "at", "message"),
    [
        ({"exp": NOW - 31}, NOW, "expired"),
        ({"nbf": NOW + 31}, NOW, "not valid yet"),
        ({"aud": "another-api"}, NOW, "another audience"),
        ({"iss": "https://evil.example"}, NOW, "another provider"),
        ({"sub": None}, NOW, "no sub claim"),
        ({"exp": None}, NOW, "no exp claim"),
        ({"exp": "tomorrow"}, NOW, "exp claim is not a time"),
        ({"sub": "x" * 300}, NOW, "sub claim must be a string"),
    ],
)
def test_a_token_outside_its_issuer_audience_or_lifetime_is_refused_saying_why(
    claims: dict[str, Any], at: float, message: str
) -> None:
    with pytest.raises(Unauthorized, match=message):
        oidc.verify(mint(SIGNER, ISSUER, **claims), KEYS, settings(), at)


def test_clock_skew_within_the_leeway_is_allowed() -> None:
    token = mint(SIGNER, ISSUER, exp=NOW - 20, nbf=NOW + 20)
    assert oidc.verify(token, KEYS, settings(), NOW).name == "oidc:user-1"
    with pytest.raises(Unauthorized, match="expired"):
        oidc.verify(token, KEYS, settings(leewaySeconds=0), NOW)


def test_forged_and_malformed_tokens_are_refused() -> None:
    good = mint(SIGNER, ISSUER)
    header, payload, signature = good.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=="))
    raised = base64.urlsafe_b64encode(json.dumps({**claims, "sub": "root"}).encode())
    tampered = ".".join([header, raised.decode().rstrip("="), signature])
    with pytest.raises(Unauthorized, match="signature does not verify"):
        oidc.verify(tampered, KEYS, settings(), NOW)
    stranger = mint(rsa_key(), ISSUER)  # right kid, another key
    with pytest.raises(Unauthorized, match="signature does not verify"):
        oidc.verify(stranger, KEYS, settings(), NOW)
    for junk in ("a.b.c", "not a token", good + "x."):
        with pytest.raises(Unauthorized):
            oidc.verify(junk, KEYS, settings(), NOW)
    assert oidc.looks_like_jwt(good) and not oidc.looks_like_jwt(client_auth.new_key())


def test_only_the_configured_asymmetric_algorithms_are_accepted() -> None:
    unsigned = jwt.encode({"iss": ISSUER, "aud": AUDIENCE, "sub": "u", "exp": NOW + 60}, None,
                          algorithm="none", headers={"kid": "k1"})  # fmt: skip
    with pytest.raises(Unauthorized, match="'none' are not accepted"):
        oidc.verify(unsigned, KEYS, settings(), NOW)
    # The classic confusion: an HMAC token keyed with the provider's public key.
    public_pem = SIGNER.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    confused = jwt.encode(
        {"iss": ISSUER, "aud": AUDIENCE, "sub": "u", "exp": NOW + 60},
        base64.b64encode(public_pem).decode(),
        algorithm="HS256",
        headers={"kid": "k1"},
    )
    with pytest.raises(Unauthorized, match="'HS256' are not accepted"):
        oidc.verify(confused, KEYS, settings(), NOW)
    with pytest.raises(Unauthorized, match="RS384"):
        oidc.verify(mint(SIGNER, ISSUER, alg="RS384"), KEYS, settings(), NOW)
    assert oidc.verify(mint(SIGNER, ISSUER, alg="RS384"), KEYS,
                       settings(algorithms=["RS384"]), NOW).name  # fmt: skip
    # An EC key: ES256 verifies; a token that says RS256 over the EC key's id does not.
    curve = ec.generate_private_key(ec.SECP256R1())
    keys = oidc.parse_jwks({"keys": [public_jwk(curve, "e1"), public_jwk(SIGNER, "k1")]})
    assert oidc.verify(mint(curve, ISSUER, kid="e1", alg="ES256"), keys, settings(), NOW)
    with pytest.raises(Unauthorized):
        oidc.verify(mint(SIGNER, ISSUER, kid="e1"), keys, settings(), NOW)
    # A JWK restricted to one algorithm is not used for another.
    pinned = oidc.parse_jwks({"keys": [public_jwk(SIGNER, "k1", alg="RS512")]})
    with pytest.raises(Unauthorized):
        oidc.verify(mint(SIGNER, ISSUER), pinned, settings(), NOW)


def test_a_token_without_a_key_id_is_tried_against_each_fitting_key() -> None:
    other = rsa_key()
    keys = oidc.parse_jwks({"keys": [public_jwk(other, "a"), public_jwk(SIGNER, "b")]})
    assert oidc.verify(mint(SIGNER, ISSUER, kid=None), keys, settings(), NOW).name
    with pytest.raises(oidc.UnknownSigningKey):
        oidc.verify(mint(SIGNER, ISSUER, kid="rotated"), keys, settings(), NOW)


def test_classes_come_from_the_claim_and_a_token_with_none_is_forbidden() -> None:
    for value, classes in [
        (["latency"], ("latency",)),
        ("throughput latency", ("latency", "throughput")),
        (["latency", "bulk", 7], ("latency",)),
    ]:
        token = mint(SIGNER, ISSUER, specgate_classes=value)
        assert oidc.verify(token, KEYS, settings(), NOW).classes == classes
    with pytest.raises(Forbidden, match="names no traffic class"):
        oidc.verify(mint(SIGNER, ISSUER, specgate_classes=["bulk"]), KEYS, settings(), NOW)
    strict = settings(defaultClasses=[])
    with pytest.raises(Forbidden, match="defaultClasses"):
        oidc.verify(mint(SIGNER, ISSUER), KEYS, strict, NOW)
    only = settings(defaultClasses=["throughput"])
    assert oidc.verify(mint(SIGNER, ISSUER), KEYS, only, NOW).classes == ("throughput",)


def test_a_jwk_set_keeps_only_usable_signature_keys_and_is_bounded() -> None:
    private = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(SIGNER))
    keys = oidc.parse_jwks(
        {
            "keys": [
                public_jwk(SIGNER, "enc", use="enc"),
                {**private, "kid": "leaked"},
                {"kty": "RSA", "kid": "broken", "n": "AA", "e": "AQAB"},
                {"kty": "oct", "kid": "hmac", "k": "c2VjcmV0"},
                "junk",
                public_jwk(SIGNER, "k1"),
            ]
        }
    )
    assert [k.kid for k in keys] == ["k1"]
    for document, message in [
        ({"keys": [public_jwk(SIGNER, f"k{i}") for i in range(oidc.MAX_KEYS + 1)]}, "over"),
        ({"keys": [public_jwk(SIGNER, "enc", use="enc")]}, "no usable"),
        ({"issuer": ISSUER}, "not a JWK Set"),
        ([], "not a JWK Set"),
    ]:
        with pytest.raises(ValueError, match=message):
            oidc.parse_jwks(document)


async def test_a_verified_token_is_remembered_until_it_expires_or_the_keys_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [NOW]
    verifier = oidc.TokenVerifier(settings(), wall_clock=lambda: clock[0])
    verifier.keys = list(KEYS)
    verifier._fetched_at = 0.0
    checks: list[str] = []
    real_verify = oidc.verify

    def counted(token: str, *args: Any) -> Any:
        checks.append(token)
        return real_verify(token, *args)

    monkeypatch.setattr(oidc, "verify", counted)
    token = mint(SIGNER, ISSUER, exp=NOW + 60)
    for _ in range(5):
        assert (await verifier.identify(token, 1.0)).name == "oidc:user-1"
    assert len(checks) == 1
    # Past exp and the leeway the token is checked again, and refused.
    clock[0] = NOW + 60 + 31
    with pytest.raises(Unauthorized, match="expired"):
        await verifier.identify(token, 2.0)
    assert len(checks) == 2
    # A refused token is not remembered; a forged one is checked every time.
    clock[0] = NOW
    forged = mint(rsa_key(), ISSUER)
    for _ in range(2):
        with pytest.raises(Unauthorized):
            await verifier.identify(forged, 3.0)
    assert len(checks) == 4
    # The cache is bounded.
    monkeypatch.setattr(oidc, "VERIFIED_CACHE", 3)
    for i in range(5):
        await verifier.identify(mint(SIGNER, ISSUER, sub=f"u{i}"), 4.0)
    assert len(verifier._verified) == 3


async def test_tokens_of_a_withdrawn_key_are_forgotten(tmp_path: Path) -> None:
    async with provider(tmp_path, {"keys": [public_jwk(SIGNER, "k1")]}) as idp:
        verifier = oidc.TokenVerifier(
            settings(idp.issuer, caFile=idp.ca_file, jwksUri=idp.issuer + "/keys")
        )
        assert await verifier.refresh(0.0)
        token = live(SIGNER, idp.issuer)
        assert await verifier.identify(token, 1.0)
        # The provider withdraws k1 (compromised) for k2: the next fetch drops the token.
        idp.jwks = {"keys": [public_jwk(rsa_key(), "k2")]}
        assert await verifier.refresh(oidc.REFRESH_SECONDS)
        with pytest.raises(oidc.UnknownSigningKey):
            await verifier.identify(token, oidc.REFRESH_SECONDS + 1)


# ---- against a real HTTPS provider ----


@dataclass
class Provider:
    """An identity provider's public face: discovery document and JWK Set over HTTPS."""

    issuer: str
    ca_file: str
    jwks: dict[str, Any]
    discovery_issuer: str | None = None
    requests: list[str] = field(default_factory=list)
    jwks_body: bytes | None = None

    def app(self) -> Starlette:
        async def discovery(request: Request) -> Response:
            self.requests.append(request.url.path)
            issuer = self.discovery_issuer or self.issuer
            return JSONResponse({"issuer": issuer, "jwks_uri": self.issuer + "/keys"})

        async def keys(request: Request) -> Response:
            self.requests.append(request.url.path)
            if self.jwks_body is not None:
                return Response(self.jwks_body, media_type="application/json")
            return JSONResponse(self.jwks)

        return Starlette(routes=[Route(oidc.DISCOVERY_PATH, discovery), Route("/keys", keys)])


def tls_files(tmp: Path) -> tuple[str, str, str]:
    """A CA, and a certificate it signs for 127.0.0.1: (ca, cert, key) file paths."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "specgate test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = (tmp / "ca.crt", tmp / "tls.crt", tmp / "tls.key")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(paths[0]), str(paths[1]), str(paths[2])


@asynccontextmanager
async def provider(tmp: Path, jwks: dict[str, Any]) -> AsyncIterator[Provider]:
    ca, cert, key = tls_files(tmp)
    port = free_port_base(1)
    face = Provider(issuer=f"https://127.0.0.1:{port}", ca_file=ca, jwks=jwks)
    config = uvicorn.Config(
        face.app(),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        ssl_certfile=cert,
        ssl_keyfile=key,
    )
    async with serving(config):
        yield face


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def live(key: Any, issuer: str, **claims: Any) -> str:
    return mint(key, issuer, exp=time.time() + 300, **claims)


async def test_tokens_from_the_provider_pass_the_router_beside_api_keys(tmp_path: Path) -> None:
    """Through the router over real HTTP: a token is accepted, its classes and admin right
    hold, an API key still works beside it, and an expired or foreign token gets 401 with the
    reason."""
    alice = "sg-alice-key"
    key_entry = {"name": "alice", "sha256": client_auth.hash_key(alice)}
    async with provider(tmp_path, {"keys": [public_jwk(SIGNER, "k1")]}) as idp, sims(1) as pods:
        auth = {
            "keys": [key_entry],
            "oidc": {
                "issuer": idp.issuer,
                "audience": AUDIENCE,
                "caFile": idp.ca_file,
                "adminGroups": ["ops"],
            },
        }
        config = router_settings(pods.urls, clientAuth=auth)
        async with run_router(config) as router, httpx.AsyncClient(timeout=30) as client:
            url = router.url + CHAT
            token = live(SIGNER, idp.issuer, specgate_classes=["throughput"])
            ok = await client.post(url, json=chat(), headers=bearer(token))
            assert ok.status_code == 200, ok.text
            wrong_class = await client.post(
                url, json=chat(), headers={**bearer(token), "x-specgate-class": "latency"}
            )
            assert wrong_class.status_code == 403 and "token subject" in wrong_class.text
            assert (await client.post(url, json=chat(), headers=bearer(alice))).status_code == 200
            expired = mint(SIGNER, idp.issuer, exp=time.time() - 120)
            answer = await client.post(url, json=chat(), headers=bearer(expired))
            assert answer.status_code == 401 and "expired" in answer.json()["error"]["message"]
            foreign = live(rsa_key(), idp.issuer)
            assert (await client.post(url, json=chat(), headers=bearer(foreign))).status_code == 401
            assert (await client.post(url, json=chat())).status_code == 401
            pods_path = router.url + "/specgate/pods"
            assert (await client.get(pods_path, headers=bearer(token))).status_code == 403
            ops = live(SIGNER, idp.issuer, groups=["ops"])
            assert (await client.get(pods_path, headers=bearer(ops))).status_code == 200
            # Fetched once at start: discovery, then the keys.
            assert idp.requests == [oidc.DISCOVERY_PATH, "/keys"]


async def test_rotated_keys_are_fetched_but_made_up_key_ids_do_not_hammer_the_provider(
    tmp_path: Path,
) -> None:
    async with provider(tmp_path, {"keys": [public_jwk(SIGNER, "k1")]}) as idp:
        verifier = oidc.TokenVerifier(
            settings(idp.issuer, caFile=idp.ca_file, jwksUri=idp.issuer + "/keys")
        )
        assert await verifier.refresh(0.0) and idp.requests == ["/keys"]
        assert (await verifier.identify(live(SIGNER, idp.issuer), 1.0)).name == "oidc:user-1"
        # The provider rotates to a new key; the first token signed with it makes one fetch.
        successor = rsa_key()
        idp.jwks = {"keys": [public_jwk(SIGNER, "k1"), public_jwk(successor, "k2")]}
        token = mint(successor, idp.issuer, kid="k2", exp=time.time() + 300)
        assert (await verifier.identify(token, 40.0)).name == "oidc:user-1"
        assert idp.requests == ["/keys", "/keys"]
        # Fifty tokens with invented key ids, at once: at most one fetch per REFETCH_SECONDS.
        forged = [mint(rsa_key() if i == 0 else SIGNER, idp.issuer, kid=f"x{i}") for i in
                  range(50)]  # fmt: skip
        results = await asyncio.gather(
            *(verifier.identify(t, 80.0 + i * 0.1) for i, t in enumerate(forged)),
            return_exceptions=True,
        )
        assert all(isinstance(r, oidc.UnknownSigningKey) for r in results), results
        assert idp.requests.count("/keys") == 3


async def test_fetching_keys_checks_tls_issuer_and_size(tmp_path: Path) -> None:
    async with provider(tmp_path, {"keys": [public_jwk(SIGNER, "k1")]}) as idp:
        # Without the provider's CA the certificate is not trusted: no keys, 503 to tokens.
        untrusted = oidc.TokenVerifier(settings(idp.issuer))
        assert not await untrusted.refresh(0.0)
        assert "certificate" in (untrusted.error or "").lower()
        with pytest.raises(oidc.ProviderUnavailable) as caught:
            await untrusted.identify(live(SIGNER, idp.issuer), 1.0)
        assert caught.value.status == 503 and caught.value.headers()["Retry-After"]
        # A discovery document that names another issuer is not believed.
        idp.discovery_issuer = "https://evil.example"
        misnamed = oidc.TokenVerifier(settings(idp.issuer, caFile=idp.ca_file))
        assert not await misnamed.refresh(0.0) and "another issuer" in (misnamed.error or "")
        idp.discovery_issuer = None
        # An oversized JWK Set is cut off, not read into memory whole.
        idp.jwks_body = b'{"keys": [' + b" " * (oidc.MAX_DOCUMENT_BYTES + 10) + b"]}"
        big = oidc.TokenVerifier(settings(idp.issuer, caFile=idp.ca_file))
        assert not await big.refresh(0.0) and "more than" in (big.error or "")
        # Keys held survive a failed refresh.
        idp.jwks_body = None
        held = oidc.TokenVerifier(settings(idp.issuer, caFile=idp.ca_file))
        assert await held.refresh(0.0)
        idp.jwks_body = b"not json"
        assert not await held.refresh(oidc.REFRESH_SECONDS)
        assert held.keys and (await held.identify(live(SIGNER, idp.issuer), 700.0)).name


async def test_a_provider_out_of_reach_answers_503_while_api_keys_keep_working() -> None:
    alice = "sg-alice-key"
    closed = free_port_base(1)
    auth = {
        "keys": [{"name": "alice", "sha256": client_auth.hash_key(alice)}],
        "oidc": {"issuer": f"https://127.0.0.1:{closed}", "audience": AUDIENCE},
    }
    async with sims(1) as pods:
        config = router_settings(pods.urls, clientAuth=auth)
        async with run_router(config) as router, httpx.AsyncClient(timeout=30) as client:
            url = router.url + CHAT
            token = live(SIGNER, f"https://127.0.0.1:{closed}")
            answer = await client.post(url, json=chat(), headers=bearer(token))
            assert answer.status_code == 503 and answer.headers["retry-after"] == "30"
            assert "signing keys" in answer.json()["error"]["message"]
            assert (await client.post(url, json=chat(), headers=bearer(alice))).status_code == 200
