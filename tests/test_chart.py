"""The Helm chart, checked with the real helm binary and kubernetes-validate --strict."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from specgate_operator import install

from .conftest import KUBERNETES_VERSION, ROOT
from .tools import CHART, helm_template, run, tool

CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
MONITORING_KINDS = {"PodMonitor", "PrometheusRule", "ServiceMonitor"}


def rendered(values: Path | None = None, **kw: Any) -> list[dict[str, Any]]:
    files = (str(values),) if values else ()
    out = helm_template(*files, **kw).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.name)
def test_helm_lint_strict(values: Path) -> None:
    run(tool("helm"), "lint", "--strict", str(CHART), "-f", str(values))


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.name)
def test_rendered_manifests_are_valid_kubernetes(values: Path) -> None:
    docs = rendered(values)
    assert by_kind(docs, "Deployment")
    for doc in docs:
        if doc["kind"] in MONITORING_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            continue  # Prometheus Operator kinds are not in Kubernetes' schemas
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_ci_values_files_cover_the_scenarios() -> None:
    names = {p.name for p in CI_VALUES}
    assert {"default-values.yaml", "monitoring-values.yaml", "namespaced-values.yaml"} <= names


@pytest.mark.parametrize(
    ("setting", "field"),
    [
        ("operator.resyncSeconds=1", "operator.resyncSeconds"),
        ("operator.bogus=1", "Additional property bogus"),
        ("image.pullPolicy=Sometimes", "image.pullPolicy"),
        ("monitoring.prometheusRule.maxErrorRatio=2", "monitoring.prometheusRule.maxErrorRatio"),
        ("operator.watchNamespaces[0]=Not_A_Namespace", "operator.watchNamespaces.0"),
        ("monitoring.podMonitor.interval=often", "monitoring.podMonitor.interval"),
        ("operator.policy.allowedHostPathPrefixes[0]=models", "allowedHostPathPrefixes.0"),
        ("operator.policy.allowedHostPathPrefixes[0]=/mnt/../", "allowedHostPathPrefixes.0"),
    ],
)
def test_schema_rejects_bad_values_naming_the_field(setting: str, field: str) -> None:
    result = helm_template(sets=(setting,), check=False)
    assert result.returncode != 0
    assert field in result.stderr, result.stderr


def test_chart_crd_is_the_crd() -> None:
    chart_crd = (CHART / "files" / "specdecodedeployments.specgate.io.yaml").read_text()
    assert chart_crd == (ROOT / "crds" / "specdecodedeployments.specgate.io.yaml").read_text(), (
        "run `make chart-crd`"
    )


def test_the_chart_installs_upgrades_and_keeps_the_crd() -> None:
    """The CRD is a template, so `helm upgrade` brings a new schema; it carries Helm's keep
    policy (uninstall leaves it and every resource); crds.enabled=false leaves it to the user."""
    generated = yaml.safe_load(
        (ROOT / "crds" / "specdecodedeployments.specgate.io.yaml").read_text()
    )
    (crd,) = by_kind(rendered(), "CustomResourceDefinition")
    assert crd["spec"] == generated["spec"]
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    (loose,) = by_kind(rendered(sets=("crds.keep=false",)), "CustomResourceDefinition")
    assert "helm.sh/resource-policy" not in (loose["metadata"].get("annotations") or {})
    assert by_kind(rendered(sets=("crds.enabled=false",)), "CustomResourceDefinition") == []


def test_app_version_follows_the_package() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart["appVersion"] == version


def test_cluster_role_is_the_operators_rules() -> None:
    docs = rendered()
    (role,) = by_kind(docs, "ClusterRole")
    assert role["rules"] == install.OPERATOR_RULES
    # Beyond it, only the Lease the replicas elect their leader with, in their namespace.
    (election,) = by_kind(docs, "Role")
    assert election["rules"] == install.LEADER_ELECTION_RULES
    (binding,) = by_kind(docs, "RoleBinding")
    assert binding["roleRef"]["name"] == election["metadata"]["name"]
    assert binding["metadata"]["namespace"] == election["metadata"]["namespace"]
    (dep,) = by_kind(docs, "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--leader-election-namespace=$(POD_NAMESPACE)" in args
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"]["type"] == "RollingUpdate"
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]


def test_an_operator_limited_to_namespaces_gets_its_rights_only_there() -> None:
    """With operator.watchNamespaces, only namespace and CRD reads stay cluster-wide; the
    rest is a Role bound in each watched namespace."""
    docs = rendered(CHART / "ci" / "namespaced-values.yaml")
    (cluster_role,) = by_kind(docs, "ClusterRole")
    assert cluster_role["rules"] == install.CLUSTER_RULES
    roles = [r for r in by_kind(docs, "Role") if r["rules"] != install.LEADER_ELECTION_RULES]
    bindings = [b for b in by_kind(docs, "RoleBinding") if "leader" not in b["roleRef"]["name"]]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["llm-prod", "llm-staging"]
    assert all(r["rules"] == install.NAMESPACED_RULES for r in roles)
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["llm-prod", "llm-staging"]
    for binding in bindings:
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "llm-operator",
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "specgate-operator", "namespace": "specgate-system"}
        ]


def _operator_args(docs: list[dict[str, Any]]) -> list[str]:
    (dep,) = by_kind(docs, "Deployment")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["specgate"]
    args: list[str] = container["args"]
    return args


def test_values_become_operator_flags_the_cli_accepts() -> None:
    from specgate.cli import build_parser

    default = _operator_args(rendered())
    assert "--all-namespaces" in default
    namespaced = _operator_args(rendered(CHART / "ci" / "namespaced-values.yaml"))
    assert "--namespace=llm-prod" in namespaced and "--all-namespaces" not in namespaced
    assert "--no-service-monitor" in namespaced and "--verbose" in namespaced
    assert "--router-image=registry.example.com/specgate:0.1.0-rc1" in namespaced
    parsed = build_parser().parse_args(namespaced)
    assert parsed.namespace == ["llm-prod", "llm-staging"] and parsed.resync_seconds == 60
    assert parsed.allowed_image_prefix == ["registry.example.com/llm/"]
    assert parsed.allowed_host_path_prefix == ["/mnt/models"]
    assert parsed.allow_env_secrets is False
    allowing = _operator_args(rendered(sets=("operator.policy.allowEnvSecrets=true",)))
    assert build_parser().parse_args(allowing).allow_env_secrets is True
    assert "--allowed-host-path-prefix" not in " ".join(default)
    monitoring = _operator_args(rendered(CHART / "ci" / "monitoring-values.yaml"))
    assert "--metrics-namespace-label=kubernetes.io/metadata.name=monitoring" in monitoring
    build_parser().parse_args(monitoring)
    # One scrape path a pod: the chart's PodMonitors switch the operator's ServiceMonitors off.
    assert "--no-service-monitor" in monitoring and "--no-service-monitor" not in default
    labelled = _operator_args(
        rendered(sets=("operator.serviceMonitorLabels.release=kube-prometheus-stack",))
    )
    assert "--service-monitor-label=release=kube-prometheus-stack" in labelled
    parsed = build_parser().parse_args(labelled)
    assert parsed.service_monitor_label == ["release=kube-prometheus-stack"]


def test_operator_pod_is_locked_down() -> None:
    (dep,) = by_kind(rendered(), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["limits"]["memory"] == "512Mi"


def test_dashboards_ship_as_labelled_configmaps() -> None:
    docs = rendered(CHART / "ci" / "monitoring-values.yaml")
    maps = [d for d in by_kind(docs, "ConfigMap") if "dashboard" in d["metadata"]["name"]]
    from specgate import dashboards

    assert (
        len(maps) == len(list((CHART / "dashboards").glob("*.json"))) == len(dashboards.DASHBOARDS)
    )
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "specgate"
        assert cm["metadata"]["namespace"] == "monitoring"
        ((name, body),) = cm["data"].items()
        assert json.loads(body) == json.loads((CHART / "dashboards" / name).read_text())
    assert not [d for d in by_kind(rendered(CHART / "ci" / "namespaced-values.yaml"), "ConfigMap")]


def test_monitoring_works_with_kube_prometheus_stacks_defaults() -> None:
    """Out of the box: every monitoring object carries the label kube-prometheus-stack selects,
    the operator's metrics are scraped where the Prometheus Operator's API is served (and no
    PodMonitor is rendered where it is not), scrapers in the monitoring namespace reach engine
    pods, and PodMonitors select only the namespaces the operator watches."""
    served = ("monitoring.coreos.com/v1/PodMonitor",)
    docs = rendered(api_versions=served)
    (own,) = by_kind(docs, "PodMonitor")
    assert own["metadata"]["name"].endswith("-operator")
    assert own["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    args = _operator_args(docs)
    assert "--service-monitor-label=release=kube-prometheus-stack" in args
    assert "--metrics-namespace-label=kubernetes.io/metadata.name=monitoring" in args
    assert not by_kind(rendered(), "PodMonitor")  # the API not served: nothing to apply
    mine = rendered(sets=("monitoring.labels.release=prom",), api_versions=served)
    assert by_kind(mine, "PodMonitor")[0]["metadata"]["labels"]["release"] == "prom"
    assert "--service-monitor-label=release=prom" in _operator_args(mine)
    scoped = rendered(
        sets=("monitoring.podMonitor.enabled=true", "operator.watchNamespaces={team-a,team-b}"),
        api_versions=served,
    )
    for monitor in by_kind(scoped, "PodMonitor"):
        if not monitor["metadata"]["name"].endswith("-operator"):
            assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    (rule,) = by_kind(
        rendered(sets=("monitoring.prometheusRule.enabled=true",), api_versions=MONITORING_APIS),
        "PrometheusRule",
    )
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert any("specgate_operator_reconciles_total" in e for e in exprs)


MONITORING_APIS = (
    "monitoring.coreos.com/v1/PodMonitor",
    "monitoring.coreos.com/v1/PrometheusRule",
)


def test_monitoring_objects_only_when_enabled_and_served() -> None:
    kinds = {d["kind"] for d in rendered(api_versions=MONITORING_APIS)}
    assert not kinds & {"PrometheusRule"} and kinds & {"PodMonitor"} == {"PodMonitor"}
    # Enabled where the Prometheus Operator's API is not served: nothing to fail the install.
    bare = {d["kind"] for d in rendered(CHART / "ci" / "monitoring-values.yaml")}
    assert not bare & MONITORING_KINDS
    docs = rendered(CHART / "ci" / "monitoring-values.yaml", api_versions=MONITORING_APIS)
    monitors = by_kind(docs, "PodMonitor")
    assert {
        m["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] for m in monitors
    } == {"router", "engine", "operator"}
    assert monitors[0]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # The operator's own metrics: its pod, its metrics port, which its flags serve.
    (own,) = [m for m in monitors if m["metadata"]["name"].endswith("-operator")]
    (dep,) = by_kind(docs, "Deployment")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert own["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert own["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": 8081, "protocol": "TCP"} in container["ports"]
    assert "--metrics-port=8081" in container["args"]
    (rule,) = by_kind(docs, "PrometheusRule")
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert alerts == {
        "SpecgateSpeculationNotPaying",
        "SpecgateOperatorReconcileErrors",
        "SpecgateThresholdFlapping",
        "SpecgatePodMetricsStale",
        "SpecgateRouterErrors",
        "SpecgateNoReadyEnginePods",
    }


def _keys(node: Any, prefix: str = "") -> list[str]:
    if not isinstance(node, dict):
        return []
    out = []
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else key
        out.append(path)
        if isinstance(value, dict) and value:
            out += _keys(value, path)
    return out


def _commented_paths(text: str) -> dict[str, bool]:
    """key path -> whether a comment line stands right above the key in values.yaml."""
    out: dict[str, bool] = {}
    stack: list[tuple[int, str]] = []
    previous = ""
    for line in text.splitlines():
        stripped = line.strip()
        key = stripped.split(":", 1)[0]
        if (
            stripped
            and not stripped.startswith(("#", "-"))
            and ":" in stripped
            and key.isidentifier()
        ):
            indent = len(line) - len(line.lstrip())
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, key))
            out[".".join(k for _, k in stack)] = previous.startswith("#")
        if stripped:
            previous = stripped
    return out


def test_every_value_is_documented_in_the_schema_and_beside_it() -> None:
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    schema = json.loads((CHART / "values.schema.json").read_text())
    commented = _commented_paths(text)
    for path in _keys(values):
        if path.startswith("operator.resources."):
            continue  # a core/v1 ResourceRequirements passed through
        node, walked = schema, []
        for part in path.split("."):
            if "properties" not in node and isinstance(node.get("additionalProperties"), dict):
                break  # a key of a free map (labels): the map is what is documented
            node = node["properties"][part]
            walked.append(part)
        where = ".".join(walked)
        assert node.get("description"), f"{where} has no description in values.schema.json"
        assert commented.get(where), f"{where} has no comment above it in values.yaml"


def test_package() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        run(tool("helm"), "package", str(CHART), "--destination", out)
        assert list(Path(out).glob("specgate-0.1.0.tgz"))


def test_pull_secrets_reach_the_pods_the_operator_creates_and_names_can_be_overridden() -> None:
    """imagePullSecrets go to the operator's pod and, as operator flags, into every engine and
    router pod it renders; fullnameOverride names the objects; `global` (set by a parent
    chart) is accepted."""
    from specgate import api
    from specgate.cli import build_parser
    from specgate_operator import render

    docs = rendered(CHART / "ci" / "namespaced-values.yaml")
    (deployment,) = by_kind(docs, "Deployment")
    assert deployment["metadata"]["name"] == "llm-operator"
    assert deployment["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    args = build_parser().parse_args(_operator_args(docs))
    assert args.image_pull_secret == ["regcred"]
    opts = render.RenderOptions(image_pull_secrets=tuple(args.image_pull_secret))
    sdd = api.SpecDecodeDeployment.model_validate(
        yaml.safe_load((ROOT / "examples" / "tiny-single-gpu.yaml").read_text())
    )
    pods = [m["spec"]["template"]["spec"] for m in render.render(sdd, opts)
            if m["kind"] == "Deployment"]  # fmt: skip
    assert len(pods) == 2
    assert all(p["imagePullSecrets"] == [{"name": "regcred"}] for p in pods)
    plain = [m for m in render.render(sdd) if m["kind"] == "Deployment"]
    assert all("imagePullSecrets" not in m["spec"]["template"]["spec"] for m in plain)


@pytest.mark.parametrize(("version", "accepted"), [("1.28.9", False), ("1.29.0", True),
                                                   ("1.34.4", True)])  # fmt: skip
def test_the_chart_installs_on_kubernetes_1_29_and_newer(version: str, accepted: bool) -> None:
    """kubeVersion covers the supported range; every manifest also validates against the
    oldest release's schemas (KUBERNETES_VERSION, test_rendered_manifests_are_valid_kubernetes)."""
    result = run(tool("helm"), "template", "sg", str(CHART), "--kube-version", version,
                 check=False)  # fmt: skip
    assert (result.returncode == 0) is accepted, result.stderr
    if not accepted:
        assert "kubeVersion" in result.stderr or "incompatible" in result.stderr


def test_name_override_names_the_objects_and_pods_take_annotations_and_labels() -> None:
    docs = rendered(sets=("nameOverride=gate", "operator.podAnnotations.team=llm",
                          "operator.podLabels.tier=control"))  # fmt: skip
    (dep,) = by_kind(docs, "Deployment")
    assert dep["metadata"]["name"] == "sg-gate"
    assert {d["metadata"]["name"] for d in by_kind(docs, "ClusterRole")} == {"sg-gate"}
    template = dep["spec"]["template"]["metadata"]
    assert template["annotations"] == {"team": "llm"}
    assert template["labels"]["tier"] == "control"
    assert dep["spec"]["selector"]["matchLabels"].items() <= template["labels"].items()
    assert "tier" not in dep["spec"]["selector"]["matchLabels"]  # selectors never change


def test_notes_name_the_images_and_what_monitoring_needs(tmp_path: Path) -> None:
    """NOTES.txt rendered as `helm install` would (helm template skips it: a copy of the chart
    renders it as a template, and --debug prints it before the YAML check refuses it)."""
    chart = tmp_path / "specgate"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "templates" / "notes-check.yaml")
    out = run(tool("helm"), "template", "sg", str(chart), "--namespace", "specgate-system",
              "--show-only", "templates/notes-check.yaml", "--debug", check=False)  # fmt: skip
    notes = out.stdout.split("notes-check.yaml", 1)[1]
    assert "ghcr.io/specgate/worker" in notes and "ghcr.io/specgate/specgate" in notes
    assert '{"release":"kube-prometheus-stack"}' in notes
    assert "the holder of Lease sg-specgate reconciles" in notes


def test_a_global_registry_replaces_every_images_registry() -> None:
    from specgate.cli import build_parser

    docs = rendered(CHART / "ci" / "conventions-values.yaml")
    (dep,) = by_kind(docs, "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == (
        "mirror.example.com:5000/specgate/specgate:0.1.0"
    )
    args = build_parser().parse_args(_operator_args(docs))
    assert args.router_image == "mirror.example.com:5000/specgate/specgate:0.1.0"
    # A Docker Hub image has no registry part: the mirror goes in front.
    assert args.engine_image == "mirror.example.com:5000/lmsysorg/sglang:v0.5.17-specgate"
    sets = ("global.imageRegistry=mirror.local", "operator.engineImage=localhost:5000/w:1")
    local = build_parser().parse_args(_operator_args(rendered(sets=sets)))
    assert local.engine_image == "mirror.local/w:1"
    default = build_parser().parse_args(_operator_args(rendered()))
    assert default.engine_image.startswith("ghcr.io/specgate/worker:")


def test_the_operator_pod_takes_extra_env_volumes_and_security_contexts() -> None:
    (dep,) = by_kind(rendered(CHART / "ci" / "conventions-values.yaml"), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["fsGroup"] == 10001
    assert container["securityContext"]["runAsUser"] == 10001
    env = {e["name"]: e for e in container["env"]}
    assert env["HTTPS_PROXY"]["value"] == "http://proxy.example.com:3128"
    assert "POD_NAME" in env  # the chart's own stay
    assert {"name": "ca", "configMap": {"name": "corporate-ca"}} in pod["volumes"]
    assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]
    assert {"name": "ca", "mountPath": "/etc/ca", "readOnly": True} in container["volumeMounts"]


def test_helm_test_sends_a_clients_requests_through_the_named_router() -> None:
    """The test pod runs `specgate smoke` (tests/test_smoke.py runs that command against a
    real router) at the deployment's router Service; no pod without a deployment to test."""
    from specgate.cli import build_parser

    assert not [d for d in rendered() if d["kind"] == "Pod"]
    (pod,) = [d for d in rendered(CHART / "ci" / "conventions-values.yaml") if d["kind"] == "Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["metadata"]["namespace"] == "llm"
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "mirror.example.com:5000/specgate/specgate:0.1.0"
    assert container["command"][0] == "specgate"
    args = build_parser().parse_args(container["command"][1:])
    assert (args.url, args.wait) == ("http://llama-8b-router.llm.svc:9000", 120)
    assert container["env"] == [{"name": args.api_key_env, "valueFrom": {
        "secretKeyRef": {"name": "smoke-key", "key": "key"}}}]  # fmt: skip
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_chart_readme_is_generated_from_the_values(tmp_path: Path) -> None:
    """charts/specgate/README.md is what helm-docs writes from values.yaml (`make chart-docs`),
    so it lists every value with its default and comment; parents of documented keys are
    sections, not rows."""
    charts = tmp_path / "charts"
    shutil.copytree(CHART, charts / "specgate")
    (charts / "specgate" / "README.md").unlink()
    run(tool("helm-docs"), "--chart-search-root", str(charts), "--skip-version-footer",
        "--sort-values-order", "file")  # fmt: skip
    made = (charts / "specgate" / "README.md").read_text()
    assert made == (CHART / "README.md").read_text(), "run `make chart-docs`"
    rows = [line.split(" | ")[0].strip("| ") for line in made.splitlines() if line.startswith("| ")]
    assert "tests.deployment" in rows and "operator.extraEnv" in rows
    assert "operator" not in rows and "monitoring.podMonitor" not in rows
