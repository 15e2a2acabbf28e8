"""The command line: crd, render and install-manifests as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
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


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "no SpecDecodeDeployment in it"),
        ("# only a comment\n", "no SpecDecodeDeployment in it"),
        ("kind: SpecDecodeDeployment\nmetadata: {name: x}\n", "apiVersion: Invalid value: None"),
        (
            "apiVersion: v1\nkind: SpecDecodeDeployment\nmetadata: {name: x}\n",
            "apiVersion: Invalid value: 'v1': use specgate.io/v1alpha1",
        ),
        (
            "apiVersion: specgate.io/v1alpha1\nkind: SpecDecodeDeployment\nspec: {}\n",
            "metadata.name: Required value",
        ),
        (
            "apiVersion: specgate.io/v1alpha1\nkind: SpecDecodeDeployment\nmetadata: x\n",
            "metadata.name: Required value",
        ),
        (
            "apiVersion: specgate.io/v1alpha1\nkind: SpecDecodeDeployment\n"
            "metadata: {name: Bad_Name}\n",
            "metadata.name: Invalid value: 'Bad_Name': lowercase letters",
        ),
        (
            "apiVersion: specgate.io/v1alpha1\nkind: SpecDecodeDeployment\n"
            f"metadata: {{name: {'a' * 60}}}\n",
            "over 63: use at most 49",
        ),
        ("[1, 2]\n", "document 1 is a list, not a SpecDecodeDeployment"),
        ("a: [\n", "error: "),
    ],
)
def test_render_answers_bad_input_with_one_line_and_exit_2(
    tmp_path: Path, text: str, expected: str
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    result = specgate("render", "-f", str(bad))
    assert result.returncode == 2, result
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert all(line.startswith("error: ") for line in result.stderr.splitlines())


def test_a_name_of_the_longest_allowed_length_renders_children_within_63() -> None:
    text = EXAMPLES[1].read_text()
    doc = yaml.safe_load(text)
    doc["metadata"]["name"] = "a" * 49
    result = specgate("render", "-f", "-", stdin=yaml.safe_dump(doc))
    assert result.returncode == 0, result.stderr
    names = [d["metadata"]["name"] for d in yaml.safe_load_all(result.stdout)]
    assert max(len(n) for n in names) <= 63
    from specgate_operator.render import names as child_names

    assert max(len(n) for n in child_names("a" * 49).values()) == 63  # the Lease's name


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--pods", "0"], "--pods must be 1-64, got 0"),
        (["--threshold", "-3"], "--threshold must be 0-4096, got -3"),
        (["--pods", "two"], "--pods takes a whole number"),
        (["--time-scale", "0"], "--time-scale must be a number > 0"),
        (["--time-scale", "nan"], "--time-scale must be a number > 0"),
    ],
)
def test_up_refuses_bad_arguments_with_one_line(args: list[str], expected: str) -> None:
    result = specgate("up", *args)
    assert result.returncode == 2 and expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_client_key_prints_the_key_once_and_an_entry_the_router_accepts(tmp_path: Path) -> None:
    import yaml

    from specgate_router import client_auth

    done = subprocess.run(
        [sys.executable, "-m", "specgate.cli", "client-key", "team-a", "--classes",
         "throughput", "--requests-per-minute", "120"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    key = done.stderr.strip().rsplit(" ", 1)[-1]
    assert key.startswith(client_auth.KEY_PREFIX) and key not in done.stdout
    path = tmp_path / "keys.yaml"
    path.write_text(done.stdout)
    (entry,) = client_auth.read_keys_file(str(path))
    assert entry.classes == ["throughput"] and entry.requests_per_minute == 120
    assert entry.admin is False
    assert client_auth.KeyRing([entry]).identify(key).name == "team-a"
    assert yaml.safe_load(done.stdout)[0]["sha256"] == client_auth.hash_key(key)
    bad = subprocess.run(
        [sys.executable, "-m", "specgate.cli", "client-key", "team a"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "name" in bad.stderr
    admin = subprocess.run(
        [sys.executable, "-m", "specgate.cli", "client-key", "ops", "--admin"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert admin.returncode == 0 and yaml.safe_load(admin.stdout)[0]["admin"] is True


HOST_ROOT = (
    "apiVersion: specgate.io/v1alpha1\nkind: SpecDecodeDeployment\nmetadata: {name: x}\n"
    "spec:\n  model: {path: m, source: {type: hostPath, hostPath: {path: /}}}\n"
    "  speculative: {draftModel: {path: d}}\n"
)


def test_render_applies_the_operators_policy_with_its_options(tmp_path: Path) -> None:
    """What render prints is what the operator creates: a resource its policy refuses prints
    nothing and names the field; the operator's option that allows it lets render print it."""
    resource = tmp_path / "root.yaml"
    resource.write_text(HOST_ROOT)
    refused = specgate("render", "-f", str(resource))
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.startswith("error: SpecDecodeDeployment 'x': spec.model.source.hostPath")
    allowed = specgate("render", "-f", str(resource), "--allowed-host-path-prefix=/")
    assert allowed.returncode == 0, allowed.stderr
    assert "hostPath" in allowed.stdout


def test_render_notes_the_secrets_the_operator_needs_labelled(tmp_path: Path) -> None:
    resource = tmp_path / "key.yaml"
    resource.write_text(
        HOST_ROOT.replace("hostPath, hostPath: {path: /}", "image")
        + "  apiKeySecretRef: {name: team-key}\n"
    )
    result = specgate("render", "-f", str(resource))
    assert result.returncode == 0, result.stderr
    assert "Secret 'team-key'" in result.stderr and "specgate.io/referable=true" in result.stderr
    quiet = specgate("render", "-f", str(resource), "--allow-unlabelled-secrets")
    assert quiet.returncode == 0 and quiet.stderr == ""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a: " + "[" * 20_000, "line 1, column 67: nested deeper than 64 levels"),
        (
            "a: &a ["
            + ",".join(["x"] * 9)
            + "]\n"
            + "".join(
                f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 9) + "]\n"
                for i in range(8)
            ),
            "expands to more than",
        ),
        ("kind: SpecDecodeDeployment\nspec: [1,\n b: c: d\n", "line 3, column"),
    ],
)
def test_render_refuses_hostile_yaml_in_one_line(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "hostile.yaml"
    path.write_text(text)
    result = specgate("render", "-f", str(path))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: {path}: ") and expected in result.stderr


def test_render_refuses_a_namespace_that_is_not_a_name() -> None:
    result = specgate("render", "-f", str(EXAMPLES[0]), "-n", "Bad NS!")
    assert result.returncode == 2 and result.stderr.startswith("error: --namespace: 'Bad NS!'")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["crd", "--check", "/nonexistent/crd.yaml"], "/nonexistent/crd.yaml"),
        (["install-manifests", "--check", "/nonexistent/op.yaml"], "/nonexistent/op.yaml"),
        (["dashboards", "--out", "/proc/specgate/dashboards"], "/proc/specgate"),
        (["sim", "--port", "99999"], "--port must be 1-65535"),
        (["sim", "--max-running-requests", "-1"], "--max-running-requests must be"),
        (["sim", "--profile", "nope"], "unknown profile 'nope'"),
        (["router", "--port", "99999"], "--port must be 1-65535"),
        (
            ["router", "--backend", "http://a:1", "--engine-api-key-file", "/nonexistent"],
            "key-file",
        ),
        (["up", "--profile", "nope"], "unknown profile 'nope'"),
        (["demo", "--profile", "nope", "--no-plot"], "unknown profile 'nope'"),
        (["up", "--host", "999.1.1.1"], "--host takes an IP address or host name"),
        (["demo", "--duration", "-5"], "--duration must be a number > 0"),
    ],
)
def test_a_malformed_invocation_is_one_line_and_a_non_zero_exit(
    args: list[str], expected: str
) -> None:
    result = specgate(*args)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert expected in last and "error" in last, result.stderr


def test_the_engine_key_is_never_taken_from_the_command_line() -> None:
    """Every process list shows a command line: the router takes the key from a file or the
    environment only, and a key given as a flag value is neither used nor echoed."""
    result = specgate("router", "--backend", "http://a:1", "--engine-api-key", "sk-visible-key")
    assert result.returncode == 2 and "sk-visible-key" not in result.stderr, result.stderr


def test_a_profile_file_of_the_wrong_shape_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "profile.json"
    bad.write_text('{"name": "x", "target": 5}')
    for command in ("sim", "up"):
        result = specgate(command, "--profile", str(bad))
        assert result.returncode != 0 and "Traceback" not in result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: --profile: "), result.stderr


def test_the_operator_without_a_cluster_is_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "specgate.cli", "operator"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "no")},
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: no in-cluster account and no kubeconfig")
    assert result.stderr.count("\n") == 1
