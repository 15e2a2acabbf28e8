"""The patched engine as a pod with `spec.engine.runAsUser` runs it, and the router's cost at c = 1.

One server on the synthetic 3B pair (lab/gpu/synthetic.py), temperature 0.8, the operator's
default control flags, its key only in SGLANG_API_KEY (as the operator passes it), run as
--user with HOME in a fresh folder; then specgate's router in front of it. Prints who the
engine runs as, what it answers without and with its key, and output tok/s of one closed-loop
client straight to the engine and through the router, windows alternated (the router's
per-request cost at the lowest load, where it weighs most).

    bash lab/gpu/run-on-gpu.sh SITE OUT lab/bench/engine_user.py [--user 65534]
"""

from __future__ import annotations

import argparse
import json
import stat
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hold_grid
from hold_grid import verify  # type: ignore[attr-defined]


def modes(root: Path) -> dict[str, str]:
    """Each file's permission bits under `root`, as `ls -l` shows them."""
    return {
        str(path.relative_to(root)): stat.filemode(path.stat().st_mode)
        for path in sorted(root.rglob("*"))
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="engine-user-results")
    parser.add_argument("--user", type=int, default=65534)
    parser.add_argument("--windows", type=int, default=4, help="per path, alternated")
    parser.add_argument("--window", type=float, default=8.0)
    parser.add_argument("--port", type=int, default=32600)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = hold_grid.MODELS
    hold_grid.write_synthetic_pair(models, 12.0)  # type: ignore[attr-defined]
    results: dict[str, Any] = {"model_modes_as_written": modes(models)}
    flags = verify.server_flags(
        models / "target",
        mem_fraction=0.3,
        max_running=128,
        max_graph_batch=128,
        dummy_weights=False,
        sleep_on_idle=True,
    )
    eagle = [*verify.EAGLE, "--speculative-draft-model-path", str(models / "draft")]
    _, control = hold_grid.operator_defaults()
    setup = argparse.Namespace(engine_key_from_env=True, engine_user=args.user)
    flags, env = hold_grid.routed_engine_setup([*flags, *eagle, *control], {}, setup)
    router_port = args.port + hold_grid.ROUTER_PORT_OFFSET
    procs = [verify.start("engine", flags, args.port, out, env, user=args.user)]
    try:
        results["startup_seconds"] = round(verify.wait_healthy(args.port, procs[0]), 1)
        results["engine"] = hold_grid.engine_checks(args.port, procs[0])
        verify.log(f"engine: {results['engine']}")
        procs.append(hold_grid.start_router(args.port, router_port, out))
        rates: dict[str, list[float]] = {"direct": [], "routed": []}
        for _ in range(args.windows):
            for route, port in (("direct", args.port), ("routed", router_port)):
                clients = verify.ClosedLoopClients(port, 1, 0.8, hold_grid.NEW_TOKENS)
                time.sleep(1.0)
                rates[route] += hold_grid.windows(clients, 1, args.window)
                clients.stop()
        results["c1_tok_s"] = rates
        direct, routed = (statistics.median(rates[k]) for k in ("direct", "routed"))
        results["routed_over_direct"] = round(routed / direct, 3)
        verify.log(f"c = 1: direct {direct:.0f}, routed {routed:.0f} tok/s ({routed / direct:.3f})")
    except Exception as exc:  # keep what was measured
        results["error"] = f"{type(exc).__name__}: {exc}"
        verify.log(results["error"])
    finally:
        verify.stop_all(procs)
        (out / "engine-user.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 1 if "error" in results else 0


if __name__ == "__main__":
    sys.exit(main())
