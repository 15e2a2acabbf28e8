"""`make images` (scripts/build_image.py): the specgate image built without a container engine,
as the Dockerfile describes it, reproducible, and running: its `specgate` is run inside the
image's own root filesystem (a chroot, as its non-root user).

Not covered here: a container runtime running the image (no kubelet or containerd on this
machine yet), and the engine's worker image (SGLang and CUDA; built with docker)."""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from specgate import __version__

from .conftest import ROOT

pytestmark = pytest.mark.integration


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"specgate_{name}", ROOT / "scripts" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_image = _load("build_image")


def _build(out: Path, cache: Path) -> tuple[Path, str, str]:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_image.py"), "--out", str(out),
         "--cache", str(cache), "--epoch", "1767225600"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    archive = out / f"specgate-{__version__}.oci.tar"
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith(f"{archive}: sha256:"), last
    return archive, last.split()[1].rstrip(","), done.stdout


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cache = ROOT / ".tools" / "image-cache"
    first = _build(tmp_path_factory.mktemp("one"), cache)
    second = _build(tmp_path_factory.mktemp("two"), cache)
    return {"archive": first[0], "digest": first[1], "again": second[1], "log": first[2]}


def _blob(tar: tarfile.TarFile, digest: str) -> bytes:
    member = tar.extractfile(f"blobs/sha256/{digest.removeprefix('sha256:')}")
    assert member is not None
    return member.read()


def _parts(archive: Path) -> tuple[dict[str, Any], dict[str, Any], list[bytes]]:
    with tarfile.open(archive) as tar:
        index = json.loads(tar.extractfile("index.json").read())  # type: ignore[union-attr]
        (entry,) = index["manifests"]
        manifest = json.loads(_blob(tar, entry["digest"]))
        config = json.loads(_blob(tar, manifest["config"]["digest"]))
        layers = [gzip.decompress(_blob(tar, layer["digest"])) for layer in manifest["layers"]]
    return entry, config, layers


def test_the_same_inputs_give_the_same_image(image: dict[str, Any]) -> None:
    assert image["digest"] == image["again"]
    entry, config, layers = _parts(image["archive"])
    assert entry["digest"] == image["digest"]
    # Each layer is what its diff_id says, and the archive names the image for containerd.
    assert config["rootfs"]["diff_ids"] == [build_image._digest(layer) for layer in layers]
    name = entry["annotations"]["io.containerd.image.name"]
    assert name == f"ghcr.io/specgate/specgate:{__version__}"
    print(image["log"])  # each step's time, and the size (shown with -s)


def test_the_image_is_what_the_dockerfile_describes(image: dict[str, Any]) -> None:
    _, config, _ = _parts(image["archive"])
    wanted = build_image.ImageConfig.from_dockerfile((ROOT / "Dockerfile").read_text())
    assert config["config"]["User"] == wanted.user == "65532:65532"
    assert config["config"]["Entrypoint"] == wanted.entrypoint == ["specgate"]
    assert config["config"]["Cmd"] == wanted.cmd
    env = dict(e.split("=", 1) for e in config["config"]["Env"])
    assert wanted.env.items() <= env.items() and env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert config["config"]["Labels"]["org.opencontainers.image.version"] == __version__


@pytest.fixture(scope="module")
def rootfs(image: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("rootfs")
    _, _, layers = _parts(image["archive"])
    for layer in layers:
        with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
            tar.extractall(root, filter="tar")
    return root


def _in_image(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert os.geteuid() == 0, "running the image's root filesystem needs root (chroot)"
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    return subprocess.run([chroot, "--userspec=65532:65532", str(root), *args],
                          capture_output=True, text=True, timeout=120, env=env)  # fmt: skip


def _files(root: Path) -> dict[str, int]:
    return {str(p): p.lstat().st_mtime_ns for p in root.rglob("*") if "tmp" not in p.parts}


def test_the_images_specgate_runs_as_its_user_with_nothing_written(rootfs: Path) -> None:
    before = _files(rootfs)
    version = _in_image(rootfs, "specgate", "--version")
    assert version.returncode == 0 and version.stdout.strip() == f"specgate {__version__}"
    example = rootfs / "tmp" / "resource.yaml"
    example.write_text((ROOT / "examples" / "tiny-single-gpu.yaml").read_text())
    rendered = _in_image(rootfs, "specgate", "render", "-f", "/tmp/resource.yaml")
    assert rendered.returncode == 0, rendered.stderr[-2000:]
    assert "kind: Deployment" in rendered.stdout
    # Every component the image runs imports from its byte code (the root filesystem is
    # read-only in the pods): the router, the operator, the simulator, the hub download.
    imports = (
        "import specgate_router.app, specgate_operator.main, specgate_sim.server, huggingface_hub"
    )
    found = _in_image(rootfs, "python3", "-c", imports)
    assert found.returncode == 0, found.stderr[-2000:]
    # The pods' root filesystem is read-only: nothing outside /tmp was made or changed.
    assert _files(rootfs) == before
