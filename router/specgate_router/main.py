"""`specgate router`: serve the router with uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from specgate import logs
from specgate_router import settings as settings_mod
from specgate_router.app import create_app
from specgate_router.http_limits import BoundedHttpToolsProtocol


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML settings file (re-read when it changes)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="URL",
        help="engine pod URL (repeatable); or discovery in --config",
    )
    parser.add_argument(
        "--engine-api-key", help=f"engine API key (default: ${settings_mod.API_KEY_ENV})"
    )
    parser.add_argument("--model", help="served model name")
    parser.add_argument("--default-class", choices=settings_mod.CLASSES)
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--no-access-log",
        action="store_true",
        help="no line per proxied request (logger specgate.router.access); threshold "
        "changes and their reasons are still logged at info",
    )


def overrides(args: argparse.Namespace) -> dict[str, object]:
    return {
        "backends": args.backend,
        "engineApiKey": args.engine_api_key,
        "model": args.model,
        "defaultClass": args.default_class,
    }


def run(args: argparse.Namespace) -> int:
    logs.configure(args.log_level, "json")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.no_access_log:
        logging.getLogger("specgate.router.access").setLevel(logging.WARNING)
    try:
        settings = settings_mod.load(args.config, overrides=overrides(args))
    except settings_mod.SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        app = create_app(settings, config_path=args.config)
    except (OSError, ValueError) as exc:  # the client keys file, say
        print(f"error: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=int(settings.resilience.drain_seconds),
        http=BoundedHttpToolsProtocol.with_limits(
            settings.resilience.max_header_bytes, settings.resilience.max_headers
        ),
    )
    return 0
