"""The `specgate` command line. Each subcommand imports its component lazily, arguments
included, so `specgate --help` and `specgate crd` pay for neither kopf, the router nor the
simulator, and `specgate operator` does not pay for the router."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from specgate import __version__, argtypes


def _cmd_crd(args: argparse.Namespace) -> int:
    from specgate import crd, docs

    text = docs.reference() if args.markdown else crd.crd_yaml()
    if args.check:
        current = Path(args.check).read_text()
        if current != text:
            print(
                f"{args.check} is stale: regenerate it with `make crd docs`",
                file=sys.stderr,
            )
            return 1
        return 0
    sys.stdout.write(text)
    return 0


MAX_INPUT_BYTES = 4 * 1024 * 1024
"""A resource file larger than this is refused (bounded_yaml.MAX_BYTES)."""


def load_resources(path: str) -> list[dict[str, Any]]:
    """SpecDecodeDeployments from a YAML file (several documents allowed; '-' is stdin)."""
    from specgate import bounded_yaml

    source = "stdin" if path == "-" else path
    text = sys.stdin.read(MAX_INPUT_BYTES + 1) if path == "-" else bounded_yaml.read_text(path)
    docs = [d for d in bounded_yaml.load_all(text, source) if d is not None]
    if not docs:
        raise ValueError(f"{source}: no SpecDecodeDeployment in it (the file is empty)")
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict) or doc.get("kind") != "SpecDecodeDeployment":
            kind = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(
                f"{source}: document {i + 1} is a {kind}, not a SpecDecodeDeployment"
                " (set kind: SpecDecodeDeployment)"
            )
    return docs


def _cmd_render(args: argparse.Namespace) -> int:
    from specgate import admission, api, crd
    from specgate_operator import policy, render

    schema = admission.crd_schema(crd.crd())
    opts = render.RenderOptions(
        engine_image=args.engine_image or render.RenderOptions.engine_image,
        router_image=args.router_image or render.RenderOptions.router_image,
        service_monitor=args.service_monitor,
    )
    try:
        if not admission.DNS_LABEL.match(args.namespace):
            raise ValueError(
                f"--namespace: {args.namespace!r} is not a namespace name (lowercase letters,"
                " digits and '-')"
            )
        rules = policy.from_arguments(args)
        docs = load_resources(args.filename)
    except (OSError, ValueError) as exc:
        message = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        where = f"{args.filename}: " if isinstance(exc, OSError) else ""
        first_line = message.splitlines()[0] if message else type(exc).__name__
        print(f"error: {where}{first_line}", file=sys.stderr)
        return 2
    out: list[dict[str, Any]] = []
    failed = False
    for doc in docs:
        meta = doc.get("metadata")
        name = meta.get("name", "?") if isinstance(meta, dict) else "?"
        try:
            admitted = admission.admit(doc, schema)
        except admission.AdmissionError as exc:
            failed = True
            for err in exc.errors:  # one line each: the resource, the field, what to do
                print(f"error: SpecDecodeDeployment {name!r}: {err}", file=sys.stderr)
            continue
        admitted.setdefault("metadata", {}).setdefault("namespace", args.namespace)
        sdd = api.SpecDecodeDeployment.model_validate(admitted)
        # The operator refuses what its policy refuses, so render does too, with its options.
        refused = policy.violations(sdd, rules, (opts.engine_image, opts.router_image))
        if refused:
            failed = True
            for line in refused:
                print(f"error: SpecDecodeDeployment {name!r}: {line}", file=sys.stderr)
            continue
        if not rules.allow_unlabelled_secrets:
            for field, secret in policy.secret_references(sdd):
                print(
                    f"note: SpecDecodeDeployment {name!r}: {field} names Secret {secret!r}: the"
                    f" operator uses it only if it carries the label {policy.REFERABLE_LABEL}=true",
                    file=sys.stderr,
                )
        # The real operator generates a random key once; render shows where it would go.
        out += render.render(sdd, opts, api_key="<generated-by-operator>")
    if failed:
        return 2
    sys.stdout.write(yaml.safe_dump_all(out, sort_keys=False, width=100))
    return 0


def _cmd_install_manifests(args: argparse.Namespace) -> int:
    from specgate_operator import install

    text = install.manifests_yaml()
    if args.check:
        if Path(args.check).read_text() != text:
            print(f"{args.check} is stale: regenerate it with `make deploy`", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


def _cmd_dashboards(args: argparse.Namespace) -> int:
    from specgate import dashboards

    try:
        written = dashboards.write(Path(args.out))
    except ModuleNotFoundError as exc:  # the Grafana SDK is a dev extra
        print(
            f"error: dashboards needs the dev extras ({exc.name} is missing): "
            "pip install 'specgate[dev]'",
            file=sys.stderr,
        )
        return 2
    for path in written:
        print(path)
    return 0


def _cmd_operator(args: argparse.Namespace) -> int:
    from specgate_operator import main

    return main.run(args)


def _cmd_sim(args: argparse.Namespace) -> int:
    from specgate_sim import cli

    return cli.run(args)


def _cmd_router(args: argparse.Namespace) -> int:
    from specgate_router import main

    return main.run(args)


def _cmd_client_key(args: argparse.Namespace) -> int:
    import yaml
    from pydantic import ValidationError

    from specgate_router import client_auth
    from specgate_router.settings import ClientKey

    key = client_auth.new_key()
    entry = {"name": args.name, "sha256": client_auth.hash_key(key), "classes": args.classes}
    if args.max_concurrent is not None:
        entry["maxConcurrent"] = args.max_concurrent
    if args.requests_per_minute is not None:
        entry["requestsPerMinute"] = args.requests_per_minute
    if args.admin:
        entry["admin"] = True
    try:
        ClientKey.model_validate(entry)
    except ValidationError as exc:
        first = exc.errors()[0]
        print(f"error: {'.'.join(map(str, first['loc']))}: {first['msg']}", file=sys.stderr)
        return 2
    print(f"# key for {args.name} (shown once; the router keeps only its hash): {key}",
          file=sys.stderr)  # fmt: skip
    sys.stdout.write(yaml.safe_dump([entry], sort_keys=False))
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    import asyncio

    from specgate_sim import local
    from specgate_sim import profile as profiles

    if args.engine == "sim":
        try:
            profiles.load(args.profile)
        except ValueError as exc:
            print(f"error: --profile: {exc}", file=sys.stderr)
            return 2

    cfg = local.StackConfig(
        pods=args.pods,
        engine=args.engine,
        port=args.port,
        host=args.host,
        profile=args.profile,
        model=args.model,
        threshold=args.threshold,
        time_scale=args.time_scale,
        off_step_tokens=args.off_step_tokens,
        model_path=args.model_path,
        draft_model_path=args.draft_model_path,
    )
    asyncio.run(local.serve_until_interrupted(cfg))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from specgate_sim import demo

    return demo.run(args)


def _router_arguments(p: argparse.ArgumentParser) -> None:
    from specgate_router import main as router_main

    router_main.add_arguments(p)


def _sim_arguments(p: argparse.ArgumentParser) -> None:
    from specgate_sim import cli as sim_cli

    sim_cli.add_arguments(p)


def _up_arguments(p: argparse.ArgumentParser) -> None:
    from specgate_sim import cli as sim_cli

    p.add_argument("--pods", type=argtypes.count("--pods", 1, 64), default=4)
    p.add_argument("--engine", choices=["sim", "sglang"], default="sim")
    p.add_argument("--port", type=argtypes.port("--port"), default=8000, help="router port")
    p.add_argument("--host", type=argtypes.host("--host"), default="127.0.0.1")
    p.add_argument("--profile", default="rtx-pro-6000-x8", help="simulator profile")
    p.add_argument("--model", default="sim-model", help="served model name")
    p.add_argument(
        "--threshold",
        type=argtypes.count("--threshold", 0, 4096),
        default=8,
        help="initial threshold",
    )
    p.add_argument(
        "--time-scale",
        type=argtypes.positive_float("--time-scale"),
        default=1.0,
        help="simulator time scale",
    )
    p.add_argument(
        "--off-step-tokens",
        type=sim_cli.off_step_tokens_arg,
        default=1,
        help="tokens a request per off step, as the resource's "
        "speculative.offStepTokens (1: SGLang's plain decode step)",
    )
    p.add_argument("--model-path", help="--engine sglang: target model")
    p.add_argument("--draft-model-path", help="--engine sglang: EAGLE-3 draft model")


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    from specgate_sim import demo as demo_mod

    demo_mod.add_arguments(p)


def _operator_arguments(p: argparse.ArgumentParser) -> None:
    from specgate_operator import main as operator_main

    operator_main.add_arguments(p)


def _crd_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check", metavar="FILE", help="exit 1 if FILE differs from the generated CRD")
    p.add_argument("--markdown", action="store_true", help="print the CRD reference instead")


def _render_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--filename", required=True, help="SpecDecodeDeployment YAML ('-': stdin)")
    p.add_argument("-n", "--namespace", default="default", help="namespace when the file has none")
    p.add_argument("--engine-image")
    p.add_argument("--router-image")
    p.add_argument("--service-monitor", action="store_true", help="include ServiceMonitors")
    from specgate_operator import policy

    policy.add_arguments(p)


def _client_key_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="who holds the key (letters, digits, '.', '_', '-')")
    p.add_argument(
        "--classes",
        type=lambda text: [c.strip() for c in text.split(",") if c.strip()],
        default=["latency", "throughput"],
        help="traffic classes the key may send, comma-separated (default: both)",
    )
    p.add_argument(
        "--max-concurrent", type=argtypes.count("--max-concurrent", 1, 100_000), default=None
    )
    p.add_argument(
        "--requests-per-minute",
        type=argtypes.count("--requests-per-minute", 1, 10_000_000),
        default=None,
    )
    p.add_argument(
        "--admin",
        action="store_true",
        help="the key may also read /specgate/* and the API docs (closed to other keys)",
    )


def _install_manifests_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check", metavar="FILE", help="exit 1 if FILE differs from the output")


def _dashboards_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="charts/specgate/dashboards")


def _smoke_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="the router's base URL, e.g. http://demo-router.llm:8000")
    p.add_argument("--model", help="the model to ask (default: the first the router serves)")
    p.add_argument(
        "--api-key-env",
        default="SPECGATE_API_KEY",
        metavar="VAR",
        help="environment variable holding a client key, when the router wants one",
    )
    p.add_argument(
        "--wait",
        type=argtypes.count("--wait", 0, 3600),
        default=0,
        metavar="SECONDS",
        help="ask again while the router is unreachable or has no ready pod, this long",
    )


def _cmd_smoke(args: argparse.Namespace) -> int:
    from specgate import smoke

    if not re.match(r"^https?://[^\s/]+(/\S*)?$", args.url):
        print(f"error: url {args.url!r}: give the router's base URL, http(s)://HOST[:PORT]",
              file=sys.stderr)  # fmt: skip
        return 2
    key = os.environ.get(args.api_key_env, "").strip() or None
    try:
        smoke.run(
            args.url,
            model=args.model,
            api_key=key,
            wait_seconds=args.wait,
            report=lambda line: print(line, flush=True),
        )
    except smoke.SmokeFailure as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _fetch_weights_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", default="https://huggingface.co", help="the hub's URL")
    p.add_argument("--cache", required=True, help="the cache folder (the pod's cache volume)")
    p.add_argument(
        "--allow",
        action="append",
        metavar="PATTERN",
        help="download only files matching PATTERN (repeatable); default: what SGLang loads",
    )
    p.add_argument(
        "--max-bytes",
        type=argtypes.count("--max-bytes", 1, 2**62),
        help="refuse, before downloading, models that would take the cache past this size",
    )
    p.add_argument("repos", nargs="+", metavar="REPO[@REVISION]")


def _cmd_fetch_weights(args: argparse.Namespace) -> int:
    from specgate import weights

    return weights.fetch_all(
        args.endpoint, Path(args.cache), args.repos, args.allow, args.max_bytes
    )


ArgumentsOf = Callable[[argparse.ArgumentParser], None]
Command = Callable[[argparse.Namespace], int]

COMMANDS: dict[str, tuple[str, ArgumentsOf, Command]] = {
    "crd": (
        "print the SpecDecodeDeployment CRD generated from the model",
        _crd_arguments,
        _cmd_crd,
    ),
    "render": ("print the manifests the operator would apply", _render_arguments, _cmd_render),
    "install-manifests": (
        "print the operator's namespace, RBAC and Deployment",
        _install_manifests_arguments,
        _cmd_install_manifests,
    ),
    "router": ("run the speculation-aware router", _router_arguments, _cmd_router),
    "client-key": (
        "make a client API key: the key on stderr, its keys-file entry on stdout",
        _client_key_arguments,
        _cmd_client_key,
    ),
    "sim": ("serve simulated SGLang pods (no GPU needed)", _sim_arguments, _cmd_sim),
    "up": ("engine pods and the router on localhost, until Ctrl-C", _up_arguments, _cmd_up),
    "demo": (
        "the local stack under changing load, with a live view",
        _demo_arguments,
        _cmd_demo,
    ),
    "dashboards": (
        "write the Grafana dashboards (needs the dev extras)",
        _dashboards_arguments,
        _cmd_dashboards,
    ),
    "operator": ("run the kopf operator", _operator_arguments, _cmd_operator),
    "smoke": (
        "send a client's requests through a router and report each (what `helm test` runs)",
        _smoke_arguments,
        _cmd_smoke,
    ),
    "fetch-weights": (
        "download model repositories from a hub into a cache folder (HF_TOKEN: the token)",
        _fetch_weights_arguments,
        _cmd_fetch_weights,
    ),
}
"""Each subcommand's help, arguments and runner. A component's arguments are defined by the
component and imported only for the subcommand being parsed: `specgate --help` and `specgate
crd` load neither the router, the operator nor the simulator."""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or with `only` the arguments of that subcommand alone (the others are
    listed but not loaded; "" loads none)."""
    parser = argparse.ArgumentParser(
        prog="specgate",
        description="Kubernetes operator and speculation-aware router for SGLang EAGLE-3.",
    )
    parser.add_argument("--version", action="version", version=f"specgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (text, arguments, command) in COMMANDS.items():
        p = sub.add_parser(name, help=text)
        if only is None or only == name:
            arguments(p)
        p.set_defaults(func=command)
    return parser


def _named_command(argv: Sequence[str]) -> str:
    """The subcommand `argv` names (its first word that is not an option), or ""."""
    return next((a for a in argv if not a.startswith("-")), "")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(only=_named_command(argv)).parse_args(argv)
    try:
        code: int = args.func(args)
    except OSError as exc:  # a file or folder a command was given: one line, no traceback
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
