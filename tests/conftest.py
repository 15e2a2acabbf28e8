from __future__ import annotations

import copy
import importlib.util
import random
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from specgate import admission, crd
from specgate.engine_http import EngineHttp

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
KUBERNETES_VERSION = "1.29.0"  # oldest release we support (the chart's kubeVersion)


def load_module(path: Path, name: str) -> ModuleType:
    """A script that is not part of a package (lab/bench/, worker-image/) imported by its path;
    registered under `name` so its dataclasses can resolve their own annotations."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def free_port_base(count: int, offsets: Sequence[int] = ()) -> int:
    """A base on loopback from which `count` consecutive ports, and the base plus each of
    `offsets`, are free now: for tools that number their servers from a base (gpu_envelope.py
    --port-base), so that two test runs on one machine do not take each other's ports. Drawn
    below Linux's ephemeral range (32768 up), where an outgoing connection could take a port
    between this check and the server binding it."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20_000, 32_000)
        ports = [*range(base, base + count), *(base + offset for offset in offsets)]
        if all(_bindable(port) for port in ports):
            return base
    raise AssertionError(f"no {count} free consecutive loopback ports found")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


IMAGE_EPOCH = 1767225600


def build_images(out: Path) -> dict[str, Any]:
    """`make images` into `out` at a fixed source date (so two builds can be compared):
    {"specgate"|"engine-sim": (archive, digest), "log": its output}."""
    import subprocess

    from specgate import __version__

    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_image.py"), "--out", str(out),
         "--cache", str(ROOT / ".tools" / "image-cache"), "--epoch", str(IMAGE_EPOCH)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    built: dict[str, Any] = {"log": done.stdout}
    for name in ("specgate", "engine-sim"):
        archive = out / f"{name}-{__version__}.oci.tar"
        (line,) = [x for x in done.stdout.splitlines() if x.startswith(f"{archive}: sha256:")]
        built[name] = (archive, line.split()[1].rstrip(","))
    return built


@pytest.fixture(scope="session")
def built_images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`make images` once a session (a minute), for the image tests and the real node."""
    return build_images(tmp_path_factory.mktemp("images"))


@pytest.fixture(scope="session")
def crd_manifest() -> dict[str, Any]:
    return crd.crd()


@pytest.fixture(scope="session")
def schema(crd_manifest: dict[str, Any]) -> dict[str, Any]:
    return admission.crd_schema(crd_manifest)


def minimal_resource(**spec_overrides: Any) -> dict[str, Any]:
    """The smallest valid SpecDecodeDeployment, with top-level spec keys replaced."""
    spec: dict[str, Any] = {
        "model": {"path": "meta-llama/Llama-3.1-8B-Instruct"},
        "speculative": {"draftModel": {"path": "draft/eagle3-8b"}},
    }
    spec.update(copy.deepcopy(spec_overrides))
    return {
        "apiVersion": "specgate.io/v1alpha1",
        "kind": "SpecDecodeDeployment",
        "metadata": {"name": "demo", "namespace": "default"},
        "spec": spec,
    }


def load_example(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    return doc


@pytest.fixture
async def engine_http() -> AsyncIterator[EngineHttp]:
    """The engine HTTP client the router uses, for tests that talk the control contract."""
    client = EngineHttp(connect_timeout=5, read_timeout=30)
    try:
        yield client
    finally:
        await client.close()
