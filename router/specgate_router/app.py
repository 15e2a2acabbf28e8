"""The router's HTTP app: `create_app(settings)`, no module-level state."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specgate import __version__
from specgate.engine_http import EngineHttp
from specgate_router import proxy, requests
from specgate_router.client_auth import ClientAuth, is_admin_path, require_admin
from specgate_router.errors import BadRequest, ModelNotFound, PayloadTooLarge, RouterError
from specgate_router.identity import Client
from specgate_router.settings import RouterSettings
from specgate_router.state import RouterState
from specgate_router.tracing import Tracing

log = logging.getLogger("specgate.router")
access_log = logging.getLogger("specgate.router.access")
"""One line per proxied request, on a logger of its own: `--no-access-log` silences it and
keeps the control loop's lines (threshold changes and why) at INFO."""


def _schema(model: type[Any]) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BadRequest("Content-Length is not a number")
        if int(declared) > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes")
    return bytes(body)


def create_app(
    settings: RouterSettings,
    *,
    engine_http: EngineHttp | None = None,
    config_path: str | None = None,
    identity: str | None = None,
) -> FastAPI:
    """`engine_http` carries everything sent to the engine pods: tests replace it to inject
    failures."""
    state_box: dict[str, RouterState] = {}
    # Built here, not in the lifespan: a malformed keys file stops the router at start.
    auth = ClientAuth(settings.client_auth) if settings.client_auth is not None else None
    tracing = (
        Tracing(settings.tracing, identity or socket.gethostname())
        if settings.tracing is not None
        else None
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = RouterState(
            settings,
            engine_http=engine_http,
            config_path=config_path,
            identity=identity or socket.gethostname(),
        )
        state_box["state"] = state
        app.state.router = state
        await state.start()
        if auth is not None:
            await auth.start(state.clock())  # the provider's keys, before the first token
        try:
            yield
        finally:
            await state.drain(state.settings.resilience.drain_seconds)
            await state.stop()
            if tracing is not None:
                await asyncio.to_thread(tracing.shutdown)  # flushes: bounded by its timeout

    app = FastAPI(
        title="specgate router",
        version=__version__,
        description="OpenAI-compatible, speculation-aware router for SGLang EAGLE pods.",
        lifespan=lifespan,
    )

    def current() -> RouterState:
        return state_box["state"]

    @app.exception_handler(RouterError)
    async def router_error(request: Request, exc: RouterError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    # One error shape, OpenAI's, whatever produced the error: an unknown path or method, or
    # a query parameter FastAPI refused, never answers {"detail": ...}.
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = RouterError(str(exc.detail))
        error.status = exc.status_code
        error.error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(
            error.body(), status_code=exc.status_code, headers=dict(exc.headers or {})
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        error = BadRequest(f"{where or 'request'}: {first.get('msg', 'invalid')}", param=where)
        return JSONResponse(error.body(), status_code=error.status)

    async def handle(request: Request) -> Response:
        state = current()
        if state.draining:
            raise RouterError("router is shutting down") from None
        client = None
        if auth is not None:  # before the body is read: a stranger costs no more than this
            client = await auth.identify(request.headers.get("authorization"), state.clock())
        raw = await read_body(request, state.settings.resilience.max_body_bytes)
        routed = requests.parse(request.url.path, raw, request.headers, state.settings, client)
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        span = None
        if tracing is not None:
            span, routed = tracing.start(routed, rid)
        try:
            if auth is None or client is None:
                response = await proxy.forward(state, routed, rid)
            else:
                response = await _limited(auth, client, state, routed, rid)
        except BaseException as exc:
            if span is not None:
                Tracing.failed(span, exc)
            raise
        if span is not None:
            Tracing.answered(span, response.status_code, response.headers.get("x-specgate-pod"))
            if isinstance(response, StreamingResponse):
                response.body_iterator = Tracing.ending_with(span, response.body_iterator)
            else:
                span.end()
        access_log.info(
            "request done",
            extra={
                "request_id": rid,
                "path": routed.path,
                "traffic_class": routed.traffic_class,
                "pod": response.headers.get("x-specgate-pod"),
                "status": response.status_code,
                # With tracing, the trace this line belongs to (logs and traces joined).
                **({"trace_id": f"{span.get_span_context().trace_id:032x}"} if span else {}),
            },
        )
        return response

    async def _limited(
        auth: ClientAuth, client: Client, state: RouterState, routed: Any, rid: str
    ) -> Response:
        """proxy.forward within the key's limits: its slot is held until the answer (a
        stream's last chunk) has gone."""
        auth.limits.admit(client, state.clock())
        try:
            response = await proxy.forward(state, routed, rid)
        except BaseException:
            auth.limits.release(client)
            raise
        if isinstance(response, StreamingResponse):
            chunks = response.body_iterator

            async def released() -> AsyncIterator[Any]:
                try:
                    async for chunk in chunks:
                        yield chunk
                finally:
                    auth.limits.release(client)

            response.body_iterator = released()
        else:
            auth.limits.release(client)
        return response

    app.add_api_route(
        "/v1/chat/completions",
        handle,
        methods=["POST"],
        openapi_extra=_schema(requests.ChatCompletionRequest),
        summary="OpenAI chat completions",
    )
    app.add_api_route(
        "/v1/completions",
        handle,
        methods=["POST"],
        openapi_extra=_schema(requests.CompletionRequest),
        summary="OpenAI completions",
    )
    app.add_api_route(
        "/generate",
        handle,
        methods=["POST"],
        openapi_extra=_schema(requests.GenerateRequest),
        summary="SGLang native generate",
    )

    started = int(time.time())

    def model_object() -> dict[str, Any]:
        return {
            "id": current().settings.model,
            "object": "model",
            "created": started,
            "owned_by": "specgate",
        }

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        if auth is not None:  # the model's name is the client API's business too
            await auth.identify(request.headers.get("authorization"), current().clock())
        return {"object": "list", "data": [model_object()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> dict[str, Any]:
        if auth is not None:
            await auth.identify(request.headers.get("authorization"), current().clock())
        if model_id != current().settings.model:
            raise ModelNotFound(
                f"The model {model_id!r} does not exist; this router serves"
                f" {current().settings.model!r}",
                param="model",
            )
        return model_object()

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/health")
    async def health() -> JSONResponse:
        """What OpenAI-compatible servers (vLLM, SGLang) answer and benchmark clients check
        before they send: ready to serve, as /readyz."""
        return await readyz()

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        state = current()
        now = state.clock()
        usable = [
            p for p in state.live_pods() if p.healthy and p.fresh(now, state.settings.control)
        ]
        ready = bool(usable) and not state.draining
        return JSONResponse(
            {
                "ready": ready,
                "pods": len(state.pods),
                "usable": len(usable),
                "draining": state.draining,
            },
            status_code=200 if ready else 503,
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(
            generate_latest(current().metrics.registry), media_type="text/plain; version=0.0.4"
        )

    @app.get("/specgate/pods")
    async def pods() -> dict[str, Any]:
        state = current()
        return {
            "leader": state.is_leader,
            "latencyPool": sorted(state.latency_pool),
            "latencyBatch": state.latency_batch,
            "pods": state.views(),
        }

    @app.get("/specgate/samples")
    async def samples(pod: str | None = None) -> dict[str, Any]:
        """Every pod's learning samples (or `pod`'s) and the control settings:
        `specgate_router.replay` (and lab/bench/replay_control.py) replays the controller over
        them offline."""
        return current().sample_export(pod)

    if auth is not None:
        app.add_middleware(AdminGuard, auth=auth, clock=lambda: current().clock())
    app.add_middleware(RequestIdMiddleware)
    return app


class AdminGuard:
    """With client authentication: the admin paths (client_auth.ADMIN_PATHS) need an admin
    key, checked before any handler runs; other paths pass through untouched (the API routes
    check their own keys)."""

    def __init__(self, app: ASGIApp, auth: ClientAuth, clock: Callable[[], float]) -> None:
        self.app, self.auth, self.clock = app, auth, clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_admin_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        try:
            authorization = Headers(scope=scope).get("authorization")
            require_admin(await self.auth.identify(authorization, self.clock()))
        except RouterError as exc:
            response = JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """Echo `x-request-id` (or a fresh one) on every answer. Plain ASGI: Starlette's
    BaseHTTPMiddleware would re-stream every response body through a memory channel, which
    costs streamed answers dearly."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id")
        if rid is None:
            rid = uuid.uuid4().hex.encode()
            scope = {**scope, "headers": [*scope.get("headers", []), (b"x-request-id", rid)]}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                if b"x-request-id" not in names:
                    message = {
                        **message,
                        "headers": [*message.get("headers", []), (b"x-request-id", rid)],
                    }
            await send(message)

        await self.app(scope, receive, send_with_id)
