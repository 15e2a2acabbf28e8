"""`specgate sim`: serve simulated SGLang pods until interrupted."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal

from specgate import argtypes, contract
from specgate_sim import profile as profiles
from specgate_sim.cluster import SimCluster
from specgate_sim.engine import HostSpells
from specgate_sim.pod import PodSettings


def threshold_arg(text: str) -> int | None:
    if text.lower() in ("none", "null", "always"):
        return None
    try:
        return contract.parse_threshold(int(text))
    except (ValueError, contract.ThresholdError) as exc:
        raise argparse.ArgumentTypeError(
            f"threshold must be an integer >= 0 or 'none', got {text!r}"
        ) from exc


def off_step_tokens_arg(text: str) -> int:
    """Tokens a request per off step, for `specgate sim` and `specgate up` alike."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{value}: must be at least 1 (an off step decodes a token a request)"
        )
    return value


def host_spells_arg(text: str) -> HostSpells:
    try:
        return HostSpells.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--port", type=argtypes.port("--port"), default=30000, help="port of the first pod"
    )
    parser.add_argument("--host", type=argtypes.host("--host"), default="127.0.0.1")
    parser.add_argument(
        "--pods", type=argtypes.count("--pods", 1, 256), default=1, help="pods on consecutive ports"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SGLANG_API_KEY") or None,
        help="require this Bearer key (as SGLang's --api-key; default: $SGLANG_API_KEY, as the "
        "patched engine, which keeps it out of the command line)",
    )
    parser.add_argument(
        "--profile",
        default="rtx-pro-6000-x8",
        help=f"calibration profile: {', '.join(profiles.available())} or a .json",
    )
    parser.add_argument("--model", default="sim-model", help="served model name")
    parser.add_argument(
        "--threshold",
        type=threshold_arg,
        default=8,
        help="initial speculation-disable batch threshold ('none': always)",
    )
    parser.add_argument(
        "--thresholds",
        type=lambda text: [threshold_arg(t.strip()) for t in text.split(",")],
        help="one initial threshold per pod, comma-separated (e.g. 8,8,0,0,none,none); "
        "overrides --threshold",
    )
    parser.add_argument(
        "--time-scale",
        type=argtypes.positive_float("--time-scale"),
        default=1.0,
        help="simulated seconds per real second (>1: faster than real time)",
    )
    parser.add_argument(
        "--max-running-requests", type=argtypes.count("--max-running-requests", 1, 65536)
    )
    parser.add_argument(
        "--off-step-tokens",
        type=off_step_tokens_arg,
        default=1,
        help="tokens a request per off step (the patched SGLang's --speculative-off-step-tokens)",
    )
    parser.add_argument(
        "--host-spells",
        type=host_spells_arg,
        metavar="SLOWDOWN[:FAST:SLOW]",
        help="slow spells of a shared host: the host's part of a decode step "
        "takes SLOWDOWN times as long in spells lasting SLOW seconds on average, "
        "between fast ones of FAST seconds (default 6:4); e.g. 2",
    )
    parser.add_argument(
        "--gpus",
        type=argtypes.count("--gpus", 1, 4096),
        help="the pods share this many GPUs, pod i on GPU i mod N, as SGLang servers with split "
        "memory fractions do: one step at a time on each (default: a GPU each)",
    )
    parser.add_argument("--seed", type=argtypes.count("--seed", 0, 2**63 - 1))
    parser.add_argument(
        "--no-model-inputs",
        action="store_true",
        help="report no step profile or acceptance counters, as an engine without the "
        "specgate patch: the router then learns the crossover from samples and probes",
    )


def run(args: argparse.Namespace) -> int:
    if args.port + args.pods - 1 > 65535:
        raise SystemExit(f"error: --port {args.port} with --pods {args.pods} runs past port 65535")
    if args.thresholds is not None and len(args.thresholds) != args.pods:
        raise SystemExit(
            f"error: --thresholds gives {len(args.thresholds)} values for {args.pods} pods:"
            " give one a pod"
        )
    try:
        prof = profiles.load(args.profile)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"error: --profile: {exc}") from exc
    settings = PodSettings(
        name="sim-0",
        model=args.model,
        api_key=args.api_key,
        threshold=args.threshold,
        time_scale=args.time_scale,
        seed=args.seed,
        max_running_requests=args.max_running_requests,
        off_step_tokens=args.off_step_tokens,
        host_spells=args.host_spells,
        model_inputs=not args.no_model_inputs,
    )
    asyncio.run(_serve(prof, args, settings))
    return 0


async def _serve(prof: profiles.Profile, args: argparse.Namespace, settings: PodSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with SimCluster(
        prof,
        args.pods,
        base_port=args.port,
        host=args.host,
        settings=settings,
        thresholds=args.thresholds,
        gpus=args.gpus,
    ) as cluster:
        for url in cluster.urls:
            print(f"simulated pod ({prof.name}) at {url}", flush=True)
        await stop.wait()
