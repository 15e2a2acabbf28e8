"""The real binaries the chart and monitoring tests run (installed by `make tools`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

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
) -> subprocess.CompletedProcess[str]:
    args = [tool("helm"), "template", "sg", str(CHART), "--namespace", namespace]
    for f in values_files:
        args += ["-f", f]
    for s in sets:
        args += ["--set", s]
    return run(*args, check=check)
