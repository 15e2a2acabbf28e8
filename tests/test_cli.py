"""The command line: crd, render and install-manifests as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from .conftest import EXAMPLES, ROOT


def specgate(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "specgate.cli", *args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=60,
        cwd=ROOT,
    )


def test_crd_check_passes_on_the_committed_file() -> None:
    assert specgate("crd", "--check", "crds/specdecodedeployments.specgate.io.yaml").returncode == 0


def test_crd_check_fails_on_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "crd.yaml"
    stale.write_text("# old\n")
    result = specgate("crd", "--check", str(stale))
    assert result.returncode == 1 and "stale" in result.stderr


def test_render_prints_valid_yaml_for_the_examples() -> None:
    result = specgate("render", "-f", str(EXAMPLES[0]))
    assert result.returncode == 0, result.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(result.stdout)]
    assert "Deployment" in kinds and "NetworkPolicy" in kinds


def test_render_rejects_a_bad_resource_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: specgate.io/v1alpha1\nkind: SpecDecodeDeployment\nmetadata: {name: x}\n"
        "spec:\n  model: {path: m}\n  speculative:\n    draftModel: {path: d}\n"
        "    numSteps: 3\n    numDraftTokens: 7\n"
    )
    result = specgate("render", "-f", str(bad))
    assert result.returncode == 2
    assert "spec.speculative" in result.stderr and "numSteps + 1" in result.stderr
    assert result.stdout == ""


def test_render_rejects_other_kinds(tmp_path: Path) -> None:
    other = tmp_path / "pod.yaml"
    other.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n")
    result = specgate("render", "-f", str(other))
    assert result.returncode == 2 and "not a SpecDecodeDeployment" in result.stderr


def test_render_reads_stdin() -> None:
    result = specgate("render", "-f", "-", stdin=EXAMPLES[1].read_text())
    assert result.returncode == 0 and "kind: Deployment" in result.stdout
