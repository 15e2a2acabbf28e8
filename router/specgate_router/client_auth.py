"""Client API keys: who may send, which traffic classes, and how much.

Keys are stored as their SHA-256 (a mounted Secret holds a YAML list of `ClientKey`s), so the
router's config and the Secret never hold a usable key. A presented key is hashed and compared
with every stored hash in constant time (`hmac.compare_digest`), so the time an answer takes
does not say how much of a guess was right. Each key has the classes it may send (the class
header is honoured only within them), and optionally a concurrency limit and a request rate
(a token bucket refilled at the rate, holding ten seconds' worth); past either, 429 with
Retry-After.

`KeyRing` and `Limits` are pure (time is an argument); `ClientAuth` adds reading the keys
file again when it changes.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import TypeAdapter, ValidationError

from specgate_router.errors import Forbidden, TooManyRequests, Unauthorized
from specgate_router.settings import ClientAuthSettings, ClientKey, TrafficClass

KEY_PREFIX = "sg-"
RELOAD_CHECK_SECONDS = 5.0
BURST_SECONDS = 10.0
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


class KeyRing:
    """The stored keys; `identify` finds a presented key's entry in constant time."""

    def __init__(self, keys: Iterable[ClientKey]) -> None:
        self.keys = list(keys)
        names = [k.name for k in self.keys]
        if len(set(names)) != len(names):
            raise ValueError(f"client key names must be unique, got {sorted(names)}")

    def identify(self, presented: str | None) -> ClientKey:
        if presented is None:
            raise Unauthorized("an API key is required: send Authorization: Bearer <key>")
        digest = hash_key(presented).encode()
        found = None
        for key in self.keys:  # every entry compared: no early exit
            if hmac.compare_digest(digest, key.sha256.encode()):
                found = key
        if found is None:
            raise Unauthorized("the API key is not valid: check the Authorization header")
        return found


ADMIN_PATHS = ("/specgate/", "/docs", "/redoc", "/openapi.json")
"""The router's own endpoints and its API docs: with client authentication, admin keys only
(the docs list every route and the samples show the fleet's load)."""


def is_admin_path(path: str) -> bool:
    return any(path == p or path.startswith(p if p.endswith("/") else p + "/")
               for p in ADMIN_PATHS) or path.rstrip("/") == "/specgate"  # fmt: skip


def require_admin(key: ClientKey) -> None:
    if not key.admin:
        raise Forbidden(
            f"API key {key.name!r} may not read the router's admin endpoints; "
            "use a key made with `specgate client-key NAME --admin`"
        )


def allowed_class(
    key: ClientKey, wanted: TrafficClass | None, by_rules: TrafficClass
) -> TrafficClass:
    """The request's class for this key: the header's, if the key may send it (else 403);
    without a header, the rules' class if the key may send it, else the key's first class."""
    if wanted is not None:
        if wanted not in key.classes:
            raise Forbidden(
                f"API key {key.name!r} may not send {wanted} traffic; "
                f"its classes: {', '.join(key.classes)}",
                param="x-specgate-class",
            )
        return wanted
    return by_rules if by_rules in key.classes else key.classes[0]


@dataclass
class _Usage:
    in_flight: int = 0
    tokens: float = math.inf
    at: float = 0.0


@dataclass
class Limits:
    """Per-key concurrency and rate; `admit` takes a slot (release it with `release`)."""

    usage: dict[str, _Usage] = field(default_factory=dict)

    def admit(self, key: ClientKey, now: float) -> None:
        use = self.usage.setdefault(key.name, _Usage(at=now))
        if key.max_concurrent is not None and use.in_flight >= key.max_concurrent:
            raise TooManyRequests(
                f"API key {key.name!r} has {use.in_flight} requests in flight, its limit; "
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
                    f"API key {key.name!r} is over {key.requests_per_minute} requests a minute; "
                    f"retry in {wait} s",
                    retry_after=wait,
                )
            use.tokens -= 1.0
        use.in_flight += 1

    def release(self, key: ClientKey) -> None:
        use = self.usage.get(key.name)
        if use is not None and use.in_flight > 0:
            use.in_flight -= 1


def read_keys_file(path: str) -> list[ClientKey]:
    """The keys in a YAML file; ValueError naming the file and the entry when malformed."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or []
        return _KEYS.validate_python(data)
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: {exc}") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{path}: entry {where}: {first['msg']}") from exc


class ClientAuth:
    """The key ring from the settings and the keys file, read again when the file changes (a
    Secret update reaches a mounted file within a minute or so); a file that turns malformed
    keeps the last good keys."""

    def __init__(self, settings: ClientAuthSettings) -> None:
        self.settings = settings
        self.limits = Limits()
        self.error: str | None = None
        self._mtime: float | None = None
        self._checked = -math.inf
        self.ring = KeyRing([*settings.keys, *self._file_keys()])

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
