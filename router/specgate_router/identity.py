"""Who sent a request, once authenticated: an API key's entry or an OpenID Connect token's
claims, reduced to what the router enforces."""

from __future__ import annotations

from dataclasses import dataclass

from specgate_router.settings import TrafficClass


@dataclass(frozen=True)
class Client:
    name: str
    """Key of the client's limits: the key's name, or `oidc:` and the token's subject."""
    label: str
    """How errors name the client (`API key 'alice'`, `token subject 'u-123'`)."""
    classes: tuple[TrafficClass, ...]
    """Traffic classes the client may send; never empty."""
    admin: bool
    """May read the router's own endpoints and its API docs."""
    max_concurrent: int | None = None
    requests_per_minute: int | None = None
    expires_at: float | None = None
    """Wall-clock time after which the identity no longer holds (a token's `exp` plus the
    allowed skew); None for API keys."""
