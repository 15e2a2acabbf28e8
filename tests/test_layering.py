"""The product's layering, checked on its source: which package may import what.

- Nothing in the product imports the lab (`lab/`: benchmarks, GPU jobs, results).
- The pure core (`specgate.api`, `crd`, `contract`, `admission`, `docs`) imports no I/O
  framework; the `specgate` package as a whole imports neither kopf nor a web server.
- The router imports neither kopf nor the operator; the operator imports neither the router
  nor the simulator.
- Only the simulator itself imports the simulator, and the CLI does so inside the functions
  of its `sim`, `up` and `demo` commands, never at module level.
- `specgate --help` loads neither the router, the operator nor the simulator.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import ROOT

PACKAGES = {
    "specgate": ROOT / "specgate",
    "specgate_operator": ROOT / "operator" / "specgate_operator",
    "specgate_router": ROOT / "router" / "specgate_router",
    "specgate_sim": ROOT / "sim" / "specgate_sim",
}
LAB = ("lab", "bench", "gpu_envelope", "envelope_report", "policy_at_scale")
IO_FRAMEWORKS = ("httpx", "aiohttp", "fastapi", "starlette", "uvicorn", "kopf", "kubernetes")
PURE_CORE = ("specgate.api", "specgate.crd", "specgate.contract", "specgate.admission",
             "specgate.docs")  # fmt: skip
SIM_USERS_LAZY = {"specgate.cli": ("_cmd_sim", "_cmd_up", "_cmd_demo", "_sim_arguments",
                                   "_up_arguments", "_demo_arguments")}  # fmt: skip


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # what it imports, dotted
    line: int
    function: str | None  # the enclosing function, None at module level


def imports_of(module: str, source: str) -> Iterator[Import]:
    """Every import in `source`, absolute, with the function it sits in."""
    tree = ast.parse(source)

    def visit(node: ast.AST, function: str | None) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            inner = function
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                inner = child.name if function is None else function
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(module, alias.name, child.lineno, function)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                yield Import(module, child.module, child.lineno, function)
            yield from visit(child, inner)

    yield from visit(tree, None)


def product_imports(packages: dict[str, Path] = PACKAGES) -> list[Import]:
    found = []
    for package, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            module = ".".join((package, *parts)).removesuffix(".__init__")
            found += imports_of(module, path.read_text())
    return found


def _top(name: str) -> str:
    return name.split(".", 1)[0]


def violations(found: list[Import]) -> list[str]:
    """What breaks the rules in the module docstring, one line each."""
    out = []
    for imp in found:
        where = f"{imp.module}:{imp.line} imports {imp.target}"
        top, own = _top(imp.target), _top(imp.module)
        if top in LAB:
            out.append(f"{where}: the product never imports the lab")
        if imp.module.startswith(PURE_CORE) and top in IO_FRAMEWORKS:
            out.append(f"{where}: the pure core imports no I/O framework")
        if own == "specgate" and top in ("kopf", "fastapi", "starlette", "uvicorn"):
            out.append(f"{where}: the core package needs neither kopf nor a web server")
        if own == "specgate_router" and top in ("kopf", "specgate_operator"):
            out.append(f"{where}: the router imports neither kopf nor the operator")
        if own == "specgate_operator" and top in ("specgate_router", "specgate_sim"):
            out.append(f"{where}: the operator imports neither the router nor the simulator")
        if top == "specgate_sim" and own != "specgate_sim":
            lazy = SIM_USERS_LAZY.get(imp.module, ())
            if imp.function not in lazy:
                out.append(
                    f"{where}: only the CLI's sim, up and demo commands import the simulator,"
                    " inside their functions"
                )
    return out


def test_the_product_keeps_its_layers() -> None:
    found = product_imports()
    assert len(found) > 200  # the walk reached the packages
    assert violations(found) == []


@pytest.mark.parametrize(
    ("module", "source", "rule"),
    [
        ("specgate_router.control", "from lab.bench import policy_at_scale\n", "lab"),
        ("specgate.api", "import httpx\n", "pure core"),
        ("specgate.kube", "import kopf\n", "core package"),
        ("specgate_router.state", "from specgate_operator import render\n", "router"),
        ("specgate_router.app", "def f():\n    import kopf\n", "router"),
        ("specgate_operator.handlers", "import specgate_router.control\n", "operator"),
        ("specgate.cli", "from specgate_sim import local\n", "simulator"),
        ("specgate.cli", "def _cmd_crd():\n    from specgate_sim import demo\n", "simulator"),
        ("specgate_router.replay", "from specgate_sim.profile import Profile\n", "simulator"),
    ],
)
def test_a_forbidden_import_is_caught(module: str, source: str, rule: str) -> None:
    (line,) = violations(list(imports_of(module, source)))
    assert rule in line and module in line


def test_allowed_imports_pass() -> None:
    allowed = (
        "def _cmd_up(args):\n    from specgate_sim import local\n"
        "def _demo_arguments(p):\n    from specgate_sim import demo\n"
    )
    assert violations(list(imports_of("specgate.cli", allowed))) == []
    assert violations(list(imports_of("specgate_sim.cli", "from specgate_sim import pod\n"))) == []


def test_help_loads_no_component() -> None:
    code = (
        "import sys\nfrom specgate.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = ('specgate_router', 'specgate_operator', 'specgate_sim', 'kopf', 'fastapi',"
        " 'uvicorn')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "COMMAND" in out.stdout  # the help was printed
    assert out.stdout.strip().splitlines()[-1] == "[]"
