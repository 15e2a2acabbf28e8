"""The SpecDecodeDeployment API, v1alpha1: the one typed definition of the resource.

The CRD in `crds/` is generated from these models (`specgate crd`), the operator parses resources
with them, and the docs' CRD reference is generated from them too. Attribute docstrings become the
schema's descriptions, so every field documents itself once, here.

Cross-field rules are CEL expressions (`x-kubernetes-validations`) attached to the model that
owns the fields; the API server enforces them on admission, and `specgate.admission` evaluates
the same expressions in tests and in `specgate render`.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

from specgate import contract

GROUP = "specgate.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "SpecDecodeDeployment"
PLURAL = "specdecodedeployments"
SINGULAR = "specdecodedeployment"
SHORT_NAMES = ["sdd"]

"""The value GPU feature discovery puts in `nvidia.com/gpu.product` for that card."""

# A Kubernetes resource.Quantity as a string ("16Gi", "500m", "1.5").
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
"""A Kubernetes object name (RFC 1123 subdomain)."""
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$"

# Flags the operator renders itself; letting extraArgs repeat them would silently fight the spec.
# --trust-remote-code runs code from the model repository, --enable-custom-logit-processor runs
# pickled code from requests and --config reads further flags from a file: each needs the
# resource to say so in its own field, or is refused. "speculative-" stands for every flag that
# starts with it.
RESERVED_ENGINE_FLAGS = (
    "model-path",
    "model",
    "served-model-name",
    "revision",
    "dtype",
    "context-length",
    "tp",
    "tp-size",
    "tensor-parallel-size",
    "host",
    "port",
    "api-key",
    "admin-api-key",
    "enable-metrics",
    "enable-trace",
    "otlp-traces-endpoint",
    "speculative-",
    "mem-fraction-static",
    "max-running-requests",
    "cuda-graph-max-bs",
    "cuda-graph-max-bs-decode",
    "trust-remote-code",
    "enable-custom-logit-processor",
    "config",
)


def _prefixes_pattern(words: tuple[str, ...]) -> str:
    """A regex matching every non-empty prefix of any of `words`, built on their trie so that
    shared prefixes are written once (the API server charges a rule by its regex's length)."""
    trie: dict[str, Any] = {}
    for word in words:
        if not re.fullmatch(r"[a-z0-9-]+", word):
            raise ValueError(f"reserved flag {word!r}: lowercase letters, digits and '-' only")
        node = trie
        for char in word:
            node = node.setdefault(char, {})

    def alternatives(node: dict[str, Any]) -> str:
        branches = [
            char + (f"({alternatives(child)})?" if child else "")
            for char, child in sorted(node.items())
        ]
        return branches[0] if len(branches) == 1 else "|".join(branches)

    return alternatives(trie)


RESERVED_FLAG_PATTERN = (
    "^--?(speculative-[a-z0-9-]*|" + _prefixes_pattern(RESERVED_ENGINE_FLAGS) + ")(=.*)?$"
)
"""An argument that names a reserved flag as SGLang's parser reads it: Python's argparse takes
any unambiguous prefix of a long option (`--trust-remote` is `--trust-remote-code`) and the
`=VALUE` form, so a prefix of a reserved name is refused too (SGLang refuses an ambiguous one
itself, so nothing usable is lost). Every speculative flag is reserved."""

KubeObject = Annotated[
    dict[str, Any],
    Field(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}),
]
"""A Kubernetes core type passed through as is (the API server validates it in the pod)."""


def _cel(rule: str, message: str, field_path: str | None = None) -> JsonDict:
    out: JsonDict = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        frozen=True,
    )


class PersistentVolumeClaimSource(_Model):
    """Model weights on a PersistentVolumeClaim in the resource's namespace."""

    claim_name: str = Field(min_length=1, max_length=253)
    """Name of the PersistentVolumeClaim that holds the weights."""
    sub_path: str = Field(default="", max_length=1024)
    """Path inside the volume to mount instead of its root."""
    read_only: bool = True
    """Mount the claim read-only (the engine never writes to it)."""


class HostPathSource(_Model):
    """Model weights in a directory on every GPU node (for example a local NVMe cache)."""

    path: str = Field(min_length=1, max_length=4096, pattern=r"^/")
    """Absolute directory on the node."""


class HubTokenRef(_Model):
    """A key of a Secret in the resource's namespace holding the hub token."""

    name: str = Field(min_length=1, max_length=253)
    """Secret name."""
    key: str = Field(default="token", min_length=1, max_length=253)
    """Key within the Secret."""


class HubSource(_Model):
    """Download the target and draft from a model hub before the engine starts."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "self.cache != 'pvc' || has(self.cacheClaimName)",
                    "cache 'pvc' needs cacheClaimName",
                ),
            ]
        }
    )

    endpoint: str = Field(
        default="https://huggingface.co", pattern=r"^https?://[^\s/]+(/[^\s]*)?$", max_length=512
    )
    """The hub (Hugging Face's file API, or a mirror that serves it)."""
    token_secret_ref: HubTokenRef | None = None
    """The token for gated or private repositories (sent as a Bearer token)."""
    cache: Literal["emptyDir", "pvc"] = "emptyDir"
    """Where downloads go: `emptyDir` (each pod downloads once per start) or `pvc` (a claim,
    ReadWriteMany for several replicas, that keeps revisions across pods and restarts)."""
    cache_claim_name: str | None = Field(default=None, min_length=1, max_length=253)
    """The claim when cache is `pvc`."""
    cache_size: str = Field(default="500Gi", pattern=QUANTITY_PATTERN)
    """Size limit of the emptyDir cache: models that cannot fit in it are refused before they
    are downloaded (past it the kubelet would evict the pod)."""
    allow_patterns: list[Annotated[str, Field(min_length=1, max_length=256)]] | None = Field(
        default=None, max_length=64
    )
    """Glob patterns of the repository files to download (`*` crosses folders). Unset: what
    SGLang loads (configuration and tokenizer files, and the safetensors weights, or the
    PyTorch ones when a repository has none); duplicate checkpoints such as `original/*.pth`
    stay on the hub."""


class WeightsSource(_Model):
    """Where the weights come from, mounted at `mountPath` in the engine container."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "self.type != 'pvc' || has(self.pvc)",
                    "type 'pvc' needs spec.model.source.pvc.claimName",
                ),
                _cel(
                    "self.type != 'hostPath' || has(self.hostPath)",
                    "type 'hostPath' needs spec.model.source.hostPath.path",
                ),
                _cel(
                    "self.type == 'pvc' || !has(self.pvc)",
                    "pvc is set but type is not 'pvc': set type: pvc or remove pvc",
                ),
                _cel(
                    "self.type == 'hostPath' || !has(self.hostPath)",
                    "hostPath is set but type is not 'hostPath': set type: hostPath or remove it",
                ),
                _cel(
                    "self.type == 'hub' || !has(self.hub)",
                    "hub is set but type is not 'hub': set type: hub or remove hub",
                ),
            ]
        }
    )

    type: Literal["pvc", "hostPath", "image", "hub"] = "image"
    """`pvc`: a PersistentVolumeClaim; `hostPath`: a node directory; `image`: the weights are baked
    into the engine image (or model paths are hub ids the image can resolve offline); `hub`:
    model paths are hub ids (OWNER/NAME), downloaded at their revisions into a cache volume by
    an init container before the engine starts, which then runs with the hub switched off."""
    pvc: PersistentVolumeClaimSource | None = None
    """The claim, when type is `pvc`."""
    host_path: HostPathSource | None = None
    """The node directory, when type is `hostPath`."""
    hub: HubSource | None = None
    """The hub and the cache, when type is `hub` (defaults: huggingface.co, an emptyDir)."""
    mount_path: str = Field(default="/models", pattern=r"^/", max_length=1024)
    """Where the weights are mounted in the engine container; relative model paths resolve here."""


class ModelSpec(_Model):
    """The target model."""

    path: str = Field(min_length=1, max_length=1024)
    """Model path (relative paths resolve under `source.mountPath`) or hub id, as SGLang's
    `--model-path` takes it."""
    revision: str | None = Field(default=None, max_length=255)
    """Hub revision (branch, tag or commit) when `path` is a hub id."""
    served_name: str | None = Field(default=None, min_length=1, max_length=255)
    """Model name clients send in OpenAI requests; defaults to the resource name."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Weight and activation dtype."""
    context_length: int | None = Field(default=None, ge=128, le=4_194_304)
    """Maximum context length in tokens; defaults to the model's config."""
    trust_remote_code: bool = False
    """Let SGLang run Python code shipped with the model and draft weights
    (`--trust-remote-code`): only for weights whose code you trust."""
    source: WeightsSource = Field(default_factory=WeightsSource)
    """Where the weights come from."""


class DraftModelSpec(_Model):
    """The EAGLE draft model."""

    path: str = Field(min_length=1, max_length=1024)
    """Draft model path (same resolution as `spec.model.path`) or hub id."""
    revision: str | None = Field(default=None, max_length=255)
    """Hub revision of the draft."""


class SpeculationControl(_Model):
    """How specgate switches speculation with load."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "self.minThreshold <= self.threshold && self.threshold <= self.maxThreshold",
                    "threshold must lie within [minThreshold, maxThreshold]: raise maxThreshold,"
                    " lower minThreshold or move threshold",
                ),
            ]
        }
    )

    mode: Literal["dynamic", "alwaysOn", "off"] = "dynamic"
    """`dynamic`: the router sets each pod's speculation-disable batch threshold where it
    predicts speculation stops paying, from the engine's step-cost profile and acceptance
    (or, for an engine that reports neither, where its samples show it);
    `alwaysOn`: speculate at every batch size; `off`: never speculate (the draft stays loaded and in
    sync, so switching back needs no restart)."""
    threshold: int = Field(default=8, ge=0, le=4096)
    """Speculation-disable batch threshold a pod starts with, until the router predicts or
    learns its own: a pod speculates while its decode batch holds at most this many requests.
    0 never speculates."""
    min_threshold: int = Field(default=0, ge=0, le=4096)
    """Lowest threshold the controller may set."""
    max_threshold: int = Field(default=4096, ge=0, le=4096)
    """Highest threshold the controller may set: above this batch a pod never speculates, even
    where speculation would pay. The default bounds nothing: a prediction stops at the largest
    batch the engine's step profile covers, and an estimate from samples at the batches it has
    seen. A bound of 64 cost 45% at 128 requests on an H200 (BENCHMARKS.md section 0c)."""
    hysteresis: int = Field(default=2, ge=0, le=256)
    """A move of at most this many requests is pushed only where it switches the mode at the
    batch the pod runs now; any move needs to switch a batch the pod ran within the last
    cooldown to a mode predicted 3% faster there."""
    cooldown_seconds: float = Field(default=30, ge=0, le=3600)
    """How long a move back the way the last one came waits (unless a trial read the modes
    since): a stationary load near the crossover does not swing the threshold on noise."""
    probe_interval_seconds: float = Field(default=1800, ge=0, le=86400)
    """How long a trial's reading stands. Where the model of a pod's rates could be wrong at
    the batch it holds and a few scrapes can tell, the router runs the other mode there for a
    few seconds and its own again (a trial; one pod of a deployment at a time, never in the
    latency pool), and reads the correction it then applies; that reading, or the decision
    that no trial was worth it, stands this long at that batch while the load and workload
    stay. 0 runs no trials."""


class SpeculativeSpec(_Model):
    """EAGLE speculative decoding."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "self.control.mode != 'dynamic' || self.eagleTopk == 1",
                    "control.mode 'dynamic' needs eagleTopk: 1 (the runtime threshold switches"
                    " chain drafts only); set eagleTopk: 1 or control.mode: alwaysOn",
                ),
                _cel(
                    "self.eagleTopk != 1 || self.numDraftTokens == self.numSteps + 1",
                    "with eagleTopk: 1, numDraftTokens must equal numSteps + 1",
                ),
                _cel(
                    "self.numDraftTokens <= self.eagleTopk * self.numSteps + 1",
                    "numDraftTokens cannot exceed eagleTopk * numSteps + 1 (the draft tree size)",
                ),
                _cel(
                    "self.offStepTokens <= self.numDraftTokens",
                    "offStepTokens cannot exceed numDraftTokens (an off step's tokens take the"
                    " KV slots a speculating step keeps for its drafts): lower offStepTokens",
                ),
            ]
        }
    )

    algorithm: Literal["EAGLE3", "EAGLE"] = "EAGLE3"
    """Speculative algorithm, as SGLang's `--speculative-algorithm` takes it."""
    draft_model: DraftModelSpec
    """The draft model trained for the target."""
    num_steps: int = Field(default=3, ge=1, le=16)
    """Draft steps per decode step (`--speculative-num-steps`)."""
    eagle_topk: int = Field(default=1, ge=1, le=16)
    """Branching factor of the draft tree (`--speculative-eagle-topk`)."""
    num_draft_tokens: int = Field(default=4, ge=2, le=257)
    """Tokens verified per request per step (`--speculative-num-draft-tokens`)."""
    off_step_tokens: int = Field(default=1, ge=1, le=257)
    """Tokens each request decodes in one step with speculation off
    (`--speculative-off-step-tokens`): that many plain decode forwards run back to back, so the
    engine's per-step scheduling work is paid once per this many tokens, and tokens reach
    clients that many at a time while speculation is off. 4 makes the off mode faster than a
    plain server on small models, where the host's per-step work dominates (BENCHMARKS.md,
    "Speculation off against a plain server"); the default of 1 is SGLang's own plain decode
    step, the one verified at every tensor-parallel size. At most numDraftTokens; ignored with
    control.mode alwaysOn."""
    control: SpeculationControl = Field(default_factory=SpeculationControl)
    """Runtime control of speculation."""


class EngineSpec(_Model):
    """The SGLang engine pods."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "self.gpusPerPod % self.tensorParallelSize == 0",
                    "gpusPerPod must be a multiple of tensorParallelSize",
                ),
                _cel(
                    "self.extraArgs.all(a, !a.matches('" + RESERVED_FLAG_PATTERN + "'))",
                    "extraArgs may not set flags the operator renders from the spec (model,"
                    " parallelism, host/port, API key, metrics, speculative, memory and batch"
                    " flags, or a prefix of one) or that run foreign code (--trust-remote-code:"
                    " set spec.model.trustRemoteCode; --enable-custom-logit-processor, --config):"
                    " use the matching spec field instead",
                ),
            ]
        }
    )

    image: str | None = Field(default=None, min_length=1, max_length=512)
    """Engine image; defaults to the specgate worker image the operator was configured with."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Image pull policy of the engine container."""
    tensor_parallel_size: Literal[1, 2, 4, 8] = 8
    """Tensor-parallel degree (`--tp`)."""
    gpus_per_pod: int = Field(default=8, ge=1, le=8)
    """GPUs each engine pod requests (of `gpuResourceName`)."""
    gpu_resource_name: str = Field(
        default="nvidia.com/gpu",
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[a-zA-Z0-9]([-a-zA-Z0-9_.]*[a-zA-Z0-9])?$",
    )
    """The extended resource the GPUs are requested as: `nvidia.com/gpu` from NVIDIA's device
    plugin, or another name its configuration gives (a MIG profile such as
    `nvidia.com/mig-3g.40gb`, a renamed or shared resource)."""
    port: int = Field(default=30000, ge=1024, le=65535)
    """Port the engine listens on inside the pod."""
    mem_fraction_static: float | None = Field(default=None, ge=0.05, le=0.98)
    """Fraction of GPU memory for weights and KV cache (`--mem-fraction-static`); SGLang picks
    when unset."""
    max_running_requests: int | None = Field(default=None, ge=1, le=65536)
    """Cap on concurrently running requests per pod (`--max-running-requests`)."""
    cuda_graph_max_bs: int | None = Field(default=None, ge=1, le=4096)
    """Largest decode batch captured in CUDA graphs (`--cuda-graph-max-bs-decode`)."""
    extra_args: list[Annotated[str, Field(max_length=512)]] = Field(
        default_factory=list, max_length=64
    )
    """Further SGLang flags, appended verbatim (at most 64, each at most 512 characters: the
    API server bounds the cost of the rule that checks them)."""
    env: list[KubeObject] = Field(default_factory=list, max_length=128)
    """Environment variables (core/v1 EnvVar) for the engine container."""
    resources: KubeObject = Field(default_factory=dict)
    """Extra container resources (core/v1 ResourceRequirements); the GPU count always comes from
    `gpusPerPod`."""
    shm_size: str = Field(default="16Gi", pattern=QUANTITY_PATTERN)
    """Size of the memory-backed /dev/shm (NCCL needs it for tensor parallelism)."""
    run_as_user: int | None = Field(default=None, ge=1, le=2147483647)
    """Run the engine as this non-root user ID, with HOME (SGLang's kernel caches) on a
    writable emptyDir; unset, it runs as the image's user, which is root in SGLang's image.
    Either way it runs without privilege escalation, with no capabilities and the runtime's
    default seccomp profile."""
    startup_timeout_seconds: int = Field(default=1800, ge=60, le=7200)
    """How long the startup probe waits for weights to load and CUDA graphs to capture."""
    service_account_name: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN
    )
    """ServiceAccount of the engine pods (and a hub source's download), for workload identity
    to an object store or a registry. It must carry the label `specgate.io/referable=true`,
    set by whoever may write it. No API token is mounted either way."""


class PlacementSpec(_Model):
    """Where engine pods may run."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels engine pods require; none by default (the pods request `nvidia.com/gpu`, so
    they land on GPU nodes). To pin a GPU model, use GPU feature discovery's product label,
    e.g. `nvidia.com/gpu.product: NVIDIA-H200`."""
    tolerations: list[KubeObject] = Field(
        default_factory=lambda: [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ],
        max_length=64,
    )
    """Tolerations (core/v1 Toleration); by default the `nvidia.com/gpu` taint."""
    affinity: KubeObject | None = None
    """Affinity (core/v1 Affinity) for engine pods."""
    priority_class_name: str | None = Field(default=None, min_length=1, max_length=253)
    """PriorityClass for engine pods."""
    runtime_class_name: str | None = Field(default=None, min_length=1, max_length=253)
    """RuntimeClass for engine pods (for example `nvidia`)."""


class PoolSplit(_Model):
    """Bounds on the share of pods kept in the latency pool (speculating, small batches); the
    router sizes the split from the observed class mix within them."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "self.minLatencyFraction <= self.maxLatencyFraction",
                    "minLatencyFraction must not exceed maxLatencyFraction",
                ),
            ]
        }
    )

    min_latency_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    """Lowest share of pods in the latency pool."""
    max_latency_fraction: float = Field(default=1.0, ge=0.0, le=1.0)
    """Highest share of pods in the latency pool."""
    throughput_batch_per_pod: int = Field(default=24, ge=1, le=4096)
    """Running requests per pod at which plain decoding reaches about 95% of its peak throughput
    (24 on the RTX PRO 6000 profile). The latency pool only takes pods the throughput traffic
    does not need at this batch: under heavy load, throughput capacity comes first and latency
    traffic shares pods. Higher values buy latency traffic speculation with fleet tokens."""
    latency_tpot_target_ms: float | None = Field(default=None, gt=0.0, le=10000.0)
    """Time per output token the latency class should get. When set, the latency pool holds
    its traffic at the largest batch where a speculating pod is predicted to meet it (its
    step profile over the accept length, plus its measured time between decode steps per
    token times the batch; at most the threshold), forms even where spreading all traffic
    would keep every pod speculating, lets throughput traffic fill the rest of that batch, and
    forms no pool when the pods that leaves cannot hold it. Unset: the threshold sizes the
    pool."""


FilterName = Literal["healthy", "not-draining", "circuit-closed", "fresh-metrics"]
ScorerName = Literal["load", "class-fit"]
PickerName = Literal["max-score", "weighted-random"]


def _default_filters() -> list[FilterName]:
    return ["healthy", "not-draining", "circuit-closed", "fresh-metrics"]


class WeightedScorer(_Model):
    """A scorer and its weight in the sum the picker compares."""

    name: ScorerName
    """`load`: free capacity (running and queued requests against the pod's cap). `class-fit`:
    latency traffic to pods that will speculate it, in the latency pool first; throughput
    traffic to the throughput pool."""
    weight: float = Field(default=1.0, ge=0.0, le=1000.0)
    """Weight of this scorer's score, in [0, 1], in the sum."""


class RouterPlugins(_Model):
    """How the router places a request: filters drop pods that cannot take it, scorers rate the
    rest in [0, 1], and the picker chooses by the weighted sum, each plugin named."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "'healthy' in self.filters",
                    "filters must include healthy: without it requests go to pods that are down",
                ),
            ]
        }
    )

    filters: list[FilterName] = Field(default_factory=_default_filters, max_length=8)
    """Applied in order. `healthy`: the pod answers its scrapes; `not-draining`: it is not
    leaving; `circuit-closed`: its circuit breaker lets requests through; `fresh-metrics`
    (soft: ignored when it would leave no pod): its metrics are recent."""
    scorers: list[WeightedScorer] = Field(
        default_factory=lambda: [
            WeightedScorer(name="load", weight=1.0),
            WeightedScorer(name="class-fit", weight=2.0),
        ],
        max_length=8,
    )
    """Scorers and their weights; class-fit weighs more than load so that latency traffic
    speculates unless its pods are full."""
    picker: PickerName = "max-score"
    """`max-score`: the highest weighted sum, ties broken at random; `weighted-random`: a pod
    drawn with probability proportional to its weighted sum."""

    @model_validator(mode="after")
    def _healthy_first(self) -> RouterPlugins:
        # The same rule as the CEL one above, for the router's own configuration file.
        if "healthy" not in self.filters:
            raise ValueError(
                "filters must include healthy: without it requests go to pods that are down"
            )
        return self


class RouterTimeouts(_Model):
    """How long the router waits on an engine pod before giving up on it."""

    first_byte_seconds: float = Field(default=60.0, gt=0.0, le=3600.0)
    """Longest wait for the first byte of an answer, prompt processing included. Past it the
    request is retried on another pod (nothing reached the client yet) and the silent pod is
    taken out of rotation until it answers again. Raise it for very long prompts."""
    between_chunks_seconds: float = Field(default=30.0, gt=0.0, le=3600.0)
    """Longest silence between two chunks of an answer; past it a stream ends with an error
    event and `data: [DONE]`."""
    answer_seconds: float = Field(default=600.0, gt=0.0, le=86400.0)
    """Longest an answer may take from the request's arrival to its last byte; past it a
    stream ends with an error event and `data: [DONE]`, and a non-streamed request gets 504.
    It bounds what one client holds of a pod, and how long a drain waits
    (`disruption.drainSeconds`). The default is the OpenAI client's own request timeout."""


HOSTNAME_PATTERN = r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
"""A Gateway API hostname: a lower-case DNS name, optionally with a leading `*.` wildcard."""


class GatewayParentRef(_Model):
    """A Gateway the route attaches to (Gateway API ParentReference, kind Gateway)."""

    name: str = Field(min_length=1, max_length=253)
    """Gateway name."""
    namespace: str | None = Field(default=None, min_length=1, max_length=63)
    """Gateway namespace; the resource's own when unset (the Gateway must allow routes from
    it)."""
    section_name: str | None = Field(default=None, min_length=1, max_length=253)
    """Listener of the Gateway to attach to; all that allow the route when unset."""


class HTTPRouteSpec(_Model):
    """A Gateway API HTTPRoute (gateway.networking.k8s.io/v1) to the router Service. It routes
    the OpenAI API paths (`/v1/`) only: the router's `/specgate/` status and sample endpoints
    and its `/metrics` stay inside the cluster."""

    parent_refs: list[GatewayParentRef] = Field(min_length=1, max_length=16)
    """Gateways to attach to."""
    hostnames: list[Annotated[str, Field(max_length=253, pattern=HOSTNAME_PATTERN)]] = Field(
        default_factory=list, max_length=16
    )
    """Host names the route matches; every host the Gateway accepts when empty."""


JwtAlgorithm = Literal[
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"
]
"""Asymmetric JWS algorithms only: the router holds no secret that could mint a token."""

CLAIM_NAME = r"^[A-Za-z0-9_.:/-]+$"


def _rsa_and_ec() -> list[JwtAlgorithm]:
    return ["RS256", "ES256"]


def _both_classes() -> list[Literal["latency", "throughput"]]:
    return ["latency", "throughput"]


class ConfigMapKeyRef(_Model):
    """A key in a ConfigMap in the resource's namespace."""

    name: str = Field(min_length=1, max_length=253)
    """ConfigMap name."""
    key: str = Field(default="ca.crt", min_length=1, max_length=253)
    """Key in the ConfigMap."""


class OidcSpec(_Model):
    """OpenID Connect: clients send a bearer token (a JWT) from an identity provider, and the
    router checks its signature against the keys the provider publishes, its issuer, audience
    and lifetime, and takes the client's classes and admin rights from its claims."""

    issuer: str = Field(max_length=512, pattern=r"^https://[^\s?#]+$")
    """The provider's issuer URL; a token's `iss` must equal it. The signing keys come from
    the `jwks_uri` of `{issuer}/.well-known/openid-configuration` unless `jwksUri` is set."""
    jwks_uri: str | None = Field(default=None, max_length=1024, pattern=r"^https://[^\s#]+$")
    """The provider's signing keys (a JWK Set), for a provider without a discovery document."""
    audience: str = Field(min_length=1, max_length=512)
    """A token's `aud` must include it: the client id or API audience the provider issues
    the tokens for."""
    algorithms: list[JwtAlgorithm] = Field(default_factory=_rsa_and_ec, min_length=1, max_length=10)
    """Signature algorithms accepted (asymmetric only)."""
    classes_claim: str = Field(
        default="specgate_classes", min_length=1, max_length=253, pattern=CLAIM_NAME
    )
    """Claim listing the traffic classes a token may send (a list, or one space-separated
    string; a dotted name reaches a nested claim). The class header is honoured within them."""
    default_classes: list[Literal["latency", "throughput"]] = Field(
        default_factory=_both_classes, max_length=2
    )
    """Classes of a token without that claim; empty refuses such tokens (403)."""
    groups_claim: str = Field(default="groups", min_length=1, max_length=253, pattern=CLAIM_NAME)
    """Claim listing the token's groups (a dotted name reaches a nested claim, such as
    Keycloak's `realm_access.roles`)."""
    admin_groups: list[Annotated[str, Field(min_length=1, max_length=253)]] = Field(
        default_factory=list, max_length=16
    )
    """Groups whose tokens may also read the router's own endpoints (`/specgate/*`) and its
    API docs; none when empty."""
    max_concurrent: int | None = Field(default=None, ge=1, le=100_000)
    """Requests in flight at once per token subject (`sub`); past it, 429."""
    requests_per_minute: int | None = Field(default=None, ge=1, le=10_000_000)
    """Sustained request rate per token subject (bursts of ten seconds' worth); past it, 429."""
    leeway_seconds: int = Field(default=30, ge=0, le=300)
    """Clock skew allowed between the provider and the router when checking `exp` and
    `nbf`."""
    ca: ConfigMapKeyRef | None = None
    """CA bundle that signs the provider's TLS certificate, for a provider behind a private
    CA (an in-cluster Dex or Keycloak); the image's public CAs when unset."""


class ClientAuthSpec(_Model):
    """Client authentication on the router's API paths (`/v1/...`, `/generate`): hashed API
    keys from a Secret, OpenID Connect tokens, or both."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "has(self.secretName) || has(self.oidc)",
                    "clientAuth needs secretName (API keys), oidc (tokens) or both",
                ),
            ]
        }
    )

    secret_name: str | None = Field(default=None, min_length=1, max_length=253)
    """Secret in the resource's namespace holding the keys file: a YAML list of entries with
    `name`, `sha256` (of the key), `classes` and optional `maxConcurrent` and
    `requestsPerMinute`; `specgate client-key NAME` makes a key and its entry. Changes reach
    the routers without a restart."""
    key: str = Field(default="keys.yaml", min_length=1, max_length=253)
    """Key in the Secret that holds the file."""
    oidc: OidcSpec | None = None
    """Also accept OpenID Connect tokens (JWTs); API keys and tokens work side by side."""

    @model_validator(mode="after")
    def _some_credentials(self) -> ClientAuthSpec:
        # The same rule as the CEL one above, for `specgate render` and the operator.
        if self.secret_name is None and self.oidc is None:
            raise ValueError("clientAuth needs secretName (API keys), oidc (tokens) or both")
        return self


class RouterTracing(_Model):
    """OpenTelemetry spans of the router's requests, exported over OTLP/HTTP."""

    otlp_endpoint: str = Field(max_length=1024, pattern=r"^https?://[^\s]+$")
    """The collector's traces endpoint, for example
    `http://otel-collector.observability:4318/v1/traces`."""
    sample_ratio: float = Field(default=1.0, ge=0, le=1)
    """Share of traces recorded when the client sends no sampled trace context; a client's
    sampling decision is followed."""


class RouterSpec(_Model):
    """The speculation-aware router in front of the engine pods."""

    replicas: int = Field(default=2, ge=1, le=16)
    """Router replicas; all route, one (the Lease holder) controls thresholds."""
    image: str | None = Field(default=None, min_length=1, max_length=512)
    """Router image; defaults to the image the operator was configured with."""
    port: int = Field(default=8000, ge=1024, le=65535)
    """Port of the OpenAI-compatible API."""
    default_class: Literal["latency", "throughput"] = "latency"
    """Traffic class of requests without an `x-specgate-class` header."""
    pools: PoolSplit = Field(default_factory=PoolSplit)
    """Latency/throughput pool split."""
    plugins: RouterPlugins = Field(default_factory=RouterPlugins)
    """Placement plugins: filters, weighted scorers and the picker."""
    timeouts: RouterTimeouts = Field(default_factory=RouterTimeouts)
    """Time limits on engine pods' answers."""
    resources: KubeObject = Field(
        default_factory=lambda: {
            "requests": {"cpu": "500m", "memory": "256Mi"},
            "limits": {"memory": "1Gi"},
        }
    )
    """Router container resources (core/v1 ResourceRequirements)."""
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    """Type of the router's Service."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels router pods require (they need no GPU; by default they go anywhere)."""
    tolerations: list[KubeObject] = Field(default_factory=list, max_length=64)
    """Tolerations (core/v1 Toleration) for router pods, under the same operator policy as
    the engine pods' (`--allowed-toleration-key`)."""
    client_auth: ClientAuthSpec | None = None
    """Require client API keys (hashed at rest, with classes and limits per key); any client
    that reaches the router may send when unset."""
    allowed_engine_fields: list[contract.EngineOnlyField] = Field(
        default_factory=list, max_length=16
    )
    """SGLang request fields clients may send through the router although each hands them
    control of the engine (code, files, sessions, queue order): for example `lora_path` for a
    deployment that serves LoRA adapters. None by default: such requests get 400."""
    http_route: HTTPRouteSpec | None = None
    """Expose the router through a Gateway API Gateway with an HTTPRoute (the Gateway API CRDs
    must be installed); none when unset."""
    tracing: RouterTracing | None = None
    """Export a span per request (class, pod, status, time to the last byte) to an
    OpenTelemetry collector; the span continues the client's `traceparent`. The engine pods
    export theirs to the same endpoint (SGLang's `--enable-trace`, over OTLP/HTTP), as
    children of the router's span and sampled as it is; the engine image needs the
    OpenTelemetry packages, which specgate's worker image has. None when unset (a client's
    `traceparent` still reaches the engine)."""


class DisruptionSpec(_Model):
    """How engine pods are replaced in an update and stopped in a drain."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "self.maxSurge + self.maxUnavailable >= 1",
                    "maxSurge and maxUnavailable cannot both be 0: an update could replace no pod",
                ),
            ]
        }
    )

    drain_seconds: int | None = Field(default=None, ge=0, le=86400)
    """How long a stopping pod serves the requests it already runs. An engine pod's preStop
    hook waits until its engine runs and queues none (after the few seconds endpoints take to
    drop the pod), at most this long, then SGLang gets SIGTERM; a router pod refuses new
    requests and waits as long for its streams. Unset: the router's
    `timeouts.answerSeconds`, the longest answer it lets run, so no answer is cut."""
    max_surge: int = Field(default=1, ge=0, le=256)
    """Engine pods started above `replicas` during an update. With 1, a new pod becomes Ready
    before an old one stops, so a one-replica model serves through updates; it needs room for
    one more pod's GPUs, and without it the update waits (the old pods keep serving). On a
    cluster with no spare GPUs set 0 and `maxUnavailable: 1`."""
    max_unavailable: int = Field(default=0, ge=0, le=256)
    """Engine pods that may be down at once during an update."""
    protect_last_pod: bool = False
    """With one engine replica, a node drain (a voluntary eviction) waits until the pod is
    deleted by hand or a second replica runs: the PodDisruptionBudget requires one pod
    available. Off, a drain evicts it and the model is down until it starts elsewhere
    (weights load and CUDA graphs capture again). With several replicas, drains take one pod
    at a time either way."""

    @model_validator(mode="after")
    def _replaces_some_pod(self) -> DisruptionSpec:
        # The same rule as the CEL one above, for `specgate render` and the operator.
        if self.max_surge + self.max_unavailable < 1:
            raise ValueError(
                "maxSurge and maxUnavailable cannot both be 0: an update could replace no pod"
            )
        return self

    def drain_for(self, timeouts: RouterTimeouts) -> int:
        """The drain in whole seconds: the setting, or the longest answer the router allows."""
        if self.drain_seconds is not None:
            return self.drain_seconds
        return math.ceil(timeouts.answer_seconds)


class SecretKeyRef(_Model):
    """A key in a Secret in the resource's namespace."""

    name: str = Field(min_length=1, max_length=253)
    """Secret name."""
    key: str = Field(default="api-key", min_length=1, max_length=253)
    """Key in the Secret."""


HUB_REPO = "^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$"


class SpecDecodeDeploymentSpec(_Model):
    """Desired state of a speculative-decoding model deployment."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    f"self.model.source.type != 'hub' || (self.model.path.matches('{HUB_REPO}')"
                    f" && self.speculative.draftModel.path.matches('{HUB_REPO}'))",
                    "with source.type hub, model.path and speculative.draftModel.path are hub"
                    " ids: OWNER/NAME",
                ),
            ]
        }
    )

    model: ModelSpec
    """The target model."""
    speculative: SpeculativeSpec
    """EAGLE speculation and its runtime control."""
    engine: EngineSpec = Field(default_factory=EngineSpec)
    """SGLang engine pods."""
    replicas: int = Field(default=1, ge=0, le=256)
    """Engine pods (each one a full model replica over `gpusPerPod` GPUs)."""
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    """Scheduling of engine pods."""
    router: RouterSpec = Field(default_factory=RouterSpec)
    """The router."""
    disruption: DisruptionSpec = Field(default_factory=DisruptionSpec)
    """Updates and drains of engine pods: surge, drain time, the one-replica budget."""
    api_key_secret_ref: SecretKeyRef | None = None
    """Secret holding the engine API key; when unset the operator creates `<name>-engine-key`."""


# ---- status (written by the operator and, for pods[], by the router) ----


class Condition(_Model):
    """A metav1.Condition."""

    type: str = Field(max_length=316)
    """`Ready`, `Progressing`, `Degraded` or `SpeculationControlled`."""
    status: Literal["True", "False", "Unknown"]
    """Condition status."""
    reason: str = Field(max_length=1024)
    """CamelCase reason."""
    message: str = Field(default="", max_length=32768)
    """Human-readable detail."""
    last_transition_time: str
    """When status last changed (RFC 3339)."""
    observed_generation: int | None = Field(default=None, ge=0)
    """Generation the condition was computed from."""


class PodSpeculationStatus(_Model):
    """One engine pod as the router sees it."""

    name: str
    """Pod name."""
    ready: bool = False
    """Pod passes its readiness probe and the router's health checks."""
    speculating: bool = False
    """Speculation on at the pod's current batch size."""
    threshold: int | None = None
    """Current speculation-disable batch threshold (null: always speculate)."""
    batch_size: int = 0
    """Running requests in the decode batch."""
    accept_length: float | None = None
    """Mean accepted tokens per speculating step."""
    last_change: str | None = None
    """When the threshold last changed (RFC 3339)."""
    rule: str = Field(default="", max_length=32)
    """The control rule behind the threshold's value (`move`, `hold`, `no-gain`, `cooldown`,
    `trial`...; docs/router.md lists them)."""
    reason: str = ""
    """The figures behind the rule."""


class RouterStatus(_Model):
    """The router as the operator sees it."""

    endpoint: str = ""
    """In-cluster URL of the OpenAI-compatible API."""
    ready: bool = False
    """At least one router replica is ready."""


class SpecDecodeDeploymentStatus(_Model):
    """Observed state."""

    observed_generation: int = 0
    """Last spec generation the operator acted on."""
    replicas: int = 0
    """Engine pods that exist."""
    ready_replicas: int = 0
    """Engine pods that are ready."""
    selector: str = ""
    """Label selector of engine pods (for the scale subresource)."""
    threshold: str = ""
    """Summary of the pods' thresholds (one value or a min-max range)."""
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={
            # One entry per type, merged by type under server-side apply.
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )
    """Ready, Progressing, Degraded, SpeculationControlled."""
    pods: list[PodSpeculationStatus] = Field(default_factory=list)
    """Per-pod speculation state, written by the router."""
    router: RouterStatus = Field(default_factory=RouterStatus)
    """The router."""


class SpecDecodeDeployment(BaseModel):
    """A full resource as read from the API server (metadata kept as a plain mapping)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    api_version: Literal["specgate.io/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["SpecDecodeDeployment"]
    metadata: dict[str, Any]
    spec: SpecDecodeDeploymentSpec

    @property
    def name(self) -> str:
        return str(self.metadata["name"])

    @property
    def namespace(self) -> str:
        return str(self.metadata.get("namespace") or "default")

    @property
    def uid(self) -> str:
        return str(self.metadata.get("uid", ""))
