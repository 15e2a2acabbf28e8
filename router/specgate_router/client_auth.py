"""Client API keys: who may send, which traffic classes, and how much.

Keys are stored as their SHA-256 (a mounted Secret holds a YAML list of `ClientKey`s), so the
router's config and the Secret never hold a usable key. A presented key is hashed and compared
with every stored hash in constant time (`hmac.compare_digest`), so the time an answer takes
does not say how much of a guess was right. Each key has the classes it may send (the class
header is honoured only within them), and optionally a concurrency limit and a request rate
(a token bucket refilled at the rate, holding ten seconds' worth); past either, 429 with
Retry-After.

With OpenID Connect configured, a bearer token shaped as a JWT is checked by `oidc.py`
instead; either way the request goes on as a `Client` with classes, admin right and limits.

`KeyRing` and `Limits` are pure (time is an argument); `ClientAuth` adds reading the keys
file again when it changes and fetching the provider's keys.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field

from pydantic import TypeAdapter, ValidationError

from specgate import bounded_yaml
from specgate_router import oidc
from specgate_router.errors import Forbidden, TooManyRequests, Unauthorized
from specgate_router.identity import Client
from specgate_router.settings import ClientAuthSettings, ClientKey, TrafficClass

KEY_PREFIX = "sg-"
RELOAD_CHECK_SECONDS = 5.0
BURST_SECONDS = 10.0
MAX_TRACKED_CLIENTS = 10_000
"""Usage entries kept before idle ones are dropped (token subjects are not a closed list)."""
_KEYS = TypeAdapter(list[ClientKey])


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def new_key() -> str:
    """A random client key (256 bits), prefixed so that scanners can find a leaked one."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def from_key(key: ClientKey) -> Client:
    return Client(  # the entry's name is checked as unique and safe to print
        name=key.name,
        label=f"API key {key.name!r}",
        classes=tuple(key.classes),
        admin=key.admin,
        max_concurrent=key.max_concurrent,
        requests_per_minute=key.requests_per_minute,
    )


class KeyRing:
    """The stored keys; `identify` finds a presented key's entry in constant time."""

    def __init__(self, keys: Iterable[ClientKey]) -> None:
        self.keys = list(keys)
        names = [k.name for k in self.keys]
        if len(set(names)) != len(names):
            raise ValueError(f"client key names must be unique, got {sorted(names)}")

    def identify(self, presented: str | None) -> Client:
        if presented is None:
            raise Unauthorized("an API key is required: send Authorization: Bearer <key>")
        digest = hash_key(presented).encode()
        found = None
        for key in self.keys:  # every entry compared: no early exit
            if hmac.compare_digest(digest, key.sha256.encode()):
                found = key
        if found is None:
            raise Unauthorized("the API key is not valid: check the Authorization header")
        return from_key(found)


ADMIN_PATHS = ("/specgate/", "/docs", "/redoc", "/openapi.json")
"""The router's own endpoints and its API docs: with client authentication, admin keys only
(the docs list every route and the samples show the fleet's load)."""


def is_admin_path(path: str) -> bool:
    return any(path == p or path.startswith(p if p.endswith("/") else p + "/")
               for p in ADMIN_PATHS) or path.rstrip("/") == "/specgate"  # fmt: skip


def require_admin(client: Client) -> None:
    if not client.admin:
        raise Forbidden(
            f"{client.label} may not read the router's admin endpoints; use a key made with "
            "`specgate client-key NAME --admin`, or a token in one of clientAuth.oidc.adminGroups"
        )


def allowed_class(
    client: Client, wanted: TrafficClass | None, by_rules: TrafficClass
) -> TrafficClass:
    """The request's class for this client: the header's, if it may send it (else 403);
    without a header, the rules' class if it may send it, else its first class."""
    if wanted is not None:
        if wanted not in client.classes:
            raise Forbidden(
                f"{client.label} may not send {wanted} traffic; "
                f"its classes: {', '.join(client.classes)}",
                param="x-specgate-class",
            )
        return wanted
    return by_rules if by_rules in client.classes else client.classes[0]


@dataclass
class _Usage:
    in_flight: int = 0
    tokens: float = math.inf
    at: float = 0.0


@dataclass
class Limits:
    """Per-key concurrency and rate; `admit` takes a slot (release it with `release`)."""

    usage: dict[str, _Usage] = field(default_factory=dict)

    def admit(self, key: Client, now: float) -> None:
        if key.name not in self.usage and len(self.usage) >= MAX_TRACKED_CLIENTS:
            self._forget_idle(now)
        use = self.usage.setdefault(key.name, _Usage(at=now))
        if key.max_concurrent is not None and use.in_flight >= key.max_concurrent:
            raise TooManyRequests(
                f"{key.label} has {use.in_flight} requests in flight, its limit; "
                "retry when one finishes",
                retry_after=1,
            )
        if key.requests_per_minute is not None:
            rate = key.requests_per_minute / 60.0
            burst = max(1.0, rate * BURST_SECONDS)
            use.tokens = min(burst, use.tokens + (now - use.at) * rate)
            use.at = now
            if use.tokens < 1.0:
                wait = math.ceil((1.0 - use.tokens) / rate)
                raise TooManyRequests(
                    f"{key.label} is over {key.requests_per_minute} requests a minute; "
                    f"retry in {wait} s",
                    retry_after=wait,
                )
            use.tokens -= 1.0
        use.in_flight += 1

    def release(self, key: Client) -> None:
        use = self.usage.get(key.name)
        if use is not None and use.in_flight > 0:
            use.in_flight -= 1

    def _forget_idle(self, now: float) -> None:
        """Drop clients with nothing in flight and no request for BURST_SECONDS: their
        buckets have refilled, so a fresh entry is the same state."""
        for name in [n for n, u in self.usage.items()
                     if u.in_flight == 0 and now - u.at >= BURST_SECONDS]:  # fmt: skip
            del self.usage[name]


def read_keys_file(path: str) -> list[ClientKey]:
    """The keys in a YAML file; ValueError naming the file and the entry when malformed."""
    try:
        data = bounded_yaml.load_file(path) or []
        return _KEYS.validate_python(data)
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc}") from None
    except bounded_yaml.YamlError as exc:
        raise ValueError(str(exc)) from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{path}: entry {where}: {first['msg']}") from exc


class ClientAuth:
    """The key ring from the settings and the keys file, read again when the file changes (a
    Secret update reaches a mounted file within a minute or so); a file that turns malformed
    keeps the last good keys. With OpenID Connect, also the provider's token verifier."""

    def __init__(self, settings: ClientAuthSettings) -> None:
        self.settings = settings
        self.limits = Limits()
        self.error: str | None = None
        self._mtime: float | None = None
        self._checked = -math.inf
        self.ring = KeyRing([*settings.keys, *self._file_keys()])
        self.tokens = oidc.TokenVerifier(settings.oidc) if settings.oidc is not None else None

    async def start(self, now: float) -> None:
        """Fetch the provider's keys now, so the first token does not wait for them (a
        provider that cannot be reached is tried again as tokens arrive)."""
        if self.tokens is not None:
            await self.tokens.refresh(now)

    async def identify(self, authorization: str | None, now: float) -> Client:
        """The client behind an Authorization header: a JWT goes to the provider's verifier
        (when configured), anything else to the key ring."""
        self.refresh(now)
        presented = bearer(authorization)
        if self.tokens is not None:
            if presented is None:
                raise Unauthorized(
                    "an API key or a token is required: send Authorization: Bearer <key or token>"
                )
            if oidc.looks_like_jwt(presented):
                return await self.tokens.identify(presented, now)
        return self.ring.identify(presented)

    def _file_keys(self) -> list[ClientKey]:
        path = self.settings.keys_file
        if path is None:
            return []
        self._mtime = os.stat(path).st_mtime
        return read_keys_file(path)

    def refresh(self, now: float) -> None:
        path = self.settings.keys_file
        if path is None or now - self._checked < RELOAD_CHECK_SECONDS:
            return
        self._checked = now
        try:
            if os.stat(path).st_mtime == self._mtime:
                return
            self.ring = KeyRing([*self.settings.keys, *self._file_keys()])
            self.error = None
        except (OSError, ValueError) as exc:
            self.error = str(exc)[:300]  # keep serving with the last good keys
