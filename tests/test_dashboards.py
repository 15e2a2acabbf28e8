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
import json
import math
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from specgate import dashboards
from specgate_sim import profile as profiles
from specgate_sim.cluster import SimCluster, free_ports
from specgate_sim.loadgen import LoadGenerator, Phase
from specgate_sim.pod import PodSettings

from .conftest import ROOT
from .router_harness import run_router
from .tools import CHART, TOOLS, query_range, tool

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


@pytest.fixture(scope="module")
def prometheus_with_data(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A real Prometheus that scraped a router + 3 simulated pods every second through ~25 s of
    mixed load; it stays up for the queries."""
    tmp = tmp_path_factory.mktemp("prom")
    prom_port, router_port = free_ports(2)
    cfg = tmp / "prometheus.yml"
    cfg.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: specgate-router\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{router_port}']}}]\n"
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
        for _ in range(100):
            try:
                if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            raise AssertionError("prometheus did not become ready")
        start = time.time()
        asyncio.run(_load(router_port))
        time.sleep(3)  # a few more scrapes
        yield {"url": url, "start": start, "end": time.time()}
    finally:
        proc.terminate()
        proc.wait(timeout=20)


async def _load(router_port: int) -> None:
    prof = profiles.load("rtx-pro-6000-x8")
    settings = PodSettings(api_key="k", threshold=8, model="m", time_scale=1.0, seed=2)
    async with SimCluster(prof, 3, settings=settings) as pods:
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
            await gen.run()
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
