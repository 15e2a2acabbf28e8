"""What the cluster's administrator lets a SpecDecodeDeployment do, beyond what its schema
allows: the images its pods may run and the node directories it may mount.

A tenant who may create SpecDecodeDeployments but not pods must not get, through the
operator, what a pod spec of their own would give: any image, or a node's root filesystem.
The operator checks every resource against its policy before rendering anything, and a
resource that breaks it gets no children and a `PolicyViolation` condition naming the field
and the fix. Pure: tested without a cluster.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from specgate import api

IMAGE_SEPARATORS = "/:@"


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

    def __post_init__(self) -> None:
        for prefix in self.allowed_host_path_prefixes:
            if not prefix.startswith("/") or ".." in prefix.split("/"):
                raise ValueError(
                    f"allowed host path prefix {prefix!r}: an absolute path without '..'"
                )
        for prefix in self.allowed_image_prefixes:
            if not prefix or any(c.isspace() for c in prefix):
                raise ValueError(f"allowed image prefix {prefix!r}: a non-empty image prefix")


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


def violations(
    sdd: api.SpecDecodeDeployment, policy: Policy, default_images: tuple[str, ...] = ()
) -> list[str]:
    """One line per field the policy refuses, naming the field and the fix."""
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
    source = sdd.spec.model.source
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


__all__ = ["Policy", "host_path_allowed", "image_allowed", "violations"]
