"""`make images` (scripts/build_image.py): the specgate image built without a container engine,
as the Dockerfile describes it, reproducible, and running: its `specgate` is run inside the
image's own root filesystem (a chroot, as its non-root user).

Not covered here: a container runtime running the image (no kubelet or containerd on this
machine yet), and the engine's worker image (SGLang and CUDA; built with docker)."""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from specgate import __version__, api, contract
from specgate_operator import render
from specgate_sim.cluster import free_ports

from .conftest import ROOT, build_images
from .tools import load_script, wait_until_answers

pytestmark = pytest.mark.integration


build_image = load_script("build_image")


@pytest.fixture(scope="module")
def image(built_images: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The session's build and a second one from the same inputs."""
    again = build_images(tmp_path_factory.mktemp("two"))
    return {
        "archive": built_images["specgate"][0], "digest": built_images["specgate"][1],
        "again": again["specgate"][1], "log": built_images["log"],
        "standin": built_images["engine-sim"][0],
        "standin_again": (built_images["engine-sim"][1], again["engine-sim"][1]),
    }  # fmt: skip


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
    one, two = image["standin_again"]
    assert one == two
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


def _unpack(archive: Path, root: Path) -> Path:
    _, _, layers = _parts(archive)
    for layer in layers:
        with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
            tar.extractall(root, filter="tar")
    return root


@pytest.fixture(scope="module")
def rootfs(image: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _unpack(image["archive"], tmp_path_factory.mktemp("rootfs"))


def _chroot(root: Path, *args: str) -> list[str]:
    """`args` run in the image's root filesystem as its user."""
    assert os.geteuid() == 0, "running the image's root filesystem needs root (chroot)"
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    return [chroot, "--userspec=65532:65532", str(root), *args]


IMAGE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}


def _in_image(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_chroot(root, *args), capture_output=True, text=True, timeout=120,
                          env=IMAGE_ENV)  # fmt: skip


def _files(root: Path) -> dict[str, int]:
    return {str(p): p.lstat().st_mtime_ns for p in root.rglob("*") if "tmp" not in p.parts}


def test_the_images_specgate_runs_as_its_user_with_nothing_written(rootfs: Path) -> None:
    before = _files(rootfs)
    version = _in_image(rootfs, "specgate", "--version")
    assert version.returncode == 0 and version.stdout.strip() == f"specgate {__version__}"
    # The user has a name (kopf asks getpass for one; a nameless uid crashed the operator pod).
    user = _in_image(rootfs, "python3", "-c", "import getpass; print(getpass.getuser())")
    assert user.stdout.strip() == "specgate", user.stderr[-500:]
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


def test_the_engine_stand_in_serves_the_command_line_the_operator_renders(
    image: dict[str, Any], tmp_path: Path
) -> None:
    """The stand-in image run with the engine container's command and arguments as the operator
    renders them: a pod that answers like a patched SGLang engine (key, model, metrics)."""
    root = _unpack(image["standin"], tmp_path / "rootfs")
    _, config, _ = _parts(image["standin"])
    port = free_ports(1)[0]
    doc = yaml.safe_load((ROOT / "examples" / "tiny-single-gpu.yaml").read_text())
    doc["spec"]["engine"] = {**doc["spec"].get("engine", {}), "port": port}
    (deployment,) = [
        m for m in render.render(api.SpecDecodeDeployment.model_validate(doc), api_key="k")
        if m["kind"] == "Deployment" and m["metadata"]["name"].endswith("-engine")
    ]  # fmt: skip
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == config["config"]["Entrypoint"]
    env = {**IMAGE_ENV, "SGLANG_API_KEY": "k", "SPECGATE_SIM_TIME_SCALE": "20"}
    pod = subprocess.Popen(_chroot(root, *container["command"], *container["args"]), env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answers(url + "/health")
        auth = {"Authorization": "Bearer k"}
        assert httpx.get(url + "/v1/models", timeout=5).status_code == 401  # the key is needed
        models = httpx.get(url + "/v1/models", headers=auth, timeout=5).json()
        assert [m["id"] for m in models["data"]] == ["llama-8b"]
        metrics = httpx.get(url + "/metrics", timeout=5).text
        (gauge,) = [line for line in metrics.splitlines()
                    if line.startswith(contract.METRIC_THRESHOLD + "{")]  # fmt: skip
        assert gauge.endswith(" 8.0")  # the rendered --speculative-disable-batch-threshold
        chat = httpx.post(url + "/v1/chat/completions", headers=auth, timeout=30, json={
            "model": "llama-8b", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5})  # fmt: skip
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 5
    finally:
        pod.terminate()
        out, _ = pod.communicate(timeout=30)
    assert "Traceback" not in out, out[-3000:]
