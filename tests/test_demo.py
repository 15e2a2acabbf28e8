"""`specgate demo` (what `make demo` runs) completes in a short mode and writes its plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_demo_short_run(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "specgate.cli",
            "demo",
            "--duration",
            "12",
            "--pods",
            "3",
            "--no-live",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "plot: " in result.stdout and "latency:" in result.stdout
    png = tmp_path / "demo.png"
    assert png.stat().st_size > 20_000 and png.read_bytes()[:4] == b"\x89PNG"
    data = json.loads((tmp_path / "demo.json").read_text())
    summary = data["summary"]
    assert summary["latency"]["requests"] > 0 and summary["throughput"]["requests"] > 0
    assert summary["latency"]["failed"] == 0 and summary["throughput"]["failed"] == 0
    # The pods were observed through the router, speculating at some times and not others.
    points = data["points"]
    assert {p["speculating"] for p in points if p["batch"] > 0} == {True, False}


def test_demo_without_matplotlib_says_how_to_get_the_plot(tmp_path: Path) -> None:
    """With matplotlib missing the demo says how to install the plot extra before the load
    starts, runs, and writes its raw data: no traceback."""
    hide = (
        "import sys\nsys.modules['matplotlib'] = None\n"
        "from specgate.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    args = ["demo", "--duration", "3", "--pods", "2", "--no-live", "--out", str(tmp_path)]
    result = subprocess.run(
        [sys.executable, "-c", hide, *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "pip install 'specgate[plot]'" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "demo.png").exists() and (tmp_path / "demo.json").exists()
