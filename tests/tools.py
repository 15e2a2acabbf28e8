"""The real binaries the chart and monitoring tests run (installed by `make tools`)."""

from __future__ import annotations

import contextlib
import importlib.util
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

from .conftest import ROOT

TOOLS = ROOT / ".tools"
CHART = ROOT / "charts" / "specgate"


def tool(name: str) -> str:
    for candidate in (TOOLS / "bin" / name, Path(shutil.which(name) or "/nonexistent")):
        if candidate.exists():
            return str(candidate)
    raise AssertionError(f"{name} is not installed: run `make tools` (scripts/install-tools.sh)")


def run(*args: str, check: bool = True, **kw: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=120, **kw)  # type: ignore[call-overload]
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result  # type: ignore[no-any-return]


def helm_template(
    *values_files: str,
    sets: tuple[str, ...] = (),
    check: bool = True,
    namespace: str = "specgate-system",
    api_versions: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    args = [tool("helm"), "template", "sg", str(CHART), "--namespace", namespace]
    for api in api_versions:  # what the cluster serves, for .Capabilities
        args += ["--api-versions", api]
    for f in values_files:
        args += ["-f", f]
    for s in sets:
        args += ["--set", s]
    return run(*args, check=check)


def query_range(data: dict[str, Any], expr: str, **variables: str) -> list[dict[str, Any]]:
    """A dashboard query's series from the Prometheus at data["url"] over [start, end]: its
    template variables (namespace, deployment, pod) set to `variables`, `.*` where not given,
    and $__rate_interval to 20s."""
    expr = expr.replace("$__rate_interval", "20s")
    expr = re.sub(
        r"\$(namespace|deployment|pod)\b", lambda m: variables.get(m.group(1), ".*"), expr
    )
    resp = httpx.get(
        data["url"] + "/api/v1/query_range",
        params={"query": expr, "start": data["start"], "end": data["end"], "step": "1s"},
        timeout=30,
    )
    body = resp.json()
    assert body["status"] == "success", (expr, body)
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def wait_for(check: Any, what: str, seconds: float) -> Any:
    """Poll `check` every half second until it returns something true, and return that;
    AssertionError naming `what` after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {seconds:.0f}s waiting for {what}")


def wait_until_answers(url: str, timeout: float = 60.0) -> None:
    """Poll `url` until it answers 200; AssertionError naming it after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer 200 within {timeout:.0f} s")


def load_script(name: str) -> ModuleType:
    """scripts/NAME.py as a module (in sys.modules, as dataclasses need)."""
    module_name = f"specgate_script_{name}"
    spec = importlib.util.spec_from_file_location(module_name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules[module_name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def specgate_up(pods: int = 2) -> Iterator[str]:
    """`specgate up` (simulated pods at 20x, on a free port) as a user runs it; yields the
    router's URL at once, before it is ready, and stops it after the block."""
    from specgate_sim.cluster import free_ports

    port = free_ports(1)[0]
    up = subprocess.Popen(
        [sys.executable, "-m", "specgate.cli", "up", "--pods", str(pods), "--port", str(port),
         "--time-scale", "20"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        up.terminate()
        up.wait(30)
