"""What the cluster's administrator lets a SpecDecodeDeployment do, beyond what its schema
allows: the images its pods may run, the node directories it may mount, the Secrets it may
name, the hubs it may download from, the engine flags and environment it may set, and the
scheduling privileges (tolerations, runtime and priority classes) and sizes it may ask for.

A tenant who may create SpecDecodeDeployments but not pods must not get, through the
operator, what a pod spec of their own would give: any image, or a node's root filesystem.
The operator checks every resource against its policy before rendering anything, and a
resource that breaks it gets no children and a `PolicyViolation` condition naming the field
and the fix. `specgate render` applies the same policy, with the same options. Pure: tested
without a cluster (the operator reads the labels of the Secrets a resource names and passes
them in).
"""

from __future__ import annotations

import argparse
import ipaddress
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from specgate import api

IMAGE_SEPARATORS = "/:@"

REFERABLE_LABEL = "specgate.io/referable"
"""A Secret a resource names (apiKeySecretRef, the hub token, client keys) must carry this label
with the value "true": only someone who may write the Secret can let resources use it, so a
tenant who may create resources cannot send another team's Secret to an engine or a hub."""

RESERVED_ENV_NAMES = frozenset(
    {
        "SGLANG_API_KEY",  # the engine key the operator sets from apiKeySecretRef
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONSTARTUP",
        "PYTHONUSERBASE",
        "PYTHONINSPECT",
        "BASH_ENV",
        "ENV",
    }
)
"""Environment names spec.engine.env may not set: the engine key the operator sets, and what
makes the runtime load code from elsewhere (a weights volume, say: --trust-remote-code by
another road). Every LD_ name is refused too (LD_PRELOAD,
LD_LIBRARY_PATH, ...)."""

_QUANTITY_SUFFIXES = {
    "": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip


def quantity_bytes(quantity: str) -> float:
    """A Kubernetes quantity ("16Gi", "1.5T") as a number; ValueError when it is not one."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)", quantity)
    if match is None or match.group(2) not in _QUANTITY_SUFFIXES:
        raise ValueError(f"{quantity!r} is not a quantity such as 16Gi")
    return float(match.group(1)) * _QUANTITY_SUFFIXES[match.group(2)]


@dataclass(frozen=True)
class Policy:
    allowed_image_prefixes: tuple[str, ...] = ()
    """Images a resource may name (spec.engine.image, spec.router.image) start with one of
    these; empty: any image. The operator's own default images are always allowed."""
    allowed_host_path_prefixes: tuple[str, ...] = ()
    """Node directories a hostPath weights source may mount lie under one of these; empty:
    hostPath sources are refused."""
    allow_env_secrets: bool = False
    """Let spec.engine.env read Secrets (valueFrom.secretKeyRef). Off, a resource reads only
    the Secrets its own fields name (the engine key, the hub token, the client keys), so a
    tenant who may create resources but not pods cannot read its namespace's other Secrets
    through an engine pod."""
    allowed_hub_endpoints: tuple[str, ...] = ("https://huggingface.co",)
    """Hubs (scheme://host[:port]) a hub weights source may download from; the init container
    sends the resource's hub token there. Loopback, link-local and unspecified addresses are
    refused whatever the list says."""
    allowed_toleration_keys: tuple[str, ...] = ("nvidia.com/gpu",)
    """Taint keys engine pods may tolerate. A toleration without a key (of every taint) needs
    "*" here."""
    allowed_runtime_classes: tuple[str, ...] = ("nvidia",)
    """RuntimeClasses engine pods may name."""
    allowed_priority_classes: tuple[str, ...] = ()
    """PriorityClasses engine pods may name; empty: any but the system ones (system-*), which
    need naming here."""
    max_shm_size: str = "256Gi"
    """Largest spec.engine.shmSize (memory-backed: it counts against the node's memory)."""
    max_cache_size: str = "4Ti"
    """Largest spec.model.source.hub.cacheSize (an emptyDir on the node's disk)."""
    allow_unlabelled_secrets: bool = False
    """Let resources name Secrets without the specgate.io/referable=true label."""

    def __post_init__(self) -> None:
        for prefix in self.allowed_host_path_prefixes:
            if not prefix.startswith("/") or ".." in prefix.split("/"):
                raise ValueError(
                    f"allowed host path prefix {prefix!r}: an absolute path without '..'"
                )
        for prefix in self.allowed_image_prefixes:
            if not prefix or any(c.isspace() for c in prefix):
                raise ValueError(f"allowed image prefix {prefix!r}: a non-empty image prefix")
        for endpoint in self.allowed_hub_endpoints:
            if hub_origin(endpoint) is None:
                raise ValueError(
                    f"allowed hub endpoint {endpoint!r}: a URL such as https://hub.example.com"
                )
        for name, size in (
            ("max shm size", self.max_shm_size),
            ("max cache size", self.max_cache_size),
        ):
            try:
                quantity_bytes(size)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None


def image_allowed(image: str, prefixes: tuple[str, ...]) -> bool:
    """`image` starts with a prefix at a boundary: "registry.io/team" allows
    "registry.io/team/worker:1" but not "registry.io/team-other/worker"."""
    if not prefixes:
        return True
    for prefix in prefixes:
        if image == prefix:
            return True
        if image.startswith(prefix) and (
            prefix[-1] in IMAGE_SEPARATORS or image[len(prefix)] in IMAGE_SEPARATORS
        ):
            return True
    return False


def host_path_allowed(path: str, prefixes: tuple[str, ...]) -> bool:
    """`path` (absolute, no '..') lies at or under one of `prefixes`, compared as path
    components after normalisation ("/models" allows "/models/llama", not "/models2")."""
    if not path.startswith("/") or ".." in path.split("/"):
        return False
    normal = posixpath.normpath(path)
    for prefix in prefixes:
        root = posixpath.normpath(prefix)
        if normal == root or normal.startswith(root.rstrip("/") + "/"):
            return True
    return False


def hub_origin(url: str) -> str | None:
    """scheme://host[:port] of an http(s) URL, lowercased; None when it is not one."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return f"{parts.scheme}://{parts.hostname.lower()}" + (f":{port}" if port else "")


def _internal_host(host: str) -> bool:
    """Loopback, link-local (cloud metadata) or unspecified, by address or well-known name."""
    if host in ("localhost", "metadata", "metadata.google.internal") or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return address.is_loopback or address.is_link_local or address.is_unspecified


def hub_endpoint_problem(endpoint: str, allowed: tuple[str, ...]) -> str | None:
    """Why a hub endpoint is refused, or None."""
    origin = hub_origin(endpoint)
    if origin is None:
        return f"{endpoint!r} is not an http(s) URL"
    host = urlsplit(endpoint).hostname or ""
    if _internal_host(host):
        return f"{endpoint!r} is a loopback, link-local or unspecified address"
    if origin not in {hub_origin(a) for a in allowed}:
        return f"{endpoint!r} is not a hub this operator allows ({', '.join(allowed) or 'none'})"
    return None


def reserved_engine_arg(arg: str) -> bool:
    """`arg` sets a flag the operator renders or refuses, as SGLang's parser would read it."""
    return re.match(api.RESERVED_FLAG_PATTERN, arg) is not None


def secret_references(sdd: api.SpecDecodeDeployment) -> list[tuple[str, str]]:
    """(field, Secret name) for every Secret the resource names itself."""
    out = []
    if sdd.spec.api_key_secret_ref is not None:
        out.append(("spec.apiKeySecretRef", sdd.spec.api_key_secret_ref.name))
    hub = sdd.spec.model.source.hub
    if sdd.spec.model.source.type == "hub" and hub and hub.token_secret_ref is not None:
        out.append(("spec.model.source.hub.tokenSecretRef", hub.token_secret_ref.name))
    auth = sdd.spec.router.client_auth
    if auth is not None and auth.secret_name is not None:
        out.append(("spec.router.clientAuth.secretName", auth.secret_name))
    return out


def secret_violations(
    sdd: api.SpecDecodeDeployment, policy: Policy, labels: Mapping[str, Mapping[str, str]]
) -> list[str]:
    """One line per Secret the resource names without the label that lets it (`labels`: each
    existing Secret's labels by name; one not in it is reported missing by the caller)."""
    if policy.allow_unlabelled_secrets:
        return []
    out = []
    for field, name in secret_references(sdd):
        if name in labels and labels[name].get(REFERABLE_LABEL) != "true":
            out.append(
                f"{field}: Secret {name!r} lacks the label {REFERABLE_LABEL}=true that lets"
                " resources use it: label it (`kubectl label secret"
                f" {name} {REFERABLE_LABEL}=true`) if this resource may read it"
            )
    return out


def service_account_violation(
    sdd: api.SpecDecodeDeployment, labels: Mapping[str, str]
) -> str | None:
    """The refusal of the engine's ServiceAccount (`labels`: its labels) unless whoever may
    write it let resources run pods as it: a tenant who may only write SpecDecodeDeployments
    must not borrow another workload's cloud identity."""
    name = sdd.spec.engine.service_account_name
    if name is None or labels.get(REFERABLE_LABEL) == "true":
        return None
    return (
        f"spec.engine.serviceAccountName: ServiceAccount {name!r} lacks the label"
        f" {REFERABLE_LABEL}=true that lets resources run pods as it: label it (`kubectl label"
        f" serviceaccount {name} {REFERABLE_LABEL}=true`) if this resource may use it"
    )


def _too_large(field: str, size: str, limit: str, flag: str) -> str | None:
    try:
        if quantity_bytes(size) <= quantity_bytes(limit):
            return None
    except ValueError as exc:
        return f"{field}: {exc}"
    return f"{field}: {size} is over this operator's limit of {limit}: ask for less (or {flag})"


def violations(
    sdd: api.SpecDecodeDeployment, policy: Policy, default_images: tuple[str, ...] = ()
) -> list[str]:
    """One line per field the policy refuses, naming the field and the fix. Secrets' labels
    are checked apart (secret_violations): they need the cluster."""
    out = []
    for field, image in (
        ("spec.engine.image", sdd.spec.engine.image),
        ("spec.router.image", sdd.spec.router.image),
    ):
        if image is None or image in default_images:
            continue
        if not image_allowed(image, policy.allowed_image_prefixes):
            allowed = ", ".join(policy.allowed_image_prefixes)
            out.append(
                f"{field}: {image!r} is not under the images this operator allows ({allowed}):"
                " use one of them, or leave the field unset for the default image"
            )
    if not policy.allow_env_secrets:
        for i, var in enumerate(sdd.spec.engine.env):
            value_from = var.get("valueFrom") if isinstance(var, dict) else None
            if isinstance(value_from, dict) and "secretKeyRef" in value_from:
                out.append(
                    f"spec.engine.env[{i}].valueFrom.secretKeyRef: this operator lets resources"
                    " read only the Secrets their own fields name (apiKeySecretRef,"
                    " model.source.hub.tokenSecretRef, router.clientAuth): use one of them, or"
                    " ask its administrator for --allow-env-secrets"
                )
    engine = sdd.spec.engine
    for i, arg in enumerate(engine.extra_args):
        if reserved_engine_arg(arg):
            out.append(
                f"spec.engine.extraArgs[{i}]: {arg.split('=')[0]!r} sets (or abbreviates) a flag"
                " the operator renders from the spec or refuses: use the matching spec field"
            )
    for i, var in enumerate(engine.env):
        name = var.get("name") if isinstance(var, dict) else None
        if isinstance(name, str) and (name in RESERVED_ENV_NAMES or name.startswith("LD_")):
            out.append(
                f"spec.engine.env[{i}].name: {name!r} is set by the operator or loads code from"
                " elsewhere: remove it (the key and remote code have their own fields)"
            )
    placement = sdd.spec.placement
    allowed_keys = policy.allowed_toleration_keys
    for where, tolerations in (
        ("spec.placement.tolerations", placement.tolerations),
        ("spec.router.tolerations", sdd.spec.router.tolerations),
    ):
        for i, toleration in enumerate(tolerations):
            key = toleration.get("key") if isinstance(toleration, dict) else None
            if "*" in allowed_keys or (key and key in allowed_keys):
                continue
            what = f"the taint {key!r}" if key else "every taint"
            out.append(
                f"{where}[{i}]: tolerating {what} is not allowed (this operator allows"
                f" {', '.join(allowed_keys) or 'none'}): remove it, or ask its administrator"
                " for --allowed-toleration-key"
            )
    runtime = placement.runtime_class_name
    if runtime is not None and runtime not in policy.allowed_runtime_classes:
        out.append(
            f"spec.placement.runtimeClassName: {runtime!r} is not allowed (this operator allows"
            f" {', '.join(policy.allowed_runtime_classes) or 'none'}): use one of them"
        )
    priority = placement.priority_class_name
    listed = policy.allowed_priority_classes
    if priority is not None and (
        priority not in listed if listed else priority.startswith("system-")
    ):
        out.append(
            f"spec.placement.priorityClassName: {priority!r} is not allowed (system classes,"
            " and any class outside --allowed-priority-class when that is set): use another"
        )
    problem = _too_large(
        "spec.engine.shmSize", engine.shm_size, policy.max_shm_size, "--max-shm-size"
    )
    if problem:
        out.append(problem)
    source = sdd.spec.model.source
    if source.type == "hub":
        hub = source.hub or api.HubSource()
        reason = hub_endpoint_problem(hub.endpoint, policy.allowed_hub_endpoints)
        if reason:
            out.append(
                f"spec.model.source.hub.endpoint: {reason}: use an allowed hub, or ask its"
                " administrator for --allowed-hub-endpoint"
            )
        problem = _too_large(
            "spec.model.source.hub.cacheSize", hub.cache_size, policy.max_cache_size,
            "--max-cache-size",
        )  # fmt: skip
        if problem:
            out.append(problem)
    if source.type == "hostPath" and source.host_path is not None:
        path = source.host_path.path
        if not policy.allowed_host_path_prefixes:
            out.append(
                "spec.model.source.hostPath.path: this operator allows no hostPath weights"
                " (its administrator can allow directories with --allowed-host-path-prefix):"
                " use a pvc source"
            )
        elif not host_path_allowed(path, policy.allowed_host_path_prefixes):
            allowed = ", ".join(policy.allowed_host_path_prefixes)
            out.append(
                f"spec.model.source.hostPath.path: {path!r} is not under the directories this"
                f" operator allows ({allowed}): use one of them, or a pvc source"
            )
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The policy's command-line options, shared by `specgate operator` and `specgate render`
    so that render prints what the operator would create."""
    default = Policy()
    group = parser.add_argument_group("policy (what resources may do)")
    group.add_argument(
        "--allowed-image-prefix",
        action="append",
        default=[],
        metavar="PREFIX",
        help="images resources may name start with one of these (repeatable; none: any image)",
    )
    group.add_argument(
        "--allowed-host-path-prefix",
        action="append",
        default=[],
        metavar="DIR",
        help="node directories hostPath weights may mount (repeatable; none: no hostPath)",
    )
    group.add_argument(
        "--allow-env-secrets",
        action="store_true",
        help="let spec.engine.env read Secrets (secretKeyRef); off: only the Secrets a "
        "resource's own fields name",
    )
    group.add_argument(
        "--allowed-hub-endpoint",
        action="append",
        default=None,
        metavar="URL",
        help="hubs hub weights may come from (repeatable; default: "
        + ", ".join(default.allowed_hub_endpoints)
        + ")",
    )
    group.add_argument(
        "--allowed-toleration-key",
        action="append",
        default=None,
        metavar="KEY",
        help="taint keys engine pods may tolerate (repeatable; '*': any, including a "
        "toleration of every taint; default: " + ", ".join(default.allowed_toleration_keys) + ")",
    )
    group.add_argument(
        "--allowed-runtime-class",
        action="append",
        default=None,
        metavar="NAME",
        help="RuntimeClasses engine pods may name (repeatable; default: "
        + ", ".join(default.allowed_runtime_classes)
        + ")",
    )
    group.add_argument(
        "--allowed-priority-class",
        action="append",
        default=[],
        metavar="NAME",
        help="PriorityClasses engine pods may name (repeatable; none: any but system-*)",
    )
    group.add_argument("--max-shm-size", default=default.max_shm_size, metavar="QUANTITY")
    group.add_argument("--max-cache-size", default=default.max_cache_size, metavar="QUANTITY")
    group.add_argument(
        "--allow-unlabelled-secrets",
        action="store_true",
        help=f"let resources name Secrets without the label {REFERABLE_LABEL}=true",
    )


def from_arguments(args: argparse.Namespace) -> Policy:
    """The Policy the options of add_arguments give; ValueError names a bad one."""
    default = Policy()
    return Policy(
        allowed_image_prefixes=tuple(args.allowed_image_prefix),
        allowed_host_path_prefixes=tuple(args.allowed_host_path_prefix),
        allow_env_secrets=args.allow_env_secrets,
        allowed_hub_endpoints=tuple(args.allowed_hub_endpoint or default.allowed_hub_endpoints),
        allowed_toleration_keys=tuple(
            args.allowed_toleration_key or default.allowed_toleration_keys
        ),
        allowed_runtime_classes=tuple(
            args.allowed_runtime_class or default.allowed_runtime_classes
        ),
        allowed_priority_classes=tuple(args.allowed_priority_class),
        max_shm_size=args.max_shm_size,
        max_cache_size=args.max_cache_size,
        allow_unlabelled_secrets=args.allow_unlabelled_secrets,
    )


__all__ = [
    "REFERABLE_LABEL",
    "Policy",
    "add_arguments",
    "from_arguments",
    "host_path_allowed",
    "hub_endpoint_problem",
    "image_allowed",
    "quantity_bytes",
    "reserved_engine_arg",
    "secret_references",
    "secret_violations",
    "service_account_violation",
    "violations",
]
