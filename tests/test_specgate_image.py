"""The specgate image (the root Dockerfile), checked without a Docker engine: the wheel it builds
from exactly the paths it copies holds every package and the `specgate` command, runs from the
wheel alone, and the image's user is the one the chart and the plain manifests run it as."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"


def _build_stage_copies() -> list[str]:
    """The sources of the build stage's COPY lines (the wheel is built from these alone)."""
    build = DOCKERFILE.read_text().split("\nFROM ", 2)[1]
    sources = []
    for line in build.splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            sources += line.split()[1:-1]
    return sources


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    context = tmp_path_factory.mktemp("context")
    for source in _build_stage_copies():
        path = ROOT / source.rstrip("/")
        if path.is_dir():
            shutil.copytree(
                path,
                context / path.name,
                ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
            )
        else:
            shutil.copy(path, context / path.name)
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(context)],
        check=True,
        timeout=300,
    )
    (built,) = out.glob("specgate-*.whl")
    return built


def test_the_image_wheel_holds_every_package_and_the_command(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"specgate", "specgate_operator", "specgate_router", "specgate_sim"}
    assert any(n.startswith("specgate_sim/profiles/") and n.endswith(".json") for n in names)
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert re.search(r"^specgate = specgate\.cli:main$", text, re.M), text
    # pyproject.toml declares Apache-2.0; the image ships its text.
    assert any(n.endswith("LICENSE") and ".dist-info/" in n for n in names), names


def test_the_image_runs_the_operator_and_router_commands_from_the_wheel_alone(
    wheel: Path, tmp_path: Path
) -> None:
    """Installed on its own (no repository on the path), the wheel answers the commands the
    chart and the operator's router Deployments run."""
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    code = "\n".join(
        [
            "import sys, specgate_router",
            f"assert specgate_router.__file__.startswith({str(target)!r}), "
            "specgate_router.__file__",
            "from specgate.cli import main",
            "sys.argv = ['specgate', *sys.argv[1:]]",
            "main()",
        ]
    )
    for command in (["operator", "--help"], ["router", "--help"]):
        done = subprocess.run(
            [sys.executable, "-c", code, *command],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "usage" in done.stdout.lower()


def test_the_package_without_extras_runs_every_command_a_user_or_pod_runs(
    wheel: Path, tmp_path: Path
) -> None:
    """`pip install specgate` (no extras) in a fresh virtual environment: everything render,
    the operator and the router import is a runtime dependency. The one command that needs
    the dev extras says so in one line."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [
        str(venv / "bin" / "python"),
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
    ]
    subprocess.run([*pip, str(wheel)], check=True, timeout=600)
    specgate = str(venv / "bin" / "specgate")
    example = str(ROOT / "examples" / "tiny-single-gpu.yaml")
    for command in (
        ["--help"],
        ["render", "-f", example],
        ["crd"],
        ["install-manifests"],
        ["client-key", "team-a"],
        ["operator", "--help"],
        ["router", "--help"],
        ["sim", "--help"],
        ["up", "--help"],
    ):
        done = subprocess.run(
            [specgate, *command], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, (command, done.stderr[-2000:])
        assert "Traceback" not in done.stderr, (command, done.stderr[-2000:])
    rendered = subprocess.run(
        [specgate, "render", "-f", example], capture_output=True, text=True, timeout=120
    )
    assert "kind: Deployment" in rendered.stdout
    extras = subprocess.run(
        [specgate, "dashboards", "--out", str(tmp_path / "d")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert extras.returncode != 0 and "Traceback" not in extras.stderr, extras.stderr[-2000:]
    assert extras.stderr.strip().count("\n") == 0 and "dev" in extras.stderr, extras.stderr


def test_the_image_user_is_the_one_its_pods_run_as() -> None:
    (user,) = re.findall(r"^USER (\d+):(\d+)$", DOCKERFILE.read_text(), re.M)
    manifests = list(yaml.safe_load_all((ROOT / "deploy" / "operator.yaml").read_text()))
    (operator,) = [m for m in manifests if m and m["kind"] == "Deployment"]
    (container,) = operator["spec"]["template"]["spec"]["containers"]
    assert container["command"][0] == "specgate"
    assert str(container["securityContext"]["runAsUser"]) == user[0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    values = yaml.safe_load((ROOT / "charts" / "specgate" / "values.yaml").read_text())
    pod = values["operator"]["podSecurityContext"]
    assert (str(pod["runAsUser"]), str(pod["runAsGroup"])) == user


def test_the_docker_context_lets_in_what_the_build_copies() -> None:
    """.dockerignore excludes everything but the build's sources: a COPY of an excluded path
    would fail the build."""
    allowed = {
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    assert {s.rstrip("/") for s in _build_stage_copies()} <= allowed


def test_both_dockerfiles_pass_buildkits_own_checks(tmp_path: Path) -> None:
    """buildkit's Dockerfile checks (what `docker build --check` runs: parse errors, casing,
    shell-form CMD, undefined variables, ...), built from its Go module by `make tools`; base
    images are not pulled (no registry here), so their variables read as undefined. A file
    with faults shows the checker reports them."""
    from .tools import tool

    check = tool("dockerfile-check")
    worker = ROOT / "worker-image" / "Dockerfile"
    clean = subprocess.run(
        [check, str(DOCKERFILE), str(worker)], capture_output=True, text=True, timeout=60
    )
    assert clean.returncode == 0 and clean.stdout == "", clean.stdout + clean.stderr
    faulty = tmp_path / "Dockerfile"
    faulty.write_text("FROM python:3.11-slim AS Build\nrun pip --version\nCMD specgate --help\n")
    found = subprocess.run([check, str(faulty)], capture_output=True, text=True, timeout=60)
    assert found.returncode == 1
    for rule in ("StageNameCasing", "ConsistentInstructionCasing", "JSONArgsRecommended"):
        assert rule in found.stdout, found.stdout
