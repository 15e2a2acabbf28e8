"""Render a SpecDecodeDeployment into the Kubernetes objects that realise it.

A pure function of (resource, options): no I/O, deterministic names, so the operator, `specgate
render` and the tests all see the same manifests. Owner references are added by the operator at
apply time (they need the live uid), not here.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any

import yaml

from specgate import SGLANG_VERSION, __version__, api
from specgate_operator.policy import quantity_bytes

Manifest = dict[str, Any]

ENGINE_KEY_ENV = "SPECGATE_ENGINE_API_KEY"
"""The router's environment variable for the engine API key."""
ENGINE_SERVER_KEY_ENV = "SGLANG_API_KEY"
"""The engine's: the patched server reads its key from it when --api-key is not given, so the
key is never in the process's command line."""
ROUTER_CONFIG_FILE = "router.yaml"
ROUTER_CONFIG_DIR = "/etc/specgate"
CLIENT_KEYS_DIR = "/etc/specgate-client-keys"
CLIENT_KEYS_FILE = "keys.yaml"
OIDC_CA_DIR = "/etc/specgate-oidc-ca"
OIDC_CA_FILE = "ca.crt"
ROUTER_PRESTOP_SECONDS = 5
MANAGED_BY = "specgate-operator"
LABEL_DEPLOYMENT = "specgate.io/deployment"
LABEL_COMPONENT = "app.kubernetes.io/component"


@dataclass(frozen=True)
class RenderOptions:
    """Operator-wide settings that are not part of a resource."""

    engine_image: str = f"ghcr.io/specgate/worker:{__version__}-sglang{SGLANG_VERSION}"
    router_image: str = f"ghcr.io/specgate/specgate:{__version__}"
    service_monitor: bool = False
    """Render ServiceMonitors (the operator sets this when monitoring.coreos.com/v1 is served)."""
    service_monitor_labels: dict[str, str] = field(default_factory=dict)
    """Labels on them: what the Prometheus' serviceMonitorSelector selects on."""
    image_pull_secrets: tuple[str, ...] = ()
    """Secrets for pulling the engine and router images (the chart passes its
    imagePullSecrets), in the resource's namespace."""
    metrics_namespace_labels: dict[str, str] = field(default_factory=dict)
    """Namespaces whose pods may scrape engine /metrics through the NetworkPolicy (for example
    {"kubernetes.io/metadata.name": "monitoring"}); empty: only the router reaches engine pods."""


def names(sdd_name: str) -> dict[str, str]:
    """Child object names, one place so the operator, router config and tests agree."""
    return {
        "engine": f"{sdd_name}-engine",
        "router": f"{sdd_name}-router",
        "secret": f"{sdd_name}-engine-key",
        "lease": f"{sdd_name}-router-leader",
    }


def labels(sdd: api.SpecDecodeDeployment, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "specgate",
        "app.kubernetes.io/instance": sdd.name,
        LABEL_COMPONENT: component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_DEPLOYMENT: sdd.name,
    }


def selector(sdd: api.SpecDecodeDeployment, component: str) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: sdd.name, LABEL_COMPONENT: component}


def selector_string(sdd: api.SpecDecodeDeployment, component: str) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector(sdd, component).items()))


def _meta(sdd: api.SpecDecodeDeployment, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": sdd.namespace, "labels": labels(sdd, component)}


def api_key_ref(sdd: api.SpecDecodeDeployment) -> api.SecretKeyRef:
    return sdd.spec.api_key_secret_ref or api.SecretKeyRef(name=names(sdd.name)["secret"])


def served_model_name(sdd: api.SpecDecodeDeployment) -> str:
    return sdd.spec.model.served_name or sdd.name


def initial_threshold(control: api.SpeculationControl) -> int | None:
    """The threshold an engine starts with: None (flag absent) speculates at every batch size."""
    if control.mode == "alwaysOn":
        return None
    if control.mode == "off":
        return 0
    return control.threshold


def _model_path(path: str, source: api.WeightsSource, revision: str | None = None) -> str:
    if source.type == "hub":
        # Where `specgate fetch-weights` puts the repository at its revision.
        return posixpath.join(source.mount_path, path, (revision or "main").replace("/", "--"))
    if source.type == "image" or path.startswith("/"):
        return path
    return posixpath.join(source.mount_path, path)


def hub_repos(sdd: api.SpecDecodeDeployment) -> list[str]:
    """`specgate fetch-weights` arguments for the target and the draft: REPO@REVISION."""
    model, draft = sdd.spec.model, sdd.spec.speculative.draft_model
    return [f"{model.path}@{model.revision or 'main'}", f"{draft.path}@{draft.revision or 'main'}"]


def engine_args(sdd: api.SpecDecodeDeployment) -> list[str]:
    """SGLang 0.5.17 `launch_server` flags (plus the specgate patch's threshold flag)."""
    spec = sdd.spec
    model, spec_dec, engine = spec.model, spec.speculative, spec.engine
    args = [
        "--model-path",
        _model_path(model.path, model.source, model.revision),
        "--served-model-name",
        served_model_name(sdd),
        "--dtype",
        model.dtype,
        "--tp-size",
        str(engine.tensor_parallel_size),
        "--host",
        "0.0.0.0",
        "--port",
        str(engine.port),
        "--enable-metrics",
        "--speculative-algorithm",
        spec_dec.algorithm,
        "--speculative-draft-model-path",
        _model_path(spec_dec.draft_model.path, model.source, spec_dec.draft_model.revision),
        "--speculative-num-steps",
        str(spec_dec.num_steps),
        "--speculative-eagle-topk",
        str(spec_dec.eagle_topk),
        "--speculative-num-draft-tokens",
        str(spec_dec.num_draft_tokens),
    ]
    hub = model.source.type == "hub"  # the local folders are the revisions already
    if model.revision and not hub:
        args += ["--revision", model.revision]
    if spec_dec.draft_model.revision and not hub:
        args += ["--speculative-draft-model-revision", spec_dec.draft_model.revision]
    if model.context_length is not None:
        args += ["--context-length", str(model.context_length)]
    if model.trust_remote_code:
        args.append("--trust-remote-code")
    threshold = initial_threshold(spec_dec.control)
    if threshold is not None:
        args += ["--speculative-disable-batch-threshold", str(threshold)]
        if spec_dec.off_step_tokens != 1:
            # Only a server with the threshold has off steps; without it the flag is refused.
            args += ["--speculative-off-step-tokens", str(spec_dec.off_step_tokens)]
    if engine.mem_fraction_static is not None:
        args += ["--mem-fraction-static", f"{engine.mem_fraction_static:g}"]
    if engine.max_running_requests is not None:
        args += ["--max-running-requests", str(engine.max_running_requests)]
    if engine.cuda_graph_max_bs is not None:
        # SGLang 0.5.17 keeps --cuda-graph-max-bs only as a deprecated alias of this one.
        args += ["--cuda-graph-max-bs-decode", str(engine.cuda_graph_max_bs)]
    tracing = spec.router.tracing
    if tracing is not None:
        # The engine's spans continue the router's (its traceparent), to the same collector
        # over OTLP/HTTP (ENGINE_TRACING_ENV); they follow the router's sampling decision.
        args += ["--enable-trace", "--otlp-traces-endpoint", tracing.otlp_endpoint]
    return args + list(engine.extra_args)


ENGINE_TRACING_ENV = {"name": "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "value": "http/protobuf"}
"""SGLang exports over gRPC unless told otherwise; the router's endpoint is OTLP/HTTP."""


ENGINE_CPU_REQUEST_PER_GPU = 2
ENGINE_MEMORY_REQUEST_PER_GPU_GI = 16
"""Requested for an engine pod when the resource names no CPU or memory, per GPU: its
scheduler, tokenizer and detokenizer processes and the weights' host-side loading."""
ENGINE_HOME = "/home/specgate"
ENDPOINTS_SETTLE_SECONDS = 5
"""How long a stopping pod keeps taking requests before it drains: endpoints take a few
seconds to drop it everywhere, and requests sent meanwhile must still be served."""
ENGINE_SHUTDOWN_SECONDS = 30
"""The engine's grace period beyond its drain: SGLang's own shutdown after SIGTERM."""
ROUTER_SHUTDOWN_SECONDS = 10
"""The router's grace period beyond its preStop pause and drain."""
ENGINE_DRAIN_SCRIPT = """\
import re, sys, time, urllib.request
port, settle, most = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
busy = re.compile(r"^sglang:num_(?:running|queue)_reqs(?:[{][^}]*[}])? (\\S+)$", re.M)
start = time.monotonic()
time.sleep(settle)
while time.monotonic() - start < most:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read(1 << 22).decode(errors="replace")
    except Exception:
        break
    if sum(float(n) for n in busy.findall(text)) == 0:
        break
    time.sleep(1)
"""
"""An engine pod's preStop hook (`python3 -c` in the engine image, which has no specgate):
after `settle` seconds, poll the engine's /metrics (open without the key) until it runs and
queues no request, or `most` seconds have passed, or the engine no longer answers."""
RESTRICTED_USER = 65532
"""The user specgate's own containers run as (the image's nonroot user)."""


def _engine_resources(engine: api.EngineSpec) -> dict[str, Any]:
    resources: dict[str, Any] = {k: dict(v) for k, v in engine.resources.items()}
    gpus = str(engine.gpus_per_pod)
    resources.setdefault("limits", {})[engine.gpu_resource_name] = gpus
    requests = resources.setdefault("requests", {})
    requests[engine.gpu_resource_name] = gpus
    requests.setdefault("cpu", str(ENGINE_CPU_REQUEST_PER_GPU * engine.gpus_per_pod))
    requests.setdefault("memory", f"{ENGINE_MEMORY_REQUEST_PER_GPU_GI * engine.gpus_per_pod}Gi")
    return resources


def fetch_weights_container(sdd: api.SpecDecodeDeployment, opts: RenderOptions) -> dict[str, Any]:
    """The init container of a hub source: `specgate fetch-weights` (the specgate image, non-root)
    downloads the target and the draft into the cache volume, skipping what it holds."""
    source = sdd.spec.model.source
    hub = source.hub or api.HubSource()
    env: list[dict[str, Any]] = [
        # huggingface_hub keeps its own files (Xet's chunk cache among them) under HF_HOME:
        # on the cache volume, as the root filesystem is read-only.
        {"name": "HF_HOME", "value": posixpath.join(source.mount_path, ".hf-home")},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    ]
    if hub.token_secret_ref is not None:
        ref = hub.token_secret_ref
        env.append(
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
        )
    return {
        "name": "fetch-weights",
        "image": sdd.spec.router.image or opts.router_image,
        "command": [
            "specgate",
            "fetch-weights",
            "--endpoint",
            hub.endpoint,
            "--cache",
            source.mount_path,
            *(f"--allow={pattern}" for pattern in hub.allow_patterns or ()),
            # An emptyDir past its sizeLimit gets the pod evicted: refuse models that cannot fit.
            *(
                [f"--max-bytes={int(quantity_bytes(hub.cache_size))}"]
                if hub.cache == "emptyDir"
                else []
            ),
            *hub_repos(sdd),
        ],
        "env": env,
        "volumeMounts": [{"name": "model", "mountPath": source.mount_path}],
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}},
        "securityContext": restricted_container_security(),
    }


def pause(seconds: int) -> dict[str, Any]:
    """A preStop hook that waits: an exec of the image's Python, which every Kubernetes the
    chart supports runs (the `sleep` action needs 1.30)."""
    return {"exec": {"command": ["python3", "-c", f"import time; time.sleep({seconds})"]}}


def engine_drain(port: int, drain_seconds: int) -> dict[str, Any]:
    """The engine's preStop hook: serve through the endpoints' settling, then wait for the
    running requests to end (at most `drain_seconds`)."""
    settle = min(ENDPOINTS_SETTLE_SECONDS, drain_seconds)
    command = ["python3", "-c", ENGINE_DRAIN_SCRIPT, str(port), str(settle), str(drain_seconds)]
    return {"exec": {"command": command}}


def engine_container_security(engine: api.EngineSpec) -> dict[str, Any]:
    """The engine container's security context: no privilege escalation, no capabilities
    (GPU access comes from the device plugin's device nodes, not from a capability), and
    non-root when the resource names a user. SGLang writes its kernel caches under HOME and
    compiles into the image's site-packages on first use, so the root filesystem stays
    writable."""
    out: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if engine.run_as_user is not None:
        out |= {"runAsNonRoot": True, "runAsUser": engine.run_as_user}
    return out


def _weights_volume(source: api.WeightsSource) -> dict[str, Any] | None:
    if source.type == "hub":
        hub = source.hub or api.HubSource()
        if hub.cache == "pvc" and hub.cache_claim_name:
            return {"name": "model", "persistentVolumeClaim": {"claimName": hub.cache_claim_name}}
        return {"name": "model", "emptyDir": {"sizeLimit": hub.cache_size}}
    if source.type == "pvc" and source.pvc is not None:
        claim = {"claimName": source.pvc.claim_name, "readOnly": source.pvc.read_only}
        return {"name": "model", "persistentVolumeClaim": claim}
    if source.type == "hostPath" and source.host_path is not None:
        return {"name": "model", "hostPath": {"path": source.host_path.path, "type": "Directory"}}
    return None


def engine_deployment(sdd: api.SpecDecodeDeployment, opts: RenderOptions) -> Manifest:
    spec, engine, placement = sdd.spec, sdd.spec.engine, sdd.spec.placement
    drain = spec.disruption.drain_for(spec.router.timeouts)
    n = names(sdd.name)
    key = api_key_ref(sdd)
    port = engine.port
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": engine.shm_size}}
    ]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    weights = _weights_volume(spec.model.source)
    if weights is not None:
        volumes.append(weights)
        mount: dict[str, Any] = {
            "name": "model",
            "mountPath": spec.model.source.mount_path,
            "readOnly": True,
        }
        if spec.model.source.pvc is not None and spec.model.source.pvc.sub_path:
            mount["subPath"] = spec.model.source.pvc.sub_path
        mounts.append(mount)
    env: list[dict[str, Any]] = [
        {
            "name": ENGINE_SERVER_KEY_ENV,
            "valueFrom": {"secretKeyRef": {"name": key.name, "key": key.key}},
        },
        *[dict(e) for e in engine.env],
    ]
    if engine.run_as_user is not None:
        # A user with no home in the image gets HOME=/, which it cannot write.
        volumes.append({"name": "home", "emptyDir": {}})
        mounts.append({"name": "home", "mountPath": ENGINE_HOME})
        env.insert(1, {"name": "HOME", "value": ENGINE_HOME})
    init_containers: list[dict[str, Any]] = []
    if spec.router.tracing is not None:
        env.append(dict(ENGINE_TRACING_ENV))
    if spec.model.source.type == "hub":
        init_containers.append(fetch_weights_container(sdd, opts))
        # The weights are in the cache: SGLang must not reach for the hub itself.
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    probe_port = {"port": "http"}
    container: dict[str, Any] = {
        "name": "engine",
        "image": engine.image or opts.engine_image,
        "imagePullPolicy": engine.image_pull_policy,
        "command": ["python3", "-m", "sglang.launch_server"],
        "args": engine_args(sdd),
        "env": env,
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "resources": _engine_resources(engine),
        "volumeMounts": mounts,
        "securityContext": engine_container_security(engine),
        # /health and /health_generate need no API key in SGLang 0.5.17 (utils/auth.py).
        "startupProbe": {
            "httpGet": {"path": "/health", **probe_port},
            "periodSeconds": 10,
            "failureThreshold": max(1, engine.startup_timeout_seconds // 10),
            "timeoutSeconds": 5,
        },
        "readinessProbe": {
            "httpGet": {"path": "/health_generate", **probe_port},
            "periodSeconds": 10,
            "timeoutSeconds": 30,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", **probe_port},
            "periodSeconds": 15,
            "timeoutSeconds": 10,
            "failureThreshold": 4,
        },
        # A terminating pod leaves the router's endpoints within seconds; the hook then waits
        # for the requests it already runs before SGLang gets SIGTERM.
        "lifecycle": {"preStop": engine_drain(port, drain)},
    }
    pod_spec: dict[str, Any] = {
        **({"initContainers": init_containers} if init_containers else {}),
        "containers": [container],
        "volumes": volumes,
        "nodeSelector": dict(placement.node_selector),
        "tolerations": [dict(t) for t in placement.tolerations],
        "terminationGracePeriodSeconds": drain + ENGINE_SHUTDOWN_SECONDS,
        "enableServiceLinks": False,
        # The pod reads no Kubernetes API: no token mounted (a workload-identity webhook
        # mounts its own, for the ServiceAccount the resource names).
        **({"serviceAccountName": account} if (account := engine.service_account_name) else {}),
        "automountServiceAccountToken": False,
        "securityContext": {
            "seccompProfile": {"type": "RuntimeDefault"},
            # The download runs as specgate's user: a cache claim must be writable by it.
            **({"fsGroup": RESTRICTED_USER} if init_containers else {}),
        },
    }
    if opts.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in opts.image_pull_secrets]
    if placement.affinity is not None:
        pod_spec["affinity"] = dict(placement.affinity)
    if placement.priority_class_name:
        pod_spec["priorityClassName"] = placement.priority_class_name
    if placement.runtime_class_name:
        pod_spec["runtimeClassName"] = placement.runtime_class_name
    pod_labels = labels(sdd, "engine")
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(sdd, n["engine"], "engine"),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector(sdd, "engine")},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {
                    "maxSurge": spec.disruption.max_surge,
                    "maxUnavailable": spec.disruption.max_unavailable,
                },
            },
            "template": {
                "metadata": {
                    "labels": pod_labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(port),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def engine_service(sdd: api.SpecDecodeDeployment) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(sdd, names(sdd.name)["engine"], "engine"),
        "spec": {
            # Headless: the router addresses pods one by one through EndpointSlices.
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": selector(sdd, "engine"),
            "ports": [
                {"name": "http", "port": sdd.spec.engine.port, "targetPort": "http"},
            ],
        },
    }


def router_client_auth(auth: api.ClientAuthSpec) -> dict[str, Any]:
    """The router's clientAuth: the keys file and the OIDC settings as the router pod sees
    them (the CA ConfigMap mounted as a file)."""
    out: dict[str, Any] = {}
    if auth.secret_name is not None:
        out["keysFile"] = f"{CLIENT_KEYS_DIR}/{CLIENT_KEYS_FILE}"
    if auth.oidc is not None:
        out["oidc"] = auth.oidc.model_dump(by_alias=True, mode="json", exclude={"ca"})
        if auth.oidc.ca is not None:
            out["oidc"]["caFile"] = f"{OIDC_CA_DIR}/{OIDC_CA_FILE}"
    return out


def router_config(sdd: api.SpecDecodeDeployment) -> dict[str, Any]:
    """The router's policy file (the router's own settings model reads it)."""
    control = sdd.spec.speculative.control
    n = names(sdd.name)
    return {
        "model": served_model_name(sdd),
        "defaultClass": sdd.spec.router.default_class,
        "discovery": {
            "kubernetes": {
                "namespace": sdd.namespace,
                "service": n["engine"],
                "port": sdd.spec.engine.port,
            }
        },
        "control": control.model_dump(by_alias=True, mode="json"),
        "plugins": sdd.spec.router.plugins.model_dump(by_alias=True, mode="json"),
        "resilience": {
            "firstByteTimeoutSeconds": sdd.spec.router.timeouts.first_byte_seconds,
            "readTimeoutSeconds": sdd.spec.router.timeouts.between_chunks_seconds,
            "answerTimeoutSeconds": sdd.spec.router.timeouts.answer_seconds,
            "drainSeconds": sdd.spec.disruption.drain_for(sdd.spec.router.timeouts),
        },
        "pools": {
            "minLatencyFraction": sdd.spec.router.pools.min_latency_fraction,
            "maxLatencyFraction": sdd.spec.router.pools.max_latency_fraction,
            "throughputBatchPerPod": sdd.spec.router.pools.throughput_batch_per_pod,
            "latencyTpotTargetMs": sdd.spec.router.pools.latency_tpot_target_ms,
        },
        **(
            {"clientAuth": router_client_auth(sdd.spec.router.client_auth)}
            if sdd.spec.router.client_auth is not None
            else {}
        ),
        **(
            {"tracing": sdd.spec.router.tracing.model_dump(by_alias=True, mode="json")}
            if sdd.spec.router.tracing is not None
            else {}
        ),
        **(
            {"allowedEngineFields": sorted(sdd.spec.router.allowed_engine_fields)}
            if sdd.spec.router.allowed_engine_fields
            else {}
        ),
        "leaderElection": {"leaseName": n["lease"], "namespace": sdd.namespace},
        "statusTarget": {"namespace": sdd.namespace, "name": sdd.name},
    }


def router_configmap(sdd: api.SpecDecodeDeployment) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(sdd, names(sdd.name)["router"], "router"),
        "data": {ROUTER_CONFIG_FILE: yaml.safe_dump(router_config(sdd), sort_keys=True)},
    }


def restricted_container_security() -> dict[str, Any]:
    """The container security context of specgate's own pods (operator and router): non-root,
    read-only root filesystem, no privilege escalation, no capabilities."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RESTRICTED_USER,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def router_service_account(sdd: api.SpecDecodeDeployment) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(sdd, names(sdd.name)["router"], "router"),
        "automountServiceAccountToken": True,
    }


ROUTER_RULES: list[dict[str, Any]] = [
    {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    },
    {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        # Renewals and takeovers are merge patches conditional on resourceVersion.
        "verbs": ["get", "create", "patch"],
    },
    {"apiGroups": [api.GROUP], "resources": [api.PLURAL], "verbs": ["get"]},
    {"apiGroups": [api.GROUP], "resources": [f"{api.PLURAL}/status"], "verbs": ["get", "patch"]},
]
"""What the router does with the API: watch engine endpoints, hold its Lease, publish pod state."""


def router_role(sdd: api.SpecDecodeDeployment) -> Manifest:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(sdd, names(sdd.name)["router"], "router"),
        "rules": ROUTER_RULES,
    }


def router_role_binding(sdd: api.SpecDecodeDeployment) -> Manifest:
    name = names(sdd.name)["router"]
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(sdd, name, "router"),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": sdd.namespace}],
    }


def router_deployment(sdd: api.SpecDecodeDeployment, opts: RenderOptions) -> Manifest:
    router = sdd.spec.router
    n = names(sdd.name)
    key = api_key_ref(sdd)
    container = {
        "name": "router",
        "image": router.image or opts.router_image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["specgate", "router"],
        "args": [
            "--config",
            f"{ROUTER_CONFIG_DIR}/{ROUTER_CONFIG_FILE}",
            "--port",
            str(router.port),
        ],
        "env": [
            {
                "name": ENGINE_KEY_ENV,
                "valueFrom": {"secretKeyRef": {"name": key.name, "key": key.key}},
            },
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "ports": [{"name": "http", "containerPort": router.port, "protocol": "TCP"}],
        "resources": {k: dict(v) for k, v in router.resources.items()},
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        # The config is re-read when the ConfigMap volume changes: no restart, no dropped streams.
        "volumeMounts": [{"name": "config", "mountPath": ROUTER_CONFIG_DIR, "readOnly": True}],
        "securityContext": restricted_container_security(),
        # Endpoints take a few seconds to drop a terminating pod everywhere: keep serving
        # through them, then drain in-flight streams on SIGTERM (resilience.drainSeconds).
        "lifecycle": {"preStop": pause(ROUTER_PRESTOP_SECONDS)},
    }
    volumes: list[dict[str, Any]] = [{"name": "config", "configMap": {"name": n["router"]}}]
    auth = router.client_auth
    if auth is not None and auth.secret_name is not None:
        # The keys file (hashes only); the router reads it again when the Secret changes.
        volumes.append(
            {
                "name": "client-keys",
                "secret": {
                    "secretName": auth.secret_name,
                    "items": [{"key": auth.key, "path": CLIENT_KEYS_FILE}],
                },
            }
        )
        container["volumeMounts"].append(  # type: ignore[attr-defined]
            {"name": "client-keys", "mountPath": CLIENT_KEYS_DIR, "readOnly": True}
        )
    if auth is not None and auth.oidc is not None and auth.oidc.ca is not None:
        volumes.append(
            {
                "name": "oidc-ca",
                "configMap": {
                    "name": auth.oidc.ca.name,
                    "items": [{"key": auth.oidc.ca.key, "path": OIDC_CA_FILE}],
                },
            }
        )
        container["volumeMounts"].append(  # type: ignore[attr-defined]
            {"name": "oidc-ca", "mountPath": OIDC_CA_DIR, "readOnly": True}
        )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(sdd, n["router"], "router"),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": selector(sdd, "router")},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {
                    "labels": labels(sdd, "router"),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(router.port),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "serviceAccountName": n["router"],
                    # Replicas on different nodes where there are several: one node's loss
                    # leaves the API up.
                    "affinity": {
                        "podAntiAffinity": {
                            "preferredDuringSchedulingIgnoredDuringExecution": [
                                {
                                    "weight": 100,
                                    "podAffinityTerm": {
                                        "topologyKey": "kubernetes.io/hostname",
                                        "labelSelector": {"matchLabels": selector(sdd, "router")},
                                    },
                                }
                            ]
                        }
                    },
                    **(
                        {"imagePullSecrets": [{"name": x} for x in opts.image_pull_secrets]}
                        if opts.image_pull_secrets
                        else {}
                    ),
                    **(
                        {"nodeSelector": dict(router.node_selector)} if router.node_selector else {}
                    ),
                    **(
                        {"tolerations": [dict(t) for t in router.tolerations]}
                        if router.tolerations
                        else {}
                    ),
                    "containers": [container],
                    "volumes": volumes,
                    # The preStop pause, then the drain of in-flight streams, then exit.
                    "terminationGracePeriodSeconds": ROUTER_PRESTOP_SECONDS
                    + sdd.spec.disruption.drain_for(sdd.spec.router.timeouts)
                    + ROUTER_SHUTDOWN_SECONDS,
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                },
            },
        },
    }


def router_service(sdd: api.SpecDecodeDeployment) -> Manifest:
    router = sdd.spec.router
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(sdd, names(sdd.name)["router"], "router"),
        "spec": {
            "type": router.service_type,
            "selector": selector(sdd, "router"),
            "ports": [{"name": "http", "port": router.port, "targetPort": "http"}],
        },
    }


def http_route(sdd: api.SpecDecodeDeployment) -> Manifest | None:
    """The Gateway API HTTPRoute to the router Service, or None when the spec asks for none.
    Only the OpenAI API paths are routed (see api.HTTPRouteSpec)."""
    route = sdd.spec.router.http_route
    if route is None:
        return None
    parents = []
    for ref in route.parent_refs:
        parent: dict[str, Any] = {
            "group": "gateway.networking.k8s.io",
            "kind": "Gateway",
            "name": ref.name,
        }
        if ref.namespace is not None:
            parent["namespace"] = ref.namespace
        if ref.section_name is not None:
            parent["sectionName"] = ref.section_name
        parents.append(parent)
    spec: dict[str, Any] = {
        "parentRefs": parents,
        "rules": [
            {
                "matches": [{"path": {"type": "PathPrefix", "value": "/v1/"}}],
                "backendRefs": [{"name": names(sdd.name)["router"], "port": sdd.spec.router.port}],
            }
        ],
    }
    if route.hostnames:
        spec["hostnames"] = list(route.hostnames)
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": _meta(sdd, names(sdd.name)["router"], "router"),
        "spec": spec,
    }


def engine_api_key_secret(sdd: api.SpecDecodeDeployment, api_key: str) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(sdd, names(sdd.name)["secret"], "engine"),
        "type": "Opaque",
        "stringData": {"api-key": api_key},
    }


def pod_disruption_budget(sdd: api.SpecDecodeDeployment, component: str) -> Manifest:
    """At most one of the component's pods down at a time through voluntary disruptions
    (node drains); none for a one-replica model whose resource protects its last pod."""
    protect = (
        component == "engine" and sdd.spec.replicas == 1 and sdd.spec.disruption.protect_last_pod
    )
    budget = {"minAvailable": 1} if protect else {"maxUnavailable": 1}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(sdd, names(sdd.name)[component], component),
        "spec": {**budget, "selector": {"matchLabels": selector(sdd, component)}},
    }


def engine_network_policy(sdd: api.SpecDecodeDeployment, opts: RenderOptions) -> Manifest:
    port = [{"protocol": "TCP", "port": sdd.spec.engine.port}]
    ingress: list[dict[str, Any]] = [
        {"from": [{"podSelector": {"matchLabels": selector(sdd, "router")}}], "ports": port}
    ]
    if opts.metrics_namespace_labels:
        # Scrapers reach the same port; SGLang serves /metrics and /health without the key, and
        # everything else there still needs it.
        scraper = {"namespaceSelector": {"matchLabels": dict(opts.metrics_namespace_labels)}}
        ingress.append({"from": [scraper], "ports": port})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(sdd, names(sdd.name)["engine"], "engine"),
        "spec": {
            "podSelector": {"matchLabels": selector(sdd, "engine")},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def service_monitor(
    sdd: api.SpecDecodeDeployment, component: str, labels: dict[str, str] | None = None
) -> Manifest:
    meta = _meta(sdd, names(sdd.name)[component], component)
    meta["labels"] = {**(labels or {}), **meta["labels"]}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": selector(sdd, component)},
            # The dashboards group by specgate_io_deployment, as the chart's PodMonitors give it.
            "podTargetLabels": [LABEL_DEPLOYMENT],
            "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
        },
    }


def render(
    sdd: api.SpecDecodeDeployment,
    opts: RenderOptions | None = None,
    *,
    api_key: str | None = None,
) -> list[Manifest]:
    """All child objects of one resource, in apply order.

    `api_key` is the value for the generated engine-key Secret; the Secret is rendered only when
    the spec names none and a value is given (the operator generates one and creates the Secret
    only if absent, so a key is never rotated by accident).
    """
    opts = opts or RenderOptions()
    out: list[Manifest] = []
    if sdd.spec.api_key_secret_ref is None and api_key is not None:
        out.append(engine_api_key_secret(sdd, api_key))
    out += [
        router_service_account(sdd),
        router_role(sdd),
        router_role_binding(sdd),
        router_configmap(sdd),
        engine_service(sdd),
        engine_deployment(sdd, opts),
        pod_disruption_budget(sdd, "engine"),
        engine_network_policy(sdd, opts),
        router_deployment(sdd, opts),
        pod_disruption_budget(sdd, "router"),
        router_service(sdd),
    ]
    route = http_route(sdd)
    if route is not None:
        out.append(route)
    if opts.service_monitor:
        labels = dict(opts.service_monitor_labels)
        out += [service_monitor(sdd, "engine", labels), service_monitor(sdd, "router", labels)]
    return out


def child_refs(sdd_name: str, namespace: str) -> list[tuple[str, str, str, str]]:
    """(apiVersion, kind, namespace, name) of every child the operator may have created, for
    deletion; independent of the spec so a resource with a broken spec is still cleaned up."""
    n = names(sdd_name)
    return [
        ("gateway.networking.k8s.io/v1", "HTTPRoute", namespace, n["router"]),
        ("monitoring.coreos.com/v1", "ServiceMonitor", namespace, n["router"]),
        ("monitoring.coreos.com/v1", "ServiceMonitor", namespace, n["engine"]),
        ("v1", "Service", namespace, n["router"]),
        ("apps/v1", "Deployment", namespace, n["router"]),
        ("networking.k8s.io/v1", "NetworkPolicy", namespace, n["engine"]),
        ("policy/v1", "PodDisruptionBudget", namespace, n["engine"]),
        ("policy/v1", "PodDisruptionBudget", namespace, n["router"]),
        ("apps/v1", "Deployment", namespace, n["engine"]),
        ("v1", "Service", namespace, n["engine"]),
        ("v1", "ConfigMap", namespace, n["router"]),
        ("rbac.authorization.k8s.io/v1", "RoleBinding", namespace, n["router"]),
        ("rbac.authorization.k8s.io/v1", "Role", namespace, n["router"]),
        ("v1", "ServiceAccount", namespace, n["router"]),
        ("v1", "Secret", namespace, n["secret"]),
    ]
