"""Router configuration: one pydantic model, read from YAML (the operator's ConfigMap) and
command-line flags. Unknown keys are errors that name the key."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from specgate import api, bounded_yaml, contract

TrafficClass = Literal["latency", "throughput"]
CLASSES: tuple[TrafficClass, ...] = ("latency", "throughput")
API_KEY_ENV = "SPECGATE_ENGINE_API_KEY"


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class KubernetesDiscovery(_Model):
    namespace: str
    service: str
    """The engine's headless Service; its EndpointSlices list the pods."""
    port: int = Field(default=30000, ge=1, le=65535)


class Discovery(_Model):
    kubernetes: KubernetesDiscovery | None = None


class ControlSettings(api.SpeculationControl):
    """The threshold controller: the resource's spec.speculative.control (its fields and
    defaults come from that one definition), plus the router's own timing."""

    scrape_interval_seconds: float = Field(default=0.5, gt=0, le=10)
    scrape_timeout_seconds: float = Field(default=1.0, gt=0)
    stale_after_seconds: float = Field(default=2.0, gt=0)
    """Metrics older than this count as stale: the pod is treated as saturated and no
    threshold decision is made for it."""
    stagger_seconds: float = Field(default=1.0, ge=0)
    """Minimum time between two threshold pushes to different pods."""
    push_retries: int = Field(default=3, ge=0, le=10)
    min_samples: int = Field(default=4, ge=2)
    """Observations per mode needed before the estimate replaces the initial threshold."""

    @model_validator(mode="after")
    def _bounds(self) -> ControlSettings:
        if not self.min_threshold <= self.threshold <= self.max_threshold:
            raise ValueError("control: need minThreshold <= threshold <= maxThreshold")
        return self


class PoolSettings(_Model):
    min_latency_fraction: float = Field(default=0.0, ge=0, le=1)
    max_latency_fraction: float = Field(default=1.0, ge=0, le=1)
    throughput_batch_per_pod: int = Field(default=24, ge=1)
    """The latency pool only takes pods the throughput class does not need at this batch (see
    spec.router.pools.throughputBatchPerPod)."""
    latency_tpot_target_ms: float | None = Field(default=None, gt=0)
    """Size the latency pool for this TPOT (see spec.router.pools.latencyTpotTargetMs)."""
    class_mix_window_seconds: float = Field(default=10.0, gt=0)
    """Time constant of the smoothed in-flight requests per class that size the pools."""

    @model_validator(mode="after")
    def _bounds(self) -> PoolSettings:
        if self.min_latency_fraction > self.max_latency_fraction:
            raise ValueError("pools: minLatencyFraction must not exceed maxLatencyFraction")
        return self


class ClassRules(_Model):
    """How a request without an `x-specgate-class` header gets its class."""

    api_keys: dict[str, TrafficClass] = Field(default_factory=dict)
    """Client API key (the Bearer token sent to the router) -> class."""
    throughput_above_max_tokens: int | None = Field(default=None, ge=1)
    """Requests asking for more output tokens than this are throughput traffic."""


class ClientKey(_Model):
    """One client API key, stored as its SHA-256 (the key itself is never in a file)."""

    name: str = Field(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Who holds the key (logs and errors name it)."""
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """Hex SHA-256 of the key (`specgate client-key` makes both)."""
    classes: list[TrafficClass] = Field(default_factory=lambda: list(CLASSES), min_length=1)
    """Traffic classes the key may send; the class header is honoured within them."""
    max_concurrent: int | None = Field(default=None, ge=1, le=100_000)
    """Requests in flight at once; past it, 429."""
    requests_per_minute: int | None = Field(default=None, ge=1, le=10_000_000)
    """Sustained request rate (bursts of ten seconds' worth); past it, 429."""
    admin: bool = False
    """The key may also read the router's own endpoints (/specgate/*) and its API docs
    (/docs, /redoc, /openapi.json), which client authentication closes to other keys."""


class OidcSettings(api.OidcSpec):
    """OpenID Connect tokens: the resource's spec.router.clientAuth.oidc, with the CA bundle
    as a file (the operator mounts the ConfigMap the resource names)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )

    ca_file: str | None = None
    """PEM bundle of the CAs that sign the provider's TLS certificate; the system's when
    unset."""

    @model_validator(mode="after")
    def _ca_as_file(self) -> OidcSettings:
        if self.ca is not None:
            raise ValueError("clientAuth.oidc: give the router caFile, a path; ca is a ConfigMap")
        return self


class ClientAuthSettings(_Model):
    """Client authentication: every API request must carry one of these keys or a token
    from the OpenID Connect provider."""

    keys_file: str | None = None
    """A YAML list of keys (a mounted Secret), read again when it changes."""
    keys: list[ClientKey] = Field(default_factory=list)
    """Keys given inline (besides the file's)."""
    oidc: OidcSettings | None = None
    """Bearer tokens (JWTs) from an OpenID Connect provider, besides the keys."""

    @model_validator(mode="after")
    def _some_credentials(self) -> ClientAuthSettings:
        if self.keys_file is None and not self.keys and self.oidc is None:
            raise ValueError("clientAuth needs keysFile, keys or oidc")
        return self


class ResilienceSettings(_Model):
    connect_timeout_seconds: float = Field(default=2.0, gt=0)
    first_byte_timeout_seconds: float = Field(default=60.0, gt=0)
    """Longest wait for the first byte of an engine's answer (prompt processing included):
    past it the attempt is retried on another pod, and the silent pod is marked unhealthy and
    its circuit opened (a frozen process keeps its socket open)."""
    read_timeout_seconds: float = Field(default=30.0, gt=0)
    """Longest silence allowed between two chunks of an engine's answer; past it a stream
    ends with an error event and [DONE]."""
    answer_timeout_seconds: float = Field(default=600.0, gt=0)
    """Longest an answer may take from the request's arrival to its last byte; past it a
    stream ends with an error event and [DONE] and a non-streamed request gets 504. A
    non-streamed answer's first byte is its whole body, so this, not the first-byte limit,
    bounds its wait."""
    max_attempts: int = Field(default=3, ge=1, le=10)
    """Attempts per request on different pods, for failures before the first byte."""
    backoff_base_seconds: float = Field(default=0.05, ge=0)
    backoff_max_seconds: float = Field(default=1.0, ge=0)
    breaker_failures: int = Field(default=3, ge=1)
    """Consecutive failures that open a pod's circuit."""
    breaker_open_seconds: float = Field(default=5.0, gt=0)
    retry_after_seconds: int = Field(default=1, ge=1)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    max_header_bytes: int = Field(default=64 * 1024, ge=4096, le=1024 * 1024)
    """Longest request head (request line and headers); past it, or past `maxHeaders`
    headers, 431 and the connection closes (http_limits.py)."""
    max_headers: int = Field(default=100, ge=16, le=1000)
    drain_seconds: float = Field(default=60.0, ge=0)
    """On SIGTERM: how long the router refuses new requests and waits for those in flight."""


class LeaderElection(_Model):
    lease_name: str
    namespace: str
    lease_seconds: float = Field(default=10.0, gt=1)
    renew_seconds: float = Field(default=2.0, gt=0)


class StatusTarget(_Model):
    namespace: str
    name: str
    interval_seconds: float = Field(default=5.0, gt=0)


class RouterSettings(_Model):
    model: str = "default"
    """Served model name; requests naming another model get 404."""
    default_class: TrafficClass = "latency"
    backends: list[str] = Field(default_factory=list)
    discovery: Discovery = Field(default_factory=Discovery)
    engine_api_key: str | None = Field(default=None, repr=False)
    control: ControlSettings = Field(default_factory=ControlSettings)
    pools: PoolSettings = Field(default_factory=PoolSettings)
    plugins: api.RouterPlugins = Field(default_factory=api.RouterPlugins)
    class_rules: ClassRules = Field(default_factory=ClassRules)
    client_auth: ClientAuthSettings | None = None
    tracing: api.RouterTracing | None = None
    """Spans of the router's requests to an OTLP/HTTP collector (tracing.py)."""
    """Require client API keys on the API paths; none required when unset."""
    allowed_engine_fields: frozenset[contract.EngineOnlyField] = frozenset()
    """Engine-only request fields (contract.ENGINE_ONLY_FIELDS) clients may send anyway."""
    resilience: ResilienceSettings = Field(default_factory=ResilienceSettings)
    leader_election: LeaderElection | None = None
    status_target: StatusTarget | None = None

    @model_validator(mode="after")
    def _one_source(self) -> RouterSettings:
        if not self.backends and self.discovery.kubernetes is None:
            raise ValueError(
                "no engine pods: give backends (--backend URL) or discovery.kubernetes"
            )
        return self


class SettingsError(ValueError):
    """A config file or flag the router cannot use; the message names the field."""


def explain(exc: ValidationError, source: str) -> SettingsError:
    """`exc` as one SettingsError that names `source` and each field (by its config name)."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "<root>"
        parts.append(f"{where}: {err['msg']}")
    return SettingsError(f"{source}: " + "; ".join(parts))


def load(
    path: str | Path | None = None,
    *,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> RouterSettings:
    """Settings from an optional YAML file, then flag overrides, then the API key from the
    environment when neither gave one."""
    environ = dict(os.environ) if environ is None else environ
    data: dict[str, Any] = {}
    source = "flags"
    if path is not None:
        source = str(path)
        try:
            loaded = bounded_yaml.load_file(path) or {}
        except OSError as exc:
            raise SettingsError(f"{path}: {exc.strerror or exc}") from None
        except bounded_yaml.YamlError as exc:  # names the line, never echoes it (keys live here)
            raise SettingsError(str(exc)) from None
        if not isinstance(loaded, dict):
            raise SettingsError(f"{path}: expected a mapping at the top level")
        data.update(loaded)
    for key, value in (overrides or {}).items():
        if value is not None and value != []:
            data[key] = value
    if not data.get("engineApiKey") and not data.get("engine_api_key") and environ.get(API_KEY_ENV):
        data["engineApiKey"] = environ[API_KEY_ENV]
    try:
        return RouterSettings.model_validate(data)
    except ValidationError as exc:
        raise explain(exc, source) from exc
