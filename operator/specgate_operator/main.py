"""`specgate operator`: run the kopf operator in this process, alone or as the elected one of
several replicas (election.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING

from specgate import logs
from specgate.kube import Credentials, KubeClient, KubeError
from specgate_operator import election, health, policy, render
from specgate_operator.metrics import OperatorMetrics

if TYPE_CHECKING:
    from specgate_operator import handlers


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
        default=120.0,
        help="re-apply children and refresh status this often without a watched child's"
        " change (which does it at once)",
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
    parser.add_argument(
        "--leader-election-namespace",
        default="",
        metavar="NS",
        help="elect one reconciling replica through a Lease in this namespace (the operator's"
        " own); empty: this process is the only operator",
    )
    parser.add_argument(
        "--leader-election-lease",
        default="specgate-operator",
        metavar="NAME",
        help="the Lease's name",
    )
    parser.add_argument(
        "--leader-election-lease-seconds",
        type=float,
        default=15.0,
        metavar="S",
        help="how long a leader's renewal stands: a standby takes over this long after a leader"
        " stops renewing (a leader renews every S/7.5 s and stops after 2S/3 s without one)",
    )
    parser.add_argument(
        "--identity",
        default="",
        help="this replica's name in the Lease; default: $POD_NAME, else host and process id",
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
    )
    try:
        elected = (
            election.Election(
                namespace=args.leader_election_namespace,
                lease_name=args.leader_election_lease,
                identity=args.identity
                or os.environ.get("POD_NAME")
                or f"{socket.gethostname()}-{os.getpid()}",
                lease_seconds=args.leader_election_lease_seconds,
            )
            if args.leader_election_namespace
            else None
        )
        if args.liveness:
            health.parse_endpoint(args.liveness)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_operate(args, config, elected))


async def _operate(
    args: argparse.Namespace,
    config: handlers.OperatorConfig,
    elected: election.Election | None,
) -> int:
    """Serve liveness and metrics for the whole process, then run kopf: at once, or once this
    replica is elected. 0 on a clean stop, 1 when leadership was lost."""
    import kopf

    from specgate_operator import handlers

    metrics = OperatorMetrics()
    metrics.serve(args.metrics_port)
    role = election.Role.CANDIDATE if elected else election.Role.LEADER

    def on_role(new: election.Role) -> None:
        nonlocal role
        role = new
        metrics.leader.set(1 if new is election.Role.LEADER else 0)

    def liveness() -> tuple[bool, dict[str, str]]:
        return role is not election.Role.STOPPED, {"role": role.value}

    namespaces = list(args.namespace)

    async def reconcile_until(stop: asyncio.Event) -> None:
        await kopf.operator(
            registry=handlers.build_registry(config),
            memo=kopf.Memo(metrics=metrics),
            # One replica reconciles at a time (the Lease, or a single process): no peering.
            standalone=True,
            clusterwide=not namespaces,
            namespaces=namespaces,
            stop_flag=stop,
        )

    server = await health.serve(args.liveness, liveness) if args.liveness else None
    try:
        if elected is None:
            on_role(election.Role.LEADER)
            await reconcile_until(asyncio.Event())
            return 0
        kube = KubeClient(Credentials.discover())
        try:
            return 0 if await election.lead(kube, elected, reconcile_until, on_role) else 1
        finally:
            await kube.aclose()
    finally:
        if server is not None:
            server.close()
        metrics.stop()
