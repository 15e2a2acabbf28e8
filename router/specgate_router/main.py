"""`specgate router`: serve the router with uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from specgate import argtypes, logs
from specgate_router import settings as settings_mod
from specgate_router.app import create_app
from specgate_router.http_limits import BoundedHttpToolsProtocol


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML settings file (re-read when it changes)")
    parser.add_argument("--host", type=argtypes.host("--host"), default="0.0.0.0")
    parser.add_argument("--port", type=argtypes.port("--port"), default=8000)
    parser.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="URL",
        help="engine pod URL (repeatable); or discovery in --config",
    )
    parser.add_argument(
        "--engine-api-key-file",
        metavar="PATH",
        help=f"file holding the engine API key (default: ${settings_mod.API_KEY_ENV}); never"
        " the key itself on the command line, where every process list shows it",
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
    """The settings the flags give; OSError when the key file cannot be read."""
    key = None
    if args.engine_api_key_file:
        with open(args.engine_api_key_file, encoding="utf-8") as f:
            key = f.read(4096).strip() or None
    return {
        "backends": args.backend,
        "engineApiKey": key,
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
    except OSError as exc:
        print(f"error: --engine-api-key-file: {exc.strerror or exc}", file=sys.stderr)
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
        log_config=None,  # uvicorn's own lines go through the JSON handler too
        access_log=False,
        timeout_graceful_shutdown=int(settings.resilience.drain_seconds),
        http=BoundedHttpToolsProtocol.with_limits(
            settings.resilience.max_header_bytes, settings.resilience.max_headers
        ),
    )
    return 0
