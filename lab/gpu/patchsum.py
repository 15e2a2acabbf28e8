"""The patches' checksum, as run-on-gpu.sh computes it (`cat worker-image/patches/*.patch |
sha256sum`): GPU results record it, so a report can tell which patch a run measured."""

from __future__ import annotations

import hashlib
from pathlib import Path

PATCHES = Path(__file__).resolve().parents[2] / "worker-image" / "patches"


def patch_sha256(patches: Path = PATCHES) -> str:
    digest = hashlib.sha256()
    for path in sorted(patches.glob("*.patch")):
        digest.update(path.read_bytes())
    return digest.hexdigest()
