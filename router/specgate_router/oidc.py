"""OpenID Connect bearer tokens at the router.

A client sends a JWT its identity provider signed. The router accepts it when the signature
checks against one of the keys the provider publishes (its JWK Set) with an algorithm from
the configured asymmetric list, the issuer and audience match, and the token is within its
lifetime (`exp` required, `nbf` honoured, `leewaySeconds` of clock skew). Its classes and
admin right come from its claims; its limits apply per subject.

`verify` is pure (keys and time are arguments). A signature check costs several API-key
lookups (`lab/bench/auth_cost.py`), and clients send one token with many requests, so
`TokenVerifier` remembers the tokens it verified (by their SHA-256, up to VERIFIED_CACHE
entries, each until its `exp`; all forgotten when the keys change). It holds the provider's keys:
fetched at start and every REFRESH_SECONDS, and again when a token names a key id it does not
hold (the provider rotated its keys), at most once every REFETCH_SECONDS, so made-up key ids
cannot make the router hammer the provider. Every fetch is bounded in time and size; a failed
one keeps the keys held.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import httpx
import jwt

from specgate.engine_client import ReplyTooLarge, read_capped
from specgate_router.errors import Forbidden, NoCapacity, Unauthorized
from specgate_router.identity import Client
from specgate_router.settings import CLASSES, OidcSettings

log = logging.getLogger("specgate.router.oidc")

MAX_TOKEN_CHARS = 16_384
MAX_DOCUMENT_BYTES = 512 * 1024
"""A discovery document or JWK Set larger than this is refused (real ones are a few KiB)."""
MAX_KEYS = 64
MAX_SUBJECT_CHARS = 255
FETCH_TIMEOUT_SECONDS = 5.0
REFRESH_SECONDS = 600.0
REFETCH_SECONDS = 30.0
VERIFIED_CACHE = 4096
DISCOVERY_PATH = "/.well-known/openid-configuration"

_JWT_SHAPE = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")
_KEY_TYPE = {"RS": "RSA", "PS": "RSA", "ES": "EC", "Ed": "OKP"}
"""The JWK key type each algorithm family needs."""


def looks_like_jwt(token: str) -> bool:
    """Three base64url parts: a JWS in compact form (specgate's own keys have no dots)."""
    return len(token) <= MAX_TOKEN_CHARS and _JWT_SHAPE.fullmatch(token) is not None


class UnknownSigningKey(Unauthorized):
    """The token names a key id the router does not hold: worth fetching the keys again."""


class ProviderUnavailable(NoCapacity):
    """No signing keys held: the provider could not be reached since the router started."""


@dataclass(frozen=True)
class SigningKey:
    kid: str | None
    key_type: str
    alg: str | None
    """The algorithm the JWK is restricted to, if it names one."""
    key: Any
    """The public key (a `cryptography` key object)."""


def parse_jwks(document: Any) -> list[SigningKey]:
    """The usable signature keys of a JWK Set; keys for encryption, symmetric or unknown
    types, or carrying private parts (a provider that publishes those is misconfigured) are
    skipped.
    ValueError when none is usable."""
    if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
        raise ValueError("not a JWK Set (no `keys` list)")
    if len(document["keys"]) > MAX_KEYS:
        raise ValueError(f"the JWK Set has {len(document['keys'])} keys, over {MAX_KEYS}")
    out = []
    for jwk in document["keys"]:
        if not isinstance(jwk, dict) or jwk.get("use", "sig") != "sig" or "d" in jwk:
            continue
        if jwk.get("kty") not in _KEY_TYPE.values():  # a shared secret ("oct") never
            continue
        kid = jwk.get("kid")
        if kid is not None and not isinstance(kid, str):
            continue
        try:
            parsed = jwt.PyJWK(jwk)
        except (jwt.PyJWTError, ValueError, TypeError):
            continue
        alg = jwk.get("alg") if isinstance(jwk.get("alg"), str) else None
        out.append(SigningKey(kid=kid, key_type=str(jwk.get("kty")), alg=alg, key=parsed.key))
    if not out:
        raise ValueError("the JWK Set holds no usable signature key")
    return out


def _shown(value: object) -> str:
    """A value from a token, safe to put in an error message."""
    text = value if isinstance(value, str) else repr(value)
    return repr(text[:64] + ("..." if len(text) > 64 else ""))


def claim(claims: Mapping[str, Any], name: str) -> Any:
    """A claim by name, or by a dotted path into nested objects (`realm_access.roles`) when
    no top-level claim has the whole name."""
    if name in claims:
        return claims[name]
    value: Any = claims
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _strings(value: Any) -> list[str]:
    """A claim as a list of strings: a list's strings, or a space-separated string's words."""
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list):
        return [v for v in value if isinstance(v, str)]
    return []


def verify(
    token: str, keys: Sequence[SigningKey], settings: OidcSettings, now_epoch: float
) -> Client:
    """The client a token stands for; Unauthorized (401) when it is not a valid token of
    this provider and audience, Forbidden (403) when its claims allow no traffic class."""
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError:
        raise Unauthorized("the bearer token is not a well-formed JWT") from None
    alg = header.get("alg")
    if alg not in settings.algorithms:
        raise Unauthorized(
            f"tokens signed with {_shown(alg)} are not accepted here; the router takes "
            f"{', '.join(settings.algorithms)} (clientAuth.oidc.algorithms)"
        )
    kid = header.get("kid")
    if kid is not None and not any(k.kid == kid for k in keys):
        raise UnknownSigningKey(
            f"the token is signed with key {_shown(kid)}, which the provider does not publish"
        )
    fitting = [
        k
        for k in keys
        if (kid is None or k.kid == kid)
        and k.key_type == _KEY_TYPE[alg[:2]]
        and (k.alg is None or k.alg == alg)
    ]
    claims = _decoded(token, fitting, alg, settings)
    exp = claims.get("exp")
    if not _is_time(exp):
        raise Unauthorized("the token's exp claim is not a time")
    if now_epoch > exp + settings.leeway_seconds:
        raise Unauthorized("the token has expired: get a new one from the provider")
    nbf = claims.get("nbf")
    if nbf is not None and (not _is_time(nbf) or now_epoch + settings.leeway_seconds < nbf):
        raise Unauthorized("the token is not valid yet (nbf)")
    subject = claims.get("sub")
    if not isinstance(subject, str) or not 0 < len(subject) <= MAX_SUBJECT_CHARS:
        raise Unauthorized(f"the token's sub claim must be a string of 1 to {MAX_SUBJECT_CHARS}")
    return Client(
        name=f"oidc:{subject}",
        label=f"token subject {_shown(subject)}",
        classes=_classes(claims, settings),
        admin=bool(
            set(_strings(claim(claims, settings.groups_claim))) & set(settings.admin_groups)
        ),
        max_concurrent=settings.max_concurrent,
        requests_per_minute=settings.requests_per_minute,
        expires_at=exp + settings.leeway_seconds,
    )


def _decoded(
    token: str, fitting: Sequence[SigningKey], alg: str, settings: OidcSettings
) -> dict[str, Any]:
    """The token's claims once its signature checks against one of `fitting` (several when
    the token names no key id), with issuer and audience checked; lifetime is the caller's,
    against its own clock."""
    options: Any = {
        "verify_exp": False,
        "verify_nbf": False,
        "verify_iat": False,
        "require": ["exp", "iss", "aud", "sub"],
    }
    for key in fitting:
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key.key,
                algorithms=[alg],
                audience=settings.audience,
                issuer=settings.issuer,
                options=options,
            )
            return claims
        except jwt.InvalidSignatureError:
            continue
        except jwt.InvalidAudienceError:
            raise Unauthorized(
                f"the token was issued for another audience; this router takes "
                f"{settings.audience!r} (clientAuth.oidc.audience)"
            ) from None
        except jwt.InvalidIssuerError:
            raise Unauthorized(
                f"the token was issued by another provider; this router takes "
                f"{settings.issuer!r} (clientAuth.oidc.issuer)"
            ) from None
        except jwt.MissingRequiredClaimError as exc:
            raise Unauthorized(f"the token has no {exc.claim} claim") from None
        except (jwt.PyJWTError, ValueError, TypeError):
            raise Unauthorized("the token could not be verified") from None
    raise Unauthorized("the token's signature does not verify with the provider's keys")


def _is_time(value: Any) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _classes(claims: Mapping[str, Any], settings: OidcSettings) -> tuple[Any, ...]:
    named = claim(claims, settings.classes_claim)
    if named is None:
        if not settings.default_classes:
            raise Forbidden(
                f"the token has no {settings.classes_claim} claim and this router gives such "
                "tokens no traffic class (clientAuth.oidc.defaultClasses)"
            )
        return tuple(c for c in CLASSES if c in settings.default_classes)
    wanted = set(_strings(named))
    classes = tuple(c for c in CLASSES if c in wanted)
    if not classes:
        raise Forbidden(
            f"the token's {settings.classes_claim} claim names no traffic class this router "
            f"serves ({', '.join(CLASSES)})"
        )
    return classes


async def fetch_json(http: httpx.AsyncClient, url: str) -> Any:
    """A JSON document, refused past MAX_DOCUMENT_BYTES; ValueError naming the URL."""
    async with http.stream("GET", url, headers={"accept": "application/json"}) as answer:
        if answer.status_code != 200:
            raise ValueError(f"{url} answered {answer.status_code}")
        try:
            body = await read_capped(answer.aiter_bytes(), MAX_DOCUMENT_BYTES)
        except ReplyTooLarge:
            raise ValueError(f"{url} sent more than {MAX_DOCUMENT_BYTES} bytes") from None
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        raise ValueError(f"{url} did not answer JSON") from None


class TokenVerifier:
    """The provider's signing keys, kept current, and `identify` over them."""

    def __init__(self, settings: OidcSettings, wall_clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.wall_clock = wall_clock
        self.keys: list[SigningKey] = []
        self.error: str | None = None
        self._fetched_at = -math.inf
        self._attempted_at = -math.inf
        self._generation = 0
        self._lock = asyncio.Lock()
        self._verified: OrderedDict[bytes, Client] = OrderedDict()

    async def identify(self, token: str, now: float) -> Client:
        """`now` is the router's monotonic clock (when to fetch); token lifetimes are
        checked against the wall clock."""
        # Keys past their age are fetched again by one request; others meanwhile go on with
        # the keys held rather than queue behind the fetch.
        if now - self._fetched_at >= REFRESH_SECONDS and not (self.keys and self._lock.locked()):
            await self.refresh(now)
        if not self.keys:
            raise ProviderUnavailable(
                "the router cannot check tokens now: it could not fetch the identity "
                "provider's signing keys; retry later",
                retry_after=int(REFETCH_SECONDS),
            )
        digest = hashlib.sha256(token.encode()).digest()
        epoch = self.wall_clock()
        known = self._verified.get(digest)
        if known is not None and known.expires_at is not None and epoch <= known.expires_at:
            self._verified.move_to_end(digest)
            return known
        try:
            client = verify(token, self.keys, self.settings, epoch)
        except UnknownSigningKey:
            if not await self.refresh(now):
                raise
            client = verify(token, self.keys, self.settings, epoch)
        self._verified[digest] = client
        if len(self._verified) > VERIFIED_CACHE:
            self._verified.popitem(last=False)
        return client

    async def refresh(self, now: float) -> bool:
        """Fetch the keys unless the last attempt was under REFETCH_SECONDS ago; True when
        the keys changed since the call began (here or in a concurrent call)."""
        seen = self._generation
        async with self._lock:
            if self._generation != seen:
                return True
            if now - self._attempted_at < REFETCH_SECONDS:
                return False
            self._attempted_at = now
            try:
                document = await asyncio.wait_for(self._fetch(), 2 * FETCH_TIMEOUT_SECONDS)
                keys = parse_jwks(document)
            except (httpx.HTTPError, ssl.SSLError, OSError, ValueError, TimeoutError) as exc:
                self.error = f"{type(exc).__name__}: {exc}"[:300]
                log.warning("could not fetch the OIDC signing keys: %s", self.error)
                return False
            if keys != self.keys:
                self._verified.clear()  # a key withdrawn takes its tokens with it
            self.keys, self.error = keys, None
            self._fetched_at = now
            self._generation += 1
            return True

    async def _fetch(self) -> Any:
        settings = self.settings
        tls: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=settings.ca_file) if settings.ca_file else True
        )
        async with httpx.AsyncClient(verify=tls, timeout=FETCH_TIMEOUT_SECONDS) as http:
            jwks_uri = settings.jwks_uri
            if jwks_uri is None:
                discovery = await fetch_json(http, settings.issuer.rstrip("/") + DISCOVERY_PATH)
                if not isinstance(discovery, dict) or discovery.get("issuer") != settings.issuer:
                    raise ValueError(
                        f"the discovery document of {settings.issuer} names another issuer"
                    )
                jwks_uri = discovery.get("jwks_uri")
                if not isinstance(jwks_uri, str) or not jwks_uri.startswith("https://"):
                    raise ValueError(
                        f"the discovery document of {settings.issuer} has no https jwks_uri"
                    )
            return await fetch_json(http, jwks_uri)
