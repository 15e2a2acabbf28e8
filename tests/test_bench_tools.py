"""Small bench/ tools: the engine-client comparison (bench/client_pool.py) and the py-spy
profile summary (bench/folded_top.py)."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import pytest

from .conftest import ROOT, load_module


def test_the_client_comparison_runs_both_clients_through_every_phase(tmp_path: Path) -> None:
    """Short phases against the stand-in engine: both clients answer at every phase and the
    report names them (the figures themselves are BENCHMARKS.md's, not a test's)."""
    bench = load_module(ROOT / "bench" / "client_pool.py", "client_pool")
    assert bench.main(["--seconds", "0.4", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "client_pool.json").read_text())["results"]
    assert set(results) == {"httpx", "aiohttp (EngineHttp)"}
    for phases in results.values():
        assert [p["clients"] for p in phases] == [16, 128, 16]
        assert all(p["requests_per_s"] > 0 and p["cpu_us_per_request"] > 0 for p in phases)
    md = (tmp_path / "client_pool.md").read_text()
    assert "| aiohttp (EngineHttp) | after c = 128 | 16 |" in md
    assert "the CPU per request of the router's aiohttp client" in md
    shares = json.loads((tmp_path / "client_pool.json").read_text())["scrape_cpu_share"]
    assert set(shares) == set(results) and all(set(s) == {"8", "64"} for s in shares.values())
    assert "| client | 8 pods | 64 pods |" in md


def test_folded_stacks_are_counted_on_top_and_anywhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A frame is counted once per stack however deep it recurses; .xz files read as is."""
    tool = load_module(ROOT / "bench" / "folded_top.py", "folded_top")
    folded = tmp_path / "router.folded.xz"
    with lzma.open(folded, "wt") as fh:
        fh.write("run (a.py:1);poll (b.py:2) 6\n")
        fh.write("run (a.py:1);pool (c.py:3);pool (c.py:3);is_idle (c.py:9) 3\n")
        fh.write("not a stack line\n")
    total, leaf, inclusive = tool.tops(tool.read_folded(folded))
    assert total == 9
    assert leaf == {"poll (b.py:2)": 6, "is_idle (c.py:9)": 3}
    assert inclusive["pool (c.py:3)"] == 3 and inclusive["run (a.py:1)"] == 9
    assert tool.main([str(folded), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "9 samples in router.folded.xz" in out and "| 6 | 66.7% | `poll (b.py:2)` |" in out
