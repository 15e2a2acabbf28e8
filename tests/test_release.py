"""The release (scripts/release.py, `make release`): one version everywhere, a changelog
section for it, and the chart pushed to an OCI registry and pulled back as it was packaged
(an in-memory registry from go-containerregistry, installed by `make tools`)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from specgate import SGLANG_VERSION, __version__
from specgate_operator import render

from .conftest import ROOT
from .tools import load_script, run, tool

release = load_script("release")


def test_every_place_names_the_packages_version() -> None:
    assert release.check() == __version__
    # The code's default images follow the installed package, and so the chart's values.
    opts = render.RenderOptions()
    assert opts.router_image.endswith(f":{__version__}")
    assert opts.engine_image.endswith(f":{__version__}-sglang{SGLANG_VERSION}")
    values = yaml.safe_load((ROOT / "charts/specgate/values.yaml").read_text())
    assert values["operator"]["engineImage"] == opts.engine_image
    done = subprocess.run([sys.executable, "-m", "specgate.cli", "--version"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.stdout.strip() == f"specgate {__version__}"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """The files a release reads, copied."""
    for name in ("pyproject.toml", "CHANGELOG.md", "charts/specgate"):
        source, target = ROOT / name, tmp_path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy(source, target)
    return tmp_path


def test_a_version_is_set_everywhere_and_a_release_needs_its_changelog_section(
    tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert release.main(["--root", str(tree), "set-version", "0.2.0-rc.1"]) == 0
    chart = yaml.safe_load((tree / "charts/specgate/Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == ("0.2.0-rc.1", "0.2.0-rc.1")
    values = (tree / "charts/specgate/values.yaml").read_text()
    assert f"worker:0.2.0-rc.1-sglang{SGLANG_VERSION}" in values
    capsys.readouterr()
    assert release.main(["--root", str(tree), "check"]) == 1
    assert capsys.readouterr().err == (
        "error: CHANGELOG.md: no '## [0.2.0-rc.1]' section: say what the release changes\n"
    )
    with (tree / "CHANGELOG.md").open("a") as changelog:
        changelog.write("\n## [0.2.0-rc.1]\n\n- A change.\n")
    assert release.main(["--root", str(tree), "check"]) == 0
    # A place edited by hand is named, with the fix.
    path = tree / "charts/specgate/Chart.yaml"
    path.write_text(path.read_text().replace('appVersion: "0.2.0-rc.1"', 'appVersion: "0.1.9"'))
    assert release.main(["--root", str(tree), "check"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: charts/specgate/Chart.yaml: version 0.1.9, pyproject.toml")
    assert "set-version 0.2.0-rc.1" in err
    assert release.main(["--root", str(tree), "set-version", "two"]) == 1
    assert "MAJOR.MINOR.PATCH" in capsys.readouterr().err


@pytest.fixture
def registry() -> Iterator[str]:
    server = subprocess.Popen([tool("oci-registry"), "--addr", "127.0.0.1:0"],
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert server.stderr is not None
        first = server.stderr.readline()
        assert first.startswith("listening on "), first
        yield first.split()[-1]
    finally:
        server.terminate()
        server.wait(10)


def test_make_release_pushes_the_chart_and_it_pulls_back_as_packaged(
    registry: str, tmp_path: Path
) -> None:
    dist = tmp_path / "dist"
    done = subprocess.run(
        ["make", "-s", "release", f"DIST={dist}", f"REGISTRY=oci://{registry}/charts",
         "PLAIN_HTTP=1", f"IMAGES={registry}/specgate"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    archive = dist / f"specgate-{__version__}.tgz"
    assert f"Pushed: {registry}/charts/specgate:{__version__}" in done.stdout
    # The image `make images` built, pushed under the same version: the registry serves the
    # manifest that the archive holds.
    for name in ("specgate", "engine-sim"):
        with tarfile.open(dist / "images" / f"{name}-{__version__}.oci.tar") as image:
            index = json.loads(image.extractfile("index.json").read())  # type: ignore[union-attr]
        built = index["manifests"][0]["digest"]
        image_ref = f"{registry}/specgate/{name}:{__version__}"
        assert f"pushed {image_ref}@{built}" in done.stdout
        served = run(tool("crane"), "digest", image_ref, "--insecure").stdout.strip()
        assert served == built
    pulled = tmp_path / "pulled"
    pulled.mkdir()
    run(tool("helm"), "pull", f"oci://{registry}/charts/specgate", "--version", __version__,
        "--plain-http", "--destination", str(pulled))  # fmt: skip
    (copy,) = pulled.glob("*.tgz")
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    assert hashlib.sha256(copy.read_bytes()).hexdigest() == digest
    with tarfile.open(copy) as tar:
        names = tar.getnames()
        chart_file = tar.extractfile("specgate/Chart.yaml")
        assert chart_file is not None
        assert yaml.safe_load(chart_file)["appVersion"] == __version__
    assert "specgate/README.md" in names and "specgate/values.schema.json" in names
    assert not any(n.endswith(".gotmpl") for n in names)
    # What a user installs from the registry renders.
    out = run(tool("helm"), "template", "sg", f"oci://{registry}/charts/specgate",
              "--version", __version__, "--plain-http")  # fmt: skip
    assert "kind: Deployment" in out.stdout
