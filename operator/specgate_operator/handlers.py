"""kopf handlers: thin shells that render, adopt, apply and write status.

`build_registry(config)` registers every handler on a fresh registry (no module-level
registration, no globals); the per-process state (the API client) lives in kopf's memo, created
at startup and closed at cleanup.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

import kopf
from pydantic import ValidationError

from specgate import api
from specgate.kube import Credentials, KubeClient, KubeError, TokenAuth, adopt
from specgate_operator import children, render, status
from specgate_operator.metrics import OperatorMetrics
from specgate_operator.policy import (
    Policy,
    secret_references,
    secret_violations,
    service_account_violation,
    violations,
)

log = logging.getLogger("specgate.operator")

FINALIZER = "specgate.io/cleanup"
TIMER_EXIT_POLL_SECONDS = 1.0
"""How often kopf checks whether a stopping resync timer has exited (see configure)."""
RESYNC_RESTART_SECONDS = 0.5
"""Between one resync run and the next: each run itself waits for a child's change or the
resync period (build_registry), so this only paces runs after a burst of changes."""

Logger = logging.Logger | logging.LoggerAdapter[Any]


@dataclass(frozen=True)
class OperatorConfig:
    """Everything `specgate operator` is configured with."""

    render: render.RenderOptions = field(default_factory=render.RenderOptions)
    policy: Policy = field(default_factory=Policy)
    """What resources may do beyond their schema (specgate_operator.policy)."""
    resync_seconds: float = 120.0
    """How often every resource is re-applied and its status refreshed without a watched
    child's change (which does it at once): the correction of drift in unwatched children."""
    detect_monitoring: bool = True
    """Render ServiceMonitors when the monitoring.coreos.com/v1 API is served."""


class MissingSecret(Exception):
    """The spec names a Secret that does not exist (yet)."""

    reason = "SecretNotFound"


class MissingServiceAccount(MissingSecret):
    """The spec names a ServiceAccount that does not exist (yet)."""

    reason = "ServiceAccountNotFound"


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    return dict((obj.get("metadata") or {}).get("labels") or {})


async def _unreferable(
    kube: KubeClient, sdd: api.SpecDecodeDeployment, policy: Policy
) -> list[str]:
    """The policy's refusals of the Secrets and the ServiceAccount the resource names (their
    labels are read here); MissingSecret for one that does not exist."""
    labels: dict[str, dict[str, str]] = {}
    for field_name, name in secret_references(sdd):
        secret = await kube.get_or_none("v1", "Secret", sdd.namespace, name)
        if secret is None:
            raise MissingSecret(f"Secret {name!r} ({field_name}) not found")
        labels[name] = _labels(secret)
    refused = secret_violations(sdd, policy, labels)
    if (account := sdd.spec.engine.service_account_name) is not None:
        found = await kube.get_or_none("v1", "ServiceAccount", sdd.namespace, account)
        if found is None:
            raise MissingServiceAccount(
                f"ServiceAccount {account!r} (spec.engine.serviceAccountName) not found"
            )
        if (violation := service_account_violation(sdd, _labels(found))) is not None:
            refused.append(violation)
    return refused


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _invalid_spec_message(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
    )


async def _ensure_api_key(kube: KubeClient, sdd: api.SpecDecodeDeployment, owner: Any) -> None:
    ref = sdd.spec.api_key_secret_ref
    if ref is not None:
        secret = await kube.get_or_none("v1", "Secret", sdd.namespace, ref.name)
        if secret is None:
            raise MissingSecret(f"Secret {ref.name!r} (spec.apiKeySecretRef) not found")
        if ref.key not in (secret.get("data") or {}) and ref.key not in (
            secret.get("stringData") or {}
        ):
            raise MissingSecret(f"Secret {ref.name!r} has no key {ref.key!r}")
        return
    # Create-if-absent: a key generated once stays for the resource's lifetime.
    manifest = render.engine_api_key_secret(sdd, secrets.token_urlsafe(32))
    await kube.create_if_absent(adopt(manifest, owner))


async def apply_children(
    kube: KubeClient, sdd: api.SpecDecodeDeployment, owner: Any, opts: render.RenderOptions
) -> None:
    await _ensure_api_key(kube, sdd, owner)
    for manifest in render.render(sdd, opts):
        await kube.apply(adopt(manifest, owner))


async def observe(
    kube: KubeClient,
    sdd_name: str,
    namespace: str,
    generation: int,
    desired_replicas: int,
    router_port: int,
    problem: tuple[str, str] | None,
) -> status.Observed:
    n = render.names(sdd_name)
    engine = await kube.get_or_none("apps/v1", "Deployment", namespace, n["engine"])
    router = await kube.get_or_none("apps/v1", "Deployment", namespace, n["router"])
    return status.Observed(
        generation=generation,
        desired_replicas=desired_replicas,
        engine=engine,
        router=router,
        router_endpoint=f"http://{n['router']}.{namespace}.svc:{router_port}",
        problem=problem,
    )


@dataclass
class Lifecycle:
    """One resource's reconciles and its deletion, kept apart (kopf's per-object memo holds it).

    kopf runs the resync timer in a task of its own, beside the change and deletion handlers: a
    timer's reconcile that began before the deletion could apply children after on_delete had
    deleted them, and write a status that moves the resourceVersion kopf's finalizer removal is
    conditioned on, leaving the resource terminating with its children back."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    deleting: bool = False
    """Set by on_delete: no reconcile makes or updates anything after it."""
    resynced: bool = False
    """Whether the resync timer has run once: its first run reconciles at once (a status
    write that also moves kopf on when an early patch of its own met a conflict), later runs
    wait for a child's change or the period."""


def lifecycle(memo: Any) -> Lifecycle:
    """The resource's Lifecycle, made on first use (kopf's memo is a dict, one per object)."""
    found: Lifecycle | None = memo.get("lifecycle")
    if found is None:
        found = memo["lifecycle"] = Lifecycle()
    return found


def _owner(body: Any) -> dict[str, Any]:
    return {
        "apiVersion": body["apiVersion"],
        "kind": body["kind"],
        "metadata": {"name": body["metadata"]["name"], "uid": body["metadata"]["uid"]},
    }


async def reconcile(body: Any, patch: Any, memo: Any, logger: Logger) -> None:
    """Render, apply and write status; raise kopf errors so kopf retries what a retry can fix.
    Never during or after the resource's deletion (Lifecycle)."""
    guard = lifecycle(memo)
    async with guard.lock:
        if guard.deleting or body["metadata"].get("deletionTimestamp"):
            return
        metrics: OperatorMetrics | None = getattr(memo, "metrics", None)
        if metrics is None:
            await _reconcile(body, patch, memo, logger)
        else:
            await metrics.timed(lambda: _reconcile(body, patch, memo, logger))


async def _reconcile(body: Any, patch: Any, memo: Any, logger: Logger) -> None:
    kube: KubeClient = memo.kube
    config: OperatorConfig = memo.config
    meta = body["metadata"]
    generation = int(meta.get("generation", 0))
    problem: tuple[str, str] | None = None
    error: Exception | None = None
    try:
        sdd = api.SpecDecodeDeployment.model_validate(
            {
                "apiVersion": body["apiVersion"],
                "kind": body["kind"],
                "metadata": dict(meta),
                "spec": dict(body.get("spec") or {}),
            }
        )
    except ValidationError as exc:
        message = _invalid_spec_message(exc)
        problem, error = ("InvalidSpec", message), kopf.PermanentError(message)
        sdd = None
    if sdd is not None:
        defaults = (config.render.engine_image, config.render.router_image)
        refused = violations(sdd, config.policy, defaults)
        if refused:
            message = "; ".join(refused)
            problem, error = ("PolicyViolation", message), kopf.PermanentError(message)
            sdd = None
    if sdd is not None:
        opts = config.render
        if config.detect_monitoring:
            opts = render.RenderOptions(
                **{**opts.__dict__, "service_monitor": memo.service_monitor}
            )
        try:
            unreferable = await _unreferable(kube, sdd, config.policy)
            if unreferable:
                # Retried: labelling the Secret later is the fix, and changes no resource.
                message = "; ".join(unreferable)
                problem, error = (
                    ("PolicyViolation", message),
                    kopf.TemporaryError(message, delay=30),
                )
            else:
                await apply_children(kube, sdd, _owner(body), opts)
        except MissingSecret as exc:
            problem, error = (exc.reason, str(exc)), kopf.TemporaryError(str(exc), delay=10)
        except KubeError as exc:
            reason = "ApplyForbidden" if exc.status == 403 else "ApplyFailed"
            problem = (reason, str(exc))
            # 422 means the rendered object itself is invalid: only a spec change can fix it.
            error = (
                kopf.PermanentError(str(exc))
                if exc.status == 422
                else kopf.TemporaryError(str(exc), delay=15)
            )
    replicas = sdd.spec.replicas if sdd else 0
    router_port = sdd.spec.router.port if sdd else 8000
    observed = await observe(
        kube,
        meta["name"],
        meta.get("namespace") or "default",
        generation,
        replicas,
        router_port,
        problem,
    )
    selector = f"{render.LABEL_COMPONENT}=engine,{render.LABEL_DEPLOYMENT}={meta['name']}"
    new_status = status.status_patch(
        observed, dict(body.get("status") or {}), now=_now(), selector=selector
    )
    if sdd is not None and not (body.get("status") or {}).get("threshold"):
        threshold = render.initial_threshold(sdd.spec.speculative.control)
        new_status["threshold"] = "always" if threshold is None else str(threshold)
    for key, value in new_status.items():
        patch.status[key] = value
    if error is not None:
        logger.warning("reconcile of %s failed: %s", meta["name"], error)
        raise error


async def delete_children(kube: KubeClient, name: str, namespace: str, uid: str) -> int:
    """Delete every child this resource owns (the garbage collector would too; this makes
    deletion prompt and independent of it). Objects not owned by the resource are left alone."""
    deleted = 0
    for api_version, kind, ns, child in render.child_refs(name, namespace):
        try:
            obj = await kube.get_or_none(api_version, kind, ns, child)
        except KubeError as exc:
            if exc.status == 404:  # the API itself is not served (e.g. no ServiceMonitor CRD)
                continue
            raise
        if obj is None:
            continue
        owners = (obj.get("metadata") or {}).get("ownerReferences") or []
        if any(o.get("uid") == uid for o in owners) and await kube.delete(
            api_version, kind, ns, child
        ):
            deleted += 1
    return deleted


async def finalize(body: Any, memo: Any, logger: Logger) -> None:
    """The deletion: once any reconcile under way has finished, and with none after it
    (Lifecycle), delete every child the resource owns."""
    meta = body["metadata"]
    guard = lifecycle(memo)
    async with guard.lock:
        guard.deleting = True
        count = await delete_children(
            memo.kube, meta["name"], meta.get("namespace") or "default", meta["uid"]
        )
    logger.info("deleted %d children of %s", count, meta["name"])


def holds_finalizer(meta: Any, **_: Any) -> bool:
    """Whether the resource carries the operator's finalizer (a kopf `when=` filter)."""
    return FINALIZER in (meta.get("finalizers") or [])


def resyncable(meta: Any, **_: Any) -> bool:
    """The resync timer's `when=` filter: the finalizer is on and no deletion has begun."""
    return holds_finalizer(meta) and not meta.get("deletionTimestamp")


async def kopf_login(credentials: Credentials) -> kopf.ConnectionInfo:
    """kopf's connection from the operator's credentials (its own service account found as
    client-go finds it, or the kubeconfig's token, certificate or exec plugin). kopf logs in
    again after a 401, which reads a rotated service-account token (the old one stays valid
    until then); an exec plugin's token also expires when TokenAuth would renew it."""
    auth = TokenAuth(credentials)
    token = await auth.token()
    expiration = None
    if credentials.exec_plugin is not None and auth.valid_for() < float("inf"):
        expiration = datetime.datetime.now(datetime.UTC) + datetime.timedelta(
            seconds=auth.valid_for()
        )
    return kopf.ConnectionInfo(
        server=credentials.server,
        ca_path=credentials.ca_path,
        ca_data=credentials.ca_data,
        insecure=credentials.insecure or None,
        token=token,
        certificate_path=credentials.certificate_path,
        private_key_path=credentials.private_key_path,
        default_namespace=credentials.default_namespace,
        expiration=expiration,
    )


def build_registry(config: OperatorConfig) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    resource = (api.GROUP, api.VERSION, api.PLURAL)

    @kopf.on.login(registry=registry)
    async def login(**_: Any) -> kopf.ConnectionInfo:
        return await kopf_login(Credentials.discover())

    @kopf.on.startup(registry=registry)
    async def configure(
        settings: kopf.OperatorSettings, memo: Any, logger: Logger, **_: Any
    ) -> None:
        settings.persistence.finalizer = FINALIZER
        # Keep kopf's bookkeeping in annotations: .status belongs to the CRD's schema.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
            prefix="specgate.io"
        )
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="specgate.io", key="last-handled-configuration"
        )
        # A resync timer caught mid-run by a deletion keeps kopf from removing its finalizer
        # until the timer has exited, and kopf looks again only this often (default 60 s): a
        # deleted resource would stay terminating for a minute after its cleanup had finished.
        settings.background.cancellation_polling = TIMER_EXIT_POLL_SECONDS
        settings.posting.level = logging.WARNING
        settings.watching.server_timeout = 300
        settings.networking.request_timeout = 30
        memo.config = config
        if getattr(memo, "metrics", None) is None:  # the process serves its own (main.py)
            memo.metrics = OperatorMetrics()
        memo.kube = KubeClient(Credentials.discover())
        memo.wakeups = children.Wakeups()
        memo.service_monitor = False
        if config.detect_monitoring:
            memo.service_monitor = await memo.kube.serves(
                "monitoring.coreos.com/v1", "servicemonitors"
            )
        logger.info("ServiceMonitor API served: %s", memo.service_monitor)

    @kopf.on.cleanup(registry=registry)
    async def close(memo: Any, **_: Any) -> None:
        if getattr(memo, "kube", None) is not None:
            await memo.kube.aclose()

    @kopf.on.resume(*resource, registry=registry)
    @kopf.on.create(*resource, registry=registry)
    @kopf.on.update(*resource, field="spec", registry=registry)
    async def on_change(body: Any, patch: Any, memo: Any, logger: Logger, **_: Any) -> None:
        await reconcile(body, patch, memo, logger)

    # Only once kopf's finalizer is on the resource and until its deletion begins: children made
    # before it could outlive a deletion that on_delete never sees, and the timer's status
    # writes would keep moving the resourceVersion that kopf's finalizer patches are
    # conditioned on. A run that began before the deletion waits in reconcile (Lifecycle).
    # Each run waits for a watched child's change or the resync period, whichever comes first
    # (kopf's `body` is live: the reconcile sees the resource as it is then).
    @kopf.timer(
        *resource, interval=RESYNC_RESTART_SECONDS, idle=0, when=resyncable, registry=registry
    )
    async def resync(body: Any, patch: Any, memo: Any, logger: Logger, **kwargs: Any) -> None:
        stopped, guard = kwargs["stopped"], lifecycle(memo)
        if guard.resynced:
            await memo.wakeups.wait(children.key_of(body), config.resync_seconds, stopped)
        guard.resynced = True
        if not stopped:
            await reconcile(body, patch, memo, logger)

    # The watched children: an event on one wakes its resource's resync (children.py).
    for group, version, plural in children.WATCHED:

        @kopf.on.event(
            group, version, plural, labels={render.LABEL_DEPLOYMENT: kopf.PRESENT},
            registry=registry,
        )  # fmt: skip
        async def child_changed(body: Any, memo: Any, **_: Any) -> None:
            if (key := children.owner_of(body)) is not None:
                memo.wakeups.wake(key)

    @kopf.on.delete(*resource, registry=registry)
    async def on_delete(body: Any, memo: Any, logger: Logger, **_: Any) -> None:
        await finalize(body, memo, logger)
        memo.wakeups.forget(children.key_of(body))

    return registry
