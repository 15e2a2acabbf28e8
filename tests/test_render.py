"""The pure renderer: every spec field reaches the manifests, defaults apply, and every manifest is
valid Kubernetes (kubernetes-validate --strict against a pinned release)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from specgate import admission, api
from specgate_operator import render
from specgate_router.settings import PoolSettings

from .conftest import EXAMPLES, KUBERNETES_VERSION, load_example, minimal_resource


def _sdd(resource: dict[str, Any], schema: dict[str, Any]) -> api.SpecDecodeDeployment:
    return api.SpecDecodeDeployment.model_validate(admission.admit(resource, schema))


def _by_kind(manifests: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(m["kind"], m["metadata"]["name"]): m for m in manifests}


def _router_pod_and_config(
    resource: dict[str, Any], schema: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The rendered router pod spec and the router config its ConfigMap holds."""
    import yaml

    manifests = _by_kind(render.render(_sdd(resource, schema)))
    pod = manifests[("Deployment", "demo-router")]["spec"]["template"]["spec"]
    text = manifests[("ConfigMap", "demo-router")]["data"][render.ROUTER_CONFIG_FILE]
    return pod, yaml.safe_load(text)


def _engine_container(manifests: list[dict[str, Any]], name: str) -> dict[str, Any]:
    dep = _by_kind(manifests)[("Deployment", f"{name}-engine")]
    container: dict[str, Any] = dep["spec"]["template"]["spec"]["containers"][0]
    return container


def test_the_engine_pod_runs_without_privileges_and_requests_cpu_and_memory(
    schema: dict[str, Any],
) -> None:
    """By default (the image's user, root in SGLang's image): no privilege escalation, no
    capabilities, the runtime's seccomp profile, no API token, no foreign code, and CPU and
    memory requests that grow with the GPUs, each kept where the resource names its own."""
    sdd = _sdd(minimal_resource(engine={"gpusPerPod": 2, "tensorParallelSize": 2}), schema)
    out = render.render(sdd, api_key="k")
    c = _engine_container(out, "demo")
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert "--trust-remote-code" not in c["args"]
    assert not any(e["name"] == "HOME" for e in c["env"])
    pod = _by_kind(out)[("Deployment", "demo-engine")]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert c["resources"]["requests"] == {"nvidia.com/gpu": "2", "cpu": "4", "memory": "32Gi"}
    own = _sdd(minimal_resource(engine={"resources": {"requests": {"memory": "8Gi"}}}), schema)
    requests = _engine_container(render.render(own, api_key="k"), "demo")["resources"]["requests"]
    assert requests["memory"] == "8Gi" and requests["cpu"] == "16"


def test_a_hub_source_downloads_in_an_init_container_and_the_engine_runs_offline(
    schema: dict[str, Any],
) -> None:
    resource = minimal_resource(
        model={
            "path": "meta-llama/Llama-3.1-8B-Instruct",
            "revision": "0e9e39f",
            "source": {
                "type": "hub",
                "hub": {"tokenSecretRef": {"name": "hf"}, "cache": "pvc",
                        "cacheClaimName": "hub-cache", "allowPatterns": ["*.json", "*.gguf"]},
                "mountPath": "/hub",
            },
        },
        speculative={"draftModel": {"path": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}},
    )  # fmt: skip
    out = render.render(_sdd(resource, schema), api_key="k")
    pod = _by_kind(out)[("Deployment", "demo-engine")]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"] == [
        "specgate", "fetch-weights", "--endpoint", "https://huggingface.co", "--cache", "/hub",
        "--allow=*.json", "--allow=*.gguf",
        "meta-llama/Llama-3.1-8B-Instruct@0e9e39f", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B@main",
    ]  # fmt: skip
    env = {e["name"]: e for e in init["env"]}
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}
    }  # fmt: skip
    # huggingface_hub's own files go to the cache volume: the root filesystem is read-only.
    assert env["HF_HOME"]["value"] == "/hub/.hf-home"
    assert init["securityContext"]["runAsNonRoot"] is True
    assert {"name": "model", "mountPath": "/hub"} in init["volumeMounts"]
    model = next(v for v in pod["volumes"] if v["name"] == "model")
    assert model == {"name": "model", "persistentVolumeClaim": {"claimName": "hub-cache"}}
    assert pod["securityContext"]["fsGroup"] == render.RESTRICTED_USER
    c = _engine_container(out, "demo")
    assert _flag(c["args"], "--model-path") == "/hub/meta-llama/Llama-3.1-8B-Instruct/0e9e39f"
    assert (
        _flag(c["args"], "--speculative-draft-model-path")
        == "/hub/yuhuili/EAGLE3-LLaMA3.1-Instruct-8B/main"
    )
    assert "--revision" not in c["args"]  # the folder is the revision
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in c["env"]
    assert not any(e["name"] == "HF_TOKEN" for e in c["env"])  # the engine never sees it
    mount = next(m for m in c["volumeMounts"] if m["name"] == "model")
    assert mount["readOnly"] is True
    # The default cache is an emptyDir; the other sources get no init container.
    resource["spec"]["model"]["source"] = {"type": "hub"}
    default = render.render(_sdd(resource, schema), api_key="k")
    pod = _by_kind(default)[("Deployment", "demo-engine")]["spec"]["template"]["spec"]
    assert next(v for v in pod["volumes"] if v["name"] == "model")["emptyDir"] == {
        "sizeLimit": "500Gi"
    }
    # What cannot fit the emptyDir is refused before it is downloaded (and the pod evicted).
    assert "--max-bytes=536870912000" in pod["initContainers"][0]["command"]
    plain = render.render(_sdd(minimal_resource(), schema), api_key="k")
    pod = _by_kind(plain)[("Deployment", "demo-engine")]["spec"]["template"]["spec"]
    assert "initContainers" not in pod and "fsGroup" not in pod["securityContext"]
    assert "serviceAccountName" not in pod


def test_engine_pods_run_as_the_named_service_account_without_an_api_token(
    schema: dict[str, Any],
) -> None:
    resource = minimal_resource(engine={"serviceAccountName": "s3-reader"})
    out = render.render(_sdd(resource, schema), api_key="k")
    pod = _by_kind(out)[("Deployment", "demo-engine")]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "s3-reader"
    assert pod["automountServiceAccountToken"] is False


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


@pytest.fixture
def full(schema: dict[str, Any]) -> api.SpecDecodeDeployment:
    """A resource that sets every field to a non-default value."""
    resource = minimal_resource(
        replicas=3,
        model={
            "path": "llama-70b",
            "revision": "v2",
            "servedName": "llama",
            "dtype": "bfloat16",
            "contextLength": 8192,
            "trustRemoteCode": True,
            "source": {
                "type": "pvc",
                "pvc": {"claimName": "weights", "subPath": "hf", "readOnly": True},
                "mountPath": "/weights",
            },
        },
        speculative={
            "algorithm": "EAGLE",
            "draftModel": {"path": "eagle-70b", "revision": "d1"},
            "numSteps": 5,
            "eagleTopk": 1,
            "numDraftTokens": 6,
            "offStepTokens": 4,
            "control": {
                "mode": "dynamic",
                "threshold": 12,
                "minThreshold": 2,
                "maxThreshold": 40,
                "hysteresis": 3,
                "cooldownSeconds": 45,
                "probeIntervalSeconds": 900,
            },
        },
        engine={
            "image": "registry.local/worker:dev",
            "imagePullPolicy": "Always",
            "tensorParallelSize": 4,
            "gpusPerPod": 8,
            "port": 31000,
            "memFractionStatic": 0.8,
            "maxRunningRequests": 128,
            "cudaGraphMaxBs": 64,
            "extraArgs": ["--log-level", "debug"],
            "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
            "resources": {"requests": {"cpu": "8", "memory": "64Gi"}},
            "shmSize": "32Gi",
            "runAsUser": 1000,
            "startupTimeoutSeconds": 600,
        },
        placement={
            "nodeSelector": {"pool": "gpu"},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm"}],
            "affinity": {"nodeAffinity": {}},
            "priorityClassName": "high",
            "runtimeClassName": "nvidia",
        },
        router={
            "replicas": 3,
            "image": "registry.local/router:dev",
            "port": 9000,
            "defaultClass": "throughput",
            "pools": {
                "minLatencyFraction": 0.25,
                "maxLatencyFraction": 0.5,
                "throughputBatchPerPod": 24,
                "latencyTpotTargetMs": 15.0,
            },
            "resources": {"requests": {"cpu": "1"}},
            "serviceType": "LoadBalancer",
        },
        apiKeySecretRef={"name": "my-key", "key": "token"},
    )
    return _sdd(resource, schema)


def test_every_spec_field_reaches_the_manifests(full: api.SpecDecodeDeployment) -> None:
    out = render.render(full, api_key="ignored-because-a-secret-is-named")
    kinds = _by_kind(out)
    assert ("Secret", "demo-engine-key") not in kinds  # apiKeySecretRef given
    c = _engine_container(out, "demo")
    args = c["args"]
    assert _flag(args, "--model-path") == "/weights/llama-70b"
    assert _flag(args, "--revision") == "v2"
    assert _flag(args, "--served-model-name") == "llama"
    assert _flag(args, "--dtype") == "bfloat16"
    assert _flag(args, "--context-length") == "8192"
    assert "--trust-remote-code" in args
    assert _flag(args, "--speculative-algorithm") == "EAGLE"
    assert _flag(args, "--speculative-draft-model-path") == "/weights/eagle-70b"
    assert _flag(args, "--speculative-draft-model-revision") == "d1"
    assert _flag(args, "--speculative-num-steps") == "5"
    assert _flag(args, "--speculative-eagle-topk") == "1"
    assert _flag(args, "--speculative-num-draft-tokens") == "6"
    assert _flag(args, "--speculative-disable-batch-threshold") == "12"
    assert _flag(args, "--speculative-off-step-tokens") == "4"
    assert _flag(args, "--tp-size") == "4"
    assert _flag(args, "--port") == "31000"
    assert _flag(args, "--mem-fraction-static") == "0.8"
    assert _flag(args, "--max-running-requests") == "128"
    assert _flag(args, "--cuda-graph-max-bs-decode") == "64"
    assert "--cuda-graph-max-bs" not in args  # 0.5.17's deprecated alias
    assert args[-2:] == ["--log-level", "debug"]
    assert "--enable-metrics" in args
    # The key reaches the engine through its environment, never its command line (ps).
    assert not any("api-key" in a or "API_KEY" in a for a in args)
    key_env = next(e for e in c["env"] if e["name"] == render.ENGINE_SERVER_KEY_ENV)
    assert key_env["valueFrom"]["secretKeyRef"] == {"name": "my-key", "key": "token"}
    assert {"name": "NCCL_DEBUG", "value": "INFO"} in c["env"]
    assert c["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["runAsUser"] == 1000
    assert {"name": "HOME", "value": render.ENGINE_HOME} in c["env"]
    assert {"name": "home", "mountPath": render.ENGINE_HOME} in c["volumeMounts"]
    assert c["image"] == "registry.local/worker:dev" and c["imagePullPolicy"] == "Always"
    assert c["resources"]["requests"] == {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "8"}
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] == 600
    assert c["readinessProbe"]["httpGet"]["path"] == "/health_generate"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    dep = kinds[("Deployment", "demo-engine")]
    pod = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 3
    assert pod["nodeSelector"] == {"pool": "gpu"}
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "llm"}]
    assert pod["affinity"] == {"nodeAffinity": {}}
    assert pod["priorityClassName"] == "high" and pod["runtimeClassName"] == "nvidia"
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    model = next(v for v in pod["volumes"] if v["name"] == "model")
    assert model["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    mount = next(m for m in c["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/weights", "readOnly": True, "subPath": "hf"}
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "31000"
    # router
    router = kinds[("Deployment", "demo-router")]
    rc = router["spec"]["template"]["spec"]["containers"][0]
    assert router["spec"]["replicas"] == 3
    assert rc["image"] == "registry.local/router:dev"
    assert rc["resources"] == {"requests": {"cpu": "1"}}
    assert _flag(rc["args"], "--port") == "9000"
    svc = kinds[("Service", "demo-router")]
    assert svc["spec"]["type"] == "LoadBalancer" and svc["spec"]["ports"][0]["port"] == 9000
    config = render.router_config(full)
    assert config["defaultClass"] == "throughput"
    assert config["pools"] == {
        "minLatencyFraction": 0.25,
        "maxLatencyFraction": 0.5,
        "throughputBatchPerPod": 24,
        "latencyTpotTargetMs": 15.0,
    }
    # The router accepts what the operator renders.
    assert PoolSettings.model_validate(config["pools"]).latency_tpot_target_ms == 15.0
    assert config["control"] == {
        "mode": "dynamic",
        "threshold": 12,
        "minThreshold": 2,
        "maxThreshold": 40,
        "hysteresis": 3,
        "cooldownSeconds": 45,
        "probeIntervalSeconds": 900,
    }
    assert config["discovery"]["kubernetes"] == {
        "namespace": "default",
        "service": "demo-engine",
        "port": 31000,
    }
    assert config["model"] == "llama"
    np = kinds[("NetworkPolicy", "demo-engine")]
    assert np["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 31000}]


def test_defaults_reach_the_manifests(schema: dict[str, Any]) -> None:
    sdd = _sdd(minimal_resource(), schema)
    out = render.render(sdd, api_key="k")
    kinds = _by_kind(out)
    secret = kinds[("Secret", "demo-engine-key")]
    assert secret["stringData"] == {"api-key": "k"}
    c = _engine_container(out, "demo")
    assert _flag(c["args"], "--tp-size") == "8"
    assert _flag(c["args"], "--served-model-name") == "demo"
    assert _flag(c["args"], "--speculative-disable-batch-threshold") == "8"
    assert "--speculative-off-step-tokens" not in c["args"]  # the engine's own default, 1
    assert _flag(c["args"], "--model-path") == "meta-llama/Llama-3.1-8B-Instruct"  # image source
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    pod = kinds[("Deployment", "demo-engine")]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {}  # vendor-neutral: the GPU request picks GPU nodes
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert all(v["name"] != "model" for v in pod["volumes"])
    assert kinds[("Deployment", "demo-router")]["spec"]["replicas"] == 2
    assert ("ServiceMonitor", "demo-engine") not in kinds


@pytest.mark.parametrize(("mode", "flag"), [("dynamic", "8"), ("alwaysOn", None), ("off", "0")])
def test_control_mode_sets_the_initial_threshold(
    mode: str, flag: str | None, schema: dict[str, Any]
) -> None:
    speculative = {"draftModel": {"path": "d"}, "offStepTokens": 2, "control": {"mode": mode}}
    sdd = _sdd(minimal_resource(speculative=speculative), schema)
    args = _engine_container(render.render(sdd), "demo")["args"]
    assert _flag(args, "--speculative-disable-batch-threshold") == flag
    # Off steps exist only with a threshold; the engine refuses the flag without one.
    assert _flag(args, "--speculative-off-step-tokens") == (None if flag is None else "2")


def test_host_path_source_mounts_the_directory(schema: dict[str, Any]) -> None:
    sdd = _sdd(
        minimal_resource(
            model={"path": "m", "source": {"type": "hostPath", "hostPath": {"path": "/nvme/m"}}}
        ),
        schema,
    )
    out = render.render(sdd)
    pod = _by_kind(out)[("Deployment", "demo-engine")]["spec"]["template"]["spec"]
    model = next(v for v in pod["volumes"] if v["name"] == "model")
    assert model["hostPath"] == {"path": "/nvme/m", "type": "Directory"}


def test_service_monitors_and_scrapers_are_optional(schema: dict[str, Any]) -> None:
    sdd = _sdd(minimal_resource(), schema)
    opts = render.RenderOptions(
        service_monitor=True,
        metrics_namespace_labels={"kubernetes.io/metadata.name": "monitoring"},
        service_monitor_labels={"release": "kube-prometheus-stack"},
    )
    kinds = _by_kind(render.render(sdd, opts))
    assert ("ServiceMonitor", "demo-engine") in kinds and ("ServiceMonitor", "demo-router") in kinds
    monitor = kinds[("ServiceMonitor", "demo-engine")]
    # What the Prometheus selects on, and the label the dashboards group by.
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["metadata"]["labels"][render.LABEL_COMPONENT] == "engine"
    assert monitor["spec"]["podTargetLabels"] == [render.LABEL_DEPLOYMENT]
    ingress = kinds[("NetworkPolicy", "demo-engine")]["spec"]["ingress"]
    assert ingress[1]["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "monitoring"
    }


def test_network_policy_admits_only_router_pods(schema: dict[str, Any]) -> None:
    sdd = _sdd(minimal_resource(), schema)
    out = _by_kind(render.render(sdd))
    (rule,) = out[("NetworkPolicy", "demo-engine")]["spec"]["ingress"]
    router_labels = out[("Deployment", "demo-router")]["spec"]["template"]["metadata"]["labels"]
    selector = rule["from"][0]["podSelector"]["matchLabels"]
    assert selector.items() <= router_labels.items()
    engine_labels = out[("Deployment", "demo-engine")]["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= engine_labels.items()


def test_selectors_match_pod_labels(schema: dict[str, Any]) -> None:
    out = render.render(_sdd(minimal_resource(), schema))
    pod_labels = {
        m["metadata"]["labels"]["app.kubernetes.io/component"]: m["spec"]["template"]["metadata"][
            "labels"
        ]
        for m in out
        if m["kind"] == "Deployment"
    }
    for m in out:
        component = m["metadata"]["labels"]["app.kubernetes.io/component"]
        if m["kind"] == "Deployment":
            assert m["spec"]["selector"]["matchLabels"].items() <= pod_labels[component].items()
        if m["kind"] == "Service":
            assert m["spec"]["selector"].items() <= pod_labels[component].items()
        if m["kind"] == "PodDisruptionBudget":
            assert m["spec"]["selector"]["matchLabels"].items() <= pod_labels[component].items()
    assert pod_labels["engine"] != pod_labels["router"]
    budgets = {m["metadata"]["labels"]["app.kubernetes.io/component"] for m in out
               if m["kind"] == "PodDisruptionBudget"}  # fmt: skip
    assert budgets == {"engine", "router"}


def test_router_replicas_spread_over_nodes_and_drain_on_the_way_out(
    schema: dict[str, Any],
) -> None:
    """Router pods prefer different nodes, a PDB keeps all but one up through node drains, and
    a preStop pause lets endpoints drop a terminating pod before it stops accepting."""
    out = _by_kind(render.render(_sdd(minimal_resource(router={"replicas": 3}), schema)))
    pod = out[("Deployment", "demo-router")]["spec"]["template"]["spec"]
    (term,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert (
        term["podAffinityTerm"]["labelSelector"]["matchLabels"]
        == (out[("Deployment", "demo-router")]["spec"]["selector"]["matchLabels"])
    )
    assert out[("PodDisruptionBudget", "demo-router")]["spec"]["maxUnavailable"] == 1
    container = pod["containers"][0]
    hook = container["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:2] == ["python3", "-c"] and f"sleep({render.ROUTER_PRESTOP_SECONDS})" in hook[2]
    assert pod["terminationGracePeriodSeconds"] > render.ROUTER_PRESTOP_SECONDS
    assert ("policy/v1", "PodDisruptionBudget", "default", "demo-router") in render.child_refs(
        "demo", "default"
    )


def _drain_of(pod: dict[str, Any]) -> tuple[list[str], int]:
    hook = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    return hook, pod["terminationGracePeriodSeconds"]


def test_pods_drain_for_the_longest_answer_the_router_allows(schema: dict[str, Any]) -> None:
    """By default an engine pod's preStop waits for its requests up to the router's answer
    limit, and both grace periods outlast their drains; the resource's drainSeconds and
    answerSeconds move all of it together."""
    for resource, drain in [
        (minimal_resource(), 600),
        (minimal_resource(router={"timeouts": {"answerSeconds": 90.5}}), 91),
        (minimal_resource(disruption={"drainSeconds": 45}), 45),
    ]:
        out = _by_kind(render.render(_sdd(resource, schema)))
        engine = out[("Deployment", "demo-engine")]["spec"]["template"]["spec"]
        hook, grace = _drain_of(engine)
        assert hook[:3] == ["python3", "-c", render.ENGINE_DRAIN_SCRIPT]
        assert hook[3:] == ["30000", str(render.ENDPOINTS_SETTLE_SECONDS), str(drain)]
        assert grace == drain + render.ENGINE_SHUTDOWN_SECONDS
        router, config = _router_pod_and_config(resource, schema)
        assert _drain_of(router)[1] > render.ROUTER_PRESTOP_SECONDS + drain
        assert config["resilience"]["drainSeconds"] == drain


def test_a_one_replica_model_serves_through_updates_and_drains_as_chosen(
    schema: dict[str, Any],
) -> None:
    """Updates surge one pod by default (the old one serves until the new one is Ready); the
    budget lets a drain evict a lone engine pod unless the resource protects it, and never
    protects more than one pod of a larger model."""

    def rendered(**spec: Any) -> dict[tuple[str, str], Any]:
        return _by_kind(render.render(_sdd(minimal_resource(**spec), schema)))

    out = rendered()
    strategy = out[("Deployment", "demo-engine")]["spec"]["strategy"]["rollingUpdate"]
    assert strategy == {"maxSurge": 1, "maxUnavailable": 0}
    assert out[("PodDisruptionBudget", "demo-engine")]["spec"]["maxUnavailable"] == 1
    out = rendered(disruption={"maxSurge": 0, "maxUnavailable": 1, "protectLastPod": True})
    strategy = out[("Deployment", "demo-engine")]["spec"]["strategy"]["rollingUpdate"]
    assert strategy == {"maxSurge": 0, "maxUnavailable": 1}
    budget = out[("PodDisruptionBudget", "demo-engine")]["spec"]
    assert budget["minAvailable"] == 1 and "maxUnavailable" not in budget
    out = rendered(replicas=3, disruption={"protectLastPod": True})
    assert out[("PodDisruptionBudget", "demo-engine")]["spec"]["maxUnavailable"] == 1
    with pytest.raises(ValueError, match="maxSurge and maxUnavailable"):
        _sdd(minimal_resource(disruption={"maxSurge": 0, "maxUnavailable": 0}), schema)


def test_rendering_is_deterministic(full: api.SpecDecodeDeployment) -> None:
    assert render.render(full) == render.render(full)


def test_router_role_has_no_wildcards() -> None:
    for rule in render.ROUTER_RULES:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key]


def test_child_refs_cover_everything_rendered(full: api.SpecDecodeDeployment) -> None:
    opts = render.RenderOptions(service_monitor=True)
    refs = {(a, k, n) for a, k, _, n in render.child_refs("demo", "default")}
    for m in render.render(full, opts, api_key="k"):
        assert (m["apiVersion"], m["kind"], m["metadata"]["name"]) in refs


def _validate_all(manifests: list[dict[str, Any]]) -> None:
    for m in manifests:
        if m["apiVersion"].startswith("monitoring.coreos.com"):
            continue  # a CRD's kind: not in the Kubernetes schemas
        kubernetes_validate.validate(m, KUBERNETES_VERSION, strict=True)


def test_full_manifests_are_valid_kubernetes(full: api.SpecDecodeDeployment) -> None:
    _validate_all(render.render(full, render.RenderOptions(service_monitor=True), api_key="k"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: Path(p).name)
def test_example_manifests_are_valid_kubernetes(path: Path, schema: dict[str, Any]) -> None:
    sdd = _sdd(load_example(path), schema)
    out = render.render(sdd, api_key="k")
    assert len(out) >= 10
    _validate_all(out)


def test_strict_validation_catches_a_broken_manifest() -> None:
    """Guard for the check above: kubernetes-validate --strict really rejects unknown fields."""
    bad = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "x"},
        "spec": {"ports": [{"port": 80}], "clusterIp": "None"},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_an_http_route_exposes_only_the_openai_paths_of_the_router(
    schema: dict[str, Any],
) -> None:
    """With spec.router.httpRoute the operator renders a Gateway API HTTPRoute to the router
    Service for `/v1/` only (the router's status and sample endpoints stay in the cluster);
    without it, none."""
    plain = render.render(_sdd(minimal_resource(), schema))
    assert not [m for m in plain if m["kind"] == "HTTPRoute"]
    resource = minimal_resource(
        router={
            "port": 8080,
            "httpRoute": {
                "parentRefs": [
                    {"name": "inference", "namespace": "gateways"},
                    {"name": "edge", "sectionName": "https"},
                ],
                "hostnames": ["llm.example.com", "*.llm.example.com"],
            },
        }
    )
    route = _by_kind(render.render(_sdd(resource, schema)))[("HTTPRoute", "demo-router")]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference",
         "namespace": "gateways"},
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "edge",
         "sectionName": "https"},
    ]  # fmt: skip
    assert route["spec"]["hostnames"] == ["llm.example.com", "*.llm.example.com"]
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1/"}}]
    assert rule["backendRefs"] == [{"name": "demo-router", "port": 8080}]
    assert ("gateway.networking.k8s.io/v1", "HTTPRoute", "default", "demo-router") in (
        render.child_refs("demo", "default")
    )


@pytest.mark.parametrize(
    "route",
    [
        {"parentRefs": []},
        {"parentRefs": [{"name": "g"}], "hostnames": ["Upper.example.com"]},
        {"parentRefs": [{"name": "g"}], "hostnames": ["a..b"]},
        {"hostnames": ["a.example.com"]},
    ],
)
def test_a_malformed_http_route_is_refused(route: dict[str, Any], schema: dict[str, Any]) -> None:
    with pytest.raises(admission.AdmissionError, match="httpRoute"):
        admission.admit(minimal_resource(router={"httpRoute": route}), schema)


def test_client_auth_mounts_the_keys_secret_and_points_the_router_at_it(
    schema: dict[str, Any], tmp_path: Path
) -> None:
    """spec.router.clientAuth: the router pods mount the Secret's keys file (hashes only) and
    their config names it; the router accepts that config and reads such a file."""
    import json as json_mod

    import yaml

    from specgate_router import client_auth, settings

    resource = minimal_resource(router={"clientAuth": {"secretName": "demo-client-keys"}})
    pod, config = _router_pod_and_config(resource, schema)
    (volume,) = [v for v in pod["volumes"] if v["name"] == "client-keys"]
    assert volume["secret"] == {
        "secretName": "demo-client-keys",
        "items": [{"key": "keys.yaml", "path": render.CLIENT_KEYS_FILE}],
    }
    mounts = pod["containers"][0]["volumeMounts"]
    assert {"name": "client-keys", "mountPath": render.CLIENT_KEYS_DIR, "readOnly": True} in mounts
    keys_file = config["clientAuth"]["keysFile"]
    assert keys_file == f"{render.CLIENT_KEYS_DIR}/{render.CLIENT_KEYS_FILE}"
    # The router takes that config, with the file where the pod would have it.
    local = tmp_path / "keys.yaml"
    entry = {"name": "team-a", "sha256": client_auth.hash_key("sg-k"), "classes": ["latency"]}
    local.write_text(yaml.safe_dump([entry]))
    config["clientAuth"]["keysFile"] = str(local)
    config.pop("discovery")
    config["backends"] = ["http://127.0.0.1:9"]
    path = tmp_path / "router.yaml"
    path.write_text(json_mod.dumps(config))
    auth = client_auth.ClientAuth(settings.load(path).client_auth)  # type: ignore[arg-type]
    assert auth.ring.identify("sg-k").name == "team-a"
    # Without clientAuth: no volume, no keys file in the config.
    plain_pod, plain_config = _router_pod_and_config(minimal_resource(), schema)
    assert "clientAuth" not in plain_config
    assert not [v for v in plain_pod["volumes"] if v["name"] == "client-keys"]


def test_oidc_client_auth_renders_the_router_settings_and_mounts_the_ca(
    schema: dict[str, Any], tmp_path: Path
) -> None:
    """spec.router.clientAuth.oidc alone: no keys Secret is mounted, the router's config
    carries the provider settings with the CA ConfigMap as a mounted file, and the router
    accepts that config as rendered."""
    import yaml

    from specgate_router import settings

    oidc = {
        "issuer": "https://dex.auth.svc:5556/dex",
        "audience": "specgate",
        "adminGroups": ["platform"],
        "ca": {"name": "dex-ca"},
        "requestsPerMinute": 600,
    }
    resource = minimal_resource(router={"clientAuth": {"oidc": oidc}})
    pod, config = _router_pod_and_config(resource, schema)
    assert not [v for v in pod["volumes"] if v["name"] == "client-keys"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "oidc-ca"]
    assert volume["configMap"] == {
        "name": "dex-ca",
        "items": [{"key": "ca.crt", "path": render.OIDC_CA_FILE}],
    }
    mounts = pod["containers"][0]["volumeMounts"]
    assert {"name": "oidc-ca", "mountPath": render.OIDC_CA_DIR, "readOnly": True} in mounts
    assert "keysFile" not in config["clientAuth"]
    rendered = config["clientAuth"]["oidc"]
    assert (
        rendered["caFile"] == f"{render.OIDC_CA_DIR}/{render.OIDC_CA_FILE}" and "ca" not in rendered
    )
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    loaded = settings.load(path).client_auth
    assert loaded is not None and loaded.oidc is not None
    assert loaded.oidc.admin_groups == ["platform"] and loaded.oidc.requests_per_minute == 600
    assert loaded.oidc.algorithms == ["RS256", "ES256"]


def test_engines_trace_where_the_router_does(schema: dict[str, Any]) -> None:
    """With spec.router.tracing, SGLang exports its spans to the router's collector over
    OTLP/HTTP; without it, no tracing flag or variable reaches the engine."""
    endpoint = "http://otel-collector.observability:4318/v1/traces"
    traced = minimal_resource(router={"tracing": {"otlpEndpoint": endpoint}})
    for resource, on in [(traced, True), (minimal_resource(), False)]:
        out = _by_kind(render.render(_sdd(resource, schema)))
        engine = out[("Deployment", "demo-engine")]["spec"]["template"]["spec"]["containers"][0]
        args, env = engine["args"], engine["env"]
        assert ("--enable-trace" in args) is on
        assert (render.ENGINE_TRACING_ENV in env) is on
        if on:
            assert args[args.index("--otlp-traces-endpoint") + 1] == endpoint
        else:
            assert "--otlp-traces-endpoint" not in args


def test_router_pods_go_where_the_resource_places_them(schema: dict[str, Any]) -> None:
    toleration = {"key": "dedicated", "operator": "Equal", "value": "gateway"}
    placed = minimal_resource(router={"nodeSelector": {"pool": "cpu"}, "tolerations": [toleration]})
    pod, _ = _router_pod_and_config(placed, schema)
    assert pod["nodeSelector"] == {"pool": "cpu"} and pod["tolerations"] == [toleration]
    pod, _ = _router_pod_and_config(minimal_resource(), schema)
    assert "nodeSelector" not in pod and "tolerations" not in pod


def test_gpus_are_requested_as_the_resource_names_them(schema: dict[str, Any]) -> None:
    for resource, name in [
        (minimal_resource(engine={"gpusPerPod": 1, "tensorParallelSize": 1}), "nvidia.com/gpu"),
        (minimal_resource(engine={"gpusPerPod": 1, "tensorParallelSize": 1,
                                  "gpuResourceName": "nvidia.com/mig-3g.40gb"}),
         "nvidia.com/mig-3g.40gb"),
    ]:  # fmt: skip
        out = _by_kind(render.render(_sdd(resource, schema)))
        pod = out[("Deployment", "demo-engine")]["spec"]["template"]["spec"]
        resources = pod["containers"][0]["resources"]
        assert resources["limits"] == {name: "1"} and resources["requests"][name] == "1"
