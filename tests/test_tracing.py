"""Spans of the router's requests (spec.router.tracing): exported over OTLP/HTTP by the
OpenTelemetry SDK to a receiver on loopback that decodes the real protobuf payload, each a
child of the client's traceparent, and the parent of what the engine receives."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import httpx
import uvicorn
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from specgate import api
from specgate.engine_http import EngineHttp
from specgate_operator import render

from .conftest import free_port_base, minimal_resource
from .router_harness import run_router, serving
from .test_router_http import CHAT, chat, router_settings, sims

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class RecordingEngineHttp(EngineHttp):
    """The router's real engine client, noting the trace headers of each request it posts."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[dict[str, str]] = []

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        self.sent.append({k: v for k, v in headers.items() if k.startswith("trace")})
        return await super().post(url, body, headers)


@asynccontextmanager
async def collector() -> AsyncIterator[tuple[str, list[Any]]]:
    """An OTLP/HTTP traces endpoint: every span of every export request, decoded."""
    spans: list[Any] = []

    async def traces(request: Request) -> Response:
        export = ExportTraceServiceRequest.FromString(await request.body())
        for resource in export.resource_spans:
            for scope in resource.scope_spans:
                spans.extend((resource.resource, span) for span in scope.spans)
        return Response(b"", media_type="application/x-protobuf")

    port = free_port_base(1)
    config = uvicorn.Config(
        Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])]),
        host="127.0.0.1",
        port=port,
        log_level="warning",
    )
    async with serving(config):
        yield f"http://127.0.0.1:{port}/v1/traces", spans


def _attributes(span: Any) -> dict[str, Any]:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = next(
            getattr(value, f) for f in ("string_value", "int_value", "bool_value")
            if value.HasField(f)
        )  # fmt: skip
    return out


async def test_each_request_is_a_span_between_the_clients_and_the_engines() -> None:
    engine_http = RecordingEngineHttp()
    async with collector() as (endpoint, spans), sims(1) as pods:
        settings = router_settings(pods.urls, tracing={"otlpEndpoint": endpoint})
        async with (
            run_router(settings, engine_http=engine_http) as router,
            httpx.AsyncClient(timeout=30) as client,
        ):
            parent = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "tracestate": "v=1"}
            ok = await client.post(router.url + CHAT, json=chat(), headers=parent)
            assert ok.status_code == 200, ok.text
            async with client.stream(
                "POST", router.url + CHAT, json=chat(30, stream=True),
                headers={"x-specgate-class": "throughput"},
            ) as stream:  # fmt: skip
                async for _ in stream.aiter_bytes():
                    pass
            refused = await client.post(router.url + CHAT, json={"model": "m"}, headers=parent)
            assert refused.status_code == 400
        # The router has stopped: its spans are flushed.
    served = [(r, s) for r, s in spans if s.name == "POST /v1/chat/completions"]
    assert len(served) == 2, [s.name for _, s in spans]
    (resource, child), (_, root) = served
    assert child.trace_id.hex() == TRACE_ID and child.parent_span_id.hex() == CLIENT_SPAN
    names = {kv.key: kv.value.string_value for kv in resource.attributes}
    assert names["service.name"] == "specgate-router"
    attributes = _attributes(child)
    assert attributes["http.response.status_code"] == 200
    assert attributes["specgate.traffic_class"] == "latency" and attributes["specgate.pod"]
    # The engine's parent is the router's span, in the client's trace, with its tracestate.
    first, second = engine_http.sent
    assert first["traceparent"] == f"00-{TRACE_ID}-{child.span_id.hex()}-01"
    assert first["tracestate"] == "v=1"
    # Without a client trace the router starts one; the stream's span lasts to its last byte.
    assert root.parent_span_id == b"" and root.trace_id.hex() != TRACE_ID
    assert second["traceparent"].split("-")[1] == root.trace_id.hex()
    assert _attributes(root)["specgate.traffic_class"] == "throughput"
    assert root.end_time_unix_nano > root.start_time_unix_nano


async def test_a_collector_that_is_gone_costs_requests_nothing() -> None:
    closed = free_port_base(1)
    async with sims(1) as pods:
        settings = router_settings(
            pods.urls, tracing={"otlpEndpoint": f"http://127.0.0.1:{closed}/v1/traces"}
        )
        async with run_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
            answers = await asyncio.gather(
                *(client.post(router.url + CHAT, json=chat()) for _ in range(20))
            )
            assert [a.status_code for a in answers] == [200] * 20


def test_the_resources_tracing_reaches_the_routers_config() -> None:
    import yaml

    tracing = {"otlpEndpoint": "http://otel-collector.observability:4318/v1/traces"}
    sdd = api.SpecDecodeDeployment.model_validate(minimal_resource(router={"tracing": tracing}))
    manifests = {(m["kind"], m["metadata"]["name"]): m for m in render.render(sdd)}
    config = yaml.safe_load(
        manifests[("ConfigMap", "demo-router")]["data"][render.ROUTER_CONFIG_FILE]
    )
    assert config["tracing"] == {**tracing, "sampleRatio": 1.0}
    assert "tracing" not in render.router_config(
        api.SpecDecodeDeployment.model_validate(minimal_resource())
    )
