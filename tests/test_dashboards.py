"""Grafana dashboards: built as code, type-checked the way Grafana reads them, and every query
evaluated against a real Prometheus that scrapes a router with simulated pods under load.

No Grafana server can run here. Instead: `tsc` checks each dashboard against the Dashboard type
of @grafana/schema (npm); panel types and datasource references are checked by hand; and each
panel is drawn to PNG with matplotlib from the same queries over the same time range (artifacts
in out/dashboards/). Not covered: Grafana's own rendering, its variable interpolation beyond
substituting `.*` for the template variables, and the `label_values()` variable queries, which
are Grafana functions rather than PromQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kopf
import pytest

from specgate import dashboards
from specgate_operator.metrics import OperatorMetrics
from specgate_sim import profile as profiles
from specgate_sim.cluster import SimCluster, free_ports
from specgate_sim.loadgen import LoadGenerator, Phase
from specgate_sim.pod import PodSettings

from .conftest import ROOT
from .router_harness import run_router
from .tools import CHART, TOOLS, query_range, tool, wait_until_answers

FOLDER = CHART / "dashboards"
KNOWN_PANEL_TYPES = {"timeseries", "stat", "statetimeline", "table", "gauge", "bargauge", "text"}
ARTIFACTS = ROOT / "out" / "dashboards"


def committed(uid: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FOLDER / f"{uid}.json").read_text())
    return data


@pytest.mark.parametrize("uid", list(dashboards.DASHBOARDS))
def test_committed_json_is_what_the_code_builds(uid: str) -> None:
    assert committed(uid) == dashboards.build(uid), "run `make dashboards` and commit the result"


@pytest.mark.parametrize("uid", list(dashboards.DASHBOARDS))
def test_panels_and_references_resolve(uid: str) -> None:
    board = committed(uid)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert {"namespace", "deployment", "pod"} <= set(variables)
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        assert panel["type"] in KNOWN_PANEL_TYPES, panel["type"]
        refs = [panel["datasource"]] + [t["datasource"] for t in panel["targets"]]
        for ref in refs:
            assert ref == {"type": "prometheus", "uid": "${datasource}"}
        for target in panel["targets"]:
            for var in re.findall(r"\$(\w+)", target["expr"]):
                assert var in variables or var == "__rate_interval", var
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        mine = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine


def test_dashboards_type_check_against_grafana_schema(tmp_path: Path) -> None:
    node_modules = TOOLS / "node" / "node_modules"
    assert (node_modules / "@grafana" / "schema").is_dir(), "run `make tools`"
    (tmp_path / "node_modules").symlink_to(node_modules)
    files = []
    for uid in dashboards.DASHBOARDS:
        board = committed(uid)
        annotations = board.pop("annotations", {}).get("list", [])
        (tmp_path / f"{uid}.ts").write_text(
            "import type { AnnotationQuery, Dashboard, DataQuery } from '@grafana/schema';\n"
            "// The Prometheus plugin's query adds these to DataQuery (as @grafana/prometheus).\n"
            "interface PromQuery extends DataQuery { expr: string; legendFormat?: string; }\n"
            f"const annotations: Array<AnnotationQuery<PromQuery>> = {json.dumps(annotations)};\n"
            f"export const dashboard: Dashboard = {{ ...{json.dumps(board)}, "
            "annotations: { list: annotations } };\n"
        )
        files.append(f"{uid}.ts")
    (tmp_path / "tsconfig.json").write_text(
        json.dumps(
            {
                "compilerOptions": {
                    "strict": True,
                    "noEmit": True,
                    "module": "esnext",
                    "moduleResolution": "bundler",
                    "target": "es2020",
                    "skipLibCheck": True,
                },
                "files": files,
            }
        )
    )
    tsc = node_modules / ".bin" / "tsc"
    result = subprocess.run(
        [str(tsc), "-p", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_type_check_catches_an_unknown_field(tmp_path: Path) -> None:
    """Guard for the check above: a misspelt panel field fails tsc."""
    node_modules = TOOLS / "node" / "node_modules"
    (tmp_path / "node_modules").symlink_to(node_modules)
    board = committed("specgate-overview")
    board.pop("annotations", None)
    board["panels"][0]["gridPosition"] = board["panels"][0].pop("gridPos")
    (tmp_path / "bad.ts").write_text(
        "import type { Dashboard } from '@grafana/schema';\n"
        f"export const d: Dashboard = {json.dumps(board)};\n"
    )
    options = {
        "strict": True,
        "noEmit": True,
        "moduleResolution": "bundler",
        "module": "esnext",
        "skipLibCheck": True,
    }
    (tmp_path / "tsconfig.json").write_text(
        json.dumps({"compilerOptions": options, "files": ["bad.ts"]})
    )
    result = subprocess.run(
        [str(node_modules / ".bin" / "tsc"), "-p", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "gridPosition" in result.stdout


# ---- against a real Prometheus ----


DCGM_EXPOSITION = """\
# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).
# TYPE DCGM_FI_DEV_FB_USED gauge
# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).
# TYPE DCGM_FI_DEV_POWER_USAGE gauge
""" + "".join(
    f'{metric}{{gpu="{gpu}",UUID="GPU-{gpu:04d}",device="nvidia{gpu}",'
    f'modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-node-1",container="engine",'
    f'namespace="llm",pod="demo-engine-6d4f9c7b8-0"}} {value + gpu}\n'
    for gpu in range(2)
    for metric, value in (("DCGM_FI_DEV_GPU_UTIL", 87), ("DCGM_FI_DEV_FB_USED", 71234),
                          ("DCGM_FI_DEV_POWER_USAGE", 512.5))
)  # fmt: skip
"""A stand-in for NVIDIA's dcgm-exporter (no GPU here): its metric names and the labels its
Kubernetes pod mapping adds, for two GPUs of one engine pod."""


class Exposition(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = DCGM_EXPOSITION.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def prometheus_with_data(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A real Prometheus that scraped, every second through ~25 s of mixed load, a router,
    its 3 simulated engine pods (found through a file as a pod monitor would find them), the
    operator's metrics and a dcgm-exporter stand-in; it stays up for the queries."""
    tmp = tmp_path_factory.mktemp("prom")
    prom_port, router_port, operator_port = free_ports(3)
    gpus = ThreadingHTTPServer(("127.0.0.1", 0), Exposition)
    threading.Thread(target=gpus.serve_forever, daemon=True).start()
    metrics = OperatorMetrics()
    metrics.leader.set(1)
    metrics.serve(operator_port, "127.0.0.1")
    engines = tmp / "engines.json"
    engines.write_text("[]")
    cfg = tmp / "prometheus.yml"
    cfg.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: specgate-router\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{router_port}']}}]\n"
        "  - job_name: specgate-engine\n"
        "    authorization: {credentials: k}\n"
        f"    file_sd_configs: [{{files: ['{engines}'], refresh_interval: 1s}}]\n"
        "  - job_name: dcgm-exporter\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{gpus.server_address[1]}']}}]\n"
        "    honor_labels: true\n"
        "  - job_name: specgate-operator\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{operator_port}'],\n"
        "                       labels: {namespace: specgate-system, pod: specgate-0}}]\n"
    )
    proc = subprocess.Popen(
        [
            tool("prometheus"),
            f"--config.file={cfg}",
            f"--storage.tsdb.path={tmp}/data",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{prom_port}"
    try:
        wait_until_answers(url + "/-/ready", timeout=10)
        start = time.time()
        asyncio.run(_load(router_port, engines, metrics))
        time.sleep(3)  # a few more scrapes
        yield {"url": url, "start": start, "end": time.time()}
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        metrics.stop()
        gpus.shutdown()
        gpus.server_close()


async def _load(router_port: int, engines: Path, metrics: OperatorMetrics) -> None:
    prof = profiles.load("rtx-pro-6000-x8")
    settings = PodSettings(api_key="k", threshold=8, model="m", time_scale=1.0, seed=2)
    async with SimCluster(prof, 3, settings=settings) as pods:
        # As a PodMonitor labels an engine pod's series (podTargetLabels, the pod's name).
        engines.write_text(json.dumps([
            {"targets": [url.removeprefix("http://")],
             "labels": {"namespace": "llm", "specgate_io_deployment": "demo",
                        "pod": f"demo-engine-6d4f9c7b8-{i}"}}
            for i, url in enumerate(pods.urls)
        ]))  # fmt: skip
        config = {
            "model": "m",
            "backends": pods.urls,
            "engineApiKey": "k",
            "control": {
                "cooldownSeconds": 2,
                "hysteresis": 1,
                "minSamples": 3,
                "scrapeIntervalSeconds": 0.25,
                "staggerSeconds": 0.2,
            },
            "pools": {"classMixWindowSeconds": 2},
        }

        async def reconcile(fails: bool) -> None:
            await asyncio.sleep(0.01)
            if fails:
                raise kopf.TemporaryError("a Secret is missing", delay=1)

        async with run_router(config, port=router_port) as router:
            gen = LoadGenerator(
                router.url,
                "m",
                [
                    Phase("ramp", 12, 3, 30, ramp_from=(1, 1)),
                    Phase("mixed", 8, 8, 24),
                    Phase("calm", 5, 2, 0),
                ],
            )
            run = asyncio.create_task(gen.run())
            while not run.done():  # the operator reconciles meanwhile, one in five retried
                for i in range(5):
                    with contextlib.suppress(kopf.TemporaryError):
                        await metrics.timed(lambda fails=(i == 0): reconcile(fails))
                await asyncio.sleep(0.5)
            await run
            await asyncio.sleep(2)


@pytest.mark.integration
@pytest.mark.parametrize("uid", list(dashboards.DASHBOARDS))
def test_every_query_returns_series_and_panels_draw(
    uid: str, prometheus_with_data: dict[str, Any]
) -> None:
    board = committed(uid)
    panels = []
    for panel in board["panels"]:
        series = []
        for target in panel["targets"]:
            result = query_range(prometheus_with_data, target["expr"])
            assert result, f"{panel['title']}: no series for {target['expr']}"
            series.append((target["legendFormat"], result))
        panels.append((panel, series))
    for annotation in board.get("annotations", {}).get("list", []):
        assert query_range(prometheus_with_data, annotation["target"]["expr"]) is not None
    png = draw(board, panels, prometheus_with_data["start"], ARTIFACTS / f"{uid}.png")
    assert png.stat().st_size > 20_000


def _legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


def draw(board: dict[str, Any], panels: list[Any], t0: float, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = math.ceil(len(panels) / 2)
    fig, axes = plt.subplots(rows, 2, figsize=(14, 3.2 * rows))
    for ax, (panel, series) in zip(axes.flat, panels, strict=False):
        for legend, result in series:
            for s in result:
                xs = [float(t) - t0 for t, _ in s["values"]]
                ys = [float(v) for _, v in s["values"]]
                ax.plot(xs, ys, label=_legend(legend, s["metric"]) or "value", linewidth=1)
        ax.set_title(panel["title"], fontsize=9)
        ax.tick_params(labelsize=7)
        if len(ax.lines) <= 8:
            ax.legend(fontsize=6, loc="upper right")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"{board['title']} (drawn from Prometheus by the tests; seconds on x)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
