"""Grafana dashboards as code (grafana-foundation-sdk), written to charts/specgate/dashboards/.

`specgate dashboards` regenerates the JSON files; a test checks the committed files are what this
code builds. Every query is in `QUERIES` too, so the tests can run each one against a real
Prometheus that scrapes a router under load, and draw the panels to PNG from the same queries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SCOPE = 'namespace=~"$namespace", specgate_io_deployment=~"$deployment"'
POD_SCOPE = SCOPE + ', engine_pod=~"$pod"'


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat
    stepped: bool = False
    source: str = "specgate"
    """Who exports the panel's metrics: `specgate` (routers and engine pods, scraped through the
    chart's monitors), `dcgm-exporter` (NVIDIA's GPU exporter, where it runs) or `operator`
    (the operator's own PodMonitor)."""


def _quantiles(metric: str, what: str) -> tuple[Query, ...]:
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by (le, traffic_class) "
            f"(rate({metric}_bucket{{{SCOPE}}}[$__rate_interval])))",
            f"{{{{traffic_class}}}} {what} p{int(q * 100)}",
        )
        for q in (0.5, 0.99)
    )


OVERVIEW = (
    PanelSpec(
        "Output tokens/s by class",
        "Tokens delivered to clients, per traffic class.",
        (
            Query(
                f"sum by (traffic_class) (rate(specgate_router_output_tokens_total{{{SCOPE}}}"
                f"[$__rate_interval]))",
                "{{traffic_class}}",
            ),
        ),
        unit="short",
    ),
    PanelSpec(
        "Requests/s by class and status",
        "Answers per second; code is the HTTP status, or stream_error for a stream cut by a pod.",
        (
            Query(
                f"sum by (traffic_class, code) (rate(specgate_router_requests_total{{{SCOPE}}}"
                f"[$__rate_interval]))",
                "{{traffic_class}} {{code}}",
            ),
        ),
        unit="reqps",
    ),
    PanelSpec(
        "Time to first token",
        "p50 and p99 by class, as clients of the router see it.",
        _quantiles("specgate_router_ttft_seconds", "TTFT"),
        unit="s",
    ),
    PanelSpec(
        "Time per output token",
        "p50 and p99 by class, from the engines' token counts.",
        _quantiles("specgate_router_tpot_seconds", "TPOT"),
        unit="s",
    ),
    PanelSpec(
        "Retries and refusals",
        "Requests retried on another pod (by reason), and refused with 503 because no pod could "
        "take them.",
        (
            Query(
                f"sum by (reason) (rate(specgate_router_retries_total{{{SCOPE}}}"
                f"[$__rate_interval])) or vector(0)",
                "retry {{reason}}",
            ),
            Query(
                f"sum(rate(specgate_router_saturated_total{{{SCOPE}}}[$__rate_interval]))"
                " or vector(0)",
                "503 saturated",
            ),
        ),
        unit="reqps",
    ),
    PanelSpec(
        "Circuit breakers",
        "1 while a pod's circuit is open (requests to it failed repeatedly).",
        (Query(f"max by (engine_pod) (specgate_pod_circuit_open{{{SCOPE}}})", "{{engine_pod}}"),),
        stepped=True,
    ),
)

CONTROL = (
    PanelSpec(
        "Batch size against threshold",
        "Running requests per pod (solid) and its speculation-disable threshold (dashed): the pod "
        "speculates while the batch is at or under the threshold. -1 means always speculate.",
        (
            Query(
                f"max by (engine_pod) (specgate_pod_batch{{{POD_SCOPE}}})", "{{engine_pod}} batch"
            ),
            Query(
                f"max by (engine_pod) (specgate_pod_threshold{{{POD_SCOPE}}})",
                "{{engine_pod}} threshold",
            ),
        ),
    ),
    PanelSpec(
        "Speculating",
        "1 while the pod speculates at its current batch.",
        (
            Query(
                f"max by (engine_pod) (specgate_pod_speculating{{{POD_SCOPE}}})", "{{engine_pod}}"
            ),
        ),
        stepped=True,
    ),
    PanelSpec(
        "Accept length",
        "Accepted tokens per speculating step (drafts accepted + 1), counted over speculating "
        "steps only.",
        (
            Query(
                f"max by (engine_pod) (specgate_pod_accept_length{{{POD_SCOPE}}})", "{{engine_pod}}"
            ),
        ),
    ),
    PanelSpec(
        "Tokens/s with speculation on and off",
        "Engine output rate summed over the pods speculating now, and over those that are not.",
        (
            Query(
                f"sum(max by (engine_pod) (specgate_pod_gen_throughput{{{POD_SCOPE}}}) and on "
                f"(engine_pod) (max by (engine_pod) (specgate_pod_speculating{{{POD_SCOPE}}}) "
                "== 1)) or vector(0)",
                "speculating",
            ),
            Query(
                f"sum(max by (engine_pod) (specgate_pod_gen_throughput{{{POD_SCOPE}}}) and on "
                f"(engine_pod) (max by (engine_pod) (specgate_pod_speculating{{{POD_SCOPE}}}) "
                "== 0)) or vector(0)",
                "not speculating",
            ),
        ),
    ),
    PanelSpec(
        "Threshold changes",
        "Thresholds pushed to pods, by direction (the annotations mark each change).",
        (
            Query(
                f"sum by (engine_pod, direction) (increase(specgate_threshold_changes_total"
                f"{{{POD_SCOPE}}}[$__rate_interval])) or vector(0)",
                "{{engine_pod}} {{direction}}",
            ),
        ),
    ),
    PanelSpec(
        "Pools and metric age",
        "Pods in the latency pool, and the age of each pod's metrics (stale above a few seconds).",
        (
            Query(f"max(specgate_latency_pool_pods{{{SCOPE}}})", "latency pool pods"),
            Query(
                f"max by (engine_pod) (specgate_pod_scrape_age_seconds{{{POD_SCOPE}}})",
                "{{engine_pod}} metrics age (s)",
            ),
        ),
    ),
)

ENGINE_SCOPE = SCOPE + ', pod=~"$pod"'
"""SGLang's own metrics, scraped from each engine pod (pod: the engine pod's name)."""
GPU_SCOPE = 'namespace=~"$namespace", pod=~"($deployment)-engine-.+", pod=~"$pod"'
"""dcgm-exporter's labels with its Kubernetes pod mapping: the pod using the GPU, by name."""


def _engine_quantile(metric: str, q: float) -> str:
    return (
        f"histogram_quantile({q}, sum by (le, pod) "
        f"(rate({metric}_bucket{{{ENGINE_SCOPE}}}[$__rate_interval])))"
    )


ENGINES = (
    PanelSpec(
        "Running and queued requests",
        "SGLang's own count of running requests (the batch) and of requests waiting in its queue.",
        (
            Query(f"max by (pod) (sglang:num_running_reqs{{{ENGINE_SCOPE}}})", "{{pod}} running"),
            Query(f"max by (pod) (sglang:num_queue_reqs{{{ENGINE_SCOPE}}})", "{{pod}} queued"),
        ),
    ),
    PanelSpec(
        "KV cache usage",
        "Share of the KV cache's tokens in use: near 1, new requests wait or are retracted.",
        (Query(f"max by (pod) (sglang:token_usage{{{ENGINE_SCOPE}}})", "{{pod}}"),),
        unit="percentunit",
    ),
    PanelSpec(
        "Generation throughput",
        "Output tokens per second, as each engine reports it.",
        (Query(f"max by (pod) (sglang:gen_throughput{{{ENGINE_SCOPE}}})", "{{pod}}"),),
    ),
    PanelSpec(
        "Engine time to first token",
        "p50 and p99 inside the engine (queueing and prefill), beside the router's own view.",
        (
            Query(_engine_quantile("sglang:time_to_first_token_seconds", 0.5), "{{pod}} p50"),
            Query(_engine_quantile("sglang:time_to_first_token_seconds", 0.99), "{{pod}} p99"),
        ),
        unit="s",
    ),
    PanelSpec(
        "Engine request latency",
        "p50 and p99 end-to-end latency inside the engine.",
        (
            Query(_engine_quantile("sglang:e2e_request_latency_seconds", 0.5), "{{pod}} p50"),
            Query(_engine_quantile("sglang:e2e_request_latency_seconds", 0.99), "{{pod}} p99"),
        ),
        unit="s",
    ),
    PanelSpec(
        "Decode steps by mode",
        "Decode steps per second with speculation on and off (the patch's counter).",
        (
            Query(
                f"sum by (pod, mode) (rate(sglang:spec_decode_steps_total{{{ENGINE_SCOPE}}}"
                f"[$__rate_interval]))",
                "{{pod}} {{mode}}",
            ),
        ),
    ),
    PanelSpec(
        "GPU utilization",
        "Share of time each GPU of an engine pod was busy (dcgm-exporter, where it runs).",
        (Query(f"avg by (pod) (DCGM_FI_DEV_GPU_UTIL{{{GPU_SCOPE}}})", "{{pod}}"),),
        unit="percent",
        source="dcgm-exporter",
    ),
    PanelSpec(
        "GPU memory used",
        "Frame buffer in use, summed over each engine pod's GPUs (dcgm-exporter, in MiB).",
        (Query(f"sum by (pod) (DCGM_FI_DEV_FB_USED{{{GPU_SCOPE}}})", "{{pod}}"),),
        unit="decmbytes",
        source="dcgm-exporter",
    ),
    PanelSpec(
        "GPU power",
        "Power drawn by each engine pod's GPUs (dcgm-exporter).",
        (Query(f"sum by (pod) (DCGM_FI_DEV_POWER_USAGE{{{GPU_SCOPE}}})", "{{pod}}"),),
        unit="watt",
        source="dcgm-exporter",
    ),
    PanelSpec(
        "Operator reconciles",
        "Reconciles per second by outcome: ok, retry (kopf tries again), failed (refused until "
        "the resource changes; its Degraded condition says why), error (a bug: see the log).",
        (
            Query(
                "sum by (outcome) (rate(specgate_operator_reconciles_total[$__rate_interval]))",
                "{{outcome}}",
            ),
        ),
        unit="ops",
        source="operator",
    ),
    PanelSpec(
        "Operator reconcile time",
        "p50 and p99 of a reconcile: children applied, status written.",
        (
            Query(
                "histogram_quantile(0.5, sum by (le) "
                "(rate(specgate_operator_reconcile_seconds_bucket[$__rate_interval])))",
                "p50",
            ),
            Query(
                "histogram_quantile(0.99, sum by (le) "
                "(rate(specgate_operator_reconcile_seconds_bucket[$__rate_interval])))",
                "p99",
            ),
        ),
        unit="s",
        source="operator",
    ),
    PanelSpec(
        "Operator leader",
        "1 for the replica that holds the Lease and reconciles; 0 for a standby.",
        (Query("max by (pod) (specgate_operator_leader)", "{{pod}}"),),
        stepped=True,
        source="operator",
    ),
)

ANNOTATION_EXPR = (
    f"changes(max by (engine_pod) (specgate_pod_threshold{{{POD_SCOPE}}})[2m:15s]) > 0"
)

DASHBOARDS: dict[str, tuple[str, str, tuple[PanelSpec, ...]]] = {
    "specgate-overview": ("specgate overview", "Traffic, latency by class, resilience.", OVERVIEW),
    "speculation-control": (
        "specgate speculation control",
        "Per pod: batch against threshold, speculating, accept length, threshold changes.",
        CONTROL,
    ),
    "specgate-engines": (
        "specgate engines, GPUs and operator",
        "SGLang's own metrics per engine pod, its GPUs (dcgm-exporter) and the operator.",
        ENGINES,
    ),
}


def panels_from(source: str) -> list[tuple[str, PanelSpec]]:
    """(dashboard, panel) for every panel whose metrics `source` exports."""
    return [(uid, p) for uid, (_, _, ps) in DASHBOARDS.items() for p in ps if p.source == source]


def all_queries() -> dict[str, list[str]]:
    """Every PromQL expression per dashboard (annotation queries included)."""
    out: dict[str, list[str]] = {}
    for uid, (_, _, panels) in DASHBOARDS.items():
        out[uid] = [q.expr for p in panels for q in p.queries]
        if uid == "speculation-control":
            out[uid].append(ANNOTATION_EXPR)
    return out


def build(uid: str) -> dict[str, Any]:
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.builders import prometheus, stat, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import common
    from grafana_foundation_sdk.models.dashboard import (
        DashboardCursorSync,
        DataSourceRef,
        VariableRefresh,
        VariableSort,
    )

    title, description, panels = DASHBOARDS[uid]
    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")

    def variable(name: str, label: str, query: str) -> Any:
        return (
            db.QueryVariable(name)
            .label(label)
            .datasource(ds)
            .query(query)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )

    board = (
        db.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["specgate", "llm", "sglang"])
        .refresh("30s")
        .time("now-1h", "now")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .editable()
        .with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            variable(
                "namespace", "Namespace", "label_values(specgate_router_requests_total, namespace)"
            )
        )
        .with_variable(
            variable(
                "deployment",
                "Deployment",
                'label_values(specgate_pod_batch{namespace=~"$namespace"}, specgate_io_deployment)',
            )
        )
        .with_variable(
            variable(
                "pod", "Engine pod", f"label_values(specgate_pod_batch{{{SCOPE}}}, engine_pod)"
            )
        )
    )
    if uid == "speculation-control":
        anno_query = prometheus.Dataquery().expr(ANNOTATION_EXPR).ref_id("Anno").datasource(ds)
        board = board.annotation(
            db.AnnotationQuery()
            .name("Threshold changes")
            .datasource(ds)
            .enable(True)
            .icon_color("orange")
            # The SDK types target as the built-in AnnotationTarget; a Prometheus annotation's
            # target is the datasource's query (tsc checks it as AnnotationQuery<PromQuery>).
            .target(anno_query)  # type: ignore[arg-type]
        )
    for i, spec in enumerate(panels):
        builder: Any = stat.Panel() if spec.kind == "stat" else timeseries.Panel()
        builder = (
            builder.title(spec.title)
            .description(spec.description)
            .datasource(ds)
            .unit(spec.unit)
            .grid_pos(_grid(i))
        )
        if spec.kind == "timeseries":
            builder = builder.line_width(1).fill_opacity(10)
            if spec.stepped:
                builder = builder.line_interpolation(common.LineInterpolation.STEP_AFTER)
        for ref, query in zip("ABCDEFGH", spec.queries, strict=False):
            builder = builder.with_target(
                prometheus.Dataquery()
                .expr(query.expr)
                .legend_format(query.legend)
                .ref_id(ref)
                .datasource(ds)
            )
        board = board.with_panel(builder)
    data: dict[str, Any] = _clean(json.loads(json.dumps(board.build(), cls=JSONEncoder)))
    for var in data["templating"]["list"]:
        if var["type"] != "interval":  # the SDK emits interval-only fields on every variable
            for key in ("auto", "auto_count", "auto_min", "id"):
                var.pop(key, None)
    return data


def _clean(value: Any) -> Any:
    """Drop nulls: Grafana's schema has optional fields, not nullable ones (tsc says so)."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _grid(index: int) -> Any:
    from grafana_foundation_sdk.models.dashboard import GridPos

    return GridPos(h=8, w=12, x=12 * (index % 2), y=8 * (index // 2))


def write(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for uid in DASHBOARDS:
        path = folder / f"{uid}.json"
        path.write_text(json.dumps(build(uid), indent=2, sort_keys=True) + "\n")
        out.append(path)
    return out
