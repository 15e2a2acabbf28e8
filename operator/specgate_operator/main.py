"""`specgate operator`: run the kopf operator in this process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from specgate import logs
from specgate.kube import Credentials, KubeError
from specgate_operator import policy, render


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="watch this namespace (repeatable; globs allowed); default: all namespaces",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    defaults = render.RenderOptions()
    parser.add_argument("--engine-image", default=defaults.engine_image)
    parser.add_argument("--router-image", default=defaults.router_image)
    parser.add_argument(
        "--image-pull-secret",
        action="append",
        default=[],
        metavar="NAME",
        help="a Secret for pulling the engine and router images (repeatable)",
    )
    parser.add_argument(
        "--metrics-namespace-label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="let pods in namespaces with this label scrape engine /metrics (NetworkPolicy)",
    )
    policy.add_arguments(parser)
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=30.0,
        help="re-apply children and refresh status this often",
    )
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="liveness endpoint URL (empty to disable)",
    )
    parser.add_argument(
        "--service-monitor-label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a label on the ServiceMonitors (what your Prometheus selects on; repeatable)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        metavar="PORT",
        help="serve the operator's metrics (reconciles, outcomes, durations) here; 0: off",
    )
    parser.add_argument(
        "--no-service-monitor",
        action="store_true",
        help="never render ServiceMonitors, even when the API is served",
    )
    parser.add_argument(
        "--log-format",
        choices=("json", "text"),
        default="json",
        help="log lines as JSON objects (for log collectors) or plain text",
    )
    parser.add_argument("-v", "--verbose", action="store_true")


def _labels(pairs: list[str], flag: str) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag}: expected KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


def run(args: argparse.Namespace) -> int:
    import kopf

    from specgate_operator import handlers

    logs.configure("DEBUG" if args.verbose else "INFO", args.log_format)
    # One line per API call is noise at INFO; kopf logs each handler outcome already.
    logging.getLogger("httpx").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    try:
        operator_policy = policy.from_arguments(args)
        if not 0 <= args.metrics_port <= 65535:
            raise ValueError(f"--metrics-port: a port 1-65535 (0: off), got {args.metrics_port}")
        metrics_labels = _labels(args.metrics_namespace_label, "--metrics-namespace-label")
        monitor_labels = _labels(args.service_monitor_label, "--service-monitor-label")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:  # kopf would retry a missing login forever, a traceback a minute
        Credentials.discover()
    except KubeError as exc:
        print(
            f"error: {exc.message}: run it in a cluster, or point KUBECONFIG at one",
            file=sys.stderr,
        )
        return 2
    config = handlers.OperatorConfig(
        policy=operator_policy,
        render=render.RenderOptions(
            engine_image=args.engine_image,
            router_image=args.router_image,
            image_pull_secrets=tuple(args.image_pull_secret),
            metrics_namespace_labels=metrics_labels,
            service_monitor_labels=monitor_labels,
        ),
        resync_seconds=args.resync_seconds,
        detect_monitoring=not args.no_service_monitor,
        metrics_port=args.metrics_port,
    )
    namespaces = list(args.namespace)
    # A single replica (Recreate) runs at a time, so kopf's peering is not needed.
    asyncio.run(
        kopf.operator(
            registry=handlers.build_registry(config),
            memo=kopf.Memo(),
            standalone=True,
            clusterwide=not namespaces,
            namespaces=namespaces,
            liveness_endpoint=args.liveness or None,
        )
    )
    return 0
